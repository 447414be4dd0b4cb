// Per-row quantization of bf16 activations to int16 for the integer GEMMs ("w8x2a16"), on one compute tile:
// kernels/int_gemm.py's quantize_activations and pack_activations, bit for bit (tests/kernels/test_gemm_int8_host.py).
//
// Compile-time (-D):
//   QUANT_K      values per row (a multiple of 32)                                               default 2048
//   QUANT_CHUNK  values one quantize_rows_chunk call packs (a multiple of 64 dividing QUANT_K)   default QUANT_K
//
// Symbols (x: one row of QUANT_K bf16; state: 16 floats the two calls share):
//   void quantize_rows_prepare(const bf16 *x, float *state)
//        absmax = max |x|; inv = fp32(32767 / absmax) (0 for a zero row); S = Σ |rint(fp32(x · inv))| (an exact
//        integer); if 127 · S > 2^31 − 1: inv = fp32(inv · fp32(budget / fp32(S + K / 2))), budget =
//        fp32((2^31 − 1) / 127 − K) (int_gemm.activation_l1_budget); state[0] = inv, state[1] = fp32(1 / inv) (the
//        row's scale; 0 for a zero row), the rest 0
//   void quantize_rows_chunk(const bf16 *x, const float *state, int32_t *q, int32_t chunk)
//        q = the row's runs chunk · QUANT_CHUNK / 32 ... as int_gemm lays them out: per 32 values their
//        rint(fp32(x · inv)) as int16, the scale's fp32 bits as two int16 (low half first), two zeros (18 words a
//        run, QUANT_CHUNK / 32 runs)
// rint rounds half to even on both paths by fp32 arithmetic: adding and subtracting 1.5 · 2^23 rounds |y| < 2^22 to an
// integer with the fp32 add's rounding; |x · inv| ≤ 32767 (1 + 2^-23), so no value needs a clamp.
//
// AIE path: fp32(x · inv) exactly as IEEE rounds it, without an fp32 multiplier (AIE2P has none; aie_api emulates
// one): inv is split into three bf16 parts at fixed positions (hi + mid + lo = inv exactly: its significand's top,
// middle and last 8 bits), x is bf16, so x · hi is exact in the fp32 accumulator, x · hi + x · mid = x · (hi + mid)
// (8 × 16 bits) is too, and the last multiply-accumulate rounds the exact product once (a split by significance
// instead, mid taking rest's leading 8 bits, would leave x · (hi + mid) wider than fp32 when rest has leading zeros). That holds if the core's bf16 multiply-accumulate rounds
// fp32(acc + x · lo) once, to nearest even, which this machine cannot check (no Peano, no NPU); nor for parts that
// fall below fp32's normal range (|inv| < 2^-110, a row of |x| > 10^37). S is summed per lane in an int32 accumulator
// from the int16 q, then across the lanes (exact: S < 32767 · K < 2^31). A group of 8 runs is 9 aligned
// 512-bit stores: each run's q shifted into place with the previous run's tail and the scale (shuffle_up_fill,
// shuffle_down_fill). Scalar float work (the divisions, the branch) is software-emulated, once per row.
// Type-checked by `torch-npu2 lint --aie-source` and run against a value stand-in of the AIE API
// (tests/kernels/test_aie_path_values.py: equal to the host path bit for bit); code generation and register use
// are not checked here.
#include "npu2_kernel.h"

#ifndef QUANT_K
#define QUANT_K 2048
#endif
#ifndef QUANT_CHUNK
#define QUANT_CHUNK QUANT_K
#endif

namespace {

constexpr int kK = QUANT_K;
constexpr int kChunk = QUANT_CHUNK;
constexpr int kRun = 32;                        // values per run (int_gemm.CALL_K)
constexpr int kRunInt16 = 36;                   // int16 per run: 32 q, the scale, 2 zeros (int_gemm.CALL_COLS)
constexpr int kChunkRuns = kChunk / kRun;
constexpr float kQmax = 32767.0f;               // int_gemm.ACTIVATION_QMAX["w8x2a16"]
constexpr int32_t kSpentLimit = 2147483647 / 127;  // 127 · S > 2^31 − 1 exactly when S > this
constexpr float kBudget = float(2147483647 / 127 - kK);  // int_gemm.activation_l1_budget(K), rounded to fp32
constexpr float kRoundingBias = 12582912.0f;    // 1.5 * 2^23
static_assert(kK > 0 && kK % kRun == 0, "QUANT_K must be a positive multiple of 32");
static_assert(kChunk > 0 && kChunk % (2 * kRun) == 0 && kK % kChunk == 0,
              "QUANT_CHUNK must be a positive multiple of 64 dividing QUANT_K");
static_assert(kK <= 65536, "Σ|q| must stay below 2^31 (32767 · K)");
constexpr int kStateFloats = 16;

} // namespace

