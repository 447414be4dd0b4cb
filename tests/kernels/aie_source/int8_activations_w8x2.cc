// Must fail: gemm_int8.cc's MAC step with the activations as int8 (W8A8's A operand) instead of int16: the int16 x int8
// mmul takes no int8 A operand. -DACTIVATION=int16_t is the step as gemm_int8.cc writes it (both weight terms from one
// 512-bit load, each A operand feeding the hi and the lo mmul).
#include <aie_api/aie.hpp>

#ifndef ACTIVATION
#define ACTIVATION int8_t
#endif

extern "C" void w8x2_step(const ACTIVATION *a, const int8_t *w, int32_t *acc) {
  using Mmul = aie::mmul<8, 4, 8, int16_t, int8_t, acc32>;
  Mmul hi_acc(aie::load_v<Mmul::size_C>(acc)), lo_acc(aie::load_v<Mmul::size_C>(acc + Mmul::size_C));
  const aie::vector<ACTIVATION, Mmul::size_A> a0 = aie::load_v<Mmul::size_A>(a);
  const aie::vector<int8_t, 2 * Mmul::size_B> terms = aie::load_v<2 * Mmul::size_B>(w);
  hi_acc.mac(a0, terms.extract<Mmul::size_B>(0));
  lo_acc.mac(a0, terms.extract<Mmul::size_B>(1));
  aie::store_v(acc, hi_acc.to_vector<int32_t>());
  aie::store_v(acc + Mmul::size_C, lo_acc.to_vector<int32_t>());
}
