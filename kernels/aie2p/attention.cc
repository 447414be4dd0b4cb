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
// Layouts: every matrix is pre-tiled into 8x8 blocks, each block row-major, so that every block operand is one
// contiguous 64-value load (the DMAs lay Q, K and V out this way, and take the output back from it). With
// QB = ATTN_TQ / 8, KB = ATTN_TK / 8, DB = ATTN_HEAD_DIM / 8 (AIE path: every buffer 64-byte aligned):
//   q          bf16 [DB][QB][8][8]       query rows q_start .. q_start + ATTN_TQ - 1 of one head
//   kv         bf16 [2][DB][KB][8][8]    keys k_start .. k_start + ATTN_TK - 1 of its KV head (block (d, k) holds
//                                        8 keys by 8 dims), then the values of the same positions, alike (one
//                                        buffer, so one DMA fills both; QK^T reads only the key half)
//   scores     f32  [QB][KB][8][8]       q . k, or the mask value -2^100 where key position > query position
//   probs      bf16 [QB][KB][8][8]       exp2((score - running max) * ATTN_SCALE * log2(e))
//   row_max    f32  [ATTN_TQ]            running max of the scores (-2^100: no key yet)
//   row_sum    f32  [ATTN_TQ]            running sum of probs, in the units of row_max
//   row_scale  f32  [ATTN_TQ]            exp2((previous row_max - new row_max) * scale * log2(e)), for acc
//   acc        f32  [DB][QB][8][8]       running sum of probs * v
//   out        bf16 [DB][QB][8][8]       acc / row_sum (0 for a row that saw no key)
//
// Symbols (rename any with -D<name>=<new name> to link two variants into one ELF):
//   void attn_init_f32(float *row_max, float *row_sum, float *acc)
//   void attn_qk_tile_bf16(const bf16 *q, const bf16 *kv, float *scores, int32_t q_start, int32_t k_start)
//   void attn_online_softmax_bf16(const float *scores, bf16 *probs, float *row_max, float *row_sum,
//                                 float *row_scale)
//   void attn_pv_accumulate_bf16(const bf16 *probs, const bf16 *kv, const float *row_scale, float *acc)
//   void attn_finalize_bf16(const float *acc, const float *row_sum, bf16 *out)
//
// AIE path: 8x8 blocks of products with fp32 accumulators, two by two blocks sharing their operands (four
// accumulators in registers): exact bf16 (the default) as 64-lane elementwise multiply-accumulates with each operand
// vector made once per pass (bf16_blocks.h: AIE2P has no exact bf16 matrix multiply); with
// -DAIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16, aie::mmul<8, 8, 8> in BFP16 (upstream's mode). A key
// block is transposed in registers into the (dim, key) form QK^T takes (a bf16 transpose cannot be done by the
// DMA: 4-byte granules); a value block is already the (key, dim) form P.V takes. The softmax works on 8 rows
// at once: the row maxima and sums are folded out of 64-lane blocks (a transpose puts a row's values 8 lanes
// apart), the scale enters each exponent's argument (fp32 from bf16 products, see mul_split), and the
// accumulator's rescale is a vector multiply by the bf16 factors exp2 gives. It uses the core's native
// bf16 x bf16 -> fp32 products only, so it builds without the AIE API's fp32 emulation. Type-checked here
// against the real AIE API (torch-npu2 lint --aie-source), not compiled (no Peano on the development machine), and
// run against a value stand-in of the AIE API beside the scalar path (tests/kernels/test_aie_path_values.py).
//
// Causality is by position: key j of the tile is visible to query row i iff k_start + j <= q_start + i. Decode
// against a cache is the same call with q_start = the token's position. Exponentials are base 2 because exp2
// is the core's exponential; the softmax's result does not depend on the base.
#include "attention_math.h"
#include "bf16_blocks.h"

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

#ifndef ATTN_SCALE
#define ATTN_SCALE (1.0 / constexpr_sqrt(ATTN_HEAD_DIM))
#endif

constexpr int kBlock = 8;  // the side of every pre-tiled block
constexpr int kBlockSize = kBlock * kBlock;
constexpr int kTileQ = ATTN_TQ;
constexpr int kTileK = ATTN_TK;
constexpr int kHeadDim = ATTN_HEAD_DIM;
constexpr int kBlocksQ = kTileQ / kBlock;
constexpr int kBlocksK = kTileK / kBlock;
constexpr int kBlocksD = kHeadDim / kBlock;
constexpr double kLogitScaleExact = (ATTN_SCALE) * kLog2e;
constexpr float kLogitScale = float(kLogitScaleExact);

