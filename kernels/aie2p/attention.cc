// Tile primitives for causal flash attention with an online softmax, one head at a time.
//
// A builder walks, for each query head and each query tile (ATTN_TQ rows starting at position q_start), the
// key/value tiles of that head's KV head (ATTN_TK rows starting at k_start) in any order:
//
//   attn_init_f32(row_max, row_sum, acc)
//   for each key tile with k_start <= q_start + ATTN_TQ - 1   (later tiles are fully masked: skipping them
//                                                             is an optimisation, calling them is harmless)
//     attn_qk_tile_bf16(q, kv, scores, q_start, k_start)
//     attn_online_softmax_bf16(scores, probs, row_max, row_sum, row_scale)
//     attn_pv_accumulate_bf16(probs, kv, row_scale, acc)
//   attn_finalize_bf16(acc, row_sum, out)
//
// Tile sizes, compile-time (override with -D):
//   ATTN_TQ        query rows per tile (a multiple of 8)                          default 32
//   ATTN_TK        key/value rows per tile (a multiple of 8; AIE path: of 16)     default 32
//   ATTN_HEAD_DIM  head dimension (a multiple of 8; AIE path: of 16)              default 64
//   ATTN_SCALE     softmax scale                                                  default 1/sqrt(ATTN_HEAD_DIM)
//
// Buffers (row-major; AIE path: every buffer 64-byte aligned):
//   q          ATTN_TQ x ATTN_HEAD_DIM bf16      query rows q_start .. q_start + ATTN_TQ - 1 of one head
//   kv         2 x ATTN_TK x ATTN_HEAD_DIM bf16  key rows k_start .. k_start + ATTN_TK - 1 of its KV head, then
//                                                the value rows of the same positions (one buffer, so one DMA
//                                                fills both; QK^T reads only the key half)
//   scores     ATTN_TQ x ATTN_TK fp32            base-2 logits: (q . k) * ATTN_SCALE * log2(e), or the mask
//                                                value -2^100 where key position > query position
//   probs      ATTN_TQ x ATTN_TK bf16            exp2(score - running max)
//   row_max    ATTN_TQ fp32                      running max of the base-2 logits (-2^100: no key yet)
//   row_sum    ATTN_TQ fp32                      running sum of probs, in the units of row_max
//   row_scale  ATTN_TQ fp32                      exp2(previous row_max - new row_max), for the accumulator
//   acc        ATTN_TQ x ATTN_HEAD_DIM fp32      running sum of probs * v
//   out        ATTN_TQ x ATTN_HEAD_DIM bf16      acc / row_sum (0 for a row that saw no key)
//
// Symbols (rename any with -D<name>=<new name> to link two variants into one ELF):
//   void attn_init_f32(float *row_max, float *row_sum, float *acc)
//   void attn_qk_tile_bf16(const bf16 *q, const bf16 *kv, float *scores, int32_t q_start, int32_t k_start)
//   void attn_online_softmax_bf16(const float *scores, bf16 *probs, float *row_max, float *row_sum,
//                                 float *row_scale)
//   void attn_pv_accumulate_bf16(const bf16 *probs, const bf16 *kv, const float *row_scale, float *acc)
//   void attn_finalize_bf16(const float *acc, const float *row_sum, bf16 *out)
//
// The AIE path uses the core's native bf16 x bf16 -> fp32 products only (fp32 x fp32 is composed from them,
// see mul_f32), so it builds without the AIE API's fp32 emulation. It is written against the documented AIE API
// and has not been compiled here (no Peano on the development machine); the scalar path is what tests run.
//
// Causality is by position: key j of the tile is visible to query row i iff k_start + j <= q_start + i. Decode
// against a cache is the same call with q_start = the token's position. Scores live in base 2 because exp2
// is the core's exponential; the softmax's result does not depend on the base.
#include "npu2_kernel.h"

#if !defined(__AIENGINE__)
#include <cmath>
#endif

#ifndef ATTN_TQ
#define ATTN_TQ 32
#endif
#ifndef ATTN_TK
#define ATTN_TK 32
#endif
#ifndef ATTN_HEAD_DIM
#define ATTN_HEAD_DIM 64
#endif

