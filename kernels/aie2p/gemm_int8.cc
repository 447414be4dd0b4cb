// Integer prefill GEMM ("w8x2a16", kernels/int_gemm.py's numerics and layouts) on one compute tile: int16
// activations times two int8 weight terms (hi and lo, w ≈ scale · (hi + lo / 256)), two int32 accumulator tiles kept
// in L1 across the K loop, then a drain that rescales them to bf16 (plain, or SwiGLU over a [gate | up] tile).
// The host path is int_gemm.integer_product bit for bit (tests/kernels/test_gemm_int8_host.py).
//
// Compile-time (override with -D):
//   GEMM_TILE_M  rows of A and of the accumulators per call                   (a multiple of 16)  default 64
//   GEMM_TILE_N  accumulator columns T: the launch's tile_n, or 2 · tile_n for a [gate | up] tile (the gate's tile_n
//                columns, then the same up columns)                            (a multiple of 16)  default 64
//   GEMM_DRAIN_N columns one drain call rescales (a multiple of 8 dividing GEMM_TILE_N, and for SwiGLU the gate's
//                tile_n)                                                                          default GEMM_TILE_N
// One call multiplies CALL_K = 32 values of K (the layout fixes it).
//
// Layouts (MB = GEMM_TILE_M / 8, NB = GEMM_TILE_N / 8; every block row-major):
//   a    int16 [9 kb][GEMM_TILE_M m][4 k]: one call's window of the quantized activation rows (int_gemm's runs of
//        36 int16 per 32 K, cut by the DMA): kb < 8 the rows' q[m][4 kb + k] (each 8 rows one A operand of
//        aie::mmul<8, 4, 8, int16, int8>), kb = 8 per row its fp32 scale (two int16, low half first) and two zeros
//   w    int8 [9 kb][NB nb][2 t][4 k][8 n]: one call's window of the prepared weight (int_gemm.tile_weights): kb < 8
//        the B operands of term t (hi, lo) side by side, kb = 8 per nb its 8 columns' fp32 scales in t = 0
//   acc  int32 [NB nb][2 t][MB mb][8 m][8 n]: per 8-column block the hi then the lo accumulator, each block-column-
//        major, so that a drain chunk of whole 8-column blocks is one contiguous run holding both terms
//   row_scale  fp32 [GEMM_TILE_M]: the rows' activation scales; col_scale fp32 [GEMM_TILE_N]: the columns' scales
//   c    bf16 [GEMM_DRAIN_N / 8][MB][8 m][8 n]: one drain chunk, block-column-major as gemm.cc's
//
// Symbols:
//   void gemm_int_zero_i32(int32_t *acc)                                              acc = 0 (both terms)
//   void gemm_int_w8x2(const int16_t *a, const int8_t *w, int32_t *acc, float *row_scale, float *col_scale)
//        acc[t] += a · w[t] over the call's 32 K (exact int32 sums: int_gemm's activations keep 127 · Σ|q| within
//        int32), and the window's scale blocks copied to row_scale and col_scale (every call of a tile carries the
//        same scales, so the copies rewrite the same values)
//   void gemm_int_drain_bf16(const int32_t *acc, const float *row_scale, const float *col_scale, bf16 *c)
//        c = bf16((fp32(acc_hi) + fp32(acc_lo) · 2^-8) · fp32(row_scale[m] · col_scale[n])) over one chunk: acc
//        points at the chunk's first block, col_scale at its first column's scale
//   void gemm_int_swiglu_drain_bf16(const int32_t *gate, const int32_t *up, const float *row_scale,
//        const float *gate_scale, const float *up_scale, bf16 *c)
//        c = silu_mul(bf16(gate rescaled), bf16(up rescaled)) over one chunk (silu_mul.h's rounding)
//
// AIE path: per 8-column block, two row blocks × two terms in four accumulators (2 × 2 register blocking): each A
// operand (one 512-bit load) feeds the hi and the lo mmul, and one 512-bit load brings a K step's hi and lo B operands
// together (they are adjacent in the window). fp32(acc) is aie_api's int32 → float conversion (the high and low 16
// bits converted exactly and summed once: round to nearest even); fp32(acc_lo) · 2^-8 its shift argument (exact).
// Not compiled on this machine (no Peano): type-checked by `torch-npu2 lint --aie-source` and run against a value
// stand-in of the AIE API (tests/kernels/test_aie_path_values.py: equal to the host path bit for bit, its fp32
// products IEEE's there); what these cannot check:
// code generation, register pressure (the MAC loop keeps four 2048-bit accumulators and three operands live),
// and whether the two fp32 × fp32 products of the drain (row_scale · col_scale, then the sum times it) round
// correctly: AIE2P has no fp32 vector multiplier and aie_api emulates one with bf16 products
// (__AIE_API_FP32_EMULATION__), so the drain matches int_gemm bit for bit only if that emulation rounds as IEEE does.
#include "npu2_kernel.h"
#include "silu_mul.h"

