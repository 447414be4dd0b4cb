// Prefill GEMM on one compute tile: acc += A · Wᵀ over one L1 tile, W in HuggingFace's (out, in) layout.
//
// Tile sizes, compile-time (override with -D):
//   GEMM_TILE_M  rows of A and of the accumulator per call      (a multiple of 16)  default 32
//   GEMM_TILE_K  depth of one call: columns of A and of W       (a multiple of 8)   default 32
//   GEMM_TILE_N  rows of W, columns of the accumulator           (a multiple of 16)  default 128
//   GEMM_DRAIN_N columns of acc one gemm_f32_to_bf16 call rounds (a multiple of 8 dividing GEMM_TILE_N)
//                default GEMM_TILE_N. A run of whole 8-column blocks is contiguous in acc, so the drain can round
//                the tile piece by piece into a bf16 buffer smaller than the tile (L1 room for larger tiles)
// Precision, compile-time:
//   -DAIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16  the multiplies see their operands as BFP16 (each 8 values along K
//     share one exponent; the AIE API's emulation, upstream's fast mode) instead of exact bf16.
//
// Layouts: every operand is pre-tiled into 8x8 blocks (the L2 -> L1 DMA does the rearrangement), each block
// row-major. With MB = GEMM_TILE_M / 8, NB = GEMM_TILE_N / 8, KB = GEMM_TILE_K / 8:
//   a    bf16 [KB][MB][8 m][8 k]   A's blocks, the M blocks of one K step next to each other
//   w    bf16 [KB][NB][8 n][8 k]   W's blocks as stored in W: each block row is 8 consecutive K of one output
//   acc  f32  [NB][MB][8 m][8 n]   the output tile block-column-major, as upstream's drain DMA un-tiles it
//   c    bf16 [GEMM_DRAIN_N/8][MB][8 m][8 n]   one drain chunk, the layout of acc
//
// Symbols (rename with -Dgemm_zero_f32=<name> etc. to link two configurations into one ELF):
//   void gemm_zero_f32(float *acc)                                   acc = 0
//   void gemm_bf16_f32_wnk(const bf16 *a, const bf16 *w, float *acc) acc[m][n] += sum_k a[m][k] * w[n][k] (fp32)
//   void gemm_f32_to_bf16(const float *acc, bf16 *c)                 c = bf16(acc), rounded to nearest-even, over
//                                                                    GEMM_DRAIN_N columns: acc points at the chunk
//   void gemm_f32_swiglu_to_bf16(const float *gate, const float *up, bf16 *c)
//                                                                    c = silu_mul(bf16(gate), bf16(up)) over one
//                                                                    chunk: gate and up point at two chunks of acc
//                                                                    (a tile computing gate and up rows at once)
//   AIE path: every buffer 64-byte aligned.
//
// AIE path: 8x8 output blocks with fp32 accumulators, two by two blocks sharing their operands, four accumulators
// in registers over the whole K loop. Exact bf16 runs bf16_blocks.h's 64-lane multiply-accumulates (AIE2P has no
// exact bf16 matrix multiply; aie_api's mmul<4, 8, 8> emulation prepares its operands again in every call); BFP16
// emulation runs aie::mmul<8, 8, 8>. A W block is transposed in registers into the 8x8 (k, n) operand both take: a
// bf16 transpose cannot be done by the DMA (4-byte granules). Not compiled on this machine (no Peano): written
// against the documented AIE API, type-checked against it and, exact bf16, run against a value stand-in of it
// (tests/kernels/test_aie_path_values.py: equal to the host path bit for bit).
// Host path: the same blocks in the same order, one fp32 multiply-add at a time along K.
#include "npu2_kernel.h"
#include "silu_mul.h"

#if !defined(__AIENGINE__) && defined(AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16)
#include "bfp16.h"
#endif

#include "bf16_blocks.h"
#include "gemm_tiles.h"

