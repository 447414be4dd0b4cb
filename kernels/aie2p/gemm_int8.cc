// Integer prefill GEMM on one compute tile, int8 weights: acc += A · W over one L1 tile with an int32
// accumulator, then a drain that rescales to bf16. The numerics are torch_npu2/emulator/int8.py's, bit for bit.
//
// Compile-time (override with -D):
//   GEMM_TILE_M  rows of A and of the accumulator per call      (a multiple of 16)  default 32
//   GEMM_TILE_K  depth of one call                              (a multiple of 8)   default 32
//   GEMM_TILE_N  columns of W and of the accumulator            (a multiple of 16)  default 128
//   GEMM_DRAIN_N columns of acc one drain call rescales         (a multiple of 8 dividing GEMM_TILE_N)
//   GEMM_ACT_BITS 8 (W8A8: int8 activations, aie::mmul<8, 8, 8, int8, int8>, 512 MACs an instruction) or
//                16 (W8A16: int16 activations, aie::mmul<8, 4, 8, int16, int8>, 256 MACs an instruction; both
//                the int32-accumulator shapes of aie_api detail/aie2p/mmul_8_8.hpp and mmul_16_8.hpp)
//   GEMM_WEIGHT_TERMS 1, or 2 ("w8x2a16": each weight as hi + lo / 256, two int8 terms under one scale; with 16-bit
//                activations only): the A operand loaded once for both terms' mmuls, two accumulators
//
// Layouts, KM = the mmul's K (8 for int8 activations, 4 for int16), MB = GEMM_TILE_M / 8, NB = GEMM_TILE_N / 8,
// KB = GEMM_TILE_K / KM; every block row-major:
//   a    act  [KB][MB][8 m][KM k]  the activations, quantized per row (quantize_rows.cc)
//   w    int8 [T][KB][NB][KM k][8 n]  the weights, quantized per output channel and stored (K, N) when the weights
//                                  are prepared: the B operand arrives in the mmul's (k, n) order, no transpose;
//                                  T = GEMM_WEIGHT_TERMS tiles, hi then lo
//   acc  int32 [T][NB][MB][8 m][8 n]  the output tile block-column-major, as gemm.cc's, one per weight term
//   c    bf16 [GEMM_DRAIN_N/8][MB][8 m][8 n]  one drain chunk; a drain's acc points at the chunk's first block in
//                                  the first term's tile (the second term's sits GEMM_TILE_M * GEMM_TILE_N further)
//   row_scale  fp32 [GEMM_TILE_M]   the tile's rows' activation scales
//   col_scale  fp32 [GEMM_DRAIN_N]  the chunk's columns' weight scales
//
// Symbols:
//   void gemm_zero_i32(int32_t *acc)                                           acc = 0
//   void gemm_int_i32_wkn(const act *a, const int8_t *w, int32_t *acc)         acc[t][m][n] += sum_k a[m][k] w[t][k][n]
//   void gemm_i32_to_bf16(const int32_t *acc, const float *row_scale, const float *col_scale, bf16 *c)
//        c = bf16(sum * fp32(row_scale[m] * col_scale[n])) over one chunk, sum = fp32(acc[0]), or with two terms
//        fp32(fp32(acc[0]) + fp32(acc[1]) * 2^-8) (the product exact)
//   void gemm_i32_swiglu_to_bf16(const int32_t *gate, const int32_t *up, const float *row_scale,
//        const float *gate_scale, const float *up_scale, bf16 *c)   silu_mul of the two rescaled projections
//
// The int32 sums are exact: |a| <= 127 (W8A8) or the K-bound qmax of int8.py (W8A16), |w| <= 127 (hi and lo).
// fp32(acc): aie_api converts an int32 vector as its high and low 16 bits, each exact in fp32, and one fp32 add,
// which rounds the sum once (to nearest even, as the host's conversion). Not compiled on this machine (no Peano);
// type-checked by `torch-npu2 lint --aie-source`.
#include "npu2_kernel.h"
#include "gemm_tiles.h"
#include "silu_mul.h"

#ifndef GEMM_ACT_BITS
#define GEMM_ACT_BITS 8
#endif
#ifndef GEMM_WEIGHT_TERMS
#define GEMM_WEIGHT_TERMS 1
#endif

