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
//
// Packed block-quantized weights (kernels/quant.py's row layout; the format by GEMV_QUANT, default 41):
//   GEMV_QUANT  40 Q4_0 (int4 quants q - 8, fp16 scale d), 41 Q4_1 (uint4 q, fp16 d and min m), 80 Q8_0 (int8 q, d)
//   Each row of w is GEMV_K elements in groups (32 blocks when GEMV_K is a multiple of 1024, else the whole row or,
//   past 2048 bytes, the most blocks dividing it that fit), each group its blocks' quants (transposed in groups of
//   32 blocks: a lane per block), then their fp16 scales, then (Q4_1) their fp16 mins, padded to a block's quant
//   bytes (16, Q8_0 32).
//   A block's weights are GGUF's, exactly: d * (q - 8), d * q + m, d * q, in fp32.
//   void gemv_q_prepare_x(bf16 *x, int32_t length)
//     x as the calls below read it, in place: each 1024-element group of x's length elements transposed (element
//     32 l + i to 32 i + l) when GEMV_K is a multiple of 1024, else unchanged. Called once per tile entry.
//   void gemv_q_bf16(const uint8_t *w, const bf16 *x, bf16 *y)      gemv_bf16 over packed rows
//   void gemv_q_bf16_f32(const uint8_t *w, const bf16 *x, float *y)  gemv_bf16_f32 over packed rows
//   void gemv_q_partial_f32(const uint8_t *w, const bf16 *x, float *acc, int32_t k0)
//     gemv_partial_f32 over a K chunk of packed rows (GEMV_K elements: whole groups of a longer row)
//   void gemv_q_rows_bf16(const uint8_t *w, const bf16 *x, bf16 *y, int32_t row0)   gemv_rows_bf16 over packed rows
//   void gemv_q_dequant_bf16(const uint8_t *w, bf16 *out)
//     out (GEMV_ROWS x GEMV_K, row-major): the rows' weights, GGUF's fp32 values rounded once to bf16 (nearest-even)
//   Each row's sum is of the exact weights times x, in fp32, every product exact. Transposed groups: each lane
//   sums its block's (128 + q) x (Q8_0: q x), takes 128 sum(x) away (136 for Q4_0's q - 8), and the group's scales
//   apply per lane: the lane's sum as three bf16 values times d as three bf16 values, plus sum(x) times m the
//   same way, so a block contributes d * sum(q x) + m * sum(x), each block's sum rounded once in fp32 before it
//   is scaled; the lanes are summed at the end. Element-order groups: each block's q * x, exact in the
//   accumulator, split into two bf16 values and multiplied by the scale's three (fp16's 11 significant bits do
//   not fit one bf16), x by the min the same way. For transposed groups the host path computes the same sums in
//   the same order (the final lane reduction folds halves; the core's order is aie_api's reduce_add); for
//   element-order groups it sums each exact weight times x in element order, within fp32's reordering of the core's
//   (tests/kernels/test_aie_path_values.py runs both paths).
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
#ifndef GEMV_QUANT
#define GEMV_QUANT 41
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

