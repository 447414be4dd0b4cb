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
  longer vector), and ``gemv_q_dequant_bf16(const uint8_t *w, bf16 *out)`` (the rows as bf16 weights)
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
* quantize_rows.o (quantize_rows.cc), configured by QUANT_K, QUANT_CHUNK: the integer GEMMs' activations
  (kernels/int_gemm.py), a row at a time: ``quantize_rows_prepare(const bf16 *x, float *state)`` (the row's scale
  and inverse), ``quantize_rows_chunk(const bf16 *x, const float *state, int32_t *q, int32_t chunk)`` (QUANT_CHUNK
  values of the row as int_gemm's runs)
* gemm_int8.o (gemm_int8.cc), configured by GEMM_TILE_M, GEMM_TILE_N (the accumulator columns: tile_n, or
  2·tile_n for a [gate | up] tile), GEMM_DRAIN_N: ``gemm_int_zero_i32(int32_t *acc)``,
  ``gemm_int_w8x2(const int16_t *a, const int8_t *w, int32_t *acc, float *row_scale, float *col_scale)`` (32 K of
  int16 activations times two int8 weight terms into two int32 accumulators; the windows' scale blocks copied out),
  ``gemm_int_drain_bf16(const int32_t *acc, const float *row_scale, const float *col_scale, bf16 *c)`` and
  ``gemm_int_swiglu_drain_bf16(const int32_t *gate, const int32_t *up, const float *row_scale, const float
  *gate_scale, const float *up_scale, bf16 *c)``; windows and accumulators in the layouts of the source's header
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# ---- what one call computes, for the timing model's reports (kernels/timing.py) -----------------------------
# A call's work is the product of its -D macros, or read off its memref operands when the macros do not say
# it plainly (a pre-tiled GEMM tile whose macro names the timing model should not have to know).
MATMUL_OPERANDS = "matmul operands"  # A, B, C: the first three memrefs; MACs = sqrt(|A|·|B|·|C|), any layout
LAST_OPERAND = "last operand"        # elements of the last memref operand (what the call writes)
# the kinds of work a report sums separately (a bf16 mmul call is reported as mmul_bfp16 under BFP16 emulation)
CALL_KINDS = ("vector_elementwise", "vector_transcendental", "vector_mac", "mmul_bf16", "mmul_int")


@dataclass(frozen=True)
class CallCost:
    """What a kernel symbol's work is, for reports (the timing model times a call by what it executes:
    ``kernels/core_ops.py``): its kind and its work per call, MACs for the matmul kinds, elements for the others."""

    kind: str
    work: tuple[str, ...]  # -D macro names whose product is the work, or (MATMUL_OPERANDS,) / (LAST_OPERAND,)
    factor: int = 1        # the work of one unit of that product (e.g. MACs per output of a call of fixed K)


# A kernel symbol's C arguments, one letter each in order. A memref (a pointer to its L1 buffer): "r" reads it
# whole (exactly the const pointers), "w" writes it whole, "m" reads and then writes it whole, "p" reads and
# writes part of it (a row range, or a partial sum it starts or continues). A scalar: "i" int32_t, "f" float.
MEMREF_ACCESS = "rwmp"
SCALAR_TYPES = "if"


@dataclass(frozen=True)
class KernelSymbol:
    """Everything the package states about one extern "C" entry point: its arguments (the interpreter stages its
    memrefs by their access, the host build types its ctypes call by them), what a call's work is, and, for an
    integer argument that changes what a call executes, its cheapest and dearest values given the -D defines
    (the timing model's two ends, kernels/core_ops.py)."""

    name: str
    arguments: str
    cost: CallCost
    work_arguments: Callable[[dict], tuple[dict, dict]] | None = None

    def __post_init__(self):
        if not self.arguments or set(self.arguments) - set(MEMREF_ACCESS + SCALAR_TYPES):
            raise ValueError(f"{self.name}: arguments {self.arguments!r} must be letters of "
                             f"{MEMREF_ACCESS + SCALAR_TYPES!r}")

    @property
    def access(self) -> str:
        """The memref arguments' access letters, in order."""
        return "".join(a for a in self.arguments if a in MEMREF_ACCESS)


def _symbol(name: str, arguments: str, kind: str, *work: str, work_arguments=None, factor: int = 1) -> KernelSymbol:
    return KernelSymbol(name, arguments, CallCost(kind, work, factor), work_arguments)


@dataclass(frozen=True)
class KernelObject:
    object: str                   # what herds link (link_with)
    source: str                   # file name in the device's kernel folder (kernels/aie2p/)
    entries: tuple[KernelSymbol, ...]
    config_macros: tuple[str, ...]  # the -D tile-size macros a call must set
    optional_macros: tuple[str, ...] = ()  # -D switches a call may add (e.g. a precision mode)

    @property
    def symbols(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)


_GEMV = ("GEMV_ROWS", "GEMV_K")
_ATTENTION_BLOCK = ("ATTN_TQ", "ATTN_TK", "ATTN_HEAD_DIM")


def _full_decode_tile(d):
    """The builders' buckets are whole tiles: a call past the length does nothing, a full tile is the dearest. Both
    ends charge a full tile, so a prediction is that of a full bucket (decode_attention's length = capacity)."""
    return {"length": d["DATTN_TK"], "k_start": 0}, {"length": d["DATTN_TK"], "k_start": 0}


def _first_or_later_k_chunk(d):
    """The first K chunk starts each row's sum, a later one adds to it."""
    return {"k0": 0}, {"k0": d["GEMV_K"]}


def _one_call_k(d):
    """x of one call's K (a launch passes its whole x, a constant the timing model reads from the call)."""
    return {"length": d["GEMV_K"]}, {"length": d["GEMV_K"]}


def _key_block_before_or_on_the_diagonal(d):
    """A key block wholly before the query rows (nothing to mask), or on the diagonal (every row masked)."""
    return {"q_start": d["ATTN_TK"], "k_start": 0}, {"q_start": 0, "k_start": 0}


EXTERNAL_KERNELS = (
    KernelObject("rope.o", "rope_half_split.cc", (
        _symbol("rope_half_split_bf16", "rrw", "vector_elementwise", "ROPE_ROWS", "ROPE_HEADS", "ROPE_HEAD_DIM"),
    ), ("ROPE_ROWS", "ROPE_HEADS", "ROPE_HEAD_DIM")),
    KernelObject("silu_mul.o", "silu_mul.cc", (
        _symbol("silu_mul_bf16", "rrw", "vector_transcendental", "SILU_MUL_LEN"),   # aie::tanh per element
    ), ("SILU_MUL_LEN",)),
    KernelObject("gemv.o", "gemv.cc", (
        _symbol("gemv_bf16", "rrw", "vector_mac", *_GEMV),
        _symbol("gemv_bf16_f32", "rrw", "vector_mac", *_GEMV),
        # the fused decode-FFN entry points (builders/gemv_fused.py)
        _symbol("gemv_partial_f32", "rrpi", "vector_mac", *_GEMV, work_arguments=_first_or_later_k_chunk),
        _symbol("gemv_add_bf16", "rrpii", "vector_elementwise", "GEMV_ROWS"),
        _symbol("gemv_rows_bf16", "rrpi", "vector_mac", *_GEMV),
        _symbol("rmsnorm_bf16", "rwf", "vector_elementwise", "GEMV_K"),
        # reported over the vector it is handed (gate, up and the residual panel): about twice the values it computes
        _symbol("swiglu_bf16", "mi", "vector_transcendental", LAST_OPERAND),
        # the same GEMVs over packed block-quantized rows (GEMV_QUANT), dequantized in the call
        _symbol("gemv_q_bf16", "rrw", "vector_mac", *_GEMV),
        _symbol("gemv_q_bf16_f32", "rrw", "vector_mac", *_GEMV),
        _symbol("gemv_q_partial_f32", "rrpi", "vector_mac", *_GEMV, work_arguments=_first_or_later_k_chunk),
        _symbol("gemv_q_rows_bf16", "rrpi", "vector_mac", *_GEMV),
        # x transposed for them, once per tile entry; reported over the vector it is handed (x, maybe more after it)
        _symbol("gemv_q_prepare_x", "pi", "vector_elementwise", LAST_OPERAND, work_arguments=_one_call_k),
        # packed rows to bf16 weights, GGUF's values rounded once (the prefill GEMMs' weights: builders/dequant.py)
        _symbol("gemv_q_dequant_bf16", "rw", "vector_elementwise", *_GEMV),
    ), _GEMV, ("GEMV_QUANT",)),
    KernelObject("attention.o", "attention.cc", (
        _symbol("attn_init_f32", "www", "vector_elementwise", "ATTN_TQ", "ATTN_HEAD_DIM"),
        _symbol("attn_qk_tile_bf16", "rrwii", "mmul_bf16", *_ATTENTION_BLOCK,  # aie::mmul<8, 8, 8> bf16
                work_arguments=_key_block_before_or_on_the_diagonal),
        _symbol("attn_online_softmax_bf16", "rwmmw", "vector_transcendental", "ATTN_TQ", "ATTN_TK"),  # aie::exp2
        _symbol("attn_pv_accumulate_bf16", "rrrm", "mmul_bf16", *_ATTENTION_BLOCK),
        _symbol("attn_finalize_bf16", "rrw", "vector_elementwise", "ATTN_TQ", "ATTN_HEAD_DIM"),
    ), _ATTENTION_BLOCK),
    # per tile, GROUP x TK x HEAD_DIM MACs for the scores and as many for P.V; scores and probs: a tile past the
    # length returns without writing them
    KernelObject("decode_attention.o", "decode_attention.cc", (
        _symbol("dattn_init_f32", "riiwwwww", "vector_elementwise", "DATTN_GROUP", "DATTN_HEAD_DIM"),
        _symbol("dattn_tile_bf16", "rrppmmmii", "vector_mac", "DATTN_GROUP", "DATTN_TK", "DATTN_HEAD_DIM",
                work_arguments=_full_decode_tile),
        _symbol("dattn_finalize_bf16", "rrw", "vector_elementwise", "DATTN_GROUP", "DATTN_HEAD_DIM"),
    ), ("DATTN_GROUP", "DATTN_TK", "DATTN_HEAD_DIM")),
    # the prefill GEMM kernel: acc += A·Wᵀ through aie::mmul. Its precision ("bf16" exact or "bfp16" emulated) is
    # a per-call -D choice, which the timing model reads from the call (mmul_bf16 → bfp16).
    KernelObject("gemm.o", "gemm.cc", (
        _symbol("gemm_zero_f32", "w", "vector_elementwise", LAST_OPERAND),
        _symbol("gemm_bf16_f32_wnk", "rrm", "mmul_bf16", MATMUL_OPERANDS),
        _symbol("gemm_f32_to_bf16", "rw", "vector_elementwise", LAST_OPERAND),
        _symbol("gemm_f32_swiglu_to_bf16", "rrw", "vector_transcendental", LAST_OPERAND),  # silu_mul.h's aie::tanh
    ), ("GEMM_TILE_M", "GEMM_TILE_K", "GEMM_TILE_N"), ("GEMM_DRAIN_N", "AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16")),
    # the integer GEMMs ("w8x2a16", kernels/int_gemm.py): activations quantized a row at a time, then int16 x int8
    # mmuls (aie::mmul<8, 4, 8, int16, int8>) over two weight terms: a call's MACs are GEMM_TILE_M x GEMM_TILE_N x
    # 32 K x 2 terms
    KernelObject("quantize_rows.o", "quantize_rows.cc", (
        _symbol("quantize_rows_prepare", "rw", "vector_elementwise", "QUANT_K"),
        _symbol("quantize_rows_chunk", "rrwi", "vector_elementwise", "QUANT_CHUNK"),
    ), ("QUANT_K", "QUANT_CHUNK")),
    KernelObject("gemm_int8.o", "gemm_int8.cc", (
        _symbol("gemm_int_zero_i32", "w", "vector_elementwise", LAST_OPERAND),
        _symbol("gemm_int_w8x2", "rrmww", "mmul_int", "GEMM_TILE_M", "GEMM_TILE_N", factor=64),
        _symbol("gemm_int_drain_bf16", "rrrw", "vector_elementwise", LAST_OPERAND),
        _symbol("gemm_int_swiglu_drain_bf16", "rrrrrw", "vector_transcendental", LAST_OPERAND),
    ), ("GEMM_TILE_M", "GEMM_TILE_N", "GEMM_DRAIN_N")),
)

KERNEL_OBJECTS = {k.object: k for k in EXTERNAL_KERNELS}
KERNEL_SYMBOLS = {e.name: e for k in EXTERNAL_KERNELS for e in k.entries}
_OBJECT_OF_SYMBOL = {e.name: k.object for k in EXTERNAL_KERNELS for e in k.entries}


def kernel_symbol(symbol: str) -> KernelSymbol:
    try:
        return KERNEL_SYMBOLS[symbol]
    except KeyError:
        raise KeyError(f"{symbol} is not an external kernel listed in builders/externs.py") from None


def object_for_symbol(symbol: str) -> KernelObject:
    kernel_symbol(symbol)
    return KERNEL_OBJECTS[_OBJECT_OF_SYMBOL[symbol]]


CALL_COSTS = {name: entry.cost for name, entry in KERNEL_SYMBOLS.items()}


def call_cost(symbol: str) -> CallCost:
    return kernel_symbol(symbol).cost
