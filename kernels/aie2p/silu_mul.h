// SwiGLU's activation on one value or one 16-lane vector, shared by silu_mul.cc, gemv.cc's swiglu_bf16 and
// gemm.cc's SwiGLU drain: silu_mul(g, u) = bf16(bf16(silu(g)) * u), HF's act_fn(gate) * up on bf16 tensors.
//   Host path: silu(g) = g / (1 + exp(-g)) in fp32, torch's formula (the overflow to -0 below g ~ -88.7 included).
//   AIE path: silu(g) = h + h * tanh(h), h = g / 2, with the core's 16-lane vector tanh (its result is bf16, so
//   silu carries an absolute error up to ~|g| * 2^-9: not bit-exact with torch where sigmoid is tiny).
//   The caller sets round-to-nearest-even (RoundToNearestEven) on the AIE path.
#pragma once

#include "npu2_kernel.h"

#if !defined(__AIENGINE__)
#include <cmath>
#endif

namespace {

#if defined(__AIENGINE__)

constexpr int kSiluMulLanes = 16;  // the native width of the core's tanh

inline aie::vector<bfloat16, kSiluMulLanes> silu_mul_vector(aie::vector<bfloat16, kSiluMulLanes> g,
                                                             aie::vector<bfloat16, kSiluMulLanes> u) {
  const aie::vector<bfloat16, kSiluMulLanes> half = aie::broadcast<bfloat16, kSiluMulLanes>(0.5f);
  // g / 2 is exact; tanh is the one vector transcendental that gives sigmoid without a division.
  const aie::accum<accfloat, kSiluMulLanes> half_g = aie::mul(g, half);
  const aie::vector<bfloat16, kSiluMulLanes> h = half_g.to_vector<bfloat16>();
  const aie::vector<bfloat16, kSiluMulLanes> t = aie::tanh<bfloat16>(half_g.to_vector<float>());
  // h * t is exact in the accumulator, so silu = h + h * t rounds once in fp32, then to bf16 like torch's silu.
  const aie::vector<bfloat16, kSiluMulLanes> silu = aie::add(aie::mul(h, t), h).to_vector<bfloat16>();
  // HF's bf16 product: exact in fp32, rounded once.
  return aie::mul(silu, u).to_vector<bfloat16>();
}

#else

inline bf16_t silu_mul_scalar(bf16_t gate, bf16_t up) {
  const float g = bf16_to_float(gate);
  const float silu = round_to_bf16(g / (1.0f + std::exp(-g)));
  return float_to_bf16(silu * bf16_to_float(up));
}

#endif

} // namespace
