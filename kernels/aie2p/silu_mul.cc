// SwiGLU's activation: SiLU(gate) * up, elementwise over one tile.
//
// Tile size, compile-time (override with -D):
//   SILU_MUL_LEN  elements per call (AIE path: a multiple of 16)   default 1024
//
// Symbol (rename with -Dsilu_mul_bf16=<name> to link two variants into one ELF):
//   void silu_mul_bf16(const bf16 *gate, const bf16 *up, bf16 *out)
//     gate, up, out  SILU_MUL_LEN elements; out may be gate or up (in place)
//     out[i] = gate[i] * sigmoid(gate[i]) * up[i], in fp32, rounded once to bf16 (nearest-even)
//   AIE path: every buffer 64-byte aligned. sigmoid(g) is computed as (1 + tanh(g / 2)) / 2 with the core's
//   vector tanh, whose result is bf16: sigmoid then carries an absolute error up to ~2^-9, which is below a
//   bf16 ulp of the output except where sigmoid is tiny (gate below about -4).
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
#if !__AIE_API_FP32_EMULATION__
#error "silu_mul_bf16 multiplies fp32 vectors: it needs the AIE API's fp32 emulation (a newer AIE2P toolchain)"
#endif
  static_assert(kLength % 16 == 0, "AIE path: SILU_MUL_LEN must be a multiple of 16");
  // 16 lanes: the native width of the core's tanh.
  constexpr int kLanes = 16;
  RoundToNearestEven rounding;
  const aie::vector<bfloat16, kLanes> half = aie::broadcast<bfloat16, kLanes>(0.5f);

  for (int i = 0; i < kLength; i += kLanes) {
    const aie::vector<bfloat16, kLanes> g = aie::load_v<kLanes>(gate + i);
    const aie::vector<bfloat16, kLanes> u = aie::load_v<kLanes>(up + i);
    // g / 2 is exact; tanh is the one vector transcendental that gives sigmoid without a division.
    const aie::vector<bfloat16, kLanes> t = aie::tanh<bfloat16>(aie::mul(g, half).to_vector<float>());
    const aie::accum<accfloat, kLanes> sigmoid = aie::add(aie::mul(t, half), 0.5f);
    const aie::accum<accfloat, kLanes> gate_times_up = aie::mul(g, u); // exact in fp32
    const aie::accum<accfloat, kLanes> result =
        aie::mul(gate_times_up.to_vector<float>(), sigmoid.to_vector<float>());
    aie::store_v(out + i, result.to_vector<bfloat16>());
  }
#else
  for (int i = 0; i < kLength; ++i) {
    const float g = bf16_to_float(gate[i]);
    const float u = bf16_to_float(up[i]);
    // exp(-|g|) cannot overflow, so sigmoid keeps its tiny values (down to fp32 subnormals) for very negative g.
    const float e = std::exp(-std::fabs(g));
    const float sigmoid = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    out[i] = float_to_bf16(g * u * sigmoid);
  }
#endif
}
