// A host stand-in for the AIE API that counts the core instructions a kernel's AIE path issues, instead of
// computing anything. kernels/core_ops.py compiles a kernel's __AIENGINE__ path against it with the host compiler
// (and with `float` bound to counted_float, below) and runs one entry point: the tallies are what that call issues.
//
// Vectors hold no data and loads and stores touch no memory; scalar floats keep their values, and integer
// arguments are real, so the kernel's loops and branches run as written.
//
// One count per instruction, by the widths of AIE2P's units and registers:
//   load, store   up to 512 bits each (two 512-bit load units, one 512-bit store unit);
//   move          a broadcast, zeroing, an element read into a scalar register, an accumulator <-> vector register
//                 copy, or an insert/extract of under 256 bits; 256 bits or more name a register (W 256, X 512,
//                 Y 1024 bits) and are free;
//   vector, mac   vector-unit and multiplier operations of up to 32 lanes (the width aie_api's AIE2P code works at:
//                 mac_elem_32, ups_to_v32accfloat, to_v32bfloat16); a transpose is one shuffle per 512 bits (two
//                 for 64 bf16, as aie_api's AIE2P transpose does); a reduction of N lanes is log2(N) shifts and
//                 log2(N) combines (aie_api's reduce), then a move to a scalar register;
//   nonlinear     exp2 and tanh, 16 lanes each (aie_api's native width for them), after a move into an accumulator;
//   scalar_float  a scalar float operation or a float -> bf16 rounding: software-emulated on the core (no scalar FPU).
// aie::mmul calls are recorded by precision and shape, with the distinct operands they see (kernels/core_ops.py
// expands them with what aie_api emits for one call). Exact bf16 8x8x8 is recorded as the two 4x8x8 calls aie_api
// makes of it, on the two halves of A and the same B.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <set>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16) && AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16
#define AIE_COUNT_BFP16 1
#else
#define AIE_COUNT_BFP16 0
#endif

struct bfloat16;
// aie_api's 4-bit element types (global, as aie_api's types.hpp declares them); vectors of them count by 4-bit lanes
struct int4 {};
struct uint4 {};
using int16 = int16_t;

namespace aie_count {

enum Kind : unsigned { Load, Store, Mac, Vector, Move, Nonlinear, ScalarFloat, KindCount };
inline const char *const kKindNames[KindCount] = {"load", "store", "mac", "vector", "move", "nonlinear",
                                                  "scalar_float"};
inline unsigned long long tally[KindCount];
inline unsigned long long next_value = 1;

inline void count(Kind kind, unsigned long long n = 1) { tally[kind] += n; }
inline unsigned long long fresh() { return next_value++; }

constexpr unsigned long long ceil_div(unsigned long long a, unsigned long long b) { return (a + b - 1) / b; }
constexpr unsigned kRegisterBits = 512;
constexpr unsigned kNamedRegisterBits = 256;
constexpr unsigned kLanesPerOp = 32;
constexpr unsigned kNonlinearLanes = 16;

template <typename T> constexpr unsigned element_bits = 8 * sizeof(T);
template <> constexpr unsigned element_bits<bfloat16> = 16;
template <> constexpr unsigned element_bits<int4> = 4;
template <> constexpr unsigned element_bits<uint4> = 4;
template <typename T> constexpr unsigned long long registers(unsigned lanes) {
  return ceil_div(lanes * element_bits<T>, kRegisterBits);
}
constexpr unsigned long long lane_ops(unsigned lanes) { return ceil_div(lanes, kLanesPerOp); }
template <typename T> void piece(unsigned lanes) {
  if (lanes * element_bits<T> < kNamedRegisterBits)
    count(Move);
}

struct MmulUse {
  const char *precision;
  unsigned m, k, n;
  unsigned long long calls = 0;
  std::set<std::pair<unsigned long long, unsigned>> a_operands;
  std::set<unsigned long long> b_operands;
};
inline std::vector<MmulUse> mmul_uses;

inline void record_mmul(const char *precision, unsigned m, unsigned k, unsigned n, unsigned long long a,
                        unsigned a_part, unsigned long long b) {
  for (MmulUse &use : mmul_uses)
    if (!std::strcmp(use.precision, precision) && use.m == m && use.k == k && use.n == n) {
      ++use.calls;
      use.a_operands.insert({a, a_part});
      use.b_operands.insert(b);
      return;
    }
  mmul_uses.push_back(MmulUse{precision, m, k, n});
  record_mmul(precision, m, k, n, a, a_part, b);
}

// One JSON object on stdout: the tallies and the mmul uses.
inline void report() {
  std::printf("{");
  for (unsigned kind = 0; kind < KindCount; ++kind)
    std::printf("\"%s\": %llu, ", kKindNames[kind], tally[kind]);
  std::printf("\"mmul\": [");
  for (unsigned i = 0; i < mmul_uses.size(); ++i) {
    const MmulUse &use = mmul_uses[i];
    std::printf("%s{\"precision\": \"%s\", \"shape\": [%u, %u, %u], \"calls\": %llu, \"a_operands\": %zu, "
                "\"b_operands\": %zu}", i ? ", " : "", use.precision, use.m, use.k, use.n, use.calls,
                use.a_operands.size(), use.b_operands.size());
  }
  std::printf("]}\n");
}

} // namespace aie_count