// ---- packed block-quantized rows (kernels/quant.py) ----
// Packed rows hold whole 32-element blocks: a host build of the bf16 GEMVs at another K leaves them out (the AIE
// path needs K a multiple of 32 anyway).
#if GEMV_K % 32 == 0
static_assert(GEMV_QUANT == 40 || GEMV_QUANT == 41 || GEMV_QUANT == 80, "GEMV_QUANT: 40 Q4_0, 41 Q4_1, 80 Q8_0");
constexpr int kBlock = 32;
constexpr bool kHasMin = GEMV_QUANT == 41;
constexpr int kQuantBytes = GEMV_QUANT == 80 ? 32 : 16;
constexpr int kBlocks = kDepth / kBlock;
constexpr int kBlockBytes = kQuantBytes + 2 + (kHasMin ? 2 : 0);
// A group's bytes padded so that every group starts aligned to a block's quants, one vector load (kernels/quant.py:
// AIE2P truncates an unaligned address).
constexpr int padded_group_bytes(int blocks) {
  return (blocks * kBlockBytes + kQuantBytes - 1) / kQuantBytes * kQuantBytes;
}
// kernels/quant.py's groups: 32 blocks when K is a multiple of 1024, else the most blocks dividing the row whose
// bytes fit one BD dimension of 4-byte words (its MAX_GROUP_BYTES), so a K-split GEMV's chunk is whole groups.
constexpr int kMaxGroupBytes = 4 * 512;
constexpr int group_blocks() {
  if (kBlocks % 32 == 0)
    return 32;
  for (int g = kBlocks; g > 1; --g)
    if (kBlocks % g == 0 && padded_group_bytes(g) <= kMaxGroupBytes)
      return g;
  return 1;
}
constexpr int kGroupBlocks = group_blocks();
// Groups of 32 blocks hold their quants transposed (a lane per block) and read x transposed the same way
// (gemv_q_prepare_x); groups of another size hold them in element order.
constexpr bool kTransposed = kGroupBlocks == 32;
constexpr int kGroups = kBlocks / kGroupBlocks;
constexpr int kGroupElements = kGroupBlocks * kBlock;
constexpr int kGroupBytes = padded_group_bytes(kGroupBlocks);
constexpr int kRowBytes = kGroups * kGroupBytes;
// Transposed Q4 lanes take 128 + q: the nibble as the low mantissa bits under the exponent of 128, a bf16 built with
// two bit operations (below); kQuantBias * sum(x) taken away leaves sum(q x), or sum((q - 8) x) for Q4_0, whose
// weight is d (q - 8).
constexpr int kLaneOffset = 128;
constexpr int kQuantBias = kLaneOffset + (GEMV_QUANT == 40 ? 8 : 0);

inline uint16_t load_u16(const uint8_t *p) { return uint16_t(p[0] | (p[1] << 8)); }

// An fp16 value h as three bf16 values a + b + c, exactly (bit patterns returned): h = n * 2^e with n < 2048 its
// 11-bit significand; n = 16 hi + lo, and hi * 2^(e+4) = 2^(e+11) (1 + hi/128) - 2^(e+11), lo * 2^e =
// 2^(e+4) (1 + lo/16) - 2^(e+4), so a and b carry hi and lo with a leading one each and c = -(2^(e+11) + 2^(e+4))
// (8 significant bits) takes both leading ones away. Integer operations only (the core has no scalar float
// unit). GGUF's scales are finite, so h's exponent field is below 31.
struct ScaleBits {
  int16_t a, b, c;
};

inline ScaleBits exact_scale_bits(uint16_t h) {
  const int sign = h & 0x8000;
  const int field = (h >> 10) & 31;
  const int n = (field ? 1024 : 0) | (h & 1023);
  const int e = (field ? field : 1) - 25;
  return {int16_t(sign | ((e + 138) << 7) | (n >> 4)), int16_t(sign | ((e + 131) << 7) | ((n & 15) << 3)),
          int16_t((sign ^ 0x8000) | ((e + 138) << 7) | 1)};
}

#if defined(__AIENGINE__)
using Bf16Lanes = aie::vector<bfloat16, kBlock>;
using Acc = aie::accum<accfloat, kBlock>;

// ---- element-order groups (K not a multiple of 1024): a block per vector, its scale broadcast ----
// The quants of one block as 32 exact bf16 values.
inline Bf16Lanes block_quants(const uint8_t *quants) {
  if constexpr (GEMV_QUANT == 41)
    return aie::to_float<bfloat16>(aie::load_v<kBlock>(reinterpret_cast<const uint4 *>(quants)));
  else if constexpr (GEMV_QUANT == 40)
    return aie::to_float<bfloat16>(aie::load_v<kBlock>(reinterpret_cast<const int4 *>(quants)));
  else
    return aie::to_float<bfloat16>(aie::load_v<kBlock>(reinterpret_cast<const int8_t *>(quants)), 0);
}

struct ExactScale {
  Bf16Lanes a, b, c;
};

inline ExactScale exact_scale(uint16_t h) {
  const ScaleBits s = exact_scale_bits(h);
  return {aie::broadcast<int16, kBlock>(s.a).template cast_to<bfloat16>(),
          aie::broadcast<int16, kBlock>(s.b).template cast_to<bfloat16>(),
          aie::broadcast<int16, kBlock>(s.c).template cast_to<bfloat16>()};
}

inline Acc mac_scaled(Acc acc, const Bf16Lanes &v, const ExactScale &s) {
  acc = aie::mac(acc, v, s.a);
  acc = aie::mac(acc, v, s.b);
  return aie::mac(acc, v, s.c);
}

