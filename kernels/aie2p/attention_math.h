// What the attention kernels (attention.cc, decode_attention.cc) share: their default softmax scale as a constant
// expression, its split into bf16 head and tail at compile time, and on the AIE path fp32-precision products
// built from the core's bf16 x bf16 -> fp32 MACs (aie_api has no fp32 x bf16 multiply).
#pragma once

#include "npu2_kernel.h"

namespace {

constexpr double kLog2e = 1.4426950408889634;

// Newton's iteration, so the default scale is a constant expression on every compiler.
constexpr double constexpr_sqrt(double value) {
  double root = value > 1.0 ? value : 1.0;
  for (int i = 0; i < 64; ++i)
    root = 0.5 * (root + value / root);
  return root;
}

// The nearest bf16 value of x (round to nearest even, at compile time): a constant's bf16 head and tail.
constexpr double constexpr_round_to_bf16(double x) {
  if (x == 0.0)
    return 0.0;
  const double magnitude = x < 0 ? -x : x;
  double unit = 1.0; // the weight of the 8th significant bit
  while (magnitude >= 256.0 * unit)
    unit *= 2.0;
  while (magnitude < 128.0 * unit)
    unit /= 2.0;
  const double units = magnitude / unit;
  double whole = double((long long)units);
  if (units - whole > 0.5 || (units - whole == 0.5 && (long long)whole % 2 == 1))
    whole += 1.0;
  return (x < 0 ? -whole : whole) * unit;
}

constexpr float bf16_head(double x) { return float(constexpr_round_to_bf16(x)); }
constexpr float bf16_tail(double x) { return float(constexpr_round_to_bf16(x - constexpr_round_to_bf16(x))); }

#if defined(__AIENGINE__)
template <unsigned N>
inline aie::accum<accfloat, N> widen(const aie::vector<float, N> &v) { return aie::accum<accfloat, N>(v); }
template <unsigned N>
inline aie::accum<accfloat, N> widen(const aie::vector<bfloat16, N> &v) { return aie::accum<accfloat, N>(v); }

// x * y for fp32 x and bf16 y: x split into a bf16 head and the bf16 rounding of its remainder (relative error
// about 2^-16, far below the bf16 rounding of any output).
template <unsigned N>
inline aie::accum<accfloat, N> mul_by_bf16(const aie::accum<accfloat, N> &x, const aie::vector<bfloat16, N> &y) {
  const aie::vector<bfloat16, N> head = x.template to_vector<bfloat16>();
  const aie::vector<bfloat16, N> tail = aie::sub(x, head).template to_vector<bfloat16>();
  return aie::mac(aie::mul(head, y), tail, y);
}

// x * y in fp32 precision, y given as its bf16 head and tail: x split likewise, the three products that matter
// (tail x tail is below fp32's rounding).
template <unsigned N>
inline aie::accum<accfloat, N> mul_split(const aie::accum<accfloat, N> &x, const aie::vector<bfloat16, N> &y_head,
                                         const aie::vector<bfloat16, N> &y_tail) {
  const aie::vector<bfloat16, N> x_head = x.template to_vector<bfloat16>();
  const aie::vector<bfloat16, N> x_tail = aie::sub(x, x_head).template to_vector<bfloat16>();
  return aie::mac(aie::mac(aie::mul(x_head, y_head), x_head, y_tail), x_tail, y_head);
}
#endif

} // namespace