namespace {

constexpr int kBlock = 8;
constexpr int kTileM = GEMM_TILE_M;
constexpr int kTileK = GEMM_TILE_K;
constexpr int kTileN = GEMM_TILE_N;
constexpr int kDrainN = GEMM_DRAIN_N;
static_assert(kTileM > 0 && kTileM % 16 == 0, "GEMM_TILE_M must be a positive multiple of 16");
static_assert(kTileK > 0 && kTileK % kBlock == 0, "GEMM_TILE_K must be a positive multiple of 8");
static_assert(kTileN > 0 && kTileN % 16 == 0, "GEMM_TILE_N must be a positive multiple of 16");
static_assert(kDrainN > 0 && kDrainN % kBlock == 0 && kTileN % kDrainN == 0,
              "GEMM_DRAIN_N must be a positive multiple of 8 dividing GEMM_TILE_N");
static_assert(GEMM_ACT_BITS == 8 || GEMM_ACT_BITS == 16, "GEMM_ACT_BITS must be 8 or 16");
static_assert(GEMM_WEIGHT_TERMS == 1 || (GEMM_WEIGHT_TERMS == 2 && GEMM_ACT_BITS == 16),
              "GEMM_WEIGHT_TERMS must be 1, or 2 with 16-bit activations");

#if GEMM_ACT_BITS == 8
using act_t = int8_t;
constexpr int kMmulK = 8;
#else
using act_t = int16_t;
constexpr int kMmulK = 4;
#endif

constexpr int kBlocksM = kTileM / kBlock;
constexpr int kBlocksN = kTileN / kBlock;
constexpr int kBlocksK = kTileK / kMmulK;
constexpr int kBlockC = kBlock * kBlock;
constexpr int kTileElements = kTileM * kTileN;
constexpr int kDrainElements = kTileM * kDrainN;
constexpr int kTerms = GEMM_WEIGHT_TERMS;
constexpr int kWeightElements = kTileK * kTileN;  // one term's weight tile
constexpr int kLoShift = 8;                        // the second term's weight, 2^-8 (int8.py's LO_SHIFT)

} // namespace

#if defined(__AIENGINE__)

namespace {

using Mmul = aie::mmul<kBlock, kMmulK, kBlock, act_t, int8_t, acc32>;
static_assert(Mmul::size_A == kBlock * kMmulK && Mmul::size_B == kMmulK * kBlock && Mmul::size_C == kBlockC,
              "unexpected mmul shape");
constexpr int kLanes = 16;  // int32 and fp32 values per 512-bit register

// fp32(acc) · fp32(row_scale · col_scale) for 16 outputs: rows m and m + 1 of one 8x8 block, 8 columns each.
inline aie::vector<float, kLanes> rescale(const int32_t *acc, const float *row_scale, const float *col_scale) {
  const aie::vector<float, kBlock> columns = aie::load_v<kBlock>(col_scale);
  const aie::vector<float, kLanes> scale_columns = aie::concat(columns, columns);
  const aie::vector<float, kLanes> scale_rows =
      aie::concat(aie::broadcast<float, kBlock>(row_scale[0]), aie::broadcast<float, kBlock>(row_scale[1]));
  const aie::vector<float, kLanes> scale = aie::mul(scale_rows, scale_columns).to_vector<float>();
  aie::vector<float, kLanes> sums = aie::to_float(aie::load_v<kLanes>(acc));
  if constexpr (kTerms == 2)  // to_float's shift scales each 16-bit half exactly, so the one rounding is fp32(acc_lo)'s
    sums = aie::add(sums, aie::to_float(aie::load_v<kLanes>(acc + kTileElements), kLoShift));
  return aie::mul(sums, scale).to_vector<float>();
}

// Rows of a drain chunk's acc run m-fastest inside each 8x8 block: element i sits in block column i / (TILE_M*8),
// row (i / 8) % TILE_M, column i % 8 of its block.
template <typename Store>
inline void drain(const float *row_scale, const float *col_scale, Store store) {
  for (int i = 0; i < kDrainElements; i += kLanes) {
    const int row = (i / kBlock) % kTileM, column = (i / (kTileM * kBlock)) * kBlock;
    store(i, row_scale + row, col_scale + column);
  }
}

} // namespace

