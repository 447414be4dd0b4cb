// Type definitions from the top of llvm-aie's clang/lib/Headers/aie2p/aie2p_aie_api_compat.h at commit
// 26eb5ce3c12c359302305d743ed6560362755e1f (https://github.com/Xilinx/llvm-aie), copied verbatim between the
// two marker lines below; this comment and the markers are ours. Licensed under the Apache License v2.0 with LLVM
// Exceptions (LICENSE.TXT beside this file); (c) Copyright 2024-2026 Advanced Micro Devices, Inc. or its affiliates.
// The rest of that 220 KB header (intrinsic declarations) is not here: kernels/aie2p_check/aie2p_prelude.h says
// what stands in for it.
#pragma once
// ---- begin verbatim ----
struct acc16 {};
struct acc24 {};
struct acc40 {};
struct acc56 {};

struct cacc16 {};
struct cacc24 {};
struct cacc32 {};
struct cacc40 {};
struct cacc56 {};
struct cacc64 {};

struct v8cint16_compress {};
struct v4cint32_compress {};
struct v8cint32_compress {};
struct v16cint16_compress {};

typedef cint32_t cint32_w64;

struct v2cacc64 {};
struct v4cacc64 {
  v4cacc64(v8cint32);
  operator v8cint32();
};
struct v8cacc64 {};
struct v16cacc64 {};

struct v1cfloat {};
struct v2cfloat {};
struct v4cfloat {};
struct v8cfloat {
  v8cfloat(v8cint32);
};
struct v16cfloat {};

struct v128uint16_sparse {};
struct v256uint8_sparse {};
struct v512uint4_sparse {};

struct v128int16_sparse {};
struct v256int8_sparse {};
struct v512int4_sparse {};

struct v256bfp16ebs16_sparse {};
struct v256bfp16ebs8_sparse {};
struct v128bfp16ebs16_sparse {};
struct v128bfp16ebs8_sparse {};
struct v64bfp16ebs16_sparse {};
struct v64bfp16ebs8_sparse {};

struct bfp16ebs8 {};
struct bfp16ebs16 {};

inline __attribute__((always_inline)) int32_t as_int32(float a) {
  return *(int32_t *)&a;
}
inline __attribute__((always_inline)) long long as_int64(double a) {
  return *(int64_t *)&a;
}
inline __attribute__((always_inline)) float as_float(int a) {
  return *(float *)&a;
}
inline __attribute__((always_inline)) double as_double(long long a) {
  return *(double *)&a;
}
// ---- end verbatim ----
