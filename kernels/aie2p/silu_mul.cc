// SwiGLU's activation: SiLU(gate) * up, elementwise over one tile.
//
// Tile size, compile-time (override with -D):
//   SILU_MUL_LEN  elements per call (AIE path: a multiple of 16)   default 1024
//
// Symbol (rename with -Dsilu_mul_bf16=<name> to link two variants into one ELF):
//   void silu_mul_bf16(const bf16 *gate, const bf16 *up, bf16 *out)
//     gate, up, out  SILU_MUL_LEN elements; out may be gate or up (in place)
//     out[i] = bf16(bf16(silu(gate[i])) * up[i]),  silu(g) = g / (1 + exp(-g)) in fp32
//   bf16() rounds an fp32 value to nearest-even. These are the rounding points of HF's `act_fn(gate) * up` on
//   bf16 tensors: torch computes silu of a bf16 tensor in fp32 with this formula and rounds once, and the bf16
//   product is exact in fp32, so it rounds once too. Like torch, exp(-g) overflows below g ~ -88.7, where silu
//   is -0 instead of a value under 2^-120.
//   AIE path: every buffer 64-byte aligned. silu(g) is computed as (g / 2) * (1 + tanh(g / 2)) with the core's
//   vector tanh, whose result is bf16: silu then carries an absolute error up to ~|g| * 2^-9, which is below a
//   bf16 ulp of silu except where sigmoid is tiny (gate below about -4), so it is not bit-exact with HF.
#include "npu2_kernel.h"

#if !defined(__AIENGINE__)
#include <cmath>
#endif

#ifndef SILU_MUL_LEN
#define SILU_MUL_LEN 1024
#endif

namespace {

constexpr int kLength = SILU_MUL_LEN;
static_assert(kLength > 0, "SILU_MUL_LEN must be positive");

} // namespace

extern "C" void silu_mul_bf16(const bf16_t *gate, const bf16_t *up, bf16_t *out) {
#if defined(__AIENGINE__)
  static_assert(kLength % 16 == 0, "AIE path: SILU_MUL_LEN must be a multiple of 16");
  // 16 lanes: the native width of the core's tanh.
  constexpr int kLanes = 16;
  RoundToNearestEven rounding;
  const aie::vector<bfloat16, kLanes> half = aie::broadcast<bfloat16, kLanes>(0.5f);

  for (int i = 0; i < kLength; i += kLanes) {
    const aie::vector<bfloat16, kLanes> g = aie::load_v<kLanes>(gate + i);
    const aie::vector<bfloat16, kLanes> u = aie::load_v<kLanes>(up + i);
    // g / 2 is exact; tanh is the one vector transcendental that gives sigmoid without a division.
    const aie::accum<accfloat, kLanes> half_g = aie::mul(g, half);
    const aie::vector<bfloat16, kLanes> h = half_g.to_vector<bfloat16>();
    const aie::vector<bfloat16, kLanes> t = aie::tanh<bfloat16>(half_g.to_vector<float>());
    // h * t is exact in the accumulator, so silu = h + h * t rounds once in fp32, then to bf16 like torch's silu.
    const aie::vector<bfloat16, kLanes> silu = aie::add(aie::mul(h, t), h).to_vector<bfloat16>();
    // HF's bf16 product: exact in fp32, rounded once.
    aie::store_v(out + i, aie::mul(silu, u).to_vector<bfloat16>());
  }
#else
  for (int i = 0; i < kLength; ++i) {
    const float g = bf16_to_float(gate[i]);
    // torch's fp32 formula, so the bf16 silu is torch's (the overflow to -0 included).
    const float silu = round_to_bf16(g / (1.0f + std::exp(-g)));
    out[i] = float_to_bf16(silu * bf16_to_float(up[i]));
  }
#endif
}