// ---- transposed groups: a lane per block ----
using Int16Lanes = aie::vector<int16, kBlock>;

// An fp32 accumulator's lanes as three bf16 vectors whose sum is exact: 24 significant bits, 8 per part (each
// remainder is exact in the accumulator).
struct Parts {
  Bf16Lanes hi, mid, lo;
};

inline Parts split(const Acc &v) {
  const Bf16Lanes hi = v.template to_vector<bfloat16>();
  const Acc rest = aie::sub(v, hi);
  const Bf16Lanes mid = rest.template to_vector<bfloat16>();
  return {hi, mid, aie::sub(rest, mid).template to_vector<bfloat16>()};
}

// The bit patterns the transposed path builds, broadcast once per call.
struct Constants {
  Int16Lanes one, low4, low6, field5, sign, top_bias, low_bias, cancel_bias, lane_offset, minus_bias;
};

inline Constants constants() {
  auto lanes = [](int value) { return aie::broadcast<int16, kBlock>(int16(value)); };
  return {lanes(1), lanes(15), lanes(63), lanes(31), lanes(-32768), lanes(113 << 7), lanes(106 << 7),
          lanes((113 << 7) | 1),
          lanes(0x4300),                                           // bf16 128 (= kLaneOffset), mantissa empty
          lanes(kQuantBias == 136 ? 0xC308 - 0x10000 : 0xC300 - 0x10000)};  // bf16 -kQuantBias
}

// exact_scale_bits on 32 fp16 values at once: a lane per block.
inline ExactScale exact_scales(const Int16Lanes &h, const Constants &k) {
  const Int16Lanes field = aie::bit_and(aie::downshift(h, 10), k.field5);
  const Int16Lanes exponent = aie::upshift(aie::max(field, k.one), 7);  // (e + 25) << 7, subnormals at e + 25 = 1
  const Int16Lanes hidden = aie::upshift(aie::min(field, k.one), 6);   // n's leading one, as bit 6 of n >> 4
  const Int16Lanes sign = aie::bit_and(h, k.sign);
  const Int16Lanes high = aie::add(aie::add(exponent, k.top_bias), aie::add(hidden, aie::bit_and(aie::downshift(h, 4), k.low6)));
  const Int16Lanes low = aie::add(aie::add(exponent, k.low_bias), aie::upshift(aie::bit_and(h, k.low4), 3));
  const Int16Lanes cancel = aie::bit_or(aie::add(exponent, k.cancel_bias), aie::bit_xor(sign, k.sign));
  return {aie::bit_or(high, sign).template cast_to<bfloat16>(), aie::bit_or(low, sign).template cast_to<bfloat16>(),
          cancel.template cast_to<bfloat16>()};
}

// acc + v * s over the nine exact products of v's and s's parts.
inline Acc mac_parts(Acc acc, const Parts &v, const ExactScale &s) {
  acc = mac_scaled(acc, v.hi, s);
  acc = mac_scaled(acc, v.mid, s);
  return mac_scaled(acc, v.lo, s);
}

// Each lane's block: sum over its 32 elements of (bias + q) x (Q4) or q x (Q8_0), in fp32.
inline Acc group_quant_dots(const uint8_t *quants, const bf16_t *xt, const Constants &k) {
  Acc dot = aie::zeros<accfloat, kBlock>();
  if constexpr (kQuantBytes == 16) {
    for (int t = 0; t < kBlock / 2; ++t) {
      // 32 bytes, byte l = block l's elements 2t (low nibble) and 2t + 1 (high): unpacked to bytes, word l holds
      // them at bits 0-3 and 8-11. Each goes to mantissa bits 0-3 under the exponent of 128: the bf16 128 + q.
      const Int16Lanes pairs =
          aie::unpack(aie::load_v<2 * kBlock>(reinterpret_cast<const uint4 *>(quants + kBlock * t)))
              .template cast_to<int16>();
      const Bf16Lanes even = aie::bit_or(aie::bit_and(pairs, k.low4), k.lane_offset).template cast_to<bfloat16>();
      const Bf16Lanes odd = aie::bit_or(aie::downshift(pairs, 8), k.lane_offset).template cast_to<bfloat16>();
      dot = aie::mac(dot, even, aie::load_v<kBlock>(xt + 2 * kBlock * t));
      dot = aie::mac(dot, odd, aie::load_v<kBlock>(xt + 2 * kBlock * t + kBlock));
    }
  } else {
    for (int i = 0; i < kBlock; ++i)
      dot = aie::mac(dot, aie::to_float<bfloat16>(aie::load_v<kBlock>(reinterpret_cast<const int8_t *>(quants + kBlock * i)), 0),
                     aie::load_v<kBlock>(xt + kBlock * i));
  }
  return dot;
}