// A finite mask value: exp2 of it (minus any real max, times the scale) is exactly 0, it survives bf16 rounding
// unchanged (a power of two), and differences of it never overflow, so no inf - inf can turn into NaN.
constexpr float kMasked = -1.2676506002282294e30f; // -2^100
// Any real score is far above this; a running max below it means "no visible key yet".
constexpr float kNoKeyYet = kMasked / 2;

static_assert(kTileQ > 0 && kTileQ % kBlock == 0, "ATTN_TQ must be a positive multiple of 8");
static_assert(kTileK > 0 && kTileK % kBlock == 0, "ATTN_TK must be a positive multiple of 8");
static_assert(kHeadDim > 0 && kHeadDim % kBlock == 0, "ATTN_HEAD_DIM must be a positive multiple of 8");

// Offset of element (row, col) of a matrix with Cols columns held as [rows/8][Cols/8][8][8] blocks (scores,
// probs).
template <int Cols>
inline int block_offset(int row, int col) {
  return ((row / kBlock) * (Cols / kBlock) + col / kBlock) * kBlockSize + (row % kBlock) * kBlock + col % kBlock;
}

// Offset of element (row, dim) of a query-tile matrix held as [DB][QB][8][8] blocks (q, acc, out).
inline int head_offset(int row, int dim) {
  return ((dim / kBlock) * kBlocksQ + row / kBlock) * kBlockSize + (row % kBlock) * kBlock + dim % kBlock;
}

// Offset of element (key, dim) of the key (or value) half of kv: [DB][KB][8][8] blocks.
inline int kv_offset(int key, int dim) {
  return ((dim / kBlock) * kBlocksK + key / kBlock) * kBlockSize + (key % kBlock) * kBlock + dim % kBlock;
}

#if defined(__AIENGINE__)

static_assert(kTileK % 16 == 0, "AIE path: ATTN_TK must be a multiple of 16");
static_assert(kHeadDim % 16 == 0, "AIE path: ATTN_HEAD_DIM must be a multiple of 16");

using Block = aie::vector<bfloat16, kBlockSize>;
// Query row blocks one pass of the block loops covers: two (a 2x2 block of accumulators), one for ATTN_TQ = 8.
constexpr int kRowsPerPass = kBlocksQ % 2 == 0 ? 2 : 1;

constexpr float kScaleHead = bf16_head(kLogitScaleExact);
constexpr float kScaleTail = bf16_tail(kLogitScaleExact);

// Lane r * 8 + c of a block: c - r. Key c of a block is hidden from query row r iff c - r > the rows' offset.
struct LaneTable {
  int32_t value[kBlockSize];
};
constexpr LaneTable column_minus_row() {
  LaneTable table{};
  for (int lane = 0; lane < kBlockSize; ++lane)
    table.value[lane] = lane % kBlock - lane / kBlock;
  return table;
}
alignas(64) constexpr LaneTable kColumnMinusRow = column_minus_row();

// fp32 x fp32 (y split into a bf16 head and tail, then mul_split): the final normalization, once per query tile.
template <unsigned N>
inline aie::accum<accfloat, N> mul_f32(const aie::vector<float, N> &x, const aie::vector<float, N> &y) {
  const aie::vector<bfloat16, N> y_head = widen(y).template to_vector<bfloat16>();
  const aie::vector<bfloat16, N> y_tail = aie::sub(widen(y), y_head).template to_vector<bfloat16>();
  return mul_split<N>(widen(x), y_head, y_tail);
}

// A block whose lane r * 8 + c holds row r's value: 8 copies of the rows' vector, transposed.
inline Block rows_to_block(const aie::vector<bfloat16, kBlock> &rows) {
  Block copies;
  for (int c = 0; c < kBlock; ++c)
    copies.insert(c, rows);
  return aie::transpose(copies, kBlock, kBlock);
}

// Block products: exact bf16 as bf16_blocks.h's multiply-accumulates; BFP16 (upstream's mode) through
// aie::mmul<8, 8, 8>, one native multiply per block.
#if AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16
using BlockAcc = aie::mmul<8, 8, 8, bfloat16, bfloat16, accauto>;
#else
using bf16_blocks::BlockAcc;
#endif