extern "C" void gemm_zero_i32(int32_t *acc) {
  const aie::vector<int32_t, kLanes> zeros = aie::zeros<int32_t, kLanes>();
  for (int i = 0; i < kTerms * kTileElements; i += kLanes)
    aie::store_v(acc + i, zeros);
}

extern "C" void gemm_int_i32_wkn(const act_t *__restrict a, const int8_t *__restrict w, int32_t *__restrict acc) {
  // Row block i of A at K step kk starts at kk * kTileM * KM + i * size_A; column block j of W at
  // kk * kTileN * KM + j * size_B; output block (i, j) at j * kTileM * 8 + i * 64.
  constexpr int kStepA = kTileM * kMmulK, kStepW = kTileN * kMmulK, kColumnC = kTileM * kBlock;
  if constexpr (kTerms == 2) {
    // Two row blocks of one column block, both terms: four accumulators, as the one-term loop's 2 x 2, each A
    // operand feeding the hi and the lo mmul.
    for (int j = 0; j < kBlocksN; ++j)
      for (int i = 0; i < kBlocksM; i += 2) {
        int32_t *h0 = acc + j * kColumnC + i * kBlockC;
        int32_t *h1 = h0 + kBlockC;
        int32_t *l0 = h0 + kTileElements;
        int32_t *l1 = h1 + kTileElements;
        Mmul mh0(aie::load_v<kBlockC>(h0)), mh1(aie::load_v<kBlockC>(h1));
        Mmul ml0(aie::load_v<kBlockC>(l0)), ml1(aie::load_v<kBlockC>(l1));
        const act_t *pa = a + i * Mmul::size_A;
        const int8_t *pw = w + j * Mmul::size_B;
        for (int kk = 0; kk < kBlocksK; ++kk, pa += kStepA, pw += kStepW) {
          const aie::vector<act_t, Mmul::size_A> a0 = aie::load_v<Mmul::size_A>(pa);
          const aie::vector<act_t, Mmul::size_A> a1 = aie::load_v<Mmul::size_A>(pa + Mmul::size_A);
          const aie::vector<int8_t, Mmul::size_B> hi = aie::load_v<Mmul::size_B>(pw);
          const aie::vector<int8_t, Mmul::size_B> lo = aie::load_v<Mmul::size_B>(pw + kWeightElements);
          mh0.mac(a0, hi);
          mh1.mac(a1, hi);
          ml0.mac(a0, lo);
          ml1.mac(a1, lo);
        }
        aie::store_v(h0, mh0.to_vector<int32_t>());
        aie::store_v(h1, mh1.to_vector<int32_t>());
        aie::store_v(l0, ml0.to_vector<int32_t>());
        aie::store_v(l1, ml1.to_vector<int32_t>());
      }
    return;
  }
  for (int j = 0; j < kBlocksN; j += 2)
    for (int i = 0; i < kBlocksM; i += 2) {
      int32_t *c00 = acc + j * kColumnC + i * kBlockC;
      int32_t *c10 = c00 + kBlockC;
      int32_t *c01 = c00 + kColumnC;
      int32_t *c11 = c01 + kBlockC;
      Mmul m00(aie::load_v<kBlockC>(c00)), m01(aie::load_v<kBlockC>(c01));
      Mmul m10(aie::load_v<kBlockC>(c10)), m11(aie::load_v<kBlockC>(c11));
      const act_t *pa = a + i * Mmul::size_A;
      const int8_t *pw = w + j * Mmul::size_B;
      for (int kk = 0; kk < kBlocksK; ++kk, pa += kStepA, pw += kStepW) {
        const aie::vector<act_t, Mmul::size_A> a0 = aie::load_v<Mmul::size_A>(pa);
        const aie::vector<act_t, Mmul::size_A> a1 = aie::load_v<Mmul::size_A>(pa + Mmul::size_A);
        const aie::vector<int8_t, Mmul::size_B> b0 = aie::load_v<Mmul::size_B>(pw);
        const aie::vector<int8_t, Mmul::size_B> b1 = aie::load_v<Mmul::size_B>(pw + Mmul::size_B);
        m00.mac(a0, b0);
        m01.mac(a0, b1);
        m10.mac(a1, b0);
        m11.mac(a1, b1);
      }
      aie::store_v(c00, m00.to_vector<int32_t>());
      aie::store_v(c01, m01.to_vector<int32_t>());
      aie::store_v(c10, m10.to_vector<int32_t>());
      aie::store_v(c11, m11.to_vector<int32_t>());
    }
}