// What every row of a call shares: the constants, and each group's per-block sums of x, in parts.
struct CallState {
  Constants k;
  Parts x_sums[kGroups];
};

inline void prepare_call(const bf16_t *xt, CallState &state) {
  state.k = constants();
  if constexpr (kQuantBytes == 16) {
    for (int g = 0; g < kGroups; ++g) {
      Acc sum = aie::zeros<accfloat, kBlock>();
      for (int i = 0; i < kBlock; ++i)
        sum = aie::add(sum, aie::load_v<kBlock>(xt + g * kGroupElements + kBlock * i));
      state.x_sums[g] = split(sum);
    }
  }
}

inline float packed_row_dot(const uint8_t *row, const bf16_t *x, const CallState &state) {
  Acc acc = aie::zeros<accfloat, kBlock>();
  if constexpr (kTransposed) {
    const Bf16Lanes minus_bias = state.k.minus_bias.template cast_to<bfloat16>();
    for (int g = 0; g < kGroups; ++g) {
      const uint8_t *group = row + g * kGroupBytes;
      const uint8_t *scales = group + kGroupBlocks * kQuantBytes;
      Acc dot = group_quant_dots(group, x + g * kGroupElements, state.k);
      if constexpr (kQuantBytes == 16) {  // take bias * sum(x) away: sum(q x), or sum((q - 8) x) for Q4_0
        const Parts &sums = state.x_sums[g];
        dot = aie::mac(aie::mac(aie::mac(dot, sums.hi, minus_bias), sums.mid, minus_bias), sums.lo, minus_bias);
      }
      acc = mac_parts(acc, split(dot), exact_scales(aie::load_v<kBlock>(reinterpret_cast<const int16 *>(scales)), state.k));
      if constexpr (kHasMin)
        acc = mac_parts(acc, state.x_sums[g],
                        exact_scales(aie::load_v<kBlock>(reinterpret_cast<const int16 *>(scales + 2 * kGroupBlocks)), state.k));
    }
  } else {
    for (int g = 0; g < kGroups; ++g) {
      const uint8_t *group = row + g * kGroupBytes;
      const uint8_t *scales = group + kGroupBlocks * kQuantBytes;
      for (int b = 0; b < kGroupBlocks; ++b) {
        const Bf16Lanes xv = aie::load_v<kBlock>(x + g * kGroupElements + b * kBlock);
        // q * x: at most 15 significant bits, exact in the accumulator, exact as two bf16 values
        const Acc qx = aie::mul(block_quants(group + b * kQuantBytes), xv);
        const Bf16Lanes high = qx.template to_vector<bfloat16>();
        const Bf16Lanes low = aie::sub(qx, high).template to_vector<bfloat16>();
        const ExactScale d = exact_scale(load_u16(scales + 2 * b));
        acc = mac_scaled(mac_scaled(acc, high, d), low, d);
        if constexpr (kHasMin)
          acc = mac_scaled(acc, xv, exact_scale(load_u16(scales + 2 * (kGroupBlocks + b))));
      }
    }
  }
  return aie::reduce_add(acc.template to_vector<float>());
}

