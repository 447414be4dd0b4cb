// What the AIE-path source check (kernels/aie_source_check.py) force-includes instead of Peano's <aie2pintrin.h>,
// so that an ordinary x86 clang can type-check kernels/aie2p/*.cc in their __AIENGINE__ path against the real
// aie_api headers. Declarations only: nothing here is compiled into anything.
//
// How exactly each intrinsic is declared:
// - precise: every __builtin_aie2p_* and the intrinsics of PRECISE_INTRINSICS, with the types BuiltinsAIE2P.def
//   gives (aie2p_builtins.h, written by the check from the .def), and the overloads composed from them below;
// - permissive: every other intrinsic aie_api calls (aie2p_permissive.h) takes any arguments.
#pragma once

// llvm-aie's builtin accumulator element types (clang/include/clang/Basic/AIETypes.def: 32, 48, 64 and 32 bits)
// do not exist in upstream clang. Each becomes a distinct builtin type of the same width, so that v16accfloat is
// not v16float and v16acc32 is not v16int32 (aie_api specializes on both): lane counts and sizes are right, but
// accfloat is an integer type here.
typedef wchar_t __acc32;
typedef long long __acc48;
typedef long long __acc64;  // int64_t is `long` on x86-64 Linux, so v16acc64 stays distinct from v16int64
typedef char32_t __accfloat;

#define restrict __restrict
#define INTRINSIC(TYPE) static __inline__ TYPE __attribute__((__always_inline__, __nodebug__))
#define __SIGN_UNSIGNED 0
#define __SIGN_SIGNED 1

// The real llvm-aie headers, in the order aie2pintrin.h includes them.
#include "aie2p/aie2p_enums.h"
#include "aie2p/aie2p_version.h"
#include "aiebase_chess.h"
#include "aiebase_typedefs.h"
#include "aie2p/aie2p_defines.h"
#include "aiebase_resources.h"

#include "llvm-aie/aie2p_aie_api_compat_types.h"

// aie2p_addr.h's address-generator descriptors, with the constructors and members aie_api uses.
struct dims_2d_t {
  unsigned int num1;
  int inc1;
  int inc2;
  addr_t count1;
  dims_2d_t(unsigned int size1, int inc1, int inc2, addr_t count1 = 0)
      : num1(size1), inc1(inc1), inc2(inc2), count1(count1) {}
};
struct dims_3d_t {
  unsigned int num1;
  int inc1;
  unsigned int num2;
  int inc2;
  int inc3;
  addr_t count1;
  addr_t count2;
  dims_3d_t(unsigned int size1, int inc1, unsigned int size2, int inc2, int inc3, addr_t count1 = 0,
            addr_t count2 = 0)
      : num1(size1), inc1(inc1), num2(size2), inc2(inc2), inc3(inc3), count1(count1), count2(count2) {}
};

// The result of a permissive intrinsic: converts to any type and takes part in any operator.
struct __aie_any {
  template <typename T> operator T() const;
  template <typename T> __aie_any operator[](T) const;
  __aie_any operator-() const;
  __aie_any operator~() const;
  __aie_any operator!() const;
};
#define AIE_CHECK_ANY_OPERATOR(op)                                                                                    \
  template <typename T> __aie_any operator op(const __aie_any &, const T &);                                        \
  template <typename T> __aie_any operator op(const T &, const __aie_any &);                                        \
  __aie_any operator op(const __aie_any &, const __aie_any &);
AIE_CHECK_ANY_OPERATOR(+) AIE_CHECK_ANY_OPERATOR(-) AIE_CHECK_ANY_OPERATOR(*) AIE_CHECK_ANY_OPERATOR(/)
AIE_CHECK_ANY_OPERATOR(%) AIE_CHECK_ANY_OPERATOR(&) AIE_CHECK_ANY_OPERATOR(|) AIE_CHECK_ANY_OPERATOR(^)
AIE_CHECK_ANY_OPERATOR(<<) AIE_CHECK_ANY_OPERATOR(>>) AIE_CHECK_ANY_OPERATOR(==) AIE_CHECK_ANY_OPERATOR(!=)
AIE_CHECK_ANY_OPERATOR(<) AIE_CHECK_ANY_OPERATOR(>) AIE_CHECK_ANY_OPERATOR(<=) AIE_CHECK_ANY_OPERATOR(>=)
AIE_CHECK_ANY_OPERATOR(&&) AIE_CHECK_ANY_OPERATOR(||)
#undef AIE_CHECK_ANY_OPERATOR

#define AIE_CHECK_ANY_ARGUMENTS(name) template <typename... Args> __aie_any name(Args &&...);
#define AIE_CHECK_ANY_ARGUMENTS_RETURNING(type, name) template <typename... Args> type name(Args &&...);

#include "aie2p_builtins.h"

// Overloads Peano builds from the 16-lane builtins (llvm-aie aie2p_nlf_vector.h, aie2p_nlf.h), so not in the .def;
// each name's other overloads are in aie2p_builtins.h.
v32bfloat16 exp2(v32accfloat);
v32bfloat16 exp2(v32float);
v32bfloat16 tanh(v32accfloat);
v32bfloat16 tanh(v32float);
int invsqrt(int, int, int);
int inv(int, int, int);

#include "aie2p_permissive.h"