namespace {

constexpr int kBlock = 8;  // the side of every pre-tiled block
constexpr int kTileM = GEMM_TILE_M;
constexpr int kTileK = GEMM_TILE_K;
constexpr int kTileN = GEMM_TILE_N;
static_assert(kTileM > 0 && kTileM % 16 == 0, "GEMM_TILE_M must be a positive multiple of 16");
static_assert(kTileK > 0 && kTileK % kBlock == 0, "GEMM_TILE_K must be a positive multiple of 8");
static_assert(kTileN > 0 && kTileN % 16 == 0, "GEMM_TILE_N must be a positive multiple of 16");
constexpr int kDrainN = GEMM_DRAIN_N;
static_assert(kDrainN > 0 && kDrainN % 8 == 0 && kTileN % kDrainN == 0,
              "GEMM_DRAIN_N must be a positive multiple of 8 dividing GEMM_TILE_N");

constexpr int kBlocksM = kTileM / kBlock;
constexpr int kBlocksN = kTileN / kBlock;
constexpr int kBlocksK = kTileK / kBlock;
constexpr int kBlockSize = kBlock * kBlock;
constexpr int kTileElements = kTileM * kTileN;
constexpr int kDrainElements = kTileM * kDrainN;  // tile_m rows by GEMM_DRAIN_N columns: NB/NDRAIN whole block rows

} // namespace

#if defined(__AIENGINE__)

namespace {

constexpr int kFloatLanes = 16; // fp32 values per 512-bit register
// Output block (mb, nb) at nb * kColumnC + mb * 64; A block (kk, mb) at kk * kStepA + mb * 64; W block (kk, nb) at
// kk * kStepW + nb * 64.
constexpr int kStepA = kTileM * kBlock, kStepW = kTileN * kBlock, kColumnC = kTileM * kBlock;

// The (k, n) operand of one W block stored (n, k).
inline aie::vector<bfloat16, kBlockSize> w_block(const bfloat16 *block) {
  return aie::transpose(aie::load_v<kBlockSize>(block), kBlock, kBlock);
}

} // namespace

extern "C" void gemm_zero_f32(float *acc) {
  const aie::vector<float, kFloatLanes> zeros = aie::zeros<float, kFloatLanes>();
  for (int i = 0; i < kTileElements; i += kFloatLanes)
    aie::store_v(acc + i, zeros);
}

#if defined(AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16)

extern "C" void gemm_bf16_f32_wnk(const bfloat16 *__restrict a, const bfloat16 *__restrict w,
                                  float *__restrict acc) {
  using Mmul = aie::mmul<kBlock, kBlock, kBlock, bfloat16, bfloat16, accfloat>;
  for (int j = 0; j < kBlocksN; j += 2)
    for (int i = 0; i < kBlocksM; i += 2) {
      float *c00 = acc + j * kColumnC + i * kBlockSize;
      float *c10 = c00 + kBlockSize;
      float *c01 = c00 + kColumnC;
      float *c11 = c01 + kBlockSize;
      Mmul m00(aie::load_v<kBlockSize>(c00)), m01(aie::load_v<kBlockSize>(c01));
      Mmul m10(aie::load_v<kBlockSize>(c10)), m11(aie::load_v<kBlockSize>(c11));
      const bfloat16 *pa = a + i * kBlockSize;
      const bfloat16 *pw = w + j * kBlockSize;
      for (int kk = 0; kk < kBlocksK; ++kk, pa += kStepA, pw += kStepW) {
        const aie::vector<bfloat16, kBlockSize> a0 = aie::load_v<kBlockSize>(pa);
        const aie::vector<bfloat16, kBlockSize> a1 = aie::load_v<kBlockSize>(pa + kBlockSize);
        const aie::vector<bfloat16, kBlockSize> b0 = w_block(pw);
        const aie::vector<bfloat16, kBlockSize> b1 = w_block(pw + kBlockSize);
        m00.mac(a0, b0);
        m01.mac(a0, b1);
        m10.mac(a1, b0);
        m11.mac(a1, b1);
      }
      aie::store_v(c00, m00.to_vector<float>());
      aie::store_v(c01, m01.to_vector<float>());
      aie::store_v(c10, m10.to_vector<float>());
      aie::store_v(c11, m11.to_vector<float>());
    }
}

#else

