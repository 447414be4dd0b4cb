// A host stand-in for the part of the AIE API that the kernels of kernels/aie2p call (the exact bf16
// block products of kernels/aie2p/bf16_blocks.h among it), computing values instead of counting instructions (kernels/aie_count counts
// them), so tests can run a kernel's __AIENGINE__ path on the host and compare it with its scalar path.
//
// Each operation does what aie_api's documentation says it does (github:Xilinx/aie_api): transpose reads its input
// as a Row x Col row-major matrix and returns the transpose; grow_replicate repeats the vector to fill the larger
// one; extract/insert take the idx-th piece of the given width; select(a, b, m) takes b where m is set;
// filter_even keeps the even groups of `step` values; mmul<M, K, N> multiplies a row-major M x K A by a row-major
// K x N B into a row-major M x N C; to_float(v, shift) is v * 2^-shift; downshift is arithmetic; interleave_zip
// alternates chunks of its inputs into its two outputs; shuffle_up_fill/shuffle_down_fill shift by n and fill from
// the second vector's top/bottom; a 4-bit vector's element 2i is byte i's low nibble (an
// assumption the kernels' layouts share), and reduce_add folds halves (the order the kernels' host paths use,
// gemv.cc's header). Arithmetic follows the core's: a bf16 x bf16 product
// is exact in the fp32 accumulator, a multiply-accumulate rounds the sum to fp32, and accumulator -> bf16 rounds to
// nearest even (the mode the kernels set), integer accumulators sum exactly (the kernels keep their sums within
// int32), and fp32 x fp32 products are IEEE's (aie_api emulates them with bf16 products on AIE2P: whether that
// emulation rounds as IEEE does is not modelled). exp2 and tanh are the host's, rounded to bf16: the core's are not
// modelled, so only results that do not pass through them are compared. Only what those kernels call is here.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

struct bfloat16 {
  float value = 0.0f;  // always a bf16 value

  bfloat16() = default;
  bfloat16(float v) : value(round(v)) {}
  operator float() const { return value; }

  static float round(float v) {  // to nearest even, as the kernels' host path (npu2_kernel.h)
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
};

struct accfloat {};
struct acc32 {};
// aie_api's 4-bit element types: a vector of them holds values, loaded from and stored to packed nibbles
struct int4 {
  int8_t value = 0;
  operator int() const { return value; }
};
struct uint4 {
  uint8_t value = 0;
  operator int() const { return value; }
};
using int16 = int16_t;

namespace aie {

template <typename T, unsigned N> struct vector {
  std::array<T, N> data{};

  template <unsigned M> vector<T, M> extract(unsigned idx) const {
    vector<T, M> out;
    for (unsigned i = 0; i < M; ++i)
      out.data[i] = data[idx * M + i];
    return out;
  }
  T get(unsigned i) const { return data[i]; }
  void set(const T &value, unsigned i) { data[i] = value; }
  template <unsigned M> vector &insert(unsigned idx, const vector<T, M> &piece) {
    for (unsigned i = 0; i < M; ++i)
      data[idx * M + i] = piece.data[i];
    return *this;
  }
  // the same bits as another element type (bfloat16, held here as a float, by its 16-bit pattern)
  template <typename U> auto cast_to() const {
    if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<U, bfloat16>) {
      static_assert(sizeof(T) == 2 || sizeof(U) == 2, "bf16 casts to and from 16-bit integers only");
      vector<U, N> out;
      for (unsigned i = 0; i < N; ++i) {
        if constexpr (std::is_same_v<T, bfloat16>) {
          uint32_t bits;
          std::memcpy(&bits, &data[i].value, sizeof bits);
          out.data[i] = U(int16_t(bits >> 16));
        } else {
          const uint32_t bits = uint32_t(uint16_t(data[i])) << 16;
          std::memcpy(&out.data[i].value, &bits, sizeof bits);
        }
      }
      return out;
    } else {
      vector<U, N * sizeof(T) / sizeof(U)> out;
      std::memcpy(out.data.data(), data.data(), sizeof data);
      return out;
    }
  }
  template <unsigned M> vector<T, M> grow_replicate() const {
    vector<T, M> out;
    for (unsigned i = 0; i < M; ++i)
      out.data[i] = data[i % N];
    return out;
  }
};

template <typename Tag, unsigned N> struct accum {
  using value_type = std::conditional_t<std::is_same_v<Tag, acc32>, int64_t, float>;  // integer sums stay exact
  std::array<value_type, N> data{};

  accum() = default;
  template <typename T> accum(const vector<T, N> &v) { from_vector(v); }
  template <typename T> void from_vector(const vector<T, N> &v) {
    for (unsigned i = 0; i < N; ++i)
      data[i] = value_type(v.data[i]);
  }
  template <typename T> vector<T, N> to_vector() const {
    vector<T, N> out;
    for (unsigned i = 0; i < N; ++i)
      out.data[i] = T(data[i]);
    return out;
  }
};

template <unsigned N, typename T> vector<std::remove_cv_t<T>, N> load_v(const T *p) {
  vector<std::remove_cv_t<T>, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = p[i];
  return out;
}

template <unsigned N> vector<uint4, N> load_v(const uint4 *p) {
  const uint8_t *bytes = reinterpret_cast<const uint8_t *>(p);
  vector<uint4, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i].value = (bytes[i / 2] >> (4 * (i % 2))) & 15;
  return out;
}