// Transposes each 32 x 32 group of x in place: five perfect shuffles of its rows (interleave_zip of rows r and
// r + 16 into rows 2r and 2r + 1) transpose it; each shuffle writes back into the two slots it read, so after s of
// them row j sits in slot rotr5(j, s), and after five in slot j.
inline void transpose_groups(bf16_t *x, int length) {
  for (int g = 0; g < length; g += kGroupElements) {
    bf16_t *p = x + g;
    for (int s = 0; s < 5; ++s) {
      for (int r = 0; r < 16; ++r) {
        const int a = ((r >> s) | (r << (5 - s))) & 31, b = (((r + 16) >> s) | ((r + 16) << (5 - s))) & 31;
        const auto zipped = aie::interleave_zip(aie::load_v<kBlock>(p + kBlock * a), aie::load_v<kBlock>(p + kBlock * b), 1);
        aie::store_v(p + kBlock * a, zipped.first);
        aie::store_v(p + kBlock * b, zipped.second);
      }
    }
  }
}
// ---- dequantization (gemv_q_dequant_bf16): each weight bf16(d q + m), GGUF's fp32 value rounded once ----
// d q is formed exactly (q or 128 + q, at most 8 bits, times d's three exact bf16 parts: every partial sum fits the
// accumulator's 24 bits), the bias times d taken away exactly, then m added in one fp32 rounding (an exact m in an
// accumulator of its own): the fp32 value gguf-py computes, rounded to bf16 once. (A zero weight under a negative
// scale, q = 0 of Q8_0 or q = 8 of Q4_0, comes out +0 where gguf-py's is -0: the accumulator starts at +0.)
inline Acc exact_value(const ExactScale &s, const Bf16Lanes &one) {
  return mac_scaled(aie::zeros<accfloat, kBlock>(), one, s);
}

inline void dequant_row(const uint8_t *row, bf16_t *out, const Constants &k) {
  const Bf16Lanes one = aie::broadcast<bfloat16, kBlock>(bfloat16(1.0f));
  if constexpr (kTransposed) {
    const Bf16Lanes minus_bias = k.minus_bias.template cast_to<bfloat16>();
    for (int g = 0; g < kGroups; ++g) {
      const uint8_t *group = row + g * kGroupBytes;
      const uint8_t *scales = group + kGroupBlocks * kQuantBytes;
      bf16_t *values = out + g * kGroupElements;  // [element i][block l] until transposed below
      const ExactScale d = exact_scales(aie::load_v<kBlock>(reinterpret_cast<const int16 *>(scales)), k);
      Acc offset = aie::zeros<accfloat, kBlock>();  // - bias d, exact (Q8_0: no bias)
      if constexpr (kQuantBytes == 16)
        offset = mac_scaled(offset, minus_bias, d);
      Acc min = aie::zeros<accfloat, kBlock>();
      if constexpr (kHasMin)
        min = exact_value(
            exact_scales(aie::load_v<kBlock>(reinterpret_cast<const int16 *>(scales + 2 * kGroupBlocks)), k), one);
      auto store = [&](int i, const Bf16Lanes &lanes) {
        Acc w = aie::add(mac_scaled(aie::zeros<accfloat, kBlock>(), lanes, d), offset);  // d q, exact
        if constexpr (kHasMin)
          w = aie::add(w, min);
        aie::store_v(values + kBlock * i, w.template to_vector<bfloat16>());
      };
      if constexpr (kQuantBytes == 16) {
        for (int t = 0; t < kBlock / 2; ++t) {
          const Int16Lanes pairs =
              aie::unpack(aie::load_v<2 * kBlock>(reinterpret_cast<const uint4 *>(group + kBlock * t)))
                  .template cast_to<int16>();
          store(2 * t, aie::bit_or(aie::bit_and(pairs, k.low4), k.lane_offset).template cast_to<bfloat16>());
          store(2 * t + 1, aie::bit_or(aie::downshift(pairs, 8), k.lane_offset).template cast_to<bfloat16>());
        }
      } else {
        for (int i = 0; i < kBlock; ++i)
          store(i, aie::to_float<bfloat16>(
                       aie::load_v<kBlock>(reinterpret_cast<const int8_t *>(group + kBlock * i)), 0));
      }
      transpose_groups(values, kGroupElements);
    }
  } else {
    for (int g = 0; g < kGroups; ++g) {
      const uint8_t *group = row + g * kGroupBytes;
      const uint8_t *scales = group + kGroupBlocks * kQuantBytes;
      for (int b = 0; b < kGroupBlocks; ++b) {
        Acc w = mac_scaled(aie::zeros<accfloat, kBlock>(), block_quants(group + b * kQuantBytes),
                           exact_scale(load_u16(scales + 2 * b)));
        if constexpr (kHasMin)
          w = aie::add(w, exact_value(exact_scale(load_u16(scales + 2 * (kGroupBlocks + b))), one));
        aie::store_v(out + g * kGroupElements + kBlock * b, w.template to_vector<bfloat16>());
      }
    }
  }
}

