// Matrix-vector products for decode projections: y = W x with W in HuggingFace's (out, in) layout, and the
// fused decode-FFN stages built on them (residual add, in-tile RMSNorm, SiLU*up; builders/gemv_fused.py).
//
// Tile sizes, compile-time (override with -D):
//   GEMV_ROWS  output rows per call (rows of W)                  default 32
//   GEMV_K     row length of W per call, and length of x (AIE path: a multiple of 32)   default 2048
//              (gemv_partial_f32: the K chunk one call covers; rmsnorm_bf16: the vector length)
//
// Symbols (rename with -Dgemv_bf16=<name> to link two variants, e.g. two K, into one ELF):
//   void gemv_bf16(const bf16 *w, const bf16 *x, bf16 *y)
//     w  GEMV_ROWS x GEMV_K, row-major (each row contiguous)
//     x  GEMV_K
//     y  GEMV_ROWS;  y[m] = sum_k w[m][k] * x[k], accumulated in fp32, rounded once to bf16 (nearest-even)
//   void gemv_bf16_f32(const bf16 *w, const bf16 *x, float *y)
//     the same sums written as fp32: the LM head keeps its accumulator for the logits
//   void gemv_partial_f32(const bf16 *w, const bf16 *x, float *acc, int32_t k0)
//     one K chunk of a longer product: w GEMV_ROWS x GEMV_K (the chunk's columns), x the whole vector;
//     acc[m] = (k0 == 0 ? 0 : acc[m]) + sum_k w[m][k] * x[k0 + k], in fp32 (the first chunk starts the sum)
//   void gemv_add_bf16(const float *acc, const bf16 *residual, bf16 *y, int32_t residual_row0, int32_t row0)
//     y[row0 + m] = bf16(bf16(acc[m]) + residual[residual_row0 + m]) for the GEMV_ROWS rows of acc: a
//     projection rounded to bf16, then the residual add in fp32 rounded once (the unfused gemv -> add chain,
//     bit for bit). Two offsets: a tile's y holds its own rows, its residual the whole launch step's rows.
//   void gemv_rows_bf16(const bf16 *w, const bf16 *x, bf16 *y, int32_t row0)
//     gemv_bf16 writing its GEMV_ROWS results at y + row0 (a tile's rows, call after call, in one buffer)
//   void rmsnorm_bf16(const bf16 *x_and_weight, bf16 *out, float eps)
//     x_and_weight: x (GEMV_K) then the norm weight (GEMV_K), one buffer (one DMA stream into the tile);
//     out[k] = bf16(bf16(x[k] * rstd) * weight[k]), rstd = 1 / sqrt(mean(x^2) + eps) in fp32
//     (HF's order: normalize in fp32, round, then scale by the weight)
//   void swiglu_bf16(bf16 *gate_up, int32_t length)
//     gate_up: length (gate, up) pairs, interleaved (g0, u0, g1, u1, ...: a GEMV over [w_gate | w_up] rows read
//     as 2·length rows); in place, gate_up[k] = bf16(bf16(silu(g_k)) * u_k) for k < length, silu in fp32:
//     silu_mul_bf16's rounding points (HF's act_fn(gate) * up)
//   AIE path: every buffer 64-byte aligned; k0 a multiple of 32; swiglu_bf16's length a multiple of 16.
#include "npu2_kernel.h"
#include "silu_mul.h"

#if !defined(__AIENGINE__)
#include <cmath>
#endif

#ifndef GEMV_ROWS
#define GEMV_ROWS 32
#endif
#ifndef GEMV_K
#define GEMV_K 2048
#endif

namespace {

constexpr int kRows = GEMV_ROWS;
constexpr int kDepth = GEMV_K;
static_assert(kRows > 0 && kDepth > 0, "GEMV_ROWS and GEMV_K must be positive");

// row . x over kDepth elements, in fp32.
inline float row_dot(const bf16_t *row, const bf16_t *x) {
#if defined(__AIENGINE__)
  static_assert(kDepth % 32 == 0, "AIE path: GEMV_K must be a multiple of 32");
  // 32 lanes: the native width of the bf16 multiplier. Decode GEMV is bound by the DMA that feeds W, so one
  // accumulator per row is enough to keep up with it.
  constexpr int kLanes = 32;
  aie::accum<accfloat, kLanes> acc = aie::zeros<accfloat, kLanes>();
  for (int k = 0; k < kDepth; k += kLanes)
    acc = aie::mac(acc, aie::load_v<kLanes>(row + k), aie::load_v<kLanes>(x + k));
  return aie::reduce_add(acc.to_vector<float>());
#else
  float acc = 0.0f;
  for (int k = 0; k < kDepth; ++k)
    acc += bf16_to_float(row[k]) * bf16_to_float(x[k]);
  return acc;
#endif
}

// Calls store(m, sum) with row m's fp32 dot product, for every row of the tile.
template <typename Store> void row_dots(const bf16_t *w, const bf16_t *x, Store store) {
  for (int m = 0; m < kRows; ++m)
    store(m, row_dot(w + m * kDepth, x));
}

#if defined(__AIENGINE__)
inline bf16_t to_bf16(float value) { return static_cast<bfloat16>(value); }
inline float to_float(bf16_t value) { return static_cast<float>(value); }
inline float bf16_round(float value) { return to_float(to_bf16(value)); }
#else
inline bf16_t to_bf16(float value) { return float_to_bf16(value); }
inline float to_float(bf16_t value) { return bf16_to_float(value); }
inline float bf16_round(float value) { return round_to_bf16(value); }
#endif

} // namespace