#if defined(__AIENGINE__)

namespace {

constexpr int kLanes = 32;  // bf16 values per 512-bit register, and q per run

inline float from_bits(uint32_t bits) {
  float value;
  __builtin_memcpy(&value, &bits, sizeof value);
  return value;
}

struct InverseParts {
  aie::vector<bfloat16, kLanes> hi, mid, lo;  // inv = hi + mid + lo exactly, broadcast
};

// inv cut at fixed bit positions of its significand: hi its top 8 bits (its bf16 truncation), mid the next 8, lo the
// last 8. mid and lo are formed as (2^e + their bits) − 2^e, exact subtractions, so each is a bf16 value, and
// hi + mid is inv's top 16 bits: x · (hi + mid) has at most 24 significant bits.
inline InverseParts split(float inv) {
  uint32_t bits;
  __builtin_memcpy(&bits, &inv, sizeof bits);
  const uint32_t power = bits & 0xff800000u;  // the sign and exponent: ±2^e
  const float hi = from_bits(bits & 0xffff0000u);
  const float mid = from_bits(power | (bits & 0xff00u)) - from_bits(power);
  const float lo = from_bits(power | (bits & 0xffu)) - from_bits(power);
  return {aie::broadcast<bfloat16, kLanes>(bfloat16(hi)), aie::broadcast<bfloat16, kLanes>(bfloat16(mid)),
          aie::broadcast<bfloat16, kLanes>(bfloat16(lo))};
}

// rint(fp32(x · inv)) of 32 values, as integer-valued floats.
inline aie::vector<float, kLanes> quantized(aie::vector<bfloat16, kLanes> x, const InverseParts &inv,
                                            aie::vector<float, kLanes> bias) {
  aie::accum<accfloat, kLanes> product = aie::mul(x, inv.hi);
  product = aie::mac(product, x, inv.mid);
  product = aie::mac(product, x, inv.lo);  // the one rounding of x · inv
  return aie::sub(aie::add(product.to_vector<float>(), bias), bias);
}

// Packs `runs` (≤ 8) runs from a 64-byte aligned `out`: 36 · runs int16, in 512-bit stores while whole.
inline void pack_runs(const bfloat16 *x, const InverseParts &inv, aie::vector<float, kLanes> bias,
                      aie::vector<int16_t, kLanes> scale, int16_t *out, int runs) {
  aie::vector<int16_t, kLanes> pending = aie::zeros<int16_t, kLanes>();  // the stream's last elements, at the top
  for (int r = 0; r < runs; ++r) {
    const aie::vector<int16_t, kLanes> q = aie::to_fixed<int16_t>(quantized(aie::load_v<kLanes>(x + r * kRun), inv,
                                                                            bias), 0);
    aie::store_v(out + r * kLanes, r == 0 ? q : aie::shuffle_up_fill(q, pending, 4 * r));
    pending = aie::shuffle_down_fill(q, scale, 4);  // q's last 28 values, then the scale and two zeros
  }
  int16_t *tail = out + runs * kLanes;  // 4 · runs int16 of the stream are left, at the top of pending
  if (runs == 8) {
    aie::store_v(tail, pending);
    return;
  }
  const aie::vector<int16_t, kLanes> left = aie::shuffle_down(pending, kLanes - 4 * runs);
  if (4 * runs >= 16)
    aie::store_v(tail, left.extract<16>(0));
  if ((4 * runs) % 16)
    aie::store_v(tail + (4 * runs / 16) * 16, left.extract<8>((4 * runs / 16) * 2));
}

} // namespace