// A scalar float whose arithmetic is counted (the kernel is compiled with `float` meaning this type). Constant
// expressions are not counted: they are folded by the compiler.
struct counted_float {
  decltype(0.0f) value;

  constexpr counted_float() : value(0) {}
  constexpr counted_float(decltype(0.0f) v) : value(v) {}
  constexpr counted_float(double v) : value(static_cast<decltype(0.0f)>(v)) {}
  constexpr counted_float(int v) : value(static_cast<decltype(0.0f)>(v)) {}
  constexpr counted_float(const bfloat16 &v);

  static constexpr void op() {
    if (!std::is_constant_evaluated())
      aie_count::count(aie_count::ScalarFloat);
  }
  friend constexpr counted_float operator+(counted_float a, counted_float b) { op(); return a.value + b.value; }
  friend constexpr counted_float operator-(counted_float a, counted_float b) { op(); return a.value - b.value; }
  friend constexpr counted_float operator*(counted_float a, counted_float b) { op(); return a.value * b.value; }
  friend constexpr counted_float operator/(counted_float a, counted_float b) { op(); return a.value / b.value; }
  friend constexpr counted_float operator-(counted_float a) { return -a.value; }  // a sign flip: an integer op
  friend constexpr bool operator<(counted_float a, counted_float b) { op(); return a.value < b.value; }
  friend constexpr bool operator>(counted_float a, counted_float b) { op(); return a.value > b.value; }
  friend constexpr bool operator<=(counted_float a, counted_float b) { op(); return a.value <= b.value; }
  friend constexpr bool operator>=(counted_float a, counted_float b) { op(); return a.value >= b.value; }
  constexpr explicit operator int() const { op(); return static_cast<int>(value); }  // a float-to-integer conversion
};

struct bfloat16 {
  decltype(0.0f) value = 0;

  constexpr bfloat16() = default;
  constexpr bfloat16(decltype(0.0f) v) : value(v) {}
  bfloat16(counted_float v) : value(v.value) { aie_count::count(aie_count::ScalarFloat); }  // a rounding
};

constexpr counted_float::counted_float(const bfloat16 &v) : value(v.value) {}  // a shift: free

struct accfloat {};
struct accauto {};
struct acc32 {};

