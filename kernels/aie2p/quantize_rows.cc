// Per-row symmetric quantization of bf16 activations for the integer GEMMs (gemm_int8.cc), on one compute tile:
// torch_npu2/emulator/int8.py's quantize_rows, bit for bit.
//
// Compile-time (-D):
//   QUANT_ROWS     rows per call                                    default 1
//   QUANT_K        values per row (a multiple of 32)                default 2048
//   QUANT_QMAX     the largest |q|: 127 (W8A8) or int8.py's K-bound qmax for int16 (W8A16)
//   QUANT_ACT_BITS 8 or 16: the type of q
//
// Symbol: void quantize_rows_bf16(const bf16 *x, act *q, float *scale)
//   per row: absmax = max |x|, scale = absmax / qmax, q = rint(x * fp32(qmax / absmax)) (0 for a zero row);
//   x and q row-major [QUANT_ROWS][QUANT_K], scale [QUANT_ROWS].
// rint is fp32 arithmetic on both paths: adding and subtracting 1.5 * 2^23 rounds |y| < 2^22 to the nearest
// integer, ties to even (the fp32 add's rounding), whatever the core's rounding mode for conversions. |x * inv|
// is at most qmax (1 + 2^-23) < qmax + 1/2, so no value needs the clamp int8.py writes down.
#include "npu2_kernel.h"

#ifndef QUANT_ROWS
#define QUANT_ROWS 1
#endif
#ifndef QUANT_K
#define QUANT_K 2048
#endif
#ifndef QUANT_QMAX
#define QUANT_QMAX 127
#endif
#ifndef QUANT_ACT_BITS
#define QUANT_ACT_BITS 8
#endif

namespace {

constexpr int kRows = QUANT_ROWS;
constexpr int kK = QUANT_K;
constexpr float kQmax = QUANT_QMAX;
constexpr float kRoundingBias = 12582912.0f;  // 1.5 * 2^23
static_assert(kK > 0 && kK % 32 == 0, "QUANT_K must be a positive multiple of 32");
static_assert(QUANT_ACT_BITS == 8 || QUANT_ACT_BITS == 16, "QUANT_ACT_BITS must be 8 or 16");
static_assert(QUANT_QMAX > 0 && QUANT_QMAX < (1 << (QUANT_ACT_BITS - 1)), "QUANT_QMAX must fit the type of q");
#if QUANT_ACT_BITS == 8
using act_t = int8_t;
#else
using act_t = int16_t;
#endif

} // namespace

#if defined(__AIENGINE__)

namespace {
constexpr int kLanes = 32;       // bf16 values per max
constexpr int kFloatLanes = 16;  // fp32 values per register
} // namespace

extern "C" void quantize_rows_bf16(const bfloat16 *__restrict x, act_t *__restrict q, float *__restrict scale) {
  const aie::vector<float, kFloatLanes> bias = aie::broadcast<float, kFloatLanes>(kRoundingBias);
  for (int r = 0; r < kRows; ++r) {
    const bfloat16 *row = x + r * kK;
    // The largest and the smallest value; |x| <= max(largest, -smallest), exactly (negation is exact).
    aie::vector<bfloat16, kLanes> largest = aie::zeros<bfloat16, kLanes>();
    aie::vector<bfloat16, kLanes> smallest = aie::zeros<bfloat16, kLanes>();
    for (int k = 0; k < kK; k += kLanes) {
      const aie::vector<bfloat16, kLanes> values = aie::load_v<kLanes>(row + k);
      largest = aie::max(largest, values);
      smallest = aie::min(smallest, values);
    }
    const float high = float(aie::reduce_max(largest)), low = -float(aie::reduce_min(smallest));
    const float absmax = high > low ? high : low;
    const float inverse = absmax > 0.0f ? kQmax / absmax : 0.0f;
    scale[r] = absmax / kQmax;
    for (int k = 0; k < kK; k += kFloatLanes) {
      aie::accum<accfloat, kFloatLanes> widened;
      widened.from_vector(aie::load_v<kFloatLanes>(row + k));
      const aie::vector<float, kFloatLanes> scaled = aie::mul(widened.to_vector<float>(), inverse).to_vector<float>();
      const aie::vector<float, kFloatLanes> rounded =
          aie::sub(aie::add(scaled, bias), bias);  // integer-valued: the conversion below is exact
      aie::store_v(q + r * kK + k, aie::to_fixed<act_t>(rounded, 0));
    }
  }
}

#else

extern "C" void quantize_rows_bf16(const bf16_t *x, act_t *q, float *scale) {
  for (int r = 0; r < kRows; ++r) {
    const bf16_t *row = x + r * kK;
    float absmax = 0.0f;
    for (int k = 0; k < kK; ++k) {
      const float value = bf16_to_float(row[k]);
      absmax = value > absmax ? value : (-value > absmax ? -value : absmax);
    }
    const float inverse = absmax > 0.0f ? kQmax / absmax : 0.0f;
    scale[r] = absmax / kQmax;
    for (int k = 0; k < kK; ++k) {
      const volatile float scaled = bf16_to_float(row[k]) * inverse;  // rounded to fp32 before the bias
      const volatile float biased = scaled + kRoundingBias;
      q[r * kK + k] = act_t(biased - kRoundingBias);
    }
  }
}

#endif