inline void dequant_rows(const uint8_t *w, bf16_t *out) {
  const Constants k = constants();
  for (int m = 0; m < kRows; ++m)
    dequant_row(w + m * kRowBytes, out + m * kDepth, k);
}
#else
inline float fp16_to_float(uint16_t h) {
  const int field = (h >> 10) & 31;
  const int n = (field ? 1024 : 0) | (h & 1023);
  const float magnitude = std::ldexp(float(n), (field ? field : 1) - 25);
  return (h & 0x8000) ? -magnitude : magnitude;
}

inline float bits_to_float(int16_t bits) { return bf16_to_float(bf16_t(uint16_t(bits))); }

// The host path computes what the AIE path does, lane by lane, in the same order, with the same fp32 roundings
// (every product it forms is exact, as on the core: bf16 times bf16).
struct Parts {
  float hi, mid, lo;
};

inline Parts split(float v) {
  const float hi = round_to_bf16(v);
  const float rest = v - hi;
  const float mid = round_to_bf16(rest);
  return {hi, mid, round_to_bf16(rest - mid)};
}

inline float mac_parts(float acc, const Parts &v, uint16_t h) {
  const ScaleBits s = exact_scale_bits(h);
  const float parts[3] = {v.hi, v.mid, v.lo}, scale[3] = {bits_to_float(s.a), bits_to_float(s.b), bits_to_float(s.c)};
  for (float part : parts)
    for (float piece : scale)
      acc += part * piece;
  return acc;
}

struct CallState {
  Parts x_sums[kGroups][kGroupBlocks];
};

inline void prepare_call(const bf16_t *xt, CallState &state) {
  if constexpr (kTransposed && kQuantBytes == 16) {
    for (int g = 0; g < kGroups; ++g) {
      float sum[kGroupBlocks] = {};
      for (int i = 0; i < kBlock; ++i)
        for (int l = 0; l < kGroupBlocks; ++l)
          sum[l] += bf16_to_float(xt[g * kGroupElements + kBlock * i + l]);
      for (int l = 0; l < kGroupBlocks; ++l)
        state.x_sums[g][l] = split(sum[l]);
    }
  }
}

// The transposed quant of block l's element i in its group's plane (as the core reads it: 128 + q for Q4).
inline float lane_quant(const uint8_t *quants, int i, int l) {
  if constexpr (kQuantBytes == 32)
    return float(int8_t(quants[kBlock * i + l]));
  else
    return float(kLaneOffset + ((quants[kBlock * (i / 2) + l] >> (4 * (i % 2))) & 15));
}

inline float packed_row_dot(const uint8_t *row, const bf16_t *x, const CallState &state) {
  if constexpr (kTransposed) {
    float acc[kBlock] = {};
    for (int g = 0; g < kGroups; ++g) {
      const uint8_t *group = row + g * kGroupBytes;
      const uint8_t *scales = group + kGroupBlocks * kQuantBytes;
      const bf16_t *xt = x + g * kGroupElements;
      float dot[kBlock] = {};
      for (int i = 0; i < kBlock; ++i)
        for (int l = 0; l < kBlock; ++l)
          dot[l] += lane_quant(group, i, l) * bf16_to_float(xt[kBlock * i + l]);
      for (int l = 0; l < kBlock; ++l) {
        if constexpr (kQuantBytes == 16) {
          const Parts &sums = state.x_sums[g][l];
          const float parts[3] = {sums.hi, sums.mid, sums.lo};
          for (float part : parts)
            dot[l] += part * float(-kQuantBias);
        }
        acc[l] = mac_parts(acc[l], split(dot[l]), load_u16(scales + 2 * l));
        if constexpr (kHasMin)
          acc[l] = mac_parts(acc[l], state.x_sums[g][l], load_u16(scales + 2 * (kGroupBlocks + l)));
      }
    }
    for (int half = kBlock / 2; half > 0; half /= 2)  // reduce_add's order: halves folded onto the lower lanes
      for (int l = 0; l < half; ++l)
        acc[l] += acc[l + half];
    return acc[0];
  } else {
    float acc = 0.0f;
    for (int b = 0; b < kBlocks; ++b) {
      const int l = b % kGroupBlocks;
      const uint8_t *group = row + (b / kGroupBlocks) * kGroupBytes;
      const uint8_t *quants = group + l * kQuantBytes;
      const uint8_t *scales = group + kGroupBlocks * kQuantBytes;
      const float d = fp16_to_float(load_u16(scales + 2 * l));
      const float m = kHasMin ? fp16_to_float(load_u16(scales + 2 * (kGroupBlocks + l))) : 0.0f;
      for (int i = 0; i < kBlock; ++i) {
        int q;
        if constexpr (kQuantBytes == 32)
          q = int8_t(quants[i]);
        else
          q = (quants[i / 2] >> (4 * (i % 2))) & 15;
        float w;
        if constexpr (GEMV_QUANT == 40)
          w = d * float((q ^ 8) - 8);  // the stored nibble is int4 q - 8: sign-extended, GGUF's d * (q - 8)
        else if constexpr (GEMV_QUANT == 41)
          w = d * float(q) + m;
        else
          w = d * float(q);
        acc += w * bf16_to_float(x[b * kBlock + i]);
      }
    }
    return acc;
  }
}