template <unsigned N> vector<int4, N> load_v(const int4 *p) {
  const uint8_t *bytes = reinterpret_cast<const uint8_t *>(p);
  vector<int4, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i].value = int8_t(((bytes[i / 2] >> (4 * (i % 2))) & 15) << 4) >> 4;  // sign-extended
  return out;
}

template <typename T, unsigned N> void store_v(T *p, const vector<T, N> &v) {
  for (unsigned i = 0; i < N; ++i)
    p[i] = v.data[i];
}

template <typename T, unsigned N> auto zeros() {
  if constexpr (std::is_same_v<T, accfloat> || std::is_same_v<T, acc32>)
    return accum<T, N>{};
  else
    return vector<T, N>{};
}

template <typename T, unsigned N, typename U> vector<T, N> broadcast(const U &value) {
  vector<T, N> out;
  out.data.fill(T(value));
  return out;
}

template <typename T, unsigned N> vector<T, 2 * N> concat(const vector<T, N> &a, const vector<T, N> &b) {
  vector<T, 2 * N> out;
  for (unsigned i = 0; i < N; ++i) {
    out.data[i] = a.data[i];
    out.data[N + i] = b.data[i];
  }
  return out;
}

template <typename T, unsigned N> vector<T, N / 2> filter_even(const vector<T, N> &v, unsigned step) {
  vector<T, N / 2> out;
  for (unsigned i = 0, o = 0; i < N; i += 2 * step)
    for (unsigned j = 0; j < step; ++j)
      out.data[o++] = v.data[i + j];
  return out;
}

template <typename R, typename T, unsigned N> vector<R, N> to_float(const vector<T, N> &v, int shift = 0) {
  vector<R, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = R(std::ldexp(float(int(v.data[i])), -shift));  // rounded once, then scaled exactly
  return out;
}

template <typename T, unsigned N> vector<T, N> add(const vector<T, N> &a, const vector<T, N> &b) {
  vector<T, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = T(a.data[i] + b.data[i]);
  return out;
}

template <unsigned N> accum<accfloat, N> mul(const vector<bfloat16, N> &a, bfloat16 b) {
  return mul(a, broadcast<bfloat16, N>(b));
}

template <unsigned N> accum<accfloat, N> mac(const accum<accfloat, N> &acc, const vector<bfloat16, N> &a, bfloat16 b) {
  return mac(acc, a, broadcast<bfloat16, N>(b));
}

template <unsigned N> accum<accfloat, N> add(const accum<accfloat, N> &a, const accum<accfloat, N> &b) {
  accum<accfloat, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = a.data[i] + b.data[i];
  return out;
}

template <typename T, unsigned N> vector<T, N> min(const vector<T, N> &a, const vector<T, N> &b) {
  vector<T, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = a.data[i] <= b.data[i] ? a.data[i] : b.data[i];
  return out;
}

#define AIE_VALUES_BITWISE(name, op)                                                                                 \
  template <typename T, unsigned N> vector<T, N> name(const vector<T, N> &a, const vector<T, N> &b) {                \
    vector<T, N> out;                                                                                                \
    for (unsigned i = 0; i < N; ++i)                                                                                 \
      out.data[i] = T(a.data[i] op b.data[i]);                                                                       \
    return out;                                                                                                      \
  }