// Scores of Rows query row blocks from qb by two key blocks from kb: the 2x2 (or 1x2) accumulators stay in
// registers over the head dimension; `offset` = q_start - k_start. A block on or past the diagonal is masked.
template <int Rows>
inline void qk_blocks(const bf16_t *q, const bf16_t *k, float *scores, int qb, int kb, long long offset) {
  BlockAcc block[Rows][2];
#if !AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16
  for (int i = 0; i < Rows; ++i)
    for (int j = 0; j < 2; ++j)
      block[i][j] = aie::zeros<accfloat, kBlockSize>();
#endif
  for (int db = 0; db < kBlocksD; ++db) {
    Block keys[2]; // transposed: lane d * 8 + key (K's block is (key, dim))
    for (int j = 0; j < 2; ++j)
      keys[j] = aie::transpose(aie::load_v<kBlockSize>(k + (db * kBlocksK + kb + j) * kBlockSize), kBlock, kBlock);
#if AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16
    for (int i = 0; i < Rows; ++i) {
      const Block queries = aie::load_v<kBlockSize>(q + (db * kBlocksQ + qb + i) * kBlockSize);
      for (int j = 0; j < 2; ++j) {
        if (db == 0)
          block[i][j].mul(queries, keys[j]);
        else
          block[i][j].mac(queries, keys[j]);
      }
    }
#else
    Block queries[Rows]; // transposed: lane d * 8 + row
    for (int i = 0; i < Rows; ++i)
      queries[i] = aie::transpose(aie::load_v<kBlockSize>(q + (db * kBlocksQ + qb + i) * kBlockSize), kBlock, kBlock);
    bf16_blocks::mac_blocks(block, queries, keys);
#endif
  }
  const aie::vector<float, 16> masked = aie::broadcast<float, 16>(kMasked);
  for (int i = 0; i < Rows; ++i) {
    for (int j = 0; j < 2; ++j) {
      float *out = scores + ((qb + i) * kBlocksK + kb + j) * kBlockSize;
      const aie::vector<float, kBlockSize> s = block[i][j].template to_vector<float>();
      // key c of the block is hidden from row r iff c - r > limit
      const long long limit = offset + (long long)(qb + i - kb - j) * kBlock;
      if (limit >= kBlock - 1) {
        aie::store_v(out, s);
        continue;
      }
      const int32_t first_hidden = limit < -kBlock ? -kBlock : int32_t(limit + 1);
      for (int part = 0; part < kBlockSize / 16; ++part) {
        const aie::mask<16> hidden =
            aie::ge(aie::load_v<16>(kColumnMinusRow.value + part * 16), aie::broadcast<int32_t, 16>(first_hidden));
        aie::store_v(out + part * 16, aie::select(s.extract<16>(part), masked, hidden));
      }
    }
  }
}

// acc's Rows row blocks from qb by two dim blocks from db += probs . v, after scaling acc's rows by row_scale.
template <int Rows>
inline void pv_blocks(const bf16_t *probs, const bf16_t *v, const Block *row_scales, float *acc, int qb, int db) {
  BlockAcc block[Rows][2];
  for (int i = 0; i < Rows; ++i)
    for (int j = 0; j < 2; ++j) {
      const float *acc_block = acc + ((db + j) * kBlocksQ + qb + i) * kBlockSize;
      block[i][j] = BlockAcc(mul_by_bf16(widen(aie::load_v<kBlockSize>(acc_block)), row_scales[i]));
    }
  for (int kb = 0; kb < kBlocksK; ++kb) {
    Block values[2]; // row-major (key, dim): the operand P.V takes as it is
    for (int j = 0; j < 2; ++j)
      values[j] = aie::load_v<kBlockSize>(v + ((db + j) * kBlocksK + kb) * kBlockSize);
#if AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16
    for (int i = 0; i < Rows; ++i) {
      const Block p = aie::load_v<kBlockSize>(probs + ((qb + i) * kBlocksK + kb) * kBlockSize);
      for (int j = 0; j < 2; ++j)
        block[i][j].mac(p, values[j]);
    }
#else
    Block p[Rows]; // transposed: lane key * 8 + row
    for (int i = 0; i < Rows; ++i)
      p[i] = aie::transpose(aie::load_v<kBlockSize>(probs + ((qb + i) * kBlocksK + kb) * kBlockSize), kBlock, kBlock);
    bf16_blocks::mac_blocks(block, p, values);
#endif
  }
  for (int i = 0; i < Rows; ++i)
    for (int j = 0; j < 2; ++j)
      aie::store_v(acc + ((db + j) * kBlocksQ + qb + i) * kBlockSize, block[i][j].template to_vector<float>());
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
  const long long offset = (long long)q_start - k_start;
#if defined(__AIENGINE__)
  for (int qb = 0; qb < kBlocksQ; qb += kRowsPerPass)
    for (int kb = 0; kb < kBlocksK; kb += 2)
      qk_blocks<kRowsPerPass>(q, k, scores, qb, kb, offset);
#else
  for (int row = 0; row < kTileQ; ++row) {
    for (int j = 0; j < kTileK; ++j) {
      float &score = scores[block_offset<kTileK>(row, j)];
      if (j > offset + row) {
        score = kMasked;
        continue;
      }
      float dot = 0.0f;
      for (int d = 0; d < kHeadDim; ++d)
        dot += bf16_to_float(q[head_offset(row, d)]) * bf16_to_float(k[kv_offset(j, d)]);
      score = dot;
    }
  }
#endif
}