namespace aie {

using aie_count::count;
using aie_count::Kind;

template <typename T, unsigned N> struct vector {
  unsigned long long id = aie_count::fresh();  // which value it holds, for the operand reuse of mmul calls

  template <unsigned M> vector<T, M> extract(unsigned) const {
    aie_count::piece<T>(M);
    return {};
  }
  template <unsigned M> vector &insert(unsigned, const vector<T, M> &) {
    aie_count::piece<T>(M);
    id = aie_count::fresh();
    return *this;
  }
  T get(unsigned) const {
    count(Kind::Move);
    return T{};
  }
  void set(const T &, unsigned) {  // a scalar into one lane
    count(Kind::Move);
    id = aie_count::fresh();
  }
  // copies side by side: under 512 bits, one broadcast of a 128-bit element into a register (aie_api's AIE2P
  // broadcast_elem_128), then register names
  template <unsigned M> vector<T, M> grow_replicate() const {
    if (N * aie_count::element_bits<T> < aie_count::kRegisterBits)
      count(Kind::Move);
    return {};
  }
  // a reinterpretation of the same bits: no instruction
  template <typename U> vector<U, N * aie_count::element_bits<T> / aie_count::element_bits<U>> cast_to() const {
    return {};
  }
};

template <unsigned N> struct mask {};

template <typename Tag, unsigned N> struct accum {
  accum() = default;
  template <typename T> accum(const vector<T, N> &v) { from_vector(v); }

  template <typename T> void from_vector(const vector<T, N> &) {
    if constexpr (std::is_same_v<T, bfloat16>)
      count(Kind::Vector, aie_count::lane_ops(N));  // an upshift into the accumulator
    else
      count(Kind::Move, aie_count::registers<T>(N));
  }
  template <typename T> vector<T, N> to_vector() const {
    if constexpr (std::is_same_v<T, bfloat16>)
      count(Kind::Vector, aie_count::lane_ops(N));  // a rounding conversion
    else
      count(Kind::Move, aie_count::registers<T>(N));
    return {};
  }
};

template <unsigned N, typename T> vector<std::remove_cv_t<T>, N> load_v(const T *) {
  count(Kind::Load, aie_count::registers<std::remove_cv_t<T>>(N));
  return {};
}

template <typename T, unsigned N> void store_v(T *, const vector<T, N> &) {
  count(Kind::Store, aie_count::registers<T>(N));
}

template <typename T, unsigned N, typename U> vector<T, N> broadcast(const U &) {
  count(Kind::Move, aie_count::registers<T>(N));
  return {};
}

template <typename T, unsigned N> auto zeros() {
  if constexpr (std::is_same_v<T, accfloat> || std::is_same_v<T, acc32>) {
    count(Kind::Move, aie_count::registers<decltype(0.0f)>(N));
    return accum<T, N>{};
  } else {
    count(Kind::Move, aie_count::registers<T>(N));
    return vector<T, N>{};
  }
}

template <typename T, unsigned N> vector<T, N> transpose(const vector<T, N> &, unsigned, unsigned) {
  count(Kind::Vector, aie_count::registers<T>(N));
  return {};
}

template <typename T, unsigned N> vector<T, N / 2> filter_even(const vector<T, N> &, unsigned) {
  count(Kind::Vector, aie_count::registers<T>(N / 2));
  return {};
}

template <typename T, unsigned N> vector<T, N / 2> filter_odd(const vector<T, N> &, unsigned) {
  count(Kind::Vector, aie_count::registers<T>(N / 2));
  return {};
}

template <typename Tag, unsigned N, typename B> accum<Tag, N> add(const accum<Tag, N> &, const B &) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}

template <typename Tag, unsigned N, typename B> accum<Tag, N> sub(const accum<Tag, N> &, const B &) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}

template <typename A, typename B, unsigned N> accum<accfloat, N> mul(const vector<A, N> &, const vector<B, N> &) {
  count(Kind::Mac, aie_count::lane_ops(N));
  return {};
}

// fp32 x fp32: AIE2P has no fp32 multiplier; aie_api emulates one with bf16 products (__AIE_API_FP32_EMULATION__).
// Counted as the fewest passes that takes, per 16 lanes (llvm-aie's mul_elem_16_accuracy_low): each operand split
// into a bf16 head and tail (two conversions and a multiply-subtract per operand), then three bf16 multiplies.
template <unsigned N> accum<accfloat, N> mul(const vector<counted_float, N> &, const vector<counted_float, N> &) {
  const unsigned long long passes = aie_count::ceil_div(N, aie_count::kNonlinearLanes);
  count(Kind::Mac, 5 * passes);
  count(Kind::Vector, 4 * passes);
  return {};
}

template <typename Tag, typename A, typename B, unsigned N>
accum<Tag, N> mac(const accum<Tag, N> &, const vector<A, N> &, const vector<B, N> &) {
  count(Kind::Mac, aie_count::lane_ops(N));
  return {};
}

// A scalar factor is broadcast to every lane first (one move), then multiplied as a vector.
template <typename A, unsigned N> accum<accfloat, N> mul(const vector<A, N> &v, const A &) {
  count(Kind::Move);
  return mul(v, vector<A, N>{});
}

template <typename Tag, typename A, unsigned N>
accum<Tag, N> mac(const accum<Tag, N> &acc, const vector<A, N> &v, const A &) {
  count(Kind::Move);
  return mac(acc, v, vector<A, N>{});
}

template <typename T, unsigned N> vector<T, N> max(const vector<T, N> &, const vector<T, N> &) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}