inline void transpose_groups(bf16_t *x, int length) {
  for (int g = 0; g < length; g += kGroupElements) {
    bf16_t group[kGroupElements];
    for (int k = 0; k < kGroupElements; ++k)
      group[k] = x[g + k];
    for (int l = 0; l < kBlock; ++l)
      for (int i = 0; i < kBlock; ++i)
        x[g + kBlock * i + l] = group[kBlock * l + i];
  }
}
// GGUF's weight of block b's element i, in fp32: d (q - 8), d q + m or d q.
inline float packed_weight(const uint8_t *row, int b, int i) {
  const int l = b % kGroupBlocks;
  const uint8_t *group = row + (b / kGroupBlocks) * kGroupBytes;
  const uint8_t *scales = group + kGroupBlocks * kQuantBytes;
  int q;
  if constexpr (kTransposed) {
    q = int(lane_quant(group, i, l)) - (kQuantBytes == 16 ? kQuantBias : 0);
  } else if constexpr (kQuantBytes == 32) {
    q = int8_t(group[l * kQuantBytes + i]);
  } else {
    q = (group[l * kQuantBytes + i / 2] >> (4 * (i % 2))) & 15;
    if constexpr (GEMV_QUANT == 40)
      q = (q ^ 8) - 8;  // the stored nibble is int4 q - 8
  }
  const float dq = fp16_to_float(load_u16(scales + 2 * l)) * float(q);  // exact: 11 by at most 8 significant bits
  return kHasMin ? dq + fp16_to_float(load_u16(scales + 2 * (kGroupBlocks + l))) : dq;
}

inline void dequant_rows(const uint8_t *w, bf16_t *out) {
  for (int m = 0; m < kRows; ++m)
    for (int b = 0; b < kBlocks; ++b)
      for (int i = 0; i < kBlock; ++i)
        out[m * kDepth + b * kBlock + i] = float_to_bf16(packed_weight(w + m * kRowBytes, b, i));
}
#endif

template <typename Store> void packed_row_dots(const uint8_t *w, const bf16_t *x, Store store) {
  CallState state;
  prepare_call(x, state);
  for (int m = 0; m < kRows; ++m)
    store(m, packed_row_dot(w + m * kRowBytes, x, state));
}
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

#if GEMV_K % 32 == 0
extern "C" void gemv_q_bf16(const uint8_t *w, const bf16_t *x, bf16_t *y) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
#endif
  packed_row_dots(w, x, [y](int m, float sum) { y[m] = to_bf16(sum); });
}

extern "C" void gemv_q_bf16_f32(const uint8_t *w, const bf16_t *x, float *y) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
#endif
  packed_row_dots(w, x, [y](int m, float sum) { y[m] = sum; });
}

extern "C" void gemv_q_partial_f32(const uint8_t *w, const bf16_t *x, float *acc, int32_t k0) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
#endif
  const bool first = k0 == 0;
  packed_row_dots(w, x + k0, [acc, first](int m, float sum) { acc[m] = first ? sum : acc[m] + sum; });
}

extern "C" void gemv_q_rows_bf16(const uint8_t *w, const bf16_t *x, bf16_t *y, int32_t row0) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
#endif
  packed_row_dots(w, x, [y, row0](int m, float sum) { y[row0 + m] = to_bf16(sum); });
}
extern "C" void gemv_q_dequant_bf16(const uint8_t *w, bf16_t *out) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
#endif
  dequant_rows(w, out);
}
extern "C" void gemv_q_prepare_x(bf16_t *x, int32_t length) {
  if constexpr (kTransposed)  // element-order rows read x as it is
    transpose_groups(x, length);
}
#endif