extern "C" void gemm_bf16_f32_wnk(const bfloat16 *__restrict a, const bfloat16 *__restrict w,
                                  float *__restrict acc) {
  using bf16_blocks::Block;
  for (int j = 0; j < kBlocksN; j += 2)
    for (int i = 0; i < kBlocksM; i += 2) {
      float *c[2][2];
      bf16_blocks::BlockAcc sums[2][2];
      for (int r = 0; r < 2; ++r)
        for (int s = 0; s < 2; ++s) {
          c[r][s] = acc + (j + s) * kColumnC + (i + r) * kBlockSize;
          sums[r][s] = bf16_blocks::BlockAcc(aie::load_v<kBlockSize>(c[r][s]));
        }
      const bfloat16 *pa = a + i * kBlockSize;
      const bfloat16 *pw = w + j * kBlockSize;
      for (int kk = 0; kk < kBlocksK; ++kk, pa += kStepA, pw += kStepW) {
        const Block a_transposed[2] = {aie::transpose(aie::load_v<kBlockSize>(pa), kBlock, kBlock),
                                       aie::transpose(aie::load_v<kBlockSize>(pa + kBlockSize), kBlock, kBlock)};
        const Block b[2] = {w_block(pw), w_block(pw + kBlockSize)};
        bf16_blocks::mac_blocks(sums, a_transposed, b);
      }
      for (int r = 0; r < 2; ++r)
        for (int s = 0; s < 2; ++s)
          aie::store_v(c[r][s], sums[r][s].to_vector<float>());
    }
}

#endif

extern "C" void gemm_f32_to_bf16(const float *__restrict acc, bfloat16 *__restrict c) {
  RoundToNearestEven rounding;
  for (int i = 0; i < kDrainElements; i += kFloatLanes) {
    aie::accum<accfloat, kFloatLanes> sums;
    sums.from_vector(aie::load_v<kFloatLanes>(acc + i));
    aie::store_v(c + i, sums.to_vector<bfloat16>());
  }
}

extern "C" void gemm_f32_swiglu_to_bf16(const float *__restrict gate, const float *__restrict up,
                                        bfloat16 *__restrict c) {
  RoundToNearestEven rounding;
  for (int i = 0; i < kDrainElements; i += kFloatLanes) {
    aie::accum<accfloat, kFloatLanes> g, u;
    g.from_vector(aie::load_v<kFloatLanes>(gate + i));
    u.from_vector(aie::load_v<kFloatLanes>(up + i));
    aie::store_v(c + i, silu_mul_vector(g.to_vector<bfloat16>(), u.to_vector<bfloat16>()));
  }
}

#else

namespace {

// Eight consecutive K values of one row of a block, as the multiplier sees them.
inline void load_row8(const bf16_t *row, float out[kBlock]) {
#if defined(AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16)
  float widened[kBlock];
  for (int k = 0; k < kBlock; ++k)
    widened[k] = bf16_to_float(row[k]);
  bfp16_quantize_block8(widened, out);
#else
  for (int k = 0; k < kBlock; ++k)
    out[k] = bf16_to_float(row[k]);
#endif
}

} // namespace

extern "C" void gemm_zero_f32(float *acc) {
  for (int i = 0; i < kTileElements; ++i)
    acc[i] = 0.0f;
}

extern "C" void gemm_bf16_f32_wnk(const bf16_t *a, const bf16_t *w, float *acc) {
  for (int kk = 0; kk < kBlocksK; ++kk)
    for (int nb = 0; nb < kBlocksN; ++nb) {
      const bf16_t *w_blk = w + (kk * kBlocksN + nb) * kBlockSize;
      float w_rows[kBlock][kBlock];
      for (int n = 0; n < kBlock; ++n)
        load_row8(w_blk + n * kBlock, w_rows[n]);
      for (int mb = 0; mb < kBlocksM; ++mb) {
        const bf16_t *a_blk = a + (kk * kBlocksM + mb) * kBlockSize;
        float *c_blk = acc + (nb * kBlocksM + mb) * kBlockSize;
        for (int m = 0; m < kBlock; ++m) {
          float a_row[kBlock];
          load_row8(a_blk + m * kBlock, a_row);
          for (int n = 0; n < kBlock; ++n) {
            float sum = c_blk[m * kBlock + n];
            for (int k = 0; k < kBlock; ++k)
              sum += a_row[k] * w_rows[n][k];
            c_blk[m * kBlock + n] = sum;
          }
        }
      }
    }
}

extern "C" void gemm_f32_to_bf16(const float *acc, bf16_t *c) {
  for (int i = 0; i < kDrainElements; ++i)
    c[i] = float_to_bf16(acc[i]);
}

extern "C" void gemm_f32_swiglu_to_bf16(const float *gate, const float *up, bf16_t *c) {
  for (int i = 0; i < kDrainElements; ++i)
    c[i] = silu_mul_scalar(float_to_bf16(gate[i]), float_to_bf16(up[i]));
}

#endif
