// Decode attention over a KV cache: one query row per head, GQA, the cache streamed tile by tile.
//
// One core owns one KV head and the DATTN_GROUP query heads that share it. A builder walks the cache's key/value
// tiles (DATTN_TK positions each, starting at k_start) in order:
//
//   dattn_init_f32(queries, groups, group, q, row_max, row_sum, acc, cursor)
//   for each tile of the cache's capacity
//     dattn_tile_bf16(q, kv, scores, probs, row_max, row_sum, acc, cursor[0], cursor[1]);  cursor[1] += TK
//   dattn_finalize_bf16(acc, row_sum, out)
//
// The length (the number of valid positions) is data, not a parameter of the ELF: it arrives after the query
// rows of ``groups`` groups as bf16 base-256 digits (low first: every digit is an integer below 256, exact in
// bf16), dattn_init_f32 decodes it into cursor[0], and positions k_start + j >= length are never read (their
// keys and values may be anything, even NaN); a tile that starts at or past it returns at once. So one ELF serves
// every length up to its capacity.
//
// Tile sizes, compile-time (override with -D):
//   DATTN_GROUP     query heads per KV head (a core's query rows)                  default 4
//   DATTN_TK        positions per key/value tile (a multiple of 16)                default 64
//   DATTN_HEAD_DIM  head dimension (a multiple of 16)                              default 64
//   DATTN_SCALE     softmax scale                                                  default 1/sqrt(DATTN_HEAD_DIM)
//
// Layouts, all row-major (AIE path: every buffer 64-byte aligned):
//   queries  bf16 [groups][GROUP][HEAD_DIM], then 4 length digits: the query rows of ``groups`` KV heads' groups
//   q        bf16 [GROUP][HEAD_DIM]   the core's group's query rows (consecutive heads of a decode q)
//   cursor   i32  [2]                 the length, then the next tile's first position
//   kv       bf16 [TK][HEAD_DIM]      keys of positions k_start .. k_start + TK - 1 of the KV head (cache rows),
//                 [TK][HEAD_DIM]      then the values of the same positions (one buffer: one DMA channel)
//   scores   f32  [GROUP][TK]         q . k (unscaled), or the mask value -2^100 past the length
//   probs    bf16 [GROUP][TK]         exp2((score - running max) * DATTN_SCALE * log2(e)), rounded to bf16
//   row_max  f32  [GROUP]             running max of the scores, a bf16 value (-2^100: no key yet)
//   row_sum  f32  [GROUP]             running sum of the rounded probs, in the units of row_max
//   acc      f32  [GROUP][HEAD_DIM]   running sum of probs * v
//   out      bf16 [GROUP][HEAD_DIM]   acc * (1 / row_sum), rounded once (0 for a row that saw no key)
//
// Numerics, one tile at a time (torch_npu2/emulator/launches.py's decode_attention computes exactly these steps):
//   m'   = max(m, bf16(max_j s_j))                 the anchor only shifts the exponents: bf16 is precise enough
//   c    = bf16(exp2((m - m') * scale * log2 e))    the rescale of the earlier tiles (0 before the first key)
//   p_j  = bf16(exp2((s_j - m') * scale * log2 e))
//   sum' = sum * c + sum_j p_j;   acc' = acc * c + sum_j p_j v_j   (fp32)
// The host attention (patch_llama/layer.py) instead normalizes before rounding: bf16(exp(s - max) / sum). Both
// round each probability to bf16 once and accumulate P.V in fp32; they differ in where the rounding falls (here
// the unnormalized p, divided by the sum of the same rounded p at the end) and in the rescale by c when a later
// tile raises the max. tests/kernels/test_decode_attention.py bounds the difference.
//
// AIE path: the scores are dot products of bf16 vectors (32 lanes, 16 for a head_dim of odd 16s) into fp32
// accumulators, reduced per key; the exponentials are the core's bf16 exp2 on 16 lanes (a hardware approximation:
// on silicon its last bit may differ from the host path's std::exp2 rounded to bf16); P.V is a multiply-accumulate
// of value rows by each probability. fp32 products by fp32 values (the scale, the rescale of acc, the final 1/sum)
// use bf16 head/tail splits of one factor, as attention.cc does: native bf16 x bf16 -> fp32 products only.
// Type-checked against the real AIE API (torch-npu2 lint --aie-source), not compiled (no Peano here), and run
// against a value stand-in of the AIE API beside the scalar path (tests/kernels/test_aie_path_values.py).
#include "attention_math.h"

#if !defined(__AIENGINE__)
#include <cmath>
#endif

#ifndef DATTN_GROUP
#define DATTN_GROUP 4
#endif
#ifndef DATTN_TK
#define DATTN_TK 64
#endif
#ifndef DATTN_HEAD_DIM
#define DATTN_HEAD_DIM 64
#endif