template <typename T, unsigned N> vector<T, N> min(const vector<T, N> &, const vector<T, N> &) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}

// Two halves side by side: free when each names a register (256 bits or more), else a move each.
template <typename T, unsigned N> vector<T, 2 * N> concat(const vector<T, N> &, const vector<T, N> &) {
  aie_count::piece<T>(N);
  aie_count::piece<T>(N);
  return {};
}

// Vector float arithmetic: through the accumulator, one op per 32 lanes.
template <typename T, unsigned N> vector<T, N> add(const vector<T, N> &, const vector<T, N> &) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}
template <typename T, unsigned N> vector<T, N> sub(const vector<T, N> &, const vector<T, N> &) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}

template <typename T, unsigned N> vector<T, N> abs(const vector<T, N> &) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}

// Lanes shifted, the vacated ones filled from a second vector (or left undefined): one shift per 512-bit register
// (aie_api's AIE2P shuffle_up_fill / shuffle_down_fill / shuffle_down: a shift of the two vectors' concatenation).
template <typename T, unsigned N> vector<T, N> shuffle_up_fill(const vector<T, N> &, const vector<T, N> &, unsigned) {
  count(Kind::Vector, aie_count::registers<T>(N));
  return {};
}
template <typename T, unsigned N> vector<T, N> shuffle_down_fill(const vector<T, N> &, const vector<T, N> &, unsigned) {
  count(Kind::Vector, aie_count::registers<T>(N));
  return {};
}
template <typename T, unsigned N> vector<T, N> shuffle_down(const vector<T, N> &, unsigned) {
  count(Kind::Vector, aie_count::registers<T>(N));
  return {};
}

// Integer bit operations and shifts: one vector-unit op per 32 lanes.
template <typename T, unsigned N> vector<T, N> bit_and(const vector<T, N> &, const vector<T, N> &) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}
template <typename T, unsigned N> vector<T, N> bit_or(const vector<T, N> &, const vector<T, N> &) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}
template <typename T, unsigned N> vector<T, N> bit_xor(const vector<T, N> &, const vector<T, N> &) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}
template <typename T, unsigned N> vector<T, N> upshift(const vector<T, N> &, unsigned) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}
template <typename T, unsigned N> vector<T, N> downshift(const vector<T, N> &, unsigned) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}

// Integers to the next wider integer type (4 -> 8, 8 -> 16 bits): one unpack per 512-bit register of the result
// (aie_api's AIE2P vector::unpack_sign calls the unpack intrinsic once per native 512-bit output).
template <typename T> struct wider;
template <> struct wider<uint4> { using type = uint8_t; };
template <> struct wider<int4> { using type = int8_t; };
template <> struct wider<uint8_t> { using type = uint16_t; };
template <> struct wider<int8_t> { using type = int16_t; };
template <typename T, unsigned N> vector<typename wider<T>::type, N> unpack(const vector<T, N> &) {
  count(Kind::Vector, aie_count::registers<typename wider<T>::type>(N));
  return {};
}

// Two vectors' elements interleaved in chunks, returned as two vectors: a shuffle per 512-bit output register
// (aie_api's AIE2P interleave_zip: one shuffle intrinsic per output vector).
template <typename T, unsigned N>
std::pair<vector<T, N>, vector<T, N>> interleave_zip(const vector<T, N> &, const vector<T, N> &, unsigned) {
  count(Kind::Vector, 2 * aie_count::registers<T>(N));
  return {};
}

// Integers to bf16 or float, as aie_api's AIE2P Fix2Float does it (detail/aie2p/elementary.hpp). Up to 16 bits:
// a magic-number constant broadcast (a move), the values upshifted into an integer accumulator, the constant added
// in it and subtracted again in floating point, and the float accumulator converted back (four vector ops per 32
// lanes); 4-bit lanes are first unpacked to 8 bits (one more). int32 (at no fewer than 32 lanes): the high and low
// 16 bits split out (two filters) and widened (two moves), each offset by a magic number and back (four ops), summed.
template <typename TR, typename T, unsigned N> vector<TR, N> to_float(const vector<T, N> &, int = 0) {
  if constexpr (aie_count::element_bits<T> == 32) {
    count(Kind::Vector, 7 * aie_count::lane_ops(N));
    count(Kind::Move, 2 * aie_count::lane_ops(N));
  } else {
    static_assert(aie_count::element_bits<T> <= 16, "the stand-in counts Fix2Float of int32 or up to 16-bit integers");
    count(Kind::Move);
    count(Kind::Vector, 4 * aie_count::lane_ops(N) + (aie_count::element_bits<T> < 8 ? aie_count::lane_ops(N) : 0));
  }
  return {};
}
template <typename T, unsigned N> vector<counted_float, N> to_float(const vector<T, N> &v, int shift = 0) {
  return to_float<counted_float, T, N>(v, shift);  // the kernel's `float`
}

