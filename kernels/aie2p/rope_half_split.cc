// Half-split rotary position embedding (HuggingFace's `rotate_half`) over one tile of rows.
//
// Tile sizes, compile-time (override with -D):
//   ROPE_ROWS      rows per call                                          default 1
//   ROPE_HEADS     heads per row                                          default 1
//   ROPE_HEAD_DIM  elements per head; even (AIE path: a multiple of 32)   default 64
//
// Symbol (rename with -Drope_half_split_bf16=<name> to link two variants into one ELF):
//   void rope_half_split_bf16(const bf16 *x, const bf16 *lut, bf16 *y)
//     x, y  ROPE_ROWS x (ROPE_HEADS * ROPE_HEAD_DIM), row-major; y may be x (in place)
//     lut   ROPE_ROWS x ROPE_HEAD_DIM, row r = [cos_0 .. cos_{h-1}, sin_0 .. sin_{h-1}], h = ROPE_HEAD_DIM / 2,
//           the angles of row r's position (every head of a row shares them)
//   For each row and head, with a = x[i] and b = x[i + h] (i < h), rounding where HF's bf16
//   `(q * cos) + (rotate_half(q) * sin)` rounds:
//     y[i]     = bf16(bf16(a * cos_i) - bf16(b * sin_i))
//     y[i + h] = bf16(bf16(b * cos_i) + bf16(a * sin_i))
//   bf16() rounds an fp32 value to nearest-even. A bf16 x bf16 product is exact in fp32, so each product rounds
//   once, and the sum of the rounded products once more (fp32 has over twice bf16's precision, so rounding
//   their sum through it equals rounding the exact sum). rotate_half's negation commutes with rounding, so
//   HF's bf16(a * cos_i) + bf16((-b) * sin_i) is y[i], signed zeros included.
//   AIE path: every buffer 64-byte aligned.
#include "npu2_kernel.h"

#ifndef ROPE_ROWS
#define ROPE_ROWS 1
#endif
#ifndef ROPE_HEADS
#define ROPE_HEADS 1
#endif
#ifndef ROPE_HEAD_DIM
#define ROPE_HEAD_DIM 64
#endif

namespace {

constexpr int kRows = ROPE_ROWS;
constexpr int kHeads = ROPE_HEADS;
constexpr int kHeadDim = ROPE_HEAD_DIM;
constexpr int kHalf = kHeadDim / 2;
constexpr int kRowWidth = kHeads * kHeadDim;

static_assert(kRows > 0 && kHeads > 0, "ROPE_ROWS and ROPE_HEADS must be positive");
static_assert(kHeadDim > 0 && kHeadDim % 2 == 0, "ROPE_HEAD_DIM must be even");

} // namespace

extern "C" void rope_half_split_bf16(const bf16_t *x, const bf16_t *lut, bf16_t *y) {
#if defined(__AIENGINE__)
  static_assert(kHalf % 16 == 0, "AIE path: ROPE_HEAD_DIM must be a multiple of 32");
  // 32 bf16 lanes is the native width of the bf16 multiplier; 16 covers head_dim 32, 96, ...
  constexpr int kLanes = kHalf % 32 == 0 ? 32 : 16;
  using Vec = aie::vector<bfloat16, kLanes>;
  using Acc = aie::accum<accfloat, kLanes>;
  RoundToNearestEven rounding;

  for (int row = 0; row < kRows; ++row) {
    const bfloat16 *cos_row = lut + row * kHeadDim;
    const bfloat16 *sin_row = cos_row + kHalf;
    const bfloat16 *x_row = x + row * kRowWidth;
    bfloat16 *y_row = y + row * kRowWidth;
    for (int i = 0; i < kHalf; i += kLanes) {
      // One row's angles serve all of its heads: load them once per chunk.
      const Vec cos_v = aie::load_v<kLanes>(cos_row + i);
      const Vec sin_v = aie::load_v<kLanes>(sin_row + i);
      for (int head = 0; head < kHeads; ++head) {
        const int first = head * kHeadDim + i;
        const Vec a = aie::load_v<kLanes>(x_row + first);
        const Vec b = aie::load_v<kLanes>(x_row + first + kHalf);
        // Products are exact in the fp32 accumulator: to_vector is their one rounding, as in HF's bf16 mul.
        const Vec a_cos = aie::mul(a, cos_v).to_vector<bfloat16>();
        const Vec b_sin = aie::mul(b, sin_v).to_vector<bfloat16>();
        const Vec b_cos = aie::mul(b, cos_v).to_vector<bfloat16>();
        const Vec a_sin = aie::mul(a, sin_v).to_vector<bfloat16>();
        // The rounded products widen exactly; their fp32 sum rounds once more, as HF's bf16 add does.
        aie::store_v(y_row + first, aie::sub(Acc(a_cos), b_sin).to_vector<bfloat16>());
        aie::store_v(y_row + first + kHalf, aie::add(Acc(b_cos), a_sin).to_vector<bfloat16>());
      }
    }
  }
#else
  for (int row = 0; row < kRows; ++row) {
    const bf16_t *cos_row = lut + row * kHeadDim;
    const bf16_t *sin_row = cos_row + kHalf;
    for (int head = 0; head < kHeads; ++head) {
      const int offset = row * kRowWidth + head * kHeadDim;
      for (int i = 0; i < kHalf; ++i) {
        const float a = bf16_to_float(x[offset + i]);
        const float b = bf16_to_float(x[offset + i + kHalf]);
        const float c = bf16_to_float(cos_row[i]);
        const float s = bf16_to_float(sin_row[i]);
        y[offset + i] = float_to_bf16(round_to_bf16(a * c) - round_to_bf16(b * s));
        y[offset + i + kHalf] = float_to_bf16(round_to_bf16(b * c) + round_to_bf16(a * s));
      }
    }
  }
#endif
}