namespace {

#ifndef DATTN_SCALE
#define DATTN_SCALE (1.0 / constexpr_sqrt(DATTN_HEAD_DIM))
#endif

constexpr int kGroup = DATTN_GROUP;
constexpr int kTileK = DATTN_TK;
constexpr int kHeadDim = DATTN_HEAD_DIM;
constexpr double kLogitScaleExact = (DATTN_SCALE) * kLog2e;
constexpr float kLogitScale = float(kLogitScaleExact);
// A finite mask value (-2^100): exp2 of it minus any real max, times the scale, is exactly 0; it is exact in bf16.
constexpr float kMasked = -1.2676506002282294e30f;
constexpr float kNoKeyYet = kMasked / 2; // a running max below this: no key seen yet

static_assert(kGroup > 0, "DATTN_GROUP must be positive");
static_assert(kTileK > 0 && kTileK % 16 == 0, "DATTN_TK must be a positive multiple of 16");
static_assert(kHeadDim > 0 && kHeadDim % 16 == 0, "DATTN_HEAD_DIM must be a positive multiple of 16");
// The lanes of the dot products, the P.V update and the final scaling: 32, or 16 for a head_dim of odd 16s.
constexpr int kLanes = kHeadDim % 32 == 0 ? 32 : 16;

#if defined(__AIENGINE__)
inline float to_float(bfloat16 value) { return float(value); }
#else
inline float to_float(bf16_t value) { return bf16_to_float(value); }
#endif

// The tile's valid positions: 0 past the length, at most the tile.
inline int valid_positions(int32_t length, int32_t k_start) {
  const long long left = (long long)length - k_start;
  return left <= 0 ? 0 : left >= kTileK ? kTileK : int(left);
}

#if defined(__AIENGINE__)

using Lanes16 = aie::vector<bfloat16, 16>;
using Lanes = aie::vector<bfloat16, kLanes>;

constexpr float kScaleHead = bf16_head(kLogitScaleExact);
constexpr float kScaleTail = bf16_tail(kLogitScaleExact);

// x * DATTN_SCALE * log2(e) in fp32 precision.
inline aie::accum<accfloat, 16> scale_logits(const aie::accum<accfloat, 16> &x) {
  return mul_split(x, aie::broadcast<bfloat16, 16>(kScaleHead), aie::broadcast<bfloat16, 16>(kScaleTail));
}

#endif

} // namespace

