// Matrix-vector product for decode projections: y = W x with W in HuggingFace's (out, in) layout.
//
// Tile sizes, compile-time (override with -D):
//   GEMV_ROWS  output rows per call (rows of W)                  default 32
//   GEMV_K     row length of W and length of x (AIE path: a multiple of 32)   default 2048
//
// Symbols (rename with -Dgemv_bf16=<name> to link two variants, e.g. two K, into one ELF):
//   void gemv_bf16(const bf16 *w, const bf16 *x, bf16 *y)
//     w  GEMV_ROWS x GEMV_K, row-major (each row contiguous)
//     x  GEMV_K
//     y  GEMV_ROWS;  y[m] = sum_k w[m][k] * x[k], accumulated in fp32, rounded once to bf16 (nearest-even)
//   void gemv_bf16_f32(const bf16 *w, const bf16 *x, float *y)
//     the same sums written as fp32: the LM head keeps its accumulator for the logits
//   AIE path: every buffer 64-byte aligned.
#include "npu2_kernel.h"

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

} // namespace

namespace {

// Calls store(m, sum) with row m's fp32 dot product, for every row of the tile.
template <typename Store> void row_dots(const bf16_t *w, const bf16_t *x, Store store) {
#if defined(__AIENGINE__)
  static_assert(kDepth % 32 == 0, "AIE path: GEMV_K must be a multiple of 32");
  // 32 lanes: the native width of the bf16 multiplier. Decode GEMV is bound by the DMA that feeds W, so one
  // accumulator per row is enough to keep up with it.
  constexpr int kLanes = 32;
  for (int m = 0; m < kRows; ++m) {
    const bfloat16 *row = w + m * kDepth;
    aie::accum<accfloat, kLanes> acc = aie::zeros<accfloat, kLanes>();
    for (int k = 0; k < kDepth; k += kLanes)
      acc = aie::mac(acc, aie::load_v<kLanes>(row + k), aie::load_v<kLanes>(x + k));
    store(m, aie::reduce_add(acc.to_vector<float>()));
  }
#else
  for (int m = 0; m < kRows; ++m) {
    const bf16_t *row = w + m * kDepth;
    float acc = 0.0f;
    for (int k = 0; k < kDepth; ++k)
      acc += bf16_to_float(row[k]) * bf16_to_float(x[k]);
    store(m, acc);
  }
#endif
}

} // namespace

extern "C" void gemv_bf16(const bf16_t *w, const bf16_t *x, bf16_t *y) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
  row_dots(w, x, [y](int m, float sum) { y[m] = static_cast<bfloat16>(sum); });
#else
  row_dots(w, x, [y](int m, float sum) { y[m] = float_to_bf16(sum); });
#endif
}

extern "C" void gemv_bf16_f32(const bf16_t *w, const bf16_t *x, float *y) {
  row_dots(w, x, [y](int m, float sum) { y[m] = sum; });
}