AIE_VALUES_BITWISE(bit_and, &)
AIE_VALUES_BITWISE(bit_or, |)
AIE_VALUES_BITWISE(bit_xor, ^)
#undef AIE_VALUES_BITWISE

template <typename T, unsigned N> vector<T, N> upshift(const vector<T, N> &v, unsigned shift) {
  vector<T, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = T(std::make_unsigned_t<T>(v.data[i]) << shift);
  return out;
}

template <typename T, unsigned N> vector<T, N> downshift(const vector<T, N> &v, unsigned shift) {
  vector<T, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = T(v.data[i] >> shift);  // arithmetic for signed types
  return out;
}

template <unsigned N> vector<uint8_t, N> unpack(const vector<uint4, N> &v) {
  vector<uint8_t, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = v.data[i].value;
  return out;
}

template <typename T, unsigned N>
std::pair<vector<T, N>, vector<T, N>> interleave_zip(const vector<T, N> &v, const vector<T, N> &w, unsigned chunk) {
  std::array<T, 2 * N> out;
  for (unsigned i = 0, o = 0; i < N; i += chunk)
    for (const vector<T, N> *in : {&v, &w})
      for (unsigned j = 0; j < chunk; ++j)
        out[o++] = in->data[i + j];
  std::pair<vector<T, N>, vector<T, N>> halves;
  for (unsigned i = 0; i < N; ++i) {
    halves.first.data[i] = out[i];
    halves.second.data[i] = out[N + i];
  }
  return halves;
}

template <typename T, unsigned N> vector<T, N / 2> filter_odd(const vector<T, N> &v, unsigned step) {
  vector<T, N / 2> out;
  for (unsigned i = step, o = 0; i < N; i += 2 * step)
    for (unsigned j = 0; j < step; ++j)
      out.data[o++] = v.data[i + j];
  return out;
}

template <typename T, unsigned N> T reduce_add(const vector<T, N> &v) {
  std::array<T, N> lanes = v.data;
  for (unsigned half = N / 2; half > 0; half /= 2)
    for (unsigned i = 0; i < half; ++i)
      lanes[i] = T(lanes[i] + lanes[i + half]);
  return lanes[0];
}

template <typename T, unsigned N> T reduce_max(const vector<T, N> &v) {
  T out = v.data[0];
  for (unsigned i = 1; i < N; ++i)
    out = float(v.data[i]) > float(out) ? v.data[i] : out;
  return out;
}

template <typename T, unsigned N> T reduce_min(const vector<T, N> &v) {
  T out = v.data[0];
  for (unsigned i = 1; i < N; ++i)
    out = float(v.data[i]) < float(out) ? v.data[i] : out;
  return out;
}

template <typename T, unsigned N> vector<T, N> sub(const vector<T, N> &a, const vector<T, N> &b) {
  vector<T, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = T(a.data[i] - b.data[i]);
  return out;
}

template <typename T, unsigned N> vector<T, N> shuffle_up_fill(const vector<T, N> &v, const vector<T, N> &fill,
                                                               unsigned n) {
  vector<T, N> out;
  for (unsigned i = 0; i < N - n; ++i)
    out.data[i + n] = v.data[i];
  for (unsigned i = 0; i < n; ++i)
    out.data[i] = fill.data[i + N - n];
  return out;
}

template <typename T, unsigned N> vector<T, N> shuffle_down_fill(const vector<T, N> &v, const vector<T, N> &fill,
                                                                 unsigned n) {
  vector<T, N> out;
  for (unsigned i = 0; i < N - n; ++i)
    out.data[i] = v.data[i + n];
  for (unsigned i = 0; i < n; ++i)
    out.data[i + N - n] = fill.data[i];
  return out;
}

template <typename T, unsigned N> vector<T, N> shuffle_down(const vector<T, N> &v, unsigned n) {
  vector<T, N> out;  // the new top elements are undefined in aie_api: zeros here
  for (unsigned i = 0; i < N - n; ++i)
    out.data[i] = v.data[i + n];
  return out;
}

template <typename R, unsigned N> vector<R, N> to_fixed(const vector<float, N> &v, int shift = 0) {
  vector<R, N> out;  // the kernels convert integer values only: no rounding mode to model
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = R(std::nearbyint(std::ldexp(v.data[i], shift)));
  return out;
}