#ifndef GEMM_TILE_M
#define GEMM_TILE_M 64
#endif
#ifndef GEMM_TILE_N
#define GEMM_TILE_N 64
#endif
#ifndef GEMM_DRAIN_N
#define GEMM_DRAIN_N GEMM_TILE_N
#endif

namespace {

constexpr int kBlock = 8;         // mmul rows (M) and columns (N)
constexpr int kMmulK = 4;         // the int16 × int8 mmul's K
constexpr int kDataBlocks = 8;    // K blocks of one call: CALL_K = 32
constexpr int kTileM = GEMM_TILE_M;
constexpr int kTileN = GEMM_TILE_N;
constexpr int kDrainN = GEMM_DRAIN_N;
static_assert(kTileM > 0 && kTileM % 16 == 0, "GEMM_TILE_M must be a positive multiple of 16");
static_assert(kTileN > 0 && kTileN % 16 == 0, "GEMM_TILE_N must be a positive multiple of 16");
static_assert(kDrainN > 0 && kDrainN % kBlock == 0 && kTileN % kDrainN == 0,
              "GEMM_DRAIN_N must be a positive multiple of 8 dividing GEMM_TILE_N");

constexpr int kBlocksM = kTileM / kBlock;
constexpr int kBlocksN = kTileN / kBlock;
constexpr int kBlockC = kBlock * kBlock;
constexpr int kTermBlock = kTileM * kBlock;       // one term's accumulator of one 8-column block
constexpr int kStepA = kTileM * kMmulK;           // int16 of one K block of the A window
constexpr int kStepW = kBlocksN * 2 * kMmulK * kBlock;  // int8 of one K block of the W window
constexpr int kLoShift = 8;                       // the second term's weight, 2^-8 (int_gemm.LO_SHIFT)

} // namespace

#if defined(__AIENGINE__)

namespace {

using Mmul = aie::mmul<kBlock, kMmulK, kBlock, int16_t, int8_t, acc32>;
static_assert(Mmul::size_A == kBlock * kMmulK && Mmul::size_B == kMmulK * kBlock && Mmul::size_C == kBlockC,
              "unexpected mmul shape");
constexpr int kLanes = 16;       // int32 and fp32 values per 512-bit register
constexpr int kDrainLanes = 32;  // outputs a drain step takes: four rows of one 8-column block
constexpr int kDrainRows = kDrainLanes / kBlock;

// fp32 sum of both terms of 32 outputs (rows m .. m + 3 of one 8-column block) times their scales.
inline aie::vector<float, kDrainLanes> rescale(const int32_t *hi, const float *row_scale,
                                               aie::vector<float, kDrainLanes> scale_columns) {
  const aie::vector<float, kDrainLanes> scale_rows = aie::concat(
      aie::concat(aie::broadcast<float, kBlock>(row_scale[0]), aie::broadcast<float, kBlock>(row_scale[1])),
      aie::concat(aie::broadcast<float, kBlock>(row_scale[2]), aie::broadcast<float, kBlock>(row_scale[3])));
  const aie::vector<float, kDrainLanes> scale = aie::mul(scale_rows, scale_columns).to_vector<float>();
  const aie::vector<float, kDrainLanes> sums =
      aie::add(aie::to_float<float>(aie::load_v<kDrainLanes>(hi)),
               aie::to_float<float>(aie::load_v<kDrainLanes>(hi + kTermBlock), kLoShift));
  return aie::mul(sums, scale).to_vector<float>();
}

// An 8-column block's scales, four times: the columns of four rows of outputs.
inline aie::vector<float, kDrainLanes> column_scales(const float *col_scale) {
  const aie::vector<float, kBlock> columns = aie::load_v<kBlock>(col_scale);
  const aie::vector<float, 2 * kBlock> twice = aie::concat(columns, columns);
  return aie::concat(twice, twice);
}

} // namespace

