// The bf16 GEMM kernel's tile sizes (gemm.cc; gemm_int8.cc defaults its own): the builders pass them as -D macros;
// these defaults are what a build without them (a standalone type check) sees.
#pragma once

#ifndef GEMM_TILE_M
#define GEMM_TILE_M 32
#endif
#ifndef GEMM_TILE_K
#define GEMM_TILE_K 32
#endif
#ifndef GEMM_TILE_N
#define GEMM_TILE_N 128
#endif
#ifndef GEMM_DRAIN_N
#define GEMM_DRAIN_N GEMM_TILE_N
#endif
