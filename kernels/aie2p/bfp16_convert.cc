// Host test harness for bfp16.h: converts whole arrays of bf16 values, block of 8 by block of 8, so that a
// test can hold the host model of AIE2P's bf16 -> bfp16ebs8 conversion against the emulator's (torch).
// Host only: on AIE2P the conversion is the vector unit's, not this function.
//
// Symbol:
//   void bfp16_quantize_bf16(const bf16 *in, float *out, int32_t blocks)
//     in   8 * blocks bf16 values, consecutive blocks of 8 (a GEMM operand's K runs)
//     out  8 * blocks floats: each value as bfp16ebs8 represents it (see bfp16.h)
#include "npu2_kernel.h"

#if defined(__AIENGINE__)
#error "bfp16_convert.cc is a host test harness; AIE2P converts in its vector unit"
#endif

#include "bfp16.h"

extern "C" void bfp16_quantize_bf16(const bf16_t *in, float *out, int32_t blocks) {
  for (int32_t block = 0; block < blocks; ++block) {
    float values[8];
    for (int i = 0; i < 8; ++i)
      values[i] = bf16_to_float(in[8 * block + i]);
    bfp16_quantize_block8(values, out + 8 * block);
  }
}
