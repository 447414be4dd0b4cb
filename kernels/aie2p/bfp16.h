// bf16 -> bfp16ebs8, the conversion AIE2P applies to both operands of a bf16 mmul built with
// AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16, as a scalar host function.
//
// What the public sources say (facts, with where they are):
// - AIE API (Xilinx/aie_api @ dc3ab77, include/aie_api/detail/aie2p/mmul_bf16_bf16.hpp): with that macro the
//   8x8x8 and 4x8x8 bf16 mmuls widen the bf16 tiles to an accfloat accumulator, convert both with the
//   intrinsic ::to_v64bfp16ebs8 (A row-major, B transposed to N x K first, so every block of 8 runs along K)
//   and multiply with ::mac_8x8_8x8T_conf into an fp32 accumulator. The intrinsic itself is a compiler
//   builtin; the AIE API headers do not define its arithmetic.
// - block_vector.hpp: bfp16ebs8 = blocks of 8 values sharing one 8-bit exponent, 8 mantissa bits each.
// - accum.hpp (from_vector of a block_vector): an identity block has mantissa 0x40 and exponent 127, so a
//   value is int8(mantissa) * 2^(exponent - 127 - 6).
// - mlir-aie (hunhoffe/mlir-aie @ 1e40030, programming_examples/ml/block_datatypes/helper.h, AMD's host model
//   of the conversion that its tests feed to and compare with the hardware): shared exponent = the largest
//   biased fp32 exponent field in the block; each value's 24-bit significand (implicit bit set only when its
//   exponent field is nonzero) is negated in two's complement when the sign is set and shifted right
//   arithmetically by 17 + (shared - own exponent field): "the rounding mode for the mantissa in AIE2p is
//   always truncation", i.e. towards minus infinity for the two's complement value; decoding uses
//   int8 * 2^(shared - 127) / 64.
//
// Hence, per value x with exponent field e in a block with shared exponent E:
//   q = floor(signed_significand(x) / 2^(17 + E - e))  in [-128, 127],   result = q * 2^(E - 133).
// Zeros give 0 (+0.0, whatever their sign). Subnormals (e == 0) are aligned by their raw exponent field, as
// helper.h does, so they count half their value before truncation; next to any normal value they truncate to
// 0 (positive) or -1 ulp of the block (negative). Inf and NaN (e == 255) are returned unchanged; helper.h
// leaves them out and nothing public says what the silicon does with them. One departure from helper.h: its
// shortcut for shifts of 32 or more turns -0.0 into -1; the floor above gives 0, as its own shift does for
// shorter distances.
//
// The result is returned as float; every such value is exactly representable in bf16 (at most 8 significant
// bits, exponent within bf16's range), so a bf16 x bf16 -> fp32 product of converted operands is exact.
#pragma once

#if !defined(__AIENGINE__) // on AIE2P the vector unit converts (::to_v64bfp16ebs8); this is the host model

#include <cmath>
#include <cstdint>
#include <cstring>

static inline void bfp16_quantize_block8(const float in[8], float out[8]) {
  uint32_t bits[8];
  int shared_exponent = 0;
  for (int i = 0; i < 8; ++i) {
    std::memcpy(&bits[i], &in[i], sizeof bits[i]);
    const int exponent = int((bits[i] >> 23) & 0xffu);
    shared_exponent = exponent > shared_exponent ? exponent : shared_exponent;
  }
  for (int i = 0; i < 8; ++i) {
    const int exponent = int((bits[i] >> 23) & 0xffu);
    if (exponent == 0xff) {
      out[i] = in[i];
      continue;
    }
    const int32_t significand = int32_t((bits[i] & 0x7fffffu) | (exponent ? 0x800000u : 0u));
    const int32_t signed_significand = (bits[i] >> 31) ? -significand : significand;
    // |signed_significand| < 2^24, so any shift past 30 already gives the floor's 0 or -1.
    const int shift = 17 + shared_exponent - exponent;
    const int32_t mantissa = signed_significand >> (shift > 31 ? 31 : shift); // arithmetic: floor
    out[i] = std::ldexp(float(mantissa), shared_exponent - 133);
  }
}

#endif