void attn_online_softmax_bf16(const float *scores, bf16_t *probs, float *row_max, float *row_sum,
                              float *row_scale) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
  const Block scale_head = aie::broadcast<bfloat16, kBlockSize>(kScaleHead);
  const Block scale_tail = aie::broadcast<bfloat16, kBlockSize>(kScaleTail);
  const aie::vector<bfloat16, kBlock> no_key_yet = aie::broadcast<bfloat16, kBlock>(kNoKeyYet);
  for (int qb = 0; qb < kBlocksQ; ++qb) {
    const float *s = scores + qb * kBlocksK * kBlockSize;
    bf16_t *p = probs + qb * kBlocksK * kBlockSize;
    float *rows = row_max + qb * kBlock;
    // The max only anchors the exponentials (any nearby value gives the same softmax), so bf16, whose vector max
    // is native, is precise enough; kMasked is a power of two and survives the rounding.
    Block block_max = widen(aie::load_v<kBlockSize>(s)).to_vector<bfloat16>();
    for (int kb = 1; kb < kBlocksK; ++kb)
      block_max = aie::max(block_max, widen(aie::load_v<kBlockSize>(s + kb * kBlockSize)).to_vector<bfloat16>());
    // Transposed, row r's values sit 8 lanes apart: three halvings leave lane r = row r's max.
    const Block by_column = aie::transpose(block_max, kBlock, kBlock);
    const aie::vector<bfloat16, 32> max32 = aie::max(by_column.extract<32>(0), by_column.extract<32>(1));
    const aie::vector<bfloat16, 16> max16 = aie::max(max32.extract<16>(0), max32.extract<16>(1));
    const aie::vector<bfloat16, kBlock> tile_max = aie::max(max16.extract<kBlock>(0), max16.extract<kBlock>(1));
    // The running max is a bf16 value (or kMasked) already: exact in bf16.
    const aie::vector<bfloat16, kBlock> old_max = widen(aie::load_v<kBlock>(rows)).to_vector<bfloat16>();
    const aie::vector<bfloat16, kBlock> new_max = aie::max(old_max, tile_max);
    aie::store_v(rows, widen(new_max).to_vector<float>());
    // No key yet: anchor 0, so every prob comes out exp2(kMasked * scale) = 0. No key before: scale 0.
    const aie::vector<bfloat16, kBlock> anchor =
        aie::select(aie::zeros<bfloat16, kBlock>(), new_max, aie::ge(new_max, no_key_yet));
    const aie::vector<bfloat16, kBlock> rescale = aie::exp2<bfloat16>(
        mul_split(aie::sub(widen(old_max), new_max), scale_head.extract<kBlock>(0), scale_tail.extract<kBlock>(0))
            .to_vector<float>());
    const aie::vector<bfloat16, kBlock> scale =
        aie::select(aie::zeros<bfloat16, kBlock>(), rescale, aie::ge(old_max, no_key_yet));
    aie::store_v(row_scale + qb * kBlock, widen(scale).to_vector<float>());

    const Block anchors = rows_to_block(anchor);
    aie::accum<accfloat, kBlockSize> sum_by_column = aie::zeros<accfloat, kBlockSize>();
    for (int kb = 0; kb < kBlocksK; ++kb) {
      const aie::accum<accfloat, kBlockSize> shifted =
          aie::sub(widen(aie::load_v<kBlockSize>(s + kb * kBlockSize)), anchors);
      const Block e = aie::exp2<bfloat16>(mul_split(shifted, scale_head, scale_tail).to_vector<float>());
      aie::store_v(p + kb * kBlockSize, e);
      // the rounded probs, the very weights the PV product uses; transposed to fold the rows out below
      sum_by_column = aie::add(sum_by_column, aie::transpose(e, kBlock, kBlock));
    }
    const aie::vector<float, kBlockSize> sums = sum_by_column.to_vector<float>();
    const aie::vector<float, 32> sum32 = aie::add(widen(sums.extract<32>(0)), sums.extract<32>(1)).to_vector<float>();
    const aie::vector<float, 16> sum16 = aie::add(widen(sum32.extract<16>(0)), sum32.extract<16>(1)).to_vector<float>();
    const aie::accum<accfloat, kBlock> tile_sum = aie::add(widen(sum16.extract<kBlock>(0)), sum16.extract<kBlock>(1));
    const aie::accum<accfloat, kBlock> kept = mul_by_bf16(widen(aie::load_v<kBlock>(row_sum + qb * kBlock)), scale);
    aie::store_v(row_sum + qb * kBlock, aie::add(kept, tile_sum.to_vector<float>()).to_vector<float>());
  }