namespace {

// Newton's iteration, so the default scale is a constant expression on every compiler.
constexpr double constexpr_sqrt(double value) {
  double root = value > 1.0 ? value : 1.0;
  for (int i = 0; i < 64; ++i)
    root = 0.5 * (root + value / root);
  return root;
}

#ifndef ATTN_SCALE
#define ATTN_SCALE (1.0 / constexpr_sqrt(ATTN_HEAD_DIM))
#endif

constexpr int kTileQ = ATTN_TQ;
constexpr int kTileK = ATTN_TK;
constexpr int kHeadDim = ATTN_HEAD_DIM;
constexpr double kLog2e = 1.4426950408889634;
constexpr float kLogitScale = float((ATTN_SCALE) * kLog2e);

// A finite mask value: exp2 of it (minus any real max) is exactly 0, it survives bf16 rounding unchanged
// (a power of two), and differences of it never overflow, so no inf - inf can turn into NaN.
constexpr float kMasked = -1.2676506002282294e30f; // -2^100
// Any real logit is far above this; a running max below it means "no visible key yet".
constexpr float kNoKeyYet = kMasked / 2;

static_assert(kTileQ > 0 && kTileQ % 8 == 0, "ATTN_TQ must be a positive multiple of 8");
static_assert(kTileK > 0 && kTileK % 8 == 0, "ATTN_TK must be a positive multiple of 8");
static_assert(kHeadDim > 0 && kHeadDim % 8 == 0, "ATTN_HEAD_DIM must be a positive multiple of 8");

// Keys of this tile visible to query row `row`: a count in [0, kTileK] (wide arithmetic: positions are
// int32 and their difference need not be).
inline int visible_keys(int32_t q_start, int32_t k_start, int row) {
  const long long count = (long long)q_start + row - k_start + 1;
  return count < 0 ? 0 : count > kTileK ? kTileK : int(count);
}

#if defined(__AIENGINE__)

static_assert(kTileK % 16 == 0, "AIE path: ATTN_TK must be a multiple of 16");
static_assert(kHeadDim % 16 == 0, "AIE path: ATTN_HEAD_DIM must be a multiple of 16");

// 8x8x8 bf16 blocks with fp32 accumulation. Define AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16 when compiling
// to trade accuracy (8-value blocks sharing an exponent) for speed.
using BlockMmul = aie::mmul<8, 8, 8, bfloat16, bfloat16, accauto>;

alignas(64) const int32_t kLaneIndex[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// The 8x8 block at `first` of a row-major matrix with `stride` columns, as one row-major 64-lane vector.
template <int Stride, typename T>
inline aie::vector<T, 64> load_block(const T *first) {
  aie::vector<T, 64> block;
  for (int r = 0; r < 8; ++r)
    block.insert(r, aie::load_v<8>(first + r * Stride));
  return block;
}

template <int Stride>
inline void store_block(float *first, const aie::vector<float, 64> &block) {
  for (int r = 0; r < 8; ++r)
    aie::store_v(first + r * Stride, block.extract<8>(r));
}

template <unsigned N>
inline aie::accum<accfloat, N> widen(const aie::vector<float, N> &v) { return aie::accum<accfloat, N>(v); }

// fp32 x fp32 from the core's native bf16 x bf16 -> fp32 products, so the AIE path needs no fp32 vector
// multiply (the AIE API's fp32 emulation): each factor is split into a bf16 head and the bf16 rounding of its
// remainder, and the three products that matter are summed in the fp32 accumulator (the fourth, tail x
// tail, is below fp32's rounding). Relative error about 2^-16, far below the bf16 rounding of any output.
template <unsigned N>
inline aie::accum<accfloat, N> mul_f32(const aie::vector<float, N> &x, const aie::vector<float, N> &y) {
  const aie::vector<bfloat16, N> x_head = widen(x).template to_vector<bfloat16>();
  const aie::vector<bfloat16, N> y_head = widen(y).template to_vector<bfloat16>();
  const aie::vector<bfloat16, N> x_tail = aie::sub(widen(x), x_head).template to_vector<bfloat16>();
  const aie::vector<bfloat16, N> y_tail = aie::sub(widen(y), y_head).template to_vector<bfloat16>();
  aie::accum<accfloat, N> product = aie::mul(x_head, y_head);
  product = aie::mac(product, x_head, y_tail);
  return aie::mac(product, x_tail, y_head);
}

// One 64-lane fp32 block times another, 16 lanes at a time (the width of the bf16 -> fp32 multiply).
inline aie::vector<float, 64> mul_f32_block(const aie::vector<float, 64> &x, const aie::vector<float, 64> &y) {
  aie::vector<float, 64> product;
  for (int part = 0; part < 4; ++part)
    product.insert(part, mul_f32<16>(x.extract<16>(part), y.extract<16>(part)).to_vector<float>());
  return product;
}

// exp2 of one fp32 value through the core's 16-lane exp2 (native width), rounded to bf16 as every exp2 here.
inline float exp2_scalar(float x) {
  return static_cast<float>(aie::exp2<bfloat16>(aie::broadcast<float, 16>(x)).get(0));
}

#endif

} // namespace

extern "C" {

void attn_init_f32(float *row_max, float *row_sum, float *acc) {
#if defined(__AIENGINE__)
  for (int i = 0; i < kTileQ; i += 8) {
    aie::store_v(row_max + i, aie::broadcast<float, 8>(kMasked));
    aie::store_v(row_sum + i, aie::zeros<float, 8>());
  }
  for (int i = 0; i < kTileQ * kHeadDim; i += 16)
    aie::store_v(acc + i, aie::zeros<float, 16>());
#else
  for (int i = 0; i < kTileQ; ++i) {
    row_max[i] = kMasked;
    row_sum[i] = 0.0f;
  }
  for (int i = 0; i < kTileQ * kHeadDim; ++i)
    acc[i] = 0.0f;
#endif
}

void attn_qk_tile_bf16(const bf16_t *q, const bf16_t *kv, float *scores, int32_t q_start, int32_t k_start) {
  const bf16_t *k = kv;
#if defined(__AIENGINE__)
  for (int qb = 0; qb < kTileQ; qb += 8) {
    for (int kb = 0; kb < kTileK; kb += 8) {
      BlockMmul block;
      for (int d = 0; d < kHeadDim; d += 8) {
        const aie::vector<bfloat16, 64> q_block = load_block<kHeadDim>(q + qb * kHeadDim + d);
        // K's block is (key, dim); the product needs (dim, key).
        const aie::vector<bfloat16, 64> k_block = aie::transpose(load_block<kHeadDim>(k + kb * kHeadDim + d), 8, 8);
        if (d == 0)
          block.mul(q_block, k_block);
        else
          block.mac(q_block, k_block);
      }
      const aie::vector<float, 64> logits =
          mul_f32_block(block.template to_vector<float>(), aie::broadcast<float, 64>(kLogitScale));
      store_block<kTileK>(scores + qb * kTileK + kb, logits);
    }
  }
  if ((long long)k_start + kTileK - 1 <= q_start)
    return; // every key of the tile precedes every query: nothing to mask
  const aie::vector<int32_t, 16> lane = aie::load_v<16>(kLaneIndex);
  const aie::vector<float, 16> masked = aie::broadcast<float, 16>(kMasked);
  for (int row = 0; row < kTileQ; ++row) {
    const int visible = visible_keys(q_start, k_start, row);
    float *scores_row = scores + row * kTileK;
    for (int j = (visible / 16) * 16; j < kTileK; j += 16) {
      const aie::mask<16> hidden = aie::ge(lane, aie::broadcast<int32_t, 16>(visible - j));
      aie::store_v(scores_row + j, aie::select(aie::load_v<16>(scores_row + j), masked, hidden));
    }
  }
#else
  for (int row = 0; row < kTileQ; ++row) {
    const int visible = visible_keys(q_start, k_start, row);
    const bf16_t *q_row = q + row * kHeadDim;
    for (int j = 0; j < kTileK; ++j) {
      if (j >= visible) {
        scores[row * kTileK + j] = kMasked;
        continue;
      }
      const bf16_t *k_row = k + j * kHeadDim;
      float dot = 0.0f;
      for (int d = 0; d < kHeadDim; ++d)
        dot += bf16_to_float(q_row[d]) * bf16_to_float(k_row[d]);
      scores[row * kTileK + j] = dot * kLogitScale;
    }
  }
#endif
}

void attn_online_softmax_bf16(const float *scores, bf16_t *probs, float *row_max, float *row_sum,
                              float *row_scale) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
  alignas(64) float tile_sum[kTileQ];
  for (int row = 0; row < kTileQ; ++row) {
    const float *s = scores + row * kTileK;
    // The max only anchors the exponentials (any nearby value gives the same softmax), so bf16, whose
    // vector max is native, is precise enough; kMasked is a power of two and survives the rounding.
    aie::vector<bfloat16, 16> chunk_max = widen(aie::load_v<16>(s)).to_vector<bfloat16>();
    for (int j = 16; j < kTileK; j += 16)
      chunk_max = aie::max(chunk_max, widen(aie::load_v<16>(s + j)).to_vector<bfloat16>());
    const float tile_max = static_cast<float>(aie::reduce_max(chunk_max));
    const float old_max = row_max[row];
    const float new_max = tile_max > old_max ? tile_max : old_max;
    const float anchor = new_max > kNoKeyYet ? new_max : 0.0f; // no key yet: every prob must come out 0
    row_max[row] = new_max;
    row_scale[row] = old_max > kNoKeyYet ? exp2_scalar(old_max - new_max) : 0.0f;

    const aie::accum<accfloat, 16> anchor_lanes = widen(aie::broadcast<float, 16>(anchor));
    aie::accum<accfloat, 16> sum = aie::zeros<accfloat, 16>();
    for (int j = 0; j < kTileK; j += 16) {
      const aie::vector<bfloat16, 16> p =
          aie::exp2<bfloat16>(aie::sub(widen(aie::load_v<16>(s + j)), anchor_lanes).to_vector<float>());
      aie::store_v(probs + row * kTileK + j, p);
      sum = aie::add(sum, p); // the rounded probs, the very weights the PV product uses
    }
    tile_sum[row] = aie::reduce_add(sum.to_vector<float>());
  }
  for (int row = 0; row < kTileQ; row += 8) {
    const aie::accum<accfloat, 8> sum = mul_f32<8>(aie::load_v<8>(row_sum + row), aie::load_v<8>(row_scale + row));
    aie::store_v(row_sum + row, aie::add(sum, widen(aie::load_v<8>(tile_sum + row))).to_vector<float>());
  }
#else
  for (int row = 0; row < kTileQ; ++row) {
    const float *s = scores + row * kTileK;
    float tile_max = s[0];
    for (int j = 1; j < kTileK; ++j)
      tile_max = s[j] > tile_max ? s[j] : tile_max;
    const float old_max = row_max[row];
    const float new_max = tile_max > old_max ? tile_max : old_max;
    const float anchor = new_max > kNoKeyYet ? new_max : 0.0f; // no key yet: every prob must come out 0
    const float scale = old_max > kNoKeyYet ? std::exp2(old_max - new_max) : 0.0f;
    float tile_sum = 0.0f;
    for (int j = 0; j < kTileK; ++j) {
      const bf16_t p = float_to_bf16(std::exp2(s[j] - anchor));
      probs[row * kTileK + j] = p;
      tile_sum += bf16_to_float(p); // the rounded probs, the very weights the PV product uses
    }
    row_max[row] = new_max;
    row_scale[row] = scale;
    row_sum[row] = row_sum[row] * scale + tile_sum;
  }
#endif
}

void attn_pv_accumulate_bf16(const bf16_t *probs, const bf16_t *kv, const float *row_scale, float *acc) {
  const bf16_t *v = kv + kTileK * kHeadDim;
#if defined(__AIENGINE__)
  for (int qb = 0; qb < kTileQ; qb += 8) {
    aie::vector<float, 64> scale_by_row; // lane r * 8 + c holds row r's scale
    for (int r = 0; r < 8; ++r)
      scale_by_row.insert(r, aie::broadcast<float, 8>(row_scale[qb + r]));
    for (int d = 0; d < kHeadDim; d += 8) {
      float *acc_block = acc + qb * kHeadDim + d;
      BlockMmul block(widen(mul_f32_block(load_block<kHeadDim>(acc_block), scale_by_row)));
      for (int kb = 0; kb < kTileK; kb += 8)
        block.mac(load_block<kTileK>(probs + qb * kTileK + kb), load_block<kHeadDim>(v + kb * kHeadDim + d));
      store_block<kHeadDim>(acc_block, block.to_vector<float>());
    }
  }
#else
  for (int row = 0; row < kTileQ; ++row) {
    float *acc_row = acc + row * kHeadDim;
    for (int d = 0; d < kHeadDim; ++d)
      acc_row[d] *= row_scale[row];
    for (int j = 0; j < kTileK; ++j) {
      const float p = bf16_to_float(probs[row * kTileK + j]);
      const bf16_t *v_row = v + j * kHeadDim;
      for (int d = 0; d < kHeadDim; ++d)
        acc_row[d] += p * bf16_to_float(v_row[d]);
    }
  }
#endif
}

void attn_finalize_bf16(const float *acc, const float *row_sum, bf16_t *out) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
  for (int row = 0; row < kTileQ; ++row) {
    const float sum = row_sum[row];
    const aie::vector<float, 16> inverse = aie::broadcast<float, 16>(sum > 0.0f ? 1.0f / sum : 0.0f);
    for (int d = 0; d < kHeadDim; d += 16) {
      const aie::accum<accfloat, 16> o = mul_f32<16>(aie::load_v<16>(acc + row * kHeadDim + d), inverse);
      aie::store_v(out + row * kHeadDim + d, o.to_vector<bfloat16>());
    }
  }
#else
  for (int row = 0; row < kTileQ; ++row) {
    const float sum = row_sum[row];
    for (int d = 0; d < kHeadDim; ++d)
      out[row * kHeadDim + d] = float_to_bf16(sum > 0.0f ? acc[row * kHeadDim + d] / sum : 0.0f);
  }
#endif
}

} // extern "C"