inline float invsqrt(float x) { return 1.0f / std::sqrt(x); }  // the core's is not modelled

template <unsigned N> accum<accfloat, N> mul(const vector<float, N> &a, const vector<float, N> &b) {
  accum<accfloat, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = a.data[i] * b.data[i];
  return out;
}

template <unsigned M, unsigned K, unsigned N, typename TypeA, typename TypeB, typename Acc> struct mmul {
  static constexpr unsigned size_A = M * K, size_B = K * N, size_C = M * N;
  std::array<int64_t, size_C> data{};

  mmul() = default;
  template <typename T> mmul(const vector<T, size_C> &v) {
    for (unsigned i = 0; i < size_C; ++i)
      data[i] = v.data[i];
  }
  void mac(const vector<TypeA, size_A> &a, const vector<TypeB, size_B> &b) {
    for (unsigned m = 0; m < M; ++m)
      for (unsigned n = 0; n < N; ++n)
        for (unsigned k = 0; k < K; ++k)
          data[m * N + n] += int64_t(a.data[m * K + k]) * int64_t(b.data[k * N + n]);
  }
  template <typename T> vector<T, size_C> to_vector() const {
    static_assert(std::is_same_v<Acc, acc32> && std::is_same_v<T, int32_t>, "only acc32 to int32 is modelled");
    vector<T, size_C> out;
    for (unsigned i = 0; i < size_C; ++i)
      out.data[i] = T(data[i]);  // the kernels' sums fit in int32
    return out;
  }
};

template <typename T, unsigned N> vector<T, N> transpose(const vector<T, N> &v, unsigned rows, unsigned cols) {
  vector<T, N> out;
  for (unsigned r = 0; r < rows; ++r)
    for (unsigned c = 0; c < cols; ++c)
      out.data[c * rows + r] = v.data[r * cols + c];
  return out;
}

template <unsigned N> accum<accfloat, N> mul(const vector<bfloat16, N> &a, const vector<bfloat16, N> &b) {
  accum<accfloat, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = float(a.data[i]) * float(b.data[i]);
  return out;
}

template <unsigned N>
accum<accfloat, N> mac(const accum<accfloat, N> &acc, const vector<bfloat16, N> &a, const vector<bfloat16, N> &b) {
  accum<accfloat, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = acc.data[i] + float(a.data[i]) * float(b.data[i]);
  return out;
}

template <typename Tag, unsigned N, typename T> accum<Tag, N> add(const accum<Tag, N> &acc, const vector<T, N> &v) {
  accum<Tag, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = acc.data[i] + typename accum<Tag, N>::value_type(v.data[i]);
  return out;
}

template <unsigned N, typename V> accum<accfloat, N> sub(const accum<accfloat, N> &acc, const V &v) {
  accum<accfloat, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = acc.data[i] - float(v.data[i]);
  return out;
}

template <unsigned N> struct mask {
  std::array<bool, N> set{};
};

template <typename T, unsigned N> mask<N> ge(const vector<T, N> &a, const vector<T, N> &b) {
  mask<N> out;
  for (unsigned i = 0; i < N; ++i)
    out.set[i] = float(a.data[i]) >= float(b.data[i]);
  return out;
}

template <typename T, unsigned N> vector<T, N> select(const vector<T, N> &a, const vector<T, N> &b, const mask<N> &m) {
  vector<T, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = m.set[i] ? b.data[i] : a.data[i];
  return out;
}

template <typename T, unsigned N> vector<T, N> max(const vector<T, N> &a, const vector<T, N> &b) {
  vector<T, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = float(a.data[i]) >= float(b.data[i]) ? a.data[i] : b.data[i];
  return out;
}

template <typename R, unsigned N> vector<R, N> exp2(const vector<float, N> &v) {
  vector<R, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = R(std::exp2(v.data[i]));
  return out;
}

template <typename R, unsigned N> vector<R, N> tanh(const vector<float, N> &v) {
  vector<R, N> out;
  for (unsigned i = 0; i < N; ++i)
    out.data[i] = R(std::tanh(v.data[i]));
  return out;
}

enum class rounding_mode { floor, conv_even };
inline rounding_mode current_rounding = rounding_mode::floor;
inline rounding_mode swap_rounding(rounding_mode mode) { return std::exchange(current_rounding, mode); }
inline void set_rounding(rounding_mode mode) { current_rounding = mode; }

} // namespace aie
