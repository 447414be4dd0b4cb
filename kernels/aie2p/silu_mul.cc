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
#include "silu_mul.h"

#ifndef SILU_MUL_LEN
#define SILU_MUL_LEN 1024
#endif

namespace {

constexpr int kLength = SILU_MUL_LEN;
static_assert(kLength > 0, "SILU_MUL_LEN must be positive");

} // namespace

extern "C" void silu_mul_bf16(const bf16_t *gate, const bf16_t *up, bf16_t *out) {
#if defined(__AIENGINE__)
  static_assert(kLength % kSiluMulLanes == 0, "AIE path: SILU_MUL_LEN must be a multiple of 16");
  RoundToNearestEven rounding;
  for (int i = 0; i < kLength; i += kSiluMulLanes)
    aie::store_v(out + i, silu_mul_vector(aie::load_v<kSiluMulLanes>(gate + i), aie::load_v<kSiluMulLanes>(up + i)));
#else
  for (int i = 0; i < kLength; ++i)
    out[i] = silu_mul_scalar(gate[i], up[i]);
#endif
}