extern "C" void gemm_i32_to_bf16(const int32_t *__restrict acc, const float *__restrict row_scale,
                                 const float *__restrict col_scale, bfloat16 *__restrict c) {
  RoundToNearestEven rounding;
  drain(row_scale, col_scale, [&](int i, const float *rows, const float *columns) {
    aie::accum<accfloat, kLanes> out;
    out.from_vector(rescale(acc + i, rows, columns));
    aie::store_v(c + i, out.to_vector<bfloat16>());
  });
}

extern "C" void gemm_i32_swiglu_to_bf16(const int32_t *__restrict gate, const int32_t *__restrict up,
                                        const float *__restrict row_scale, const float *__restrict gate_scale,
                                        const float *__restrict up_scale, bfloat16 *__restrict c) {
  RoundToNearestEven rounding;
  drain(row_scale, gate_scale, [&](int i, const float *rows, const float *columns) {
    aie::accum<accfloat, kLanes> g, u;
    g.from_vector(rescale(gate + i, rows, columns));
    u.from_vector(rescale(up + i, rows, up_scale + (columns - gate_scale)));
    aie::store_v(c + i, silu_mul_vector(g.to_vector<bfloat16>(), u.to_vector<bfloat16>()));
  });
}

#else

namespace {

// acc[0] of one output (the next term's at acc[kTileElements]) times its row and column scales.
inline float rescale(const int32_t *acc, float row_scale, float col_scale) {
  const float scale = row_scale * col_scale;
  float sum = float(acc[0]);  // int32 -> fp32 rounds to nearest even
  if (kTerms == 2)
    sum += float(acc[kTileElements]) * (1.0f / (1 << kLoShift));  // the product exact, the sum rounded once
  return sum * scale;
}

} // namespace

extern "C" void gemm_zero_i32(int32_t *acc) {
  for (int i = 0; i < kTerms * kTileElements; ++i)
    acc[i] = 0;
}

extern "C" void gemm_int_i32_wkn(const act_t *a, const int8_t *w, int32_t *acc) {
  for (int t = 0; t < kTerms; ++t, w += kWeightElements, acc += kTileElements)
  for (int kk = 0; kk < kBlocksK; ++kk)
    for (int nb = 0; nb < kBlocksN; ++nb) {
      const int8_t *w_blk = w + (kk * kBlocksN + nb) * kMmulK * kBlock;
      for (int mb = 0; mb < kBlocksM; ++mb) {
        const act_t *a_blk = a + (kk * kBlocksM + mb) * kBlock * kMmulK;
        int32_t *c_blk = acc + (nb * kBlocksM + mb) * kBlockC;
        for (int m = 0; m < kBlock; ++m)
          for (int n = 0; n < kBlock; ++n) {
            int32_t sum = c_blk[m * kBlock + n];
            for (int k = 0; k < kMmulK; ++k)
              sum += int32_t(a_blk[m * kMmulK + k]) * int32_t(w_blk[k * kBlock + n]);
            c_blk[m * kBlock + n] = sum;
          }
      }
    }
}

extern "C" void gemm_i32_to_bf16(const int32_t *acc, const float *row_scale, const float *col_scale, bf16_t *c) {
  for (int i = 0; i < kDrainElements; ++i) {
    const int row = (i / kBlock) % kTileM, column = (i / (kTileM * kBlock)) * kBlock + i % kBlock;
    c[i] = float_to_bf16(rescale(acc + i, row_scale[row], col_scale[column]));
  }
}

extern "C" void gemm_i32_swiglu_to_bf16(const int32_t *gate, const int32_t *up, const float *row_scale,
                                        const float *gate_scale, const float *up_scale, bf16_t *c) {
  for (int i = 0; i < kDrainElements; ++i) {
    const int row = (i / kBlock) % kTileM, column = (i / (kTileM * kBlock)) * kBlock + i % kBlock;
    c[i] = silu_mul_scalar(float_to_bf16(rescale(gate + i, row_scale[row], gate_scale[column])),
                           float_to_bf16(rescale(up + i, row_scale[row], up_scale[column])));
  }
}

#endif