// fp32 -> int8/int16 (Float2Fix, at no fewer than 32 lanes): a magic-number add and subtract, then a shift-round.
template <typename TR, typename T, unsigned N> vector<TR, N> to_fixed(const vector<T, N> &, int = 0) {
  count(Kind::Vector, 3 * aie_count::lane_ops(N));
  return {};
}

template <typename T, unsigned N> T reduce(const vector<T, N> &) {
  unsigned steps = 0;
  for (unsigned lanes = N; lanes > 1; lanes /= 2)
    ++steps;
  count(Kind::Vector, 2 * steps);
  count(Kind::Move);
  return T{};
}
template <typename T, unsigned N> T reduce_max(const vector<T, N> &v) { return reduce(v); }
template <typename T, unsigned N> T reduce_min(const vector<T, N> &v) { return reduce(v); }
template <typename T, unsigned N> T reduce_add(const vector<T, N> &v) { return reduce(v); }

template <typename T, unsigned N> mask<N> ge(const vector<T, N> &, const vector<T, N> &) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}

template <typename T, unsigned N> vector<T, N> select(const vector<T, N> &, const vector<T, N> &, const mask<N> &) {
  count(Kind::Vector, aie_count::lane_ops(N));
  return {};
}

template <typename R, typename T, unsigned N> vector<R, N> nonlinear() {
  const unsigned long long ops = aie_count::ceil_div(N, aie_count::kNonlinearLanes);
  count(Kind::Move, ops);
  count(Kind::Nonlinear, ops);
  return {};
}
template <typename R, typename T, unsigned N> vector<R, N> exp2(const vector<T, N> &) { return nonlinear<R, T, N>(); }
template <typename R, typename T, unsigned N> vector<R, N> tanh(const vector<T, N> &) { return nonlinear<R, T, N>(); }

inline counted_float invsqrt(counted_float x) {
  count(Kind::ScalarFloat);
  return x;
}

enum class rounding_mode { floor, ceil, symmetric_inf, symmetric_zero, conv_even, conv_odd };
inline rounding_mode current_rounding = rounding_mode::floor;
inline rounding_mode swap_rounding(rounding_mode mode) { return std::exchange(current_rounding, mode); }
inline void set_rounding(rounding_mode mode) { current_rounding = mode; }

template <unsigned M, unsigned K, unsigned N, typename TypeA, typename TypeB, typename Acc> struct mmul {
  static constexpr unsigned size_A = M * K;
  static constexpr unsigned size_B = K * N;
  static constexpr unsigned size_C = M * N;

  mmul() = default;
  template <typename T> mmul(const vector<T, size_C> &) { count(Kind::Move, aie_count::registers<T>(size_C)); }
  mmul(const accum<accfloat, size_C> &) {}

  template <typename A, typename B> void mac(const A &a, const B &b) { use(a, b); }
  template <typename A, typename B> void mul(const A &a, const B &b) { use(a, b); }

  template <typename T> vector<T, size_C> to_vector() const {
    count(Kind::Move, aie_count::registers<T>(size_C));
    return {};
  }

private:
  template <typename A, typename B> static void use(const A &a, const B &b) {
    if constexpr (std::is_integral_v<TypeA>) {  // integer mmuls: "int8" (int8 x int8), "int16x8" (int16 x int8)
      aie_count::record_mmul(sizeof(TypeA) == 1 ? "int8" : "int16x8", M, K, N, a.id, 0, b.id);
    } else if (!AIE_COUNT_BFP16 && M == 8) {
      aie_count::record_mmul("bf16", 4, K, N, a.id, 0, b.id);
      aie_count::record_mmul("bf16", 4, K, N, a.id, 1, b.id);
    } else {
      aie_count::record_mmul(AIE_COUNT_BFP16 ? "bfp16" : "bf16", M, K, N, a.id, 0, b.id);
    }
  }
};

} // namespace aie