extern "C" void gemm_int_zero_i32(int32_t *acc) {
  const aie::vector<int32_t, kLanes> zeros = aie::zeros<int32_t, kLanes>();
  for (int i = 0; i < 2 * kTileM * kTileN; i += kLanes)
    aie::store_v(acc + i, zeros);
}

extern "C" void gemm_int_w8x2(const int16_t *__restrict a, const int8_t *__restrict w, int32_t *__restrict acc,
                              float *__restrict row_scale, float *__restrict col_scale) {
  for (int nb = 0; nb < kBlocksN; ++nb)
    for (int mb = 0; mb < kBlocksM; mb += 2) {
      int32_t *h0 = acc + nb * 2 * kTermBlock + mb * kBlockC;
      int32_t *h1 = h0 + kBlockC;
      int32_t *l0 = h0 + kTermBlock;
      int32_t *l1 = h1 + kTermBlock;
      Mmul mh0(aie::load_v<kBlockC>(h0)), mh1(aie::load_v<kBlockC>(h1));
      Mmul ml0(aie::load_v<kBlockC>(l0)), ml1(aie::load_v<kBlockC>(l1));
      const int16_t *pa = a + mb * Mmul::size_A;
      const int8_t *pw = w + nb * 2 * Mmul::size_B;
      for (int kb = 0; kb < kDataBlocks; ++kb, pa += kStepA, pw += kStepW) {
        const aie::vector<int16_t, Mmul::size_A> a0 = aie::load_v<Mmul::size_A>(pa);
        const aie::vector<int16_t, Mmul::size_A> a1 = aie::load_v<Mmul::size_A>(pa + Mmul::size_A);
        const aie::vector<int8_t, 2 * Mmul::size_B> terms = aie::load_v<2 * Mmul::size_B>(pw);  // hi, then lo
        const aie::vector<int8_t, Mmul::size_B> hi = terms.template extract<Mmul::size_B>(0);
        const aie::vector<int8_t, Mmul::size_B> lo = terms.template extract<Mmul::size_B>(1);
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
  // The scale blocks: per row two words (its scale's bits, zero), per 8-column block 8 scales then 8 zero words.
  const int32_t *rows = reinterpret_cast<const int32_t *>(a + kDataBlocks * kStepA);
  for (int m = 0; m < kTileM; m += kLanes)
    aie::store_v(row_scale + m, aie::filter_even(aie::load_v<2 * kLanes>(rows + 2 * m), 1).cast_to<float>());
  const float *columns = reinterpret_cast<const float *>(w + kDataBlocks * kStepW);
  for (int nb = 0; nb < kBlocksN; nb += 2)
    aie::store_v(col_scale + nb * kBlock, aie::concat(aie::load_v<kBlock>(columns + nb * 2 * kBlock),
                                                      aie::load_v<kBlock>(columns + (nb + 1) * 2 * kBlock)));
}

extern "C" void gemm_int_drain_bf16(const int32_t *__restrict acc, const float *__restrict row_scale,
                                    const float *__restrict col_scale, bfloat16 *__restrict c) {
  RoundToNearestEven rounding;
  for (int nb = 0; nb < kDrainN / kBlock; ++nb) {
    const aie::vector<float, kDrainLanes> columns = column_scales(col_scale + nb * kBlock);
    for (int m = 0; m < kTileM; m += kDrainRows) {
      aie::accum<accfloat, kDrainLanes> out;
      out.from_vector(rescale(acc + nb * 2 * kTermBlock + m * kBlock, row_scale + m, columns));
      aie::store_v(c + nb * kTermBlock + m * kBlock, out.to_vector<bfloat16>());
    }
  }
}

extern "C" void gemm_int_swiglu_drain_bf16(const int32_t *__restrict gate, const int32_t *__restrict up,
                                           const float *__restrict row_scale, const float *__restrict gate_scale,
                                           const float *__restrict up_scale, bfloat16 *__restrict c) {
  RoundToNearestEven rounding;
  for (int nb = 0; nb < kDrainN / kBlock; ++nb) {
    const aie::vector<float, kDrainLanes> gate_columns = column_scales(gate_scale + nb * kBlock);
    const aie::vector<float, kDrainLanes> up_columns = column_scales(up_scale + nb * kBlock);
    for (int m = 0; m < kTileM; m += kDrainRows) {
      const int offset = nb * 2 * kTermBlock + m * kBlock;
      aie::accum<accfloat, kDrainLanes> g, u;
      g.from_vector(rescale(gate + offset, row_scale + m, gate_columns));
      u.from_vector(rescale(up + offset, row_scale + m, up_columns));
      const aie::vector<bfloat16, kDrainLanes> gates = g.to_vector<bfloat16>(), ups = u.to_vector<bfloat16>();
      for (int half = 0; half < 2; ++half)  // silu_mul works on the core's 16-lane tanh
        aie::store_v(c + nb * kTermBlock + m * kBlock + half * kSiluMulLanes,
                     silu_mul_vector(gates.extract<kSiluMulLanes>(half), ups.extract<kSiluMulLanes>(half)));
    }
  }
}

#else

namespace {

// One output: both terms' sums, then the scales' product, each rounded to fp32 as int_gemm.integer_product rounds.
inline float rescale(const int32_t *hi, float row_scale, float col_scale) {
  const float scale = row_scale * col_scale;
  const float sum = float(hi[0]) + float(hi[kTermBlock]) * (1.0f / (1 << kLoShift));  // the product exact
  return sum * scale;
}

inline float bits_to_float(const void *p) {
  float value;
  std::memcpy(&value, p, sizeof value);
  return value;
}

} // namespace

extern "C" void gemm_int_zero_i32(int32_t *acc) {
  for (int i = 0; i < 2 * kTileM * kTileN; ++i)
    acc[i] = 0;
}

extern "C" void gemm_int_w8x2(const int16_t *a, const int8_t *w, int32_t *acc, float *row_scale, float *col_scale) {
  for (int nb = 0; nb < kBlocksN; ++nb)
    for (int t = 0; t < 2; ++t)
      for (int m = 0; m < kTileM; ++m)
        for (int n = 0; n < kBlock; ++n) {
          int32_t sum = acc[(nb * 2 + t) * kTermBlock + m * kBlock + n];
          for (int kb = 0; kb < kDataBlocks; ++kb)
            for (int k = 0; k < kMmulK; ++k)
              sum += int32_t(a[kb * kStepA + m * kMmulK + k]) *
                     int32_t(w[kb * kStepW + (nb * 2 + t) * kMmulK * kBlock + k * kBlock + n]);
          acc[(nb * 2 + t) * kTermBlock + m * kBlock + n] = sum;
        }
  for (int m = 0; m < kTileM; ++m)
    row_scale[m] = bits_to_float(a + kDataBlocks * kStepA + m * kMmulK);
  for (int n = 0; n < kTileN; ++n)
    col_scale[n] = bits_to_float(w + kDataBlocks * kStepW + (n / kBlock) * 2 * kMmulK * kBlock + (n % kBlock) * 4);
}

extern "C" void gemm_int_drain_bf16(const int32_t *acc, const float *row_scale, const float *col_scale, bf16_t *c) {
  for (int nb = 0; nb < kDrainN / kBlock; ++nb)
    for (int m = 0; m < kTileM; ++m)
      for (int n = 0; n < kBlock; ++n)
        c[nb * kTermBlock + m * kBlock + n] = float_to_bf16(
            rescale(acc + nb * 2 * kTermBlock + m * kBlock + n, row_scale[m], col_scale[nb * kBlock + n]));
}

extern "C" void gemm_int_swiglu_drain_bf16(const int32_t *gate, const int32_t *up, const float *row_scale,
                                           const float *gate_scale, const float *up_scale, bf16_t *c) {
  for (int nb = 0; nb < kDrainN / kBlock; ++nb)
    for (int m = 0; m < kTileM; ++m)
      for (int n = 0; n < kBlock; ++n) {
        const int offset = nb * 2 * kTermBlock + m * kBlock + n, column = nb * kBlock + n;
        c[nb * kTermBlock + m * kBlock + n] =
            silu_mul_scalar(float_to_bf16(rescale(gate + offset, row_scale[m], gate_scale[column])),
                            float_to_bf16(rescale(up + offset, row_scale[m], up_scale[column])));
      }
}

#endif