extern "C" {

void dattn_init_f32(const bf16_t *queries, int32_t groups, int32_t group, bf16_t *q, float *row_max, float *row_sum,
                    float *acc, int32_t *cursor) {
  // once per run: a scalar copy (a group's rows need not start 64-byte aligned in ``queries``)
  const bf16_t *rows = queries + group * kGroup * kHeadDim;
  for (int i = 0; i < kGroup * kHeadDim; ++i)
    q[i] = rows[i];
  const bf16_t *digits = queries + groups * kGroup * kHeadDim;
  int32_t length = 0;
  for (int i = 2; i >= 0; --i)
    length = length * 256 + int32_t(to_float(digits[i]));
  cursor[0] = length;
  cursor[1] = 0;
  for (int g = 0; g < kGroup; ++g) {
    row_max[g] = kMasked;
    row_sum[g] = 0.0f;
  }
#if defined(__AIENGINE__)
  for (int i = 0; i < kGroup * kHeadDim; i += 16)
    aie::store_v(acc + i, aie::zeros<float, 16>());
#else
  for (int i = 0; i < kGroup * kHeadDim; ++i)
    acc[i] = 0.0f;
#endif
}

void dattn_tile_bf16(const bf16_t *q, const bf16_t *kv, float *scores, bf16_t *probs, float *row_max, float *row_sum,
                     float *acc, int32_t length, int32_t k_start) {
  const bf16_t *k = kv;
  const bf16_t *v = k + kTileK * kHeadDim;
  const int valid = valid_positions(length, k_start);
  if (valid == 0)
    return;
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
  // scores: each key row loaded once, dotted with every query row of the group
  for (int j = 0; j < valid; ++j) {
    Lanes key[kHeadDim / kLanes];
    for (int d = 0; d < kHeadDim / kLanes; ++d)
      key[d] = aie::load_v<kLanes>(k + j * kHeadDim + d * kLanes);
    for (int g = 0; g < kGroup; ++g) {
      aie::accum<accfloat, kLanes> dot = aie::mul(aie::load_v<kLanes>(q + g * kHeadDim), key[0]);
      for (int d = 1; d < kHeadDim / kLanes; ++d)
        dot = aie::mac(dot, aie::load_v<kLanes>(q + g * kHeadDim + d * kLanes), key[d]);
      scores[g * kTileK + j] = aie::reduce_add(dot.to_vector<float>());
    }
  }
  for (int g = 0; g < kGroup; ++g)
    for (int j = valid; j < kTileK; ++j)
      scores[g * kTileK + j] = kMasked;

  for (int g = 0; g < kGroup; ++g) {
    const float *s = scores + g * kTileK;
    bf16_t *p = probs + g * kTileK;
    // The running max is a bf16 value (or kMasked): exact in bf16, so the max runs on native bf16 vectors.
    const bfloat16 old_max = row_max[g];
    Lanes16 high = aie::broadcast<bfloat16, 16>(old_max);
    for (int j = 0; j < kTileK; j += 16)
      high = aie::max(high, widen(aie::load_v<16>(s + j)).to_vector<bfloat16>());
    const bfloat16 new_max = aie::reduce_max(high);
    const Lanes16 anchor = aie::broadcast<bfloat16, 16>(new_max);
    const Lanes16 rescale = aie::exp2<bfloat16>(
        scale_logits(aie::sub(aie::accum<accfloat, 16>(aie::broadcast<bfloat16, 16>(old_max)), anchor))
            .to_vector<float>());
    const bool seen_before = float(old_max) > kNoKeyYet;
    const bfloat16 scale = seen_before ? rescale.get(0) : bfloat16(0.0f);
    aie::accum<accfloat, 16> sum = aie::zeros<accfloat, 16>();
    for (int j = 0; j < kTileK; j += 16) {
      const Lanes16 e = aie::exp2<bfloat16>(
          scale_logits(aie::sub(widen(aie::load_v<16>(s + j)), anchor)).to_vector<float>());
      aie::store_v(p + j, e);
      sum = aie::add(sum, e); // the rounded probs, the very weights P.V uses
    }
    row_max[g] = float(new_max);
    row_sum[g] = row_sum[g] * float(scale) + aie::reduce_add(sum.to_vector<float>());

    const Lanes scales = aie::broadcast<bfloat16, kLanes>(scale);
    for (int d = 0; d < kHeadDim; d += kLanes) {
      float *a = acc + g * kHeadDim + d;
      aie::accum<accfloat, kLanes> out = mul_by_bf16(widen(aie::load_v<kLanes>(a)), scales);
      for (int j = 0; j < valid; ++j)
        out = aie::mac(out, aie::load_v<kLanes>(v + j * kHeadDim + d), p[j]);
      aie::store_v(a, out.to_vector<float>());
    }
  }
#else
  for (int g = 0; g < kGroup; ++g) {
    float *s = scores + g * kTileK;
    float tile_max = kMasked;
    for (int j = 0; j < kTileK; ++j) {
      float dot = kMasked;
      if (j < valid) {
        dot = 0.0f;
        for (int d = 0; d < kHeadDim; ++d)
          dot += bf16_to_float(q[g * kHeadDim + d]) * bf16_to_float(k[j * kHeadDim + d]);
      }
      s[j] = dot;
      tile_max = dot > tile_max ? dot : tile_max;
    }
    const float old_max = row_max[g];
    const float rounded_max = round_to_bf16(tile_max); // rounding is monotonic: the max of the rounded scores
    const float new_max = rounded_max > old_max ? rounded_max : old_max;
    const float scale = old_max > kNoKeyYet ? round_to_bf16(std::exp2((old_max - new_max) * kLogitScale)) : 0.0f;
    float tile_sum = 0.0f;
    for (int j = 0; j < kTileK; ++j) {
      const bf16_t p = j < valid ? float_to_bf16(std::exp2((s[j] - new_max) * kLogitScale)) : bf16_t(0);
      probs[g * kTileK + j] = p;
      tile_sum += bf16_to_float(p);
    }
    row_max[g] = new_max;
    row_sum[g] = row_sum[g] * scale + tile_sum;
    for (int d = 0; d < kHeadDim; ++d) {
      float out = acc[g * kHeadDim + d] * scale;
      for (int j = 0; j < valid; ++j)
        out += bf16_to_float(probs[g * kTileK + j]) * bf16_to_float(v[j * kHeadDim + d]);
      acc[g * kHeadDim + d] = out;
    }
  }
#endif
}

void dattn_finalize_bf16(const float *acc, const float *row_sum, bf16_t *out) {
  for (int g = 0; g < kGroup; ++g) {
    const float sum = row_sum[g];
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
#if defined(__AIENGINE__)
    RoundToNearestEven rounding;
    // acc * inverse in fp32 precision: both as bf16 heads and tails, the three products that matter
    const aie::accum<accfloat, kLanes> whole = widen(aie::broadcast<float, kLanes>(inverse));
    const Lanes head = whole.to_vector<bfloat16>();
    const Lanes tail = aie::sub(whole, head).to_vector<bfloat16>();
    for (int d = 0; d < kHeadDim; d += kLanes)
      aie::store_v(out + g * kHeadDim + d,
                   mul_split(widen(aie::load_v<kLanes>(acc + g * kHeadDim + d)), head, tail).to_vector<bfloat16>());
#else
    for (int d = 0; d < kHeadDim; ++d)
      out[g * kHeadDim + d] = float_to_bf16(acc[g * kHeadDim + d] * inverse);
#endif
  }
}

} // extern "C"