#else
  for (int row = 0; row < kTileQ; ++row) {
    float tile_max = scores[block_offset<kTileK>(row, 0)];
    for (int j = 1; j < kTileK; ++j) {
      const float s = scores[block_offset<kTileK>(row, j)];
      tile_max = s > tile_max ? s : tile_max;
    }
    const float old_max = row_max[row];
    const float new_max = tile_max > old_max ? tile_max : old_max;
    const float anchor = new_max > kNoKeyYet ? new_max : 0.0f; // no key yet: every prob must come out 0
    const float scale = old_max > kNoKeyYet ? std::exp2((old_max - new_max) * kLogitScale) : 0.0f;
    float tile_sum = 0.0f;
    for (int j = 0; j < kTileK; ++j) {
      const int at = block_offset<kTileK>(row, j);
      const bf16_t p = float_to_bf16(std::exp2((scores[at] - anchor) * kLogitScale));
      probs[at] = p;
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
  for (int qb = 0; qb < kBlocksQ; qb += kRowsPerPass) {
    Block row_scales[kRowsPerPass]; // exp2's bf16 results: exact in bf16
    for (int i = 0; i < kRowsPerPass; ++i)
      row_scales[i] = rows_to_block(widen(aie::load_v<kBlock>(row_scale + (qb + i) * kBlock)).to_vector<bfloat16>());
    for (int db = 0; db < kBlocksD; db += 2)
      pv_blocks<kRowsPerPass>(probs, v, row_scales, acc, qb, db);
  }
#else
  for (int row = 0; row < kTileQ; ++row) {
    for (int d = 0; d < kHeadDim; ++d)
      acc[head_offset(row, d)] *= row_scale[row];
    for (int j = 0; j < kTileK; ++j) {
      const float p = bf16_to_float(probs[block_offset<kTileK>(row, j)]);
      for (int d = 0; d < kHeadDim; ++d)
        acc[head_offset(row, d)] += p * bf16_to_float(v[kv_offset(j, d)]);
    }
  }
#endif
}

void attn_finalize_bf16(const float *acc, const float *row_sum, bf16_t *out) {
#if defined(__AIENGINE__)
  RoundToNearestEven rounding;
  for (int qb = 0; qb < kBlocksQ; ++qb) {
    aie::vector<float, kBlockSize> inverse; // lane r * 8 + c: 1 / row r's sum
    for (int r = 0; r < kBlock; ++r) {
      const float sum = row_sum[qb * kBlock + r];
      inverse.insert(r, aie::broadcast<float, kBlock>(sum > 0.0f ? 1.0f / sum : 0.0f));
    }
    for (int db = 0; db < kBlocksD; ++db) {
      const int at = (db * kBlocksQ + qb) * kBlockSize;
      for (int part = 0; part < kBlockSize / 16; ++part) {
        const aie::accum<accfloat, 16> o =
            mul_f32<16>(aie::load_v<16>(acc + at + part * 16), inverse.extract<16>(part));
        aie::store_v(out + at + part * 16, o.to_vector<bfloat16>());
      }
    }
  }
#else
  for (int row = 0; row < kTileQ; ++row) {
    const float sum = row_sum[row];
    for (int d = 0; d < kHeadDim; ++d) {
      const int at = head_offset(row, d);
      out[at] = float_to_bf16(sum > 0.0f ? acc[at] / sum : 0.0f);
    }
  }
#endif
}

} // extern "C"
