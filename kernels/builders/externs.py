"""The external AIE2P C++ kernels the builders call: objects, sources, symbols and compile-time configuration.

This mirrors the contract written in ``kernels/aie2p/*.cc`` (their header comments are the reference for
semantics). Tile sizes there are compile-time macros, not arguments: a builder that calls a kernel also
states the ``-D`` configuration its object must be built with (``ExternDecl.defines``), and the stitcher
builds one object per distinct configuration, renaming the symbols of every configuration after the
first (``-D<symbol>=<symbol>_v<n>``). A memref reaches C as a bare pointer to its L1 buffer.

* rope.o (rope_half_split.cc), configured by ROPE_ROWS, ROPE_HEADS, ROPE_HEAD_DIM:
  ``rope_half_split_bf16(const bf16 *x, const bf16 *lut, bf16 *y)``
* silu_mul.o (silu_mul.cc), configured by SILU_MUL_LEN:
  ``silu_mul_bf16(const bf16 *gate, const bf16 *up, bf16 *out)``
* gemv.o (gemv.cc), configured by GEMV_ROWS, GEMV_K:
  ``gemv_bf16(const bf16 *w, const bf16 *x, bf16 *y)`` and, for the LM head's fp32 logits,
  ``gemv_bf16_f32(const bf16 *w, const bf16 *x, float *y)``; for the fused decode FFN (gemv_fused.py)
  ``gemv_partial_f32(const bf16 *w, const bf16 *x, float *acc, int32_t k0)``,
  ``gemv_add_bf16(const float *acc, const bf16 *residual, bf16 *y, int32_t residual_row0, int32_t row0)``,
  ``gemv_rows_bf16(const bf16 *w, const bf16 *x, bf16 *y, int32_t row0)``,
  ``rmsnorm_bf16(const bf16 *x_and_weight, bf16 *out, float eps)`` and ``swiglu_bf16(bf16 *gate_up, int32_t n)``;
  over packed block-quantized rows (kernels/quant.py; the format by the optional GEMV_QUANT: 40 Q4_0, 41 Q4_1,
  80 Q8_0) ``gemv_q_bf16``, ``gemv_q_bf16_f32``, ``gemv_q_partial_f32`` and ``gemv_q_rows_bf16``, the same
  signatures with ``const uint8_t *w``, reading x as ``gemv_q_prepare_x(bf16 *x, int32_t length)`` leaves it
  (transposed in place per 1024-element group when GEMV_K is a multiple of 1024; x alone, or at the head of a
  longer vector)
* attention.o (attention.cc), configured by ATTN_TQ, ATTN_TK, ATTN_HEAD_DIM:
  ``attn_init_f32(float *row_max, float *row_sum, float *acc)``,
  ``attn_qk_tile_bf16(const bf16 *q, const bf16 *kv, float *scores, int32_t q_start, int32_t k_start)``,
  ``attn_online_softmax_bf16(const float *scores, bf16 *probs, float *row_max, float *row_sum,
  float *row_scale)``, ``attn_pv_accumulate_bf16(const bf16 *probs, const bf16 *kv, const float *row_scale,
  float *acc)``, ``attn_finalize_bf16(const float *acc, const float *row_sum, bf16 *out)``; ``kv`` is one
  block of keys followed by the values of the same positions
* decode_attention.o (decode_attention.cc), configured by DATTN_GROUP, DATTN_TK, DATTN_HEAD_DIM:
  ``dattn_init_f32(const bf16 *queries, int32_t groups, int32_t group, bf16 *q, float *row_max, float *row_sum,
  float *acc, int32_t *cursor)`` (takes its group's query rows and decodes the length digits that follow
  ``groups`` groups' rows), ``dattn_tile_bf16(const bf16 *q, const bf16 *kv, float *scores, bf16 *probs,
  float *row_max, float *row_sum, float *acc, int32_t length, int32_t k_start)`` (one tile of one KV head's keys,
  then its values; positions at or past ``length`` are never read), ``dattn_finalize_bf16(const float *acc,
  const float *row_sum, bf16 *out)``
* gemm.o (gemm.cc), configured by GEMM_TILE_M, GEMM_TILE_K, GEMM_TILE_N, and optionally GEMM_DRAIN_N (columns
  per drain call) and AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16 (BFP16 multiplies instead of exact bf16):
  ``gemm_zero_f32(float *acc)``, ``gemm_bf16_f32_wnk(const bf16 *a, const bf16 *w, float *acc)`` (acc += A·Wᵀ,
  W in (N, K) layout), ``gemm_f32_to_bf16(const float *acc, bf16 *c)``; every operand pre-tiled into 8×8 blocks
  (A [k/8][m/8][8][8], W [k/8][n/8][8][8], acc and c [n/8][m/8][8][8])
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelObject:
    object: str                   # what herds link (link_with)
    source: str                   # file name under kernels/aie2p/
    symbols: tuple[str, ...]
    config_macros: tuple[str, ...]  # the -D tile-size macros a call must set
    optional_macros: tuple[str, ...] = ()  # -D switches a call may add (e.g. a precision mode)


EXTERNAL_KERNELS = (
    KernelObject("rope.o", "rope_half_split.cc", ("rope_half_split_bf16",),
                 ("ROPE_ROWS", "ROPE_HEADS", "ROPE_HEAD_DIM")),
    KernelObject("silu_mul.o", "silu_mul.cc", ("silu_mul_bf16",), ("SILU_MUL_LEN",)),
    KernelObject("gemv.o", "gemv.cc", ("gemv_bf16", "gemv_bf16_f32", "gemv_partial_f32", "gemv_add_bf16",
                                       "gemv_rows_bf16", "rmsnorm_bf16", "swiglu_bf16", "gemv_q_bf16",
                                       "gemv_q_bf16_f32", "gemv_q_partial_f32", "gemv_q_rows_bf16",
                                       "gemv_q_prepare_x"),
                 ("GEMV_ROWS", "GEMV_K"), ("GEMV_QUANT",)),
    KernelObject("attention.o", "attention.cc",
                 ("attn_init_f32", "attn_qk_tile_bf16", "attn_online_softmax_bf16", "attn_pv_accumulate_bf16",
                  "attn_finalize_bf16"),
                 ("ATTN_TQ", "ATTN_TK", "ATTN_HEAD_DIM")),
    KernelObject("decode_attention.o", "decode_attention.cc",
                 ("dattn_init_f32", "dattn_tile_bf16", "dattn_finalize_bf16"),
                 ("DATTN_GROUP", "DATTN_TK", "DATTN_HEAD_DIM")),
    KernelObject("gemm.o", "gemm.cc", ("gemm_zero_f32", "gemm_bf16_f32_wnk", "gemm_f32_to_bf16",
                                       "gemm_f32_swiglu_to_bf16"),
                 ("GEMM_TILE_M", "GEMM_TILE_K", "GEMM_TILE_N"),
                 ("GEMM_DRAIN_N", "AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16")),
)

KERNEL_OBJECTS = {k.object: k for k in EXTERNAL_KERNELS}
_OBJECT_OF_SYMBOL = {name: k.object for k in EXTERNAL_KERNELS for name in k.symbols}


def object_for_symbol(symbol: str) -> KernelObject:
    try:
        return KERNEL_OBJECTS[_OBJECT_OF_SYMBOL[symbol]]
    except KeyError:
        raise KeyError(f"{symbol} is not an external kernel listed in builders/externs.py") from None


# ---- what one call computes, for the timing model's reports (kernels/timing.py) -----------------------------
# A call's work is the product of its -D macros, or read off its memref operands when the macros do not say
# it plainly (a pre-tiled GEMM tile whose macro names the timing model should not have to know).
MATMUL_OPERANDS = "matmul operands"  # A, B, C: the first three memrefs; MACs = sqrt(|A|·|B|·|C|), any layout
LAST_OPERAND = "last operand"        # elements of the last memref operand (what the call writes)


@dataclass(frozen=True)
class CallCost:
    """What a kernel symbol's work is, for reports (the timing model times a call by what it executes:
    ``kernels/core_ops.py``): its kind and its work per call, MACs for the matmul kinds, elements for the others."""

    kind: str
    work: tuple[str, ...]  # -D macro names whose product is the work, or (MATMUL_OPERANDS,) / (LAST_OPERAND,)


_ATTENTION_BLOCK = ("ATTN_TQ", "ATTN_TK", "ATTN_HEAD_DIM")
CALL_COSTS = {
    "rope_half_split_bf16": CallCost("vector_elementwise", ("ROPE_ROWS", "ROPE_HEADS", "ROPE_HEAD_DIM")),
    "silu_mul_bf16": CallCost("vector_transcendental", ("SILU_MUL_LEN",)),   # aie::tanh per element
    "gemv_bf16": CallCost("vector_mac", ("GEMV_ROWS", "GEMV_K")),
    "gemv_bf16_f32": CallCost("vector_mac", ("GEMV_ROWS", "GEMV_K")),
    "attn_init_f32": CallCost("vector_elementwise", ("ATTN_TQ", "ATTN_HEAD_DIM")),
    "attn_qk_tile_bf16": CallCost("mmul_bf16", _ATTENTION_BLOCK),              # aie::mmul<8, 8, 8> bf16
    "attn_online_softmax_bf16": CallCost("vector_transcendental", ("ATTN_TQ", "ATTN_TK")),  # aie::exp2
    "attn_pv_accumulate_bf16": CallCost("mmul_bf16", _ATTENTION_BLOCK),
    "attn_finalize_bf16": CallCost("vector_elementwise", ("ATTN_TQ", "ATTN_HEAD_DIM")),
    # decode_attention.o: per tile, GROUP x TK x HEAD_DIM MACs for the scores and as many for P.V
    "dattn_init_f32": CallCost("vector_elementwise", ("DATTN_GROUP", "DATTN_HEAD_DIM")),
    "dattn_tile_bf16": CallCost("vector_mac", ("DATTN_GROUP", "DATTN_TK", "DATTN_HEAD_DIM")),
    "dattn_finalize_bf16": CallCost("vector_elementwise", ("DATTN_GROUP", "DATTN_HEAD_DIM")),
    # gemm.o (gemm.cc), the prefill GEMM kernel: acc += A·Wᵀ through aie::mmul. Its precision ("bf16" exact or
    # "bfp16" emulated) is a per-call -D choice, which the timing model reads from the call (mmul_bf16 → bfp16).
    "gemm_zero_f32": CallCost("vector_elementwise", (LAST_OPERAND,)),
    "gemm_bf16_f32_wnk": CallCost("mmul_bf16", (MATMUL_OPERANDS,)),
    "gemm_f32_to_bf16": CallCost("vector_elementwise", (LAST_OPERAND,)),
    "gemm_f32_swiglu_to_bf16": CallCost("vector_transcendental", (LAST_OPERAND,)),  # silu_mul.h's aie::tanh
    # gemv.o's fused decode-FFN entry points (builders/gemv_fused.py).
    "gemv_partial_f32": CallCost("vector_mac", ("GEMV_ROWS", "GEMV_K")),
    "gemv_rows_bf16": CallCost("vector_mac", ("GEMV_ROWS", "GEMV_K")),
    "gemv_add_bf16": CallCost("vector_elementwise", ("GEMV_ROWS",)),
    "rmsnorm_bf16": CallCost("vector_elementwise", ("GEMV_K",)),
    # Reported over the vector it is handed (gate, up and the residual panel): about twice the values it computes.
    "swiglu_bf16": CallCost("vector_transcendental", (LAST_OPERAND,)),
    # the same GEMVs over packed block-quantized rows (GEMV_QUANT), dequantized in the call
    "gemv_q_bf16": CallCost("vector_mac", ("GEMV_ROWS", "GEMV_K")),
    "gemv_q_bf16_f32": CallCost("vector_mac", ("GEMV_ROWS", "GEMV_K")),
    "gemv_q_partial_f32": CallCost("vector_mac", ("GEMV_ROWS", "GEMV_K")),
    "gemv_q_rows_bf16": CallCost("vector_mac", ("GEMV_ROWS", "GEMV_K")),
    # x transposed for them, once per tile entry; reported over the vector it is handed (x, maybe more after it)
    "gemv_q_prepare_x": CallCost("vector_elementwise", (LAST_OPERAND,)),
}


def call_cost(symbol: str) -> CallCost:
    try:
        return CALL_COSTS[symbol]
    except KeyError:
        raise KeyError(f"{symbol} has no CallCost in builders/externs.py CALL_COSTS") from None