extern "C" void quantize_rows_prepare(const bfloat16 *__restrict x, float *__restrict state) {
  RoundToNearestEven rounding;
  // The largest and the smallest value; |x| <= max(largest, -smallest), exactly (negation is exact).
  aie::vector<bfloat16, kLanes> largest = aie::zeros<bfloat16, kLanes>();
  aie::vector<bfloat16, kLanes> smallest = aie::zeros<bfloat16, kLanes>();
  for (int k = 0; k < kK; k += kLanes) {
    const aie::vector<bfloat16, kLanes> values = aie::load_v<kLanes>(x + k);
    largest = aie::max(largest, values);
    smallest = aie::min(smallest, values);
  }
  const float high = float(aie::reduce_max(largest)), low = -float(aie::reduce_min(smallest));
  const float absmax = high > low ? high : low;
  float inv = absmax > 0.0f ? kQmax / absmax : 0.0f;
  const aie::vector<float, kLanes> bias = aie::broadcast<float, kLanes>(kRoundingBias);
  const InverseParts parts = split(inv);
  aie::accum<acc32, kLanes> spent = aie::zeros<acc32, kLanes>();  // per lane at most K / 32 · 32767: exact
  for (int k = 0; k < kK; k += kLanes) {
    const aie::vector<int16_t, kLanes> q =
        aie::to_fixed<int16_t>(quantized(aie::load_v<kLanes>(x + k), parts, bias), 0);
    spent = aie::add(spent, aie::max(q, aie::sub(aie::zeros<int16_t, kLanes>(), q)));  // |q|
  }
  const int32_t total = aie::reduce_add(spent.to_vector<int32_t>());
  if (total > kSpentLimit)
    inv = inv * (kBudget / float(total + kK / 2));
  state[0] = inv;
  state[1] = inv > 0.0f ? 1.0f / inv : 0.0f;
  for (int i = 2; i < kStateFloats; ++i)
    state[i] = 0.0f;
}

extern "C" void quantize_rows_chunk(const bfloat16 *__restrict x, const float *__restrict state,
                                    int32_t *__restrict q, int32_t chunk) {
  RoundToNearestEven rounding;
  const InverseParts parts = split(state[0]);
  const aie::vector<float, kLanes> bias = aie::broadcast<float, kLanes>(kRoundingBias);
  int32_t bits;
  __builtin_memcpy(&bits, state + 1, sizeof bits);
  aie::vector<int32_t, kLanes / 2> words = aie::zeros<int32_t, kLanes / 2>();
  words.set(bits, 0);
  const aie::vector<int16_t, kLanes> scale = words.cast_to<int16_t>();  // the scale's halves, then zeros
  const bfloat16 *row = x + chunk * kChunk;
  int16_t *out = reinterpret_cast<int16_t *>(q);
  for (int run = 0; run < kChunkRuns; run += 8)
    pack_runs(row + run * kRun, parts, bias, scale, out + run * kRunInt16,
              kChunkRuns - run < 8 ? kChunkRuns - run : 8);
}

#else

#include <cstdlib>

namespace {

// rint(fp32(x · inv)), as an integer-valued float (volatile: each step rounded to fp32 as written).
inline float quantized(bf16_t x, float inv) {
  const volatile float scaled = bf16_to_float(x) * inv;
  const volatile float biased = scaled + kRoundingBias;
  return biased - kRoundingBias;
}

} // namespace

extern "C" void quantize_rows_prepare(const bf16_t *x, float *state) {
  float absmax = 0.0f;
  for (int k = 0; k < kK; ++k) {
    const float value = bf16_to_float(x[k]);
    absmax = value > absmax ? value : (-value > absmax ? -value : absmax);
  }
  float inv = absmax > 0.0f ? kQmax / absmax : 0.0f;
  int64_t total = 0;
  for (int k = 0; k < kK; ++k)
    total += int64_t(std::abs(quantized(x[k], inv)));
  if (total > kSpentLimit) {
    const volatile float bound = float(total + kK / 2);
    const volatile float ratio = kBudget / bound;
    inv = inv * ratio;
  }
  state[0] = inv;
  state[1] = inv > 0.0f ? 1.0f / inv : 0.0f;
  for (int i = 2; i < kStateFloats; ++i)
    state[i] = 0.0f;
}

extern "C" void quantize_rows_chunk(const bf16_t *x, const float *state, int32_t *q, int32_t chunk) {
  const float inv = state[0];
  uint16_t halves[2];
  std::memcpy(halves, state + 1, sizeof halves);
  int16_t *out = reinterpret_cast<int16_t *>(q);
  for (int r = 0; r < kChunkRuns; ++r) {
    const bf16_t *run = x + chunk * kChunk + r * kRun;
    int16_t *packed = out + r * kRunInt16;
    for (int k = 0; k < kRun; ++k)
      packed[k] = int16_t(quantized(run[k], inv));
    packed[kRun] = int16_t(halves[0]);
    packed[kRun + 1] = int16_t(halves[1]);
    packed[kRun + 2] = packed[kRun + 3] = 0;
  }
}

#endif
