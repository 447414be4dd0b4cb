// Must fail: aie_api has no dense int16 x int8 mmul of shape 8x8x8 with a 32-bit accumulator on AIE2P
// (detail/aie2p/mmul_16_8.hpp: 4x4x8 and 8x4x8 at 32 bits, 4x8x8 at 64); -DMMUL_K=4 is the shape gemm_int8.cc uses.
#include <aie_api/aie.hpp>

#ifndef MMUL_K
#define MMUL_K 8
#endif

extern "C" void int16_int8_mmul(const int16_t *a, const int8_t *b, int32_t *c) {
  using Mmul = aie::mmul<8, MMUL_K, 8, int16_t, int8_t, acc32>;
  Mmul m;
  m.mul(aie::load_v<Mmul::size_A>(a), aie::load_v<Mmul::size_B>(b));
  aie::store_v(c, m.to_vector<int32_t>());
}
