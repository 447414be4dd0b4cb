// Exact bf16 products of 8x8 blocks on the AIE path (attention.cc, gemm.cc): AIE2P has no exact bf16 matrix
// multiply, only elementwise bf16 x bf16 -> fp32 multiply-accumulates. aie_api's mmul<4, 8, 8> emulation is built
// from those too (32 lanes), but prepares both operands again in every call; here a block product is eight 64-lane
// multiply-accumulates, one per value k of the shared dimension, of two prepared vectors:
//   lane r * 8 + c of a(k): A[r][k], the A block's column k spread along its rows (an extract, a 128-bit broadcast
//                           and a transpose, from the block held transposed);
//   lane r * 8 + c of b(k): B[k][c], row k of the (k, c) operand repeated down the block (an extract, a broadcast).
// Each prepared vector is made once and used by every block of the pass that takes it, and an output's sum runs
// k by k, the order the scalar paths add in. Not compiled here (no Peano): type-checked by `torch-npu2 lint
// --aie-source` and run against a value stand-in of the AIE API (tests/kernels/test_aie_path_values.py: gemm.cc's
// and attention.cc's products equal their scalar paths bit for bit); neither sees register pressure (Rows x Cols
// 2048-bit accumulators live).
#pragma once

#include "npu2_kernel.h"

#if defined(__AIENGINE__)

namespace bf16_blocks {

constexpr int kSide = 8;
constexpr int kLanes = kSide * kSide;
using Block = aie::vector<bfloat16, kLanes>;
using BlockAcc = aie::accum<accfloat, kLanes>;

// Lane r * 8 + c: value k of row r of a block held transposed (lane k * 8 + r = block[r][k]).
inline Block column_across_rows(const Block &transposed, int k) {
  return aie::transpose(transposed.extract<kSide>(k).grow_replicate<kLanes>(), kSide, kSide);
}

// Lane r * 8 + c: value c of row k of a row-major block, for every r.
inline Block row_repeated(const Block &block, int k) { return block.extract<kSide>(k).grow_replicate<kLanes>(); }

// acc[i][j] += A_i . B_j over one block of the shared dimension: a_transposed[i] holds A_i transposed (lane
// k * 8 + r = A_i[r][k]), b[j] holds B_j as the (k, c) operand, row-major.
template <int Rows, int Cols>
inline void mac_blocks(BlockAcc (&acc)[Rows][Cols], const Block (&a_transposed)[Rows], const Block (&b)[Cols]) {
  for (int k = 0; k < kSide; ++k) {
    Block b_rows[Cols];
    for (int j = 0; j < Cols; ++j)
      b_rows[j] = row_repeated(b[j], k);
    for (int i = 0; i < Rows; ++i) {
      const Block a_column = column_across_rows(a_transposed[i], k);
      for (int j = 0; j < Cols; ++j)
        acc[i][j] = aie::mac(acc[i][j], a_column, b_rows[j]);
    }
  }
}

} // namespace bf16_blocks

#endif