extern "C" void gemv_bf16(const bf16_t *w, const bf16_t *x, bf16_t *y) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
#endif
  row_dots(w, x, [y](int m, float sum) { y[m] = to_bf16(sum); });
}

extern "C" void gemv_bf16_f32(const bf16_t *w, const bf16_t *x, float *y) {
  row_dots(w, x, [y](int m, float sum) { y[m] = sum; });
}

extern "C" void gemv_partial_f32(const bf16_t *w, const bf16_t *x, float *acc, int32_t k0) {
  const bool first = k0 == 0;
  row_dots(w, x + k0, [acc, first](int m, float sum) { acc[m] = first ? sum : acc[m] + sum; });
}

extern "C" void gemv_add_bf16(const float *acc, const bf16_t *residual, bf16_t *y, int32_t residual_row0,
                              int32_t row0) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
#endif
  for (int m = 0; m < kRows; ++m)
    y[row0 + m] = to_bf16(bf16_round(acc[m]) + to_float(residual[residual_row0 + m]));
}

extern "C" void gemv_rows_bf16(const bf16_t *w, const bf16_t *x, bf16_t *y, int32_t row0) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
#endif
  row_dots(w, x, [y, row0](int m, float sum) { y[row0 + m] = to_bf16(sum); });
}

extern "C" void rmsnorm_bf16(const bf16_t *x_and_weight, bf16_t *out, float eps) {
  const bf16_t *x = x_and_weight;
  const bf16_t *weight = x_and_weight + kDepth;
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
  constexpr int kLanes = 16;
  static_assert(kDepth % kLanes == 0, "AIE path: GEMV_K must be a multiple of 16");
  aie::accum<accfloat, kLanes> squares = aie::zeros<accfloat, kLanes>();
  for (int k = 0; k < kDepth; k += kLanes) {
    const aie::vector<bfloat16, kLanes> v = aie::load_v<kLanes>(x + k);
    squares = aie::mac(squares, v, v);
  }
  const float rstd = aie::invsqrt(aie::reduce_add(squares.to_vector<float>()) / kDepth + eps);
  // aie::mul multiplies bf16 by bf16 or fp32 by fp32, not bf16 by fp32. rstd is the sum of three bf16 terms, exactly
  // (8 significant bits each), so x * rstd is three exact bf16 x bf16 products summed in the fp32 accumulator: the
  // fp32 product up to the accumulator's rounding, on the native multiplier (no emulated fp32 multiply).
  const bfloat16 rstd_high = static_cast<bfloat16>(rstd);
  const float rstd_rest = rstd - static_cast<float>(rstd_high);
  const bfloat16 rstd_middle = static_cast<bfloat16>(rstd_rest);
  const bfloat16 rstd_low = static_cast<bfloat16>(rstd_rest - static_cast<float>(rstd_middle));
  for (int k = 0; k < kDepth; k += kLanes) {
    const aie::vector<bfloat16, kLanes> v = aie::load_v<kLanes>(x + k);
    aie::accum<accfloat, kLanes> scaled = aie::mul(v, rstd_high);
    scaled = aie::mac(scaled, v, rstd_middle);
    const aie::vector<bfloat16, kLanes> normed = aie::mac(scaled, v, rstd_low).template to_vector<bfloat16>();
    aie::store_v(out + k, aie::mul(normed, aie::load_v<kLanes>(weight + k)).template to_vector<bfloat16>());
  }
#else
  float sum = 0.0f;
  for (int k = 0; k < kDepth; ++k) {
    const float v = bf16_to_float(x[k]);
    sum += v * v;
  }
  const float rstd = 1.0f / std::sqrt(sum / kDepth + eps);
  for (int k = 0; k < kDepth; ++k)
    out[k] = float_to_bf16(round_to_bf16(bf16_to_float(x[k]) * rstd) * bf16_to_float(weight[k]));
#endif
}

extern "C" void swiglu_bf16(bf16_t *gate_up, int32_t length) {
  // Pair k is read at 2k and 2k + 1 and written at k, in increasing k: a write never lands on an unread pair.
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
  for (int k = 0; k < length; k += kSiluMulLanes) {
    const aie::vector<bfloat16, 2 * kSiluMulLanes> pairs = aie::load_v<2 * kSiluMulLanes>(gate_up + 2 * k);
    aie::store_v(gate_up + k, silu_mul_vector(aie::filter_even(pairs, 1), aie::filter_odd(pairs, 1)));
  }
#else
  for (int k = 0; k < length; ++k)
    gate_up[k] = silu_mul_scalar(gate_up[2 * k], gate_up[2 * k + 1]);
#endif
}
