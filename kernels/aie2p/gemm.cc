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
// AIE path: aie::mmul with an fp32 accumulator. Exact bf16 runs the 4x8x8 shape AIE2P has for bf16 (each 8x8 A
// block is two 4-row halves); BFP16 emulation runs 8x8x8. A W block is transposed in registers into the 8x8 (k, n)
// operand the mmul takes: a bf16 transpose cannot be done by the DMA (4-byte granules). Two by two mmuls share
// their operand loads, keeping four accumulators in registers over the whole K loop. Not compiled on this
// machine (no Peano): written against the documented AIE API.
// Host path: the same blocks in the same order, one fp32 multiply-add at a time along K.
#include "npu2_kernel.h"
#include "silu_mul.h"

#if !defined(__AIENGINE__) && defined(AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16)
#include "bfp16.h"
#endif

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

#if defined(AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16)
constexpr int kMmulRows = 8;
#else
constexpr int kMmulRows = 4;
#endif
using Mmul = aie::mmul<kMmulRows, kBlock, kBlock, bfloat16, bfloat16, accfloat>;
static_assert(Mmul::size_B == kBlockSize && Mmul::size_A == kMmulRows * kBlock, "unexpected mmul shape");

constexpr int kRowTiles = kTileM / kMmulRows; // mmul row tiles; even, since GEMM_TILE_M is a multiple of 16
constexpr int kFloatLanes = 16;               // fp32 values per 512-bit register

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

extern "C" void gemm_bf16_f32_wnk(const bfloat16 *__restrict a, const bfloat16 *__restrict w,
                                  float *__restrict acc) {
  // Row tile i of A at K step kk starts at kk * kTileM * 8 + i * kMmulRows * 8 (the two 4-row halves of an 8x8
  // block are consecutive); column tile j of W at kk * kTileN * 8 + j * 64; output tile (i, j) at
  // j * kTileM * 8 + i * Mmul::size_C.
  constexpr int kStepA = kTileM * kBlock, kStepW = kTileN * kBlock, kColumnC = kTileM * kBlock;
  for (int j = 0; j < kBlocksN; j += 2)
    for (int i = 0; i < kRowTiles; i += 2) {
      float *c00 = acc + j * kColumnC + i * Mmul::size_C;
      float *c10 = c00 + Mmul::size_C;
      float *c01 = c00 + kColumnC;
      float *c11 = c01 + Mmul::size_C;
      Mmul m00(aie::load_v<Mmul::size_C>(c00)), m01(aie::load_v<Mmul::size_C>(c01));
      Mmul m10(aie::load_v<Mmul::size_C>(c10)), m11(aie::load_v<Mmul::size_C>(c11));
      const bfloat16 *pa = a + i * Mmul::size_A;
      const bfloat16 *pw = w + j * kBlockSize;
      for (int kk = 0; kk < kBlocksK; ++kk, pa += kStepA, pw += kStepW) {
        const aie::vector<bfloat16, Mmul::size_A> a0 = aie::load_v<Mmul::size_A>(pa);
        const aie::vector<bfloat16, Mmul::size_A> a1 = aie::load_v<Mmul::size_A>(pa + Mmul::size_A);
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
