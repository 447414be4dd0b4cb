// Shared by every kernel in this folder: the bf16 element type and rounding, on both build paths.
//
// Peano defines __AIENGINE__ for its AIE targets (aie2p-none-unknown-elf); there the kernels use the AIE API
// and bf16 is the native `bfloat16`. Any other compiler (the host g++) gets the portable scalar path, where
// bf16 is carried as its uint16 bit pattern and every fp32 -> bf16 conversion rounds to nearest-even, the
// mode the AIE path sets for its accumulator-to-vector conversions.
//
// Everything here has internal linkage, so two variants of one kernel (compiled with different -D tile sizes
// and renamed symbols) can be linked into one ELF without clashing.
#pragma once

#include <stdint.h>

#if defined(__AIENGINE__)

#include <aie_api/aie.hpp>

using bf16_t = bfloat16;

namespace {

// Accumulator-to-bf16 conversions round to nearest-even while a kernel runs; the caller's mode comes back
// when it returns.
class RoundToNearestEven {
public:
  RoundToNearestEven() : saved_(aie::swap_rounding(aie::rounding_mode::conv_even)) {}
  ~RoundToNearestEven() { aie::set_rounding(saved_); }

private:
  aie::rounding_mode saved_;
};

} // namespace

#else

#include <cstring>

using bf16_t = uint16_t;

namespace {

inline float bf16_to_float(bf16_t bits) {
  const uint32_t widened = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof value);
  return value;
}

inline bf16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    return bf16_t((bits >> 16) | 0x0040u); // NaN stays NaN (quiet), whatever its low payload bits
  // Adding 0x7fff plus the lowest kept bit carries into the kept half exactly when the dropped half is
  // above one half, or equal to it with an odd kept half: round half to even. Overflow lands on inf.
  const uint32_t bias = 0x7fffu + ((bits >> 16) & 1u);
  return bf16_t((bits + bias) >> 16);
}

// An fp32 intermediate rounded to bf16 and widened back: a point where HF's bf16 torch ops round mid-formula.
inline float round_to_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

} // namespace

#endif
