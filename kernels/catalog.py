"""The catalogue of fused-op Programs: one factory per ``torch.ops.npu2`` op (``<op>_program``), parametrized
by model dims and sequence length.

Weights keep HuggingFace's ``nn.Linear`` layout ``(out_features, in_features)`` in every Program: the
prefill GEMM computes ``x @ W.T`` with W's contiguous rows as its K dimension, and the decode GEMV reads
the same rows, so one buffer per weight serves prefill and decode (no transposed second copy), and the
model's own parameters can be views of that buffer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import int_gemm
from .device import DEVICE
from .program import DTYPE_BYTES, Arg, CompileOptions, Launch, Program, Role, View
from .quant import FORMATS, weight_format

W, I, S, O = Role.WEIGHT, Role.INPUT, Role.SCRATCH, Role.OUTPUT

# aircc options per Program, from upstream llama32_1b's presets (mlir-air llms/shared/infra/backend_presets.py
# and llama32_1b_prefill.py): [2, 2] runtime loop tiling for the prefill ELFs, [16, 16] for the decode GEMV
# ELFs, [1, 1] for attention. aircc's default [4, 4] would fold more launch steps into each
# shim BD task, but with it air-opt-shim-dma-bds does not finish on the vectorized GEMM's down projection
# (M=1024, K=8192, N=2048: killed after 15 min; 1.0 s at [2, 2]), and Llama-3.2-1B's o_ffn at 2048 lowers in
# 126 s at [2, 2] (measured with lower_to_npu_insts). One departure: upstream's o_gemv_ffn omits ping-pong because
# its K=8192 GEMV does not fit L1 twice; ours plans its tiles with the ping-pong copies counted, so it keeps
# double buffering.
PREFILL_OPTIONS = CompileOptions(runtime_loop_tiling_sizes=(2, 2))
# Below this many rows a prefill GEMM's herd has one column of tiles, so AIR keeps gemm_swiglu's W slices whole:
# their 4-D DDR window then takes a shim BD per K step, more than a shim tile has (Llama-3.2-1B at 16 rows).
# o_ffn there runs the gate and up GEMMs and silu_mul as three launches.
FUSED_SWIGLU_MIN_ROWS = 32
# Upstream's preset also omits ping-pong for attention; ours keeps it, for the key/value blocks only
# (builders/attention.py: every other buffer of a core sits at segment scope, outside the loops AIR labels).
ATTENTION_OPTIONS = CompileOptions(runtime_loop_tiling_sizes=(1, 1))
# Decode attention keeps ping-pong: its cores stream the cache's key and value tiles while they compute.
DECODE_ATTENTION_OPTIONS = CompileOptions(runtime_loop_tiling_sizes=(1, 1))
DECODE_OPTIONS = CompileOptions(runtime_loop_tiling_sizes=(16, 16))

# How the prefill GEMMs multiply: "bfp16" builds the GEMM kernel with AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16
# (both operands converted to bfp16ebs8, blocks of 8 along K: fast), "bf16" with the AIE API's exact bf16 mmul
# (slower); "bfp16_gate_up" builds the gate/up projection (over half of a layer's MACs, and the GEMM whose
# conversion costs the least accuracy) with BFP16 and the others exact. These three multiply the model's bf16
# weights. "w8x2a16" multiplies integers (kernels/int_gemm.py): each weight as two int8 terms under a per-channel
# scale, prepared once beside the bf16 weights, activations quantized per row to int16 on the device; its
# Programs are rms_gemms_rope_w8x2 and o_ffn_w8x2. Decode GEMVs and the LM head use bf16 MACs in every mode. The
# default and its reason: README, "Numerics". (The integer schemes "int8" (W8A8) and "w8a16" have the emulator's
# numerics only: benchmarks/precision.py studies them.)
BF16_WEIGHT_PRECISIONS = ("bf16", "bfp16", "bfp16_gate_up")
INTEGER_PRECISION = "w8x2a16"
MATMUL_PRECISIONS = (*BF16_WEIGHT_PRECISIONS, INTEGER_PRECISION)
# The default, "auto" (``default_matmul_precision``): "w8x2a16" for a model with bf16 weights whose projections the
# integer GEMMs take, as close to fp32 as HF's bf16 run on the precision benchmark and predicted several times
# faster than exact bf16 (README, "Matmul precision"); otherwise "bf16" (with packed weights prefill multiplies the
# host-dequantized rows exactly, keeping their memory at the packed bytes; "w8x2a16" can still be asked for).
AUTO_PRECISION = "auto"
DEFAULT_MATMUL_PRECISION = AUTO_PRECISION
DEFAULT_BF16_WEIGHT_PRECISION = "bf16"  # the bf16-weight ops' own default (rms_gemms_rope, o_ffn)


def integer_gemm_misfit(dims: "ModelDims") -> str | None:
    """Why the integer GEMMs cannot run this model's projections (None when they can)."""
    projections = {"q_proj": (dims.q_dim, dims.hidden), "k_proj": (dims.kv_dim, dims.hidden),
                   "o_proj": (dims.hidden, dims.q_dim), "gate_proj": (dims.intermediate, dims.hidden),
                   "down_proj": (dims.hidden, dims.intermediate)}
    for name, (out_features, in_features) in projections.items():
        if in_features % int_gemm.ROW_K_GRANULE or out_features % int_gemm.TILE_GRANULE:
            return (f"{INTEGER_PRECISION!r} needs projections whose in features are multiples of "
                    f"{int_gemm.ROW_K_GRANULE} and out features multiples of {int_gemm.TILE_GRANULE}; this model's "
                    f"{name} is {out_features} × {in_features}")
    return None


def default_matmul_precision(dims: "ModelDims", weights: str = "bf16") -> str:
    """What "auto" means for a model of ``dims`` whose decode reads ``weights``."""
    return INTEGER_PRECISION if weights == "bf16" and integer_gemm_misfit(dims) is None else DEFAULT_BF16_WEIGHT_PRECISION


def resolve_matmul_precision(precision: str, dims: "ModelDims", weights: str = "bf16") -> str:
    return default_matmul_precision(dims, weights) if precision == AUTO_PRECISION else precision


# How the decode Programs hold their projection weights: "bf16", or packed block-quantized rows (kernels/quant.py:
# "q4_0", "q4_1", "q8_0"), which the GEMVs dequantize in their panel loop. Prefill Programs take bf16 weights.
DECODE_WEIGHTS = ("bf16", *FORMATS)
# The LM head's format in a patched model by default: a bf16 model's GEMV reads this packed copy (its best tokens
# scored again on the host from the bf16 weight: patch_llama/layer.py, NpuLmHead), a packed model's its own format.
RESCORED_LM_HEAD = "q8_0"


def default_lm_head_weights(weights: str) -> str:
    """The format a patched model's LM head GEMV reads by default when its projections are ``weights``."""
    return RESCORED_LM_HEAD if weights == "bf16" else weights


def _check_weights(weights: str) -> None:
    if weights not in DECODE_WEIGHTS:
        raise ValueError(f"decode weights must be one of {', '.join(map(repr, DECODE_WEIGHTS))}, got {weights!r}")


def weight_arg(name: str, out_features: int, in_features: int, weights: str, pieces: int = 1) -> Arg:
    """A projection weight of a decode Program: (out, in) bf16, or (out, row bytes / 4) int32 words of packed rows
    (kernels/quant.py's bytes, viewed as words); ``pieces``
    rows of ``in_features`` side by side in each row (w_gate_up: [gate | up], each packed on its own)."""
    if weights == "bf16":
        return Arg(name, (out_features, pieces * in_features), "bf16", Role.WEIGHT)
    return Arg(name, (out_features, pieces * weight_format(weights).row_bytes(in_features) // 4), "i32", Role.WEIGHT)


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    qkv_bias: bool = False  # the Q, K and V projections add a bias (Qwen2): prefill's QKV Programs take bq, bk, bv,
    #                         decode's bqk = [bq | bk] and bv

    def __post_init__(self):
        for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelDims.{name} must be a positive int, got {value!r}")
        _check_attention_dims(self.heads, self.kv_heads, self.head_dim)
        if not self.eps > 0:
            raise ValueError(f"ModelDims.eps must be positive, got {self.eps!r}")

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config, qkv_bias: bool = False) -> "ModelDims":
        """Dims of a HF Llama-style config (``LlamaConfig`` and compatible); ``qkv_bias`` is the model family's
        (patch_llama/families.py), not a config field every family spells the same way."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            eps=float(config.rms_norm_eps),
            qkv_bias=qkv_bias,
        )


def _launch(kind: str, reads, writes, **params) -> Launch:
    return Launch(kind, tuple(sorted(params.items())), tuple(reads), tuple(writes))


def _check_precision(precision: str, accepted=MATMUL_PRECISIONS) -> None:
    if precision not in accepted:
        raise ValueError(f"matmul precision must be one of {', '.join(map(repr, accepted))}, got {precision!r}")


def _check_seq(seq: int) -> None:
    if not isinstance(seq, int) or seq <= 0:
        raise ValueError(f"sequence length must be a positive int, got {seq!r}")


def _gemm_precision(mode: str, projection: str) -> str:
    """The precision ("bf16" or "bfp16") the GEMM of ``projection`` is built with under matmul precision ``mode``."""
    if mode == "bfp16_gate_up":
        return "bfp16" if projection == "gate_up" else "bf16"
    return mode


def _matmul_params(matmul: str, rows: int, mode: str | None, weights: str = "bf16"):
    """(K, N, projection) → a matmul launch's params: a prefill GEMM carries its precision, a decode GEMV its
    weights' format when they are packed."""
    if matmul == "gemm":
        return lambda k, n, projection: dict(M=rows, K=k, N=n, precision=_gemm_precision(mode, projection))
    packed = {} if weights == "bf16" else {"weights": weights}
    return lambda k, n, projection: dict(K=k, N=n, **packed)


def _qkv_params(hidden, heads, kv_heads, head_dim, eps, rows, qkv_bias) -> tuple:
    return ((("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim), ("eps", eps),
             ("rows", rows)) + ((("qkv_bias", 1),) if qkv_bias else ()))


def _qkv_tail(projections, rows, heads, kv_heads, head_dim, row_shape, qkv_bias: bool):
    """The Q/K/V projections of prefill rows (``projections(output, weight)`` gives each one's launch), their biases
    when the model has them, then half-split RoPE on Q and K: (the bias args, the outputs and scratch, the
    launches). A biased projection writes ``<name>_proj`` and bias_add writes ``<name>`` from it
    (builders/bias_add.py says why it is a launch of its own); unbiased, the launches and arguments are those of a
    model without the field."""
    q, kv = heads * head_dim, kv_heads * head_dim
    width = {"q": q, "k": kv, "v": kv}
    biases = tuple(Arg(f"b{n}", (width[n],), "bf16", W) for n in "qkv") if qkv_bias else ()
    raw = tuple(Arg(f"{n}_proj", row_shape(width[n]), "bf16", S) for n in "qkv") if qkv_bias else ()
    launches = tuple(projections(f"{n}_proj" if qkv_bias else n, f"w{n}") for n in "qkv")
    if qkv_bias:
        launches += tuple(_launch("bias_add", [f"{n}_proj", f"b{n}"], [n], rows=rows, cols=width[n]) for n in "qkv")
    outputs = (*raw,
               Arg("q", row_shape(q), "bf16", S),
               Arg("k", row_shape(kv), "bf16", S),
               Arg("v", row_shape(kv), "bf16", O),
               Arg("q_roped", row_shape(q), "bf16", O),
               Arg("k_roped", row_shape(kv), "bf16", O))
    launches += (_launch("rope", ["q", "rope_lut"], ["q_roped"], rows=rows, heads=heads, head_dim=head_dim),
                 _launch("rope", ["k", "rope_lut"], ["k_roped"], rows=rows, heads=kv_heads, head_dim=head_dim))
    return biases, outputs, launches


def _decode_qkv_tail(projections, heads, kv_heads, head_dim, qkv_bias: bool):
    """A decode token's Q/K/V: the Q and K projections in one launch over ``wqk`` = [Wq; Wk] (their rows stacked, so
    one GEMV writes the row [q | k]), V's over ``wv``, their biases when the model has them (``bqk`` = [bq | bk],
    ``bv``), then RoPE on the token's Q and K rows in one launch (rope_qk); ``projections(output, weight)`` gives
    each projection's launch. Returns (the bias args, the outputs and scratch, the launches), as _qkv_tail."""
    q, kv = heads * head_dim, kv_heads * head_dim
    width = {"qk": q + kv, "v": kv}
    biases = (Arg("bqk", (q + kv,), "bf16", W), Arg("bv", (kv,), "bf16", W)) if qkv_bias else ()
    raw = tuple(Arg(f"{n}_proj", (width[n],), "bf16", S) for n in width) if qkv_bias else ()
    launches = tuple(projections(f"{n}_proj" if qkv_bias else n, f"w{n}") for n in width)
    if qkv_bias:
        launches += tuple(_launch("bias_add", [f"{n}_proj", f"b{n}"], [n], rows=1, cols=width[n]) for n in width)
    outputs = (*raw,
               Arg("qk", (q + kv,), "bf16", S),
               Arg("v", (kv,), "bf16", O),
               Arg("q_roped", (q,), "bf16", O),
               Arg("k_roped", (kv,), "bf16", O))
    launches += (_launch("rope_qk", ["qk", "rope_lut"], ["q_roped", "k_roped"], heads=heads, kv_heads=kv_heads,
                         head_dim=head_dim),)
    return biases, outputs, launches


def _rms_qkv_rope(name, hidden, heads, kv_heads, head_dim, eps, rows, matmul, row_shape, options,
                  precision=None, weights="bf16", qkv_bias=False) -> Program:
    """RMSNorm → Q/K/V projections (+ their biases) → half-split RoPE on Q and K (prefill GEMM or decode GEMV).
    Host arguments: x, norm_w, the weights, their biases when ``qkv_bias``, then rope_lut; the weights are wq, wk,
    wv (biases bq, bk, bv) for prefill rows, wqk = [Wq; Wk] and wv (biases bqk, bv) for a decode token. A decode
    token's projections each normalize x themselves (rms_gemv), Q and K in one launch, and its Q and K rows rotate
    in one launch (rope_qk): every launch is a device the run enters (kernels/timing.py), so three launches cost
    less than upstream's six."""
    _check_attention_dims(heads, kv_heads, head_dim)
    h, q, kv, hd = hidden, heads * head_dim, kv_heads * head_dim, head_dim
    mm = _matmul_params(matmul, rows, precision, weights)
    out_features = {"wq": q, "wk": kv, "wv": kv, "wqk": q + kv}
    if matmul == "gemv":
        def projection(out, w):
            return _launch("rms_gemv", ["x", "norm_w", w], [out], eps=eps, **mm(h, out_features[w], w[1:]))
        norm, normed = (), ()
        biases, outputs, launches = _decode_qkv_tail(projection, heads, kv_heads, hd, qkv_bias)
        weight_args = (weight_arg("wqk", q + kv, h, weights), weight_arg("wv", kv, h, weights))
    else:
        def projection(out, w):
            return _launch(matmul, ["normed", w], [out], **mm(h, out_features[w], w[1:]))
        norm = (_launch("rmsnorm", ["x", "norm_w"], ["normed"], rows=rows, cols=h, eps=eps),)
        normed = (Arg("normed", row_shape(h), "bf16", S),)
        biases, outputs, launches = _qkv_tail(projection, rows, heads, kv_heads, hd, row_shape, qkv_bias)
        weight_args = tuple(weight_arg(w, out_features[w], h, weights) for w in ("wq", "wk", "wv"))
    return Program(
        name=name,
        params=_qkv_params(hidden, heads, kv_heads, head_dim, eps, rows, qkv_bias),
        args=(
            Arg("x", row_shape(h), "bf16", I),
            Arg("norm_w", (h,), "bf16", W),
            *normed,
            *weight_args,
            *biases,
            Arg("rope_lut", row_shape(hd), "bf16", I),
            *outputs,
        ),
        launches=(*norm, *launches),
        compile_options=options,
    )


def _o_ffn(name, hidden, q_dim, intermediate, eps, rows, row_shape, options, precision) -> Program:
    """O projection + residual → RMSNorm → SwiGLU MLP + residual (prefill GEMM). The gate and up weights are one
    buffer, ``w_gate_up`` = [Wg | Wu] (F × 2H, side by side in each row), so one launch (gemm_swiglu) projects
    both and drains SiLU(gate)·up: neither projection crosses DDR. Below FUSED_SWIGLU_MIN_ROWS rows, two gemm
    launches read the halves of its rows and silu_mul joins them."""
    h, q, f = hidden, q_dim, intermediate
    matmul, mm = "gemm", _matmul_params("gemm", rows, precision)
    if rows >= FUSED_SWIGLU_MIN_ROWS:
        swiglu_scratch = ()
        swiglu = (_launch("gemm_swiglu", ["normed", "w_gate_up"], ["act"], **mm(h, f, "gate_up")),)
    else:  # the two projections from the halves of w_gate_up's rows, then SiLU·up
        swiglu_scratch = (Arg("gate", row_shape(f), "bf16", S), Arg("up", row_shape(f), "bf16", S))
        swiglu = (_launch(matmul, ["normed", "w_gate_up"], ["gate"], **mm(h, f, "gate_up"), w_cols=2 * h, w_col0=0),
                  _launch(matmul, ["normed", "w_gate_up"], ["up"], **mm(h, f, "gate_up"), w_cols=2 * h, w_col0=h),
                  _launch("silu_mul", ["gate", "up"], ["act"], rows=rows, cols=f))
    return Program(
        name=name,
        params=(("hidden", hidden), ("q_dim", q_dim), ("intermediate", intermediate), ("eps", eps), ("rows", rows)),
        args=(
            Arg("attn", row_shape(q), "bf16", I),
            Arg("wo", (h, q), "bf16", W),
            Arg("proj", row_shape(h), "bf16", S),
            Arg("x", row_shape(h), "bf16", I),
            Arg("res1", row_shape(h), "bf16", S),
            Arg("norm_w", (h,), "bf16", W),
            Arg("normed", row_shape(h), "bf16", S),
            Arg("w_gate_up", (f, 2 * h), "bf16", W),
            *swiglu_scratch,
            Arg("act", row_shape(f), "bf16", S),
            Arg("w_down", (h, f), "bf16", W),
            Arg("down", row_shape(h), "bf16", S),
            Arg("out", row_shape(h), "bf16", O),
        ),
        launches=(
            _launch(matmul, ["attn", "wo"], ["proj"], **mm(q, h, "o")),
            _launch("add", ["x", "proj"], ["res1"], rows=rows, cols=h),
            _launch("rmsnorm", ["res1", "norm_w"], ["normed"], rows=rows, cols=h, eps=eps),
            *swiglu,
            _launch(matmul, ["act", "w_down"], ["down"], **mm(f, h, "down")),
            _launch("add", ["res1", "down"], ["out"], rows=rows, cols=h),
        ),
        compile_options=options,
    )


def _check_attention_dims(heads: int, kv_heads: int, head_dim: int) -> None:
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for half-split RoPE, got {head_dim}")


def rms_gemms_rope_program(hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, seq: int,
                   precision: str = DEFAULT_BF16_WEIGHT_PRECISION, qkv_bias: bool = False) -> Program:
    _check_seq(seq)
    _check_precision(precision, BF16_WEIGHT_PRECISIONS)
    return _rms_qkv_rope("rms_gemms_rope", hidden, heads, kv_heads, head_dim, eps, seq, "gemm", lambda n: (seq, n),
                         PREFILL_OPTIONS, precision, qkv_bias=qkv_bias)


def o_ffn_program(hidden: int, q_dim: int, intermediate: int, eps: float, seq: int,
          precision: str = DEFAULT_BF16_WEIGHT_PRECISION) -> Program:
    _check_seq(seq)
    _check_precision(precision, BF16_WEIGHT_PRECISIONS)
    return _o_ffn("o_ffn", hidden, q_dim, intermediate, eps, seq, lambda n: (seq, n), PREFILL_OPTIONS, precision)


def prepared_weight_arg(name: str, out_features: int, in_features: int, halves: int = 1) -> Arg:
    """A prefill weight as the integer GEMMs take it (kernels/int_gemm.py's tiles of two int8 terms and their
    scales, as int32 words); ``halves`` 2: a [gate | up] pair of (out, in) weights, tile by tile."""
    return Arg(name, int_gemm.prepared_weight_shape(out_features, in_features, halves), "i32", W)


def quantized_rows_arg(name: str, rows: int, cols: int) -> Arg:
    """Activations quantized per row for the integer GEMMs (int16 runs with their scales, as int32 words)."""
    return Arg(name, (rows, int_gemm.activation_words(cols)), "i32", S)


def _int_gemm(a: str, w: str, out: str, rows: int, k: int, n: int, swiglu: bool = False) -> Launch:
    return _launch("gemm_int_swiglu" if swiglu else "gemm_int", [a, w], [out], M=rows, K=k, N=n,
                   tile_n=int_gemm.weight_tile_n(n, 2 if swiglu else 1))


def rms_gemms_rope_w8x2_program(hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                                seq: int, qkv_bias: bool = False) -> Program:
    """rms_gemms_rope with integer GEMMs ("w8x2a16"): RMSNorm, the normed rows quantized per row to int16
    (quantize_rows), the Q/K/V projections over prepared weights (gemm_int), RoPE. Host arguments are
    rms_gemms_rope's, the projection weights prepared (``prepared_weight_arg``)."""
    _check_seq(seq)
    _check_attention_dims(heads, kv_heads, head_dim)
    h, q, kv, hd = hidden, heads * head_dim, kv_heads * head_dim, head_dim
    out_features = {"wq": q, "wk": kv, "wv": kv}
    biases, outputs, launches = _qkv_tail(lambda out, w: _int_gemm("normed_q", w, out, seq, h, out_features[w]),
                                          seq, heads, kv_heads, hd, lambda n: (seq, n), qkv_bias)
    return Program(
        name="rms_gemms_rope_w8x2",
        params=_qkv_params(hidden, heads, kv_heads, head_dim, eps, seq, qkv_bias),
        args=(
            Arg("x", (seq, h), "bf16", I),
            Arg("norm_w", (h,), "bf16", W),
            Arg("normed", (seq, h), "bf16", S),
            quantized_rows_arg("normed_q", seq, h),
            prepared_weight_arg("wq", q, h),
            prepared_weight_arg("wk", kv, h),
            prepared_weight_arg("wv", kv, h),
            *biases,
            Arg("rope_lut", (seq, hd), "bf16", I),
            *outputs,
        ),
        launches=(
            _launch("rmsnorm", ["x", "norm_w"], ["normed"], rows=seq, cols=h, eps=eps),
            _launch("quantize_rows", ["normed"], ["normed_q"], M=seq, K=h),
            *launches,
        ),
        compile_options=PREFILL_OPTIONS,
    )


def o_ffn_w8x2_program(hidden: int, q_dim: int, intermediate: int, eps: float, seq: int) -> Program:
    """o_ffn with integer GEMMs ("w8x2a16"): each GEMM's input quantized per row (quantize_rows), the O, [gate | up]
    (gemm_int_swiglu: both projections and SiLU·up in one launch) and down projections over prepared weights.
    Host arguments are o_ffn's, the weights prepared (``prepared_weight_arg``; w_gate_up a [gate | up] pair)."""
    _check_seq(seq)
    h, q, f = hidden, q_dim, intermediate
    return Program(
        name="o_ffn_w8x2",
        params=(("hidden", hidden), ("q_dim", q_dim), ("intermediate", intermediate), ("eps", eps), ("rows", seq)),
        args=(
            Arg("attn", (seq, q), "bf16", I),
            quantized_rows_arg("attn_q", seq, q),
            prepared_weight_arg("wo", h, q),
            Arg("proj", (seq, h), "bf16", S),
            Arg("x", (seq, h), "bf16", I),
            Arg("res1", (seq, h), "bf16", S),
            Arg("norm_w", (h,), "bf16", W),
            Arg("normed", (seq, h), "bf16", S),
            quantized_rows_arg("normed_q", seq, h),
            prepared_weight_arg("w_gate_up", f, h, halves=2),
            Arg("act", (seq, f), "bf16", S),
            quantized_rows_arg("act_q", seq, f),
            prepared_weight_arg("w_down", h, f),
            Arg("down", (seq, h), "bf16", S),
            Arg("out", (seq, h), "bf16", O),
        ),
        launches=(
            _launch("quantize_rows", ["attn"], ["attn_q"], M=seq, K=q),
            _int_gemm("attn_q", "wo", "proj", seq, q, h),
            _launch("add", ["x", "proj"], ["res1"], rows=seq, cols=h),
            _launch("rmsnorm", ["res1", "norm_w"], ["normed"], rows=seq, cols=h, eps=eps),
            _launch("quantize_rows", ["normed"], ["normed_q"], M=seq, K=h),
            _int_gemm("normed_q", "w_gate_up", "act", seq, h, f, swiglu=True),
            _launch("quantize_rows", ["act"], ["act_q"], M=seq, K=f),
            _int_gemm("act_q", "w_down", "down", seq, f, h),
            _launch("add", ["res1", "down"], ["out"], rows=seq, cols=h),
        ),
        compile_options=PREFILL_OPTIONS,
    )


def _decode_name(name: str, weights: str) -> str:
    return name if weights == "bf16" else f"{name}_packed"


def rms_gemv_rope_program(hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                          weights: str = "bf16", qkv_bias: bool = False) -> Program:
    _check_weights(weights)
    return _rms_qkv_rope(_decode_name("rms_gemv_rope", weights), hidden, heads, kv_heads, head_dim, eps, 1, "gemv",
                         lambda n: (n,), DECODE_OPTIONS, weights=weights, qkv_bias=qkv_bias)


def o_gemv_ffn_program(hidden: int, q_dim: int, intermediate: int, eps: float, weights: str = "bf16") -> Program:
    """The decode o_ffn in upstream's 3 fused launches (builders/gemv_fused.py says where and how they differ):
    O projection + residual → RMSNorm + gate and up projections + SiLU·up → down projection + residual. Only the
    post-attention residual (read again by the last launch) and the activation cross DDR between launches. The
    gate and up projections read o_ffn's ``w_gate_up`` as 2F rows of H; the tile that projects a gate/up pair
    joins it, so the activation is made once, not by every tile of the down launch.

    Host arguments are o_ffn's, in the same order: attn, wo, x, norm_w, w_gate_up, w_down. With packed
    ``weights`` each projection weight holds packed rows, w_gate_up a packed gate row then a packed up row.
    """
    _check_weights(weights)
    h, q, f = hidden, q_dim, intermediate
    packed = {} if weights == "bf16" else {"weights": weights}
    return Program(
        name=_decode_name("o_gemv_ffn", weights),
        params=(("hidden", hidden), ("q_dim", q_dim), ("intermediate", intermediate), ("eps", eps), ("rows", 1)),
        args=(
            Arg("attn", (q,), "bf16", I),
            weight_arg("wo", h, q, weights),
            Arg("x", (h,), "bf16", I),
            Arg("res1", (h,), "bf16", S),
            Arg("norm_w", (h,), "bf16", W),
            weight_arg("w_gate_up", f, h, weights, pieces=2),
            Arg("act", (f,), "bf16", S),
            weight_arg("w_down", h, f, weights),
            Arg("out", (h,), "bf16", O),
        ),
        launches=(
            _launch("gemv_add", ["attn", "wo", "x"], ["res1"], K=q, N=h, **packed),
            _launch("rms_gemv", ["res1", "norm_w", "w_gate_up"], ["act"], K=h, N=2 * f, eps=eps, gate_up=1,
                    swiglu=1, **packed),
            _launch("gemv_add", ["act", "w_down", "res1"], ["out"], K=f, N=h, **packed),
        ),
        compile_options=DECODE_OPTIONS,
    )


def o_gemv_ffn_rms_gemv_rope_program(hidden: int, q_dim: int, intermediate: int, eps: float, heads: int,
                                     kv_heads: int, head_dim: int, next_eps: float, weights: str = "bf16",
                                     qkv_bias: bool = False) -> Program:
    """One decode layer's o_gemv_ffn, then the next layer's rms_gemv_rope on its output, in one dispatch: the
    boundary between two decoder layers has no host work, so a token pays one dispatch per layer instead of two.

    Host arguments are o_gemv_ffn's, then rms_gemv_rope's weights and LUT with a ``next_`` prefix (its input is
    ``out``); outputs are ``out`` and the next layer's ``next_v``, ``next_q_roped``, ``next_k_roped``.
    """
    first = o_gemv_ffn_program(hidden, q_dim, intermediate, eps, weights)
    second = rms_gemv_rope_program(hidden, heads, kv_heads, head_dim, next_eps, weights, qkv_bias)
    rename = {a.name: "next_" + a.name for a in second.args}
    rename["x"] = "out"  # the next layer reads this layer's output
    return Program(
        name=_decode_name("o_gemv_ffn_rms_gemv_rope", weights),
        params=first.params + tuple(("next_" + k, v) for k, v in second.params),
        args=first.args + tuple(Arg(rename[a.name], a.shape, a.dtype, a.role) for a in second.args if a.name != "x"),
        launches=first.launches + tuple(
            Launch(l.kind, l.params, tuple(rename[n] for n in l.reads), tuple(rename[n] for n in l.writes))
            for l in second.launches),
        compile_options=DECODE_OPTIONS,
    )


def flash_attn_program(heads: int, kv_heads: int, head_dim: int, seq: int) -> Program:
    """Causal GQA attention over one sequence, seq-first layout, scale 1/sqrt(head_dim).

    K and V are first stacked into one (2, seq, kv_dim) buffer (KV head by KV head, each in 8-column blocks,
    builders/stack.py), so that attention fetches a position block's keys and values with one DMA (see
    builders/attention.py)."""
    _check_seq(seq)
    _check_attention_dims(heads, kv_heads, head_dim)
    q, kv = heads * head_dim, kv_heads * head_dim
    return Program(
        name="flash_attn",
        params=(("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim), ("seq", seq)),
        args=(
            Arg("q", (seq, q), "bf16", I),
            Arg("k", (seq, kv), "bf16", I),
            Arg("v", (seq, kv), "bf16", I),
            Arg("kv", (2, seq, kv), "bf16", S),
            Arg("out", (seq, q), "bf16", O),
        ),
        launches=(
            _launch("stack", ["k", "v"], ["kv"], rows=seq, cols=kv, head_dim=head_dim),
            _launch("attention", ["q", "kv"], ["out"], seq=seq, heads=heads, kv_heads=kv_heads,
                    head_dim=head_dim, causal=True),
        ),
        compile_options=ATTENTION_OPTIONS,
    )


# Decode attention's capacity buckets (positions): a run streams its bucket's whole capacity, so the bucket bounds
# the wasted DDR bytes, and every bucket is one ELF. Up to 1024 positions, multiples of 256; above, four buckets
# per octave (1280, 1536, 1792, 2048, 2560, ...): at most 255 positions or a quarter of the length streamed for
# nothing, and 16 ELFs up to 8192 positions, 24 up to 32768.
DECODE_ATTN_MIN_GRANULE = 256
# The valid length reaches the kernel as data: bf16 base-256 digits, low first (each an integer below 256, exact in
# bf16; 3 digits cover 2^24 positions, a 4th keeps the buffer whole 4-byte words). bf16 because it travels in the
# same buffer as the query rows: a core has two input DMA channels (builders/decode_attention.py).
DECODE_ATTN_LENGTH_DIGITS = 4


def decode_attn_length_digits(length: int) -> list[int]:
    """``length`` as decode attention's input holds it: DECODE_ATTN_LENGTH_DIGITS base-256 digits, low first."""
    if not isinstance(length, int) or not 0 <= length < 1 << 24:
        raise ValueError(f"a decode attention length must be an int in 0..{(1 << 24) - 1}, got {length!r}")
    return [length & 255, length >> 8 & 255, length >> 16, 0]


def decode_attn_length_value(digits) -> int:
    """The length decode attention's input digits hold (what the kernel decodes)."""
    return int(digits[0]) + 256 * int(digits[1]) + 65536 * int(digits[2])

# A cache's rows (its maximum length), and so every capacity, are a multiple of this: an even number of tiles
# (decode_attn_tile: 64 or 32 positions). AIR gives the K/V tile of a loop with an odd trip count a third ping-pong
# copy; at Llama-3.2-1B's heads, 3 tiles (192 rows) lowered with aiecc fill a core's L1 to its last byte, no headroom.
DECODE_ATTN_ROWS_MULTIPLE = 128


def decode_attn_tile(head_dim: int) -> int:
    """Positions per key/value tile of decode attention: 64 (16 KiB of K and V per tile at head_dim 64), halved
    for wider heads so that three ping-pong copies still fit L1."""
    return 64 if head_dim <= 64 else 32


def decode_attn_capacity(length: int, max_len: int) -> int:
    """The capacity bucket of a decode attention over ``length`` valid positions of a cache of ``max_len`` rows:
    the rows the op's k_cache and v_cache views must hold (the first ``capacity`` rows of the cache)."""
    if not isinstance(max_len, int) or max_len <= 0 or max_len % DECODE_ATTN_ROWS_MULTIPLE:
        raise ValueError(f"a decode attention cache holds a positive multiple of {DECODE_ATTN_ROWS_MULTIPLE} rows, "
                         f"got max_len={max_len!r}")
    if not isinstance(length, int) or not 0 < length <= max_len:
        raise ValueError(f"decode attention length must be in 1..{max_len} (the cache's rows), got {length!r}")
    octave = 1 << (length - 1).bit_length() - 1 if length > 1 else 1  # the largest power of two below length
    granule = max(DECODE_ATTN_MIN_GRANULE, octave // 4)
    return min(-(-length // granule) * granule, max_len)


def decode_attn_program(heads: int, kv_heads: int, head_dim: int, capacity: int) -> Program:
    """One decode token's attention over a KV cache's first ``capacity`` rows, of which the first ``length`` are
    valid: an input of DECODE_ATTN_LENGTH_DIGITS bf16 base-256 digits (``ops.decode_attn_length``), data, so every
    length up to the capacity runs the same ELF. Scale 1/sqrt(head_dim).

    q and out are one row (heads*head_dim,); k_cache and v_cache (capacity, kv_heads*head_dim), position-major,
    as the NPU cache holds one sequence. builders/decode_attention.py says how the length reaches the cores.
    """
    _check_attention_dims(heads, kv_heads, head_dim)
    tile = decode_attn_tile(head_dim)
    if not isinstance(capacity, int) or capacity <= 0 or capacity % DECODE_ATTN_ROWS_MULTIPLE:
        raise ValueError(f"decode attention capacity must be a positive multiple of {DECODE_ATTN_ROWS_MULTIPLE} "
                         f"positions (an even number of {tile}-position tiles), got {capacity!r}")
    q, kv = heads * head_dim, kv_heads * head_dim
    return Program(
        name="decode_attn",
        params=(("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim), ("capacity", capacity)),
        args=(
            Arg("q", (q,), "bf16", I),
            Arg("k_cache", (capacity, kv), "bf16", I),
            Arg("v_cache", (capacity, kv), "bf16", I),
            Arg("length", (DECODE_ATTN_LENGTH_DIGITS,), "bf16", I),
            Arg("out", (q,), "bf16", O),
        ),
        launches=(
            _launch("decode_attention", ["q", "k_cache", "v_cache", "length"], ["out"], capacity=capacity,
                    heads=heads, kv_heads=kv_heads, head_dim=head_dim, tile_kv=tile),
        ),
        compile_options=DECODE_ATTENTION_OPTIONS,
    )


def decode_attn_o_gemv_ffn_rms_gemv_rope_program(hidden: int, q_dim: int, intermediate: int, eps: float, heads: int,
                                                 kv_heads: int, head_dim: int, capacity: int, next_eps: float,
                                                 weights: str = "bf16", qkv_bias: bool = False) -> Program:
    """A decode layer from its attention on: decode attention over the layer's cache, o_gemv_ffn on its output,
    and the next layer's rms_gemv_rope, in one dispatch (nothing on the host sits between them).

    Host arguments are decode_attn's (q, k_cache, v_cache, length), then o_gemv_ffn_rms_gemv_rope's without
    ``attn`` (decode attention's output, a device-only scratch); outputs are ``out`` and the next layer's
    ``next_v``, ``next_q_roped``, ``next_k_roped``.
    """
    rest = o_gemv_ffn_rms_gemv_rope_program(hidden, q_dim, intermediate, eps, heads, kv_heads, head_dim, next_eps,
                                            weights, qkv_bias)
    return _after_decode_attn(_decode_name("decode_attn_o_gemv_ffn_rms_gemv_rope", weights), heads, kv_heads,
                              head_dim, capacity, rest)


def _after_decode_attn(name: str, heads: int, kv_heads: int, head_dim: int, capacity: int, rest: Program) -> Program:
    """Decode attention, then ``rest`` (a Program whose ``attn`` input is its output, now a device-only scratch),
    in one Program: decode_attn's host arguments, then ``rest``'s but ``attn``."""
    attn = rest.arg("attn")
    if heads * head_dim != attn.shape[-1]:
        raise ValueError(f"q_dim ({attn.shape[-1]}) must be heads*head_dim ({heads}*{head_dim})")
    attention = decode_attn_program(heads, kv_heads, head_dim, capacity)
    return Program(
        name=name,
        params=attention.params + rest.params,
        args=(*attention.args[:-1], Arg("attn", attn.shape, attn.dtype, S),
              *(a for a in rest.args if a.name != "attn")),
        launches=(Launch(attention.launches[0].kind, attention.launches[0].params, attention.launches[0].reads,
                         ("attn",)), *rest.launches),
        compile_options=DECODE_OPTIONS,
    )


def decode_attn_o_gemv_ffn_program(hidden: int, q_dim: int, intermediate: int, eps: float, heads: int, kv_heads: int,
                                   head_dim: int, capacity: int, weights: str = "bf16") -> Program:
    """The last decode layer from its attention on: decode attention over the layer's cache, then o_gemv_ffn on its
    output, in one dispatch (a layer with no next layer to chain into).

    Host arguments are decode_attn's (q, k_cache, v_cache, length), then o_gemv_ffn's without ``attn`` (decode
    attention's output, a device-only scratch); the output is ``out``."""
    return _after_decode_attn(_decode_name("decode_attn_o_gemv_ffn", weights), heads, kv_heads, head_dim, capacity,
                              o_gemv_ffn_program(hidden, q_dim, intermediate, eps, weights))


# Decode layers one dispatch may chain (decode_layers_program), each size an op of its own (npu2.decode_layers<n>):
# at most what a Program's argument limit allows. With each layer's weights in two arenas a layer binds six
# arguments (its caches, its arenas, the K/V rows it writes): a _qkv group of eight binds 58, so a 16-layer model's
# token takes two dispatches (with the weights one argument each, four layers bound 56 and five would bind 67).
DECODE_GROUP_SIZES = tuple(range(2, 9))


@dataclass(frozen=True)
class LayerArenas:
    """Where a decoder layer's weights lie when a decode group reads them from two buffers (``layer_arenas``):
    ``weights``, its projections in the weight format's dtype, and ``norms``, its two RMSNorm weights (bf16) and,
    for a family with Q/K/V biases, its [bq | bk] and bv (bf16). ``parts`` are views named ``input_norm``,
    ``post_attention_norm``, (``qk_bias``, ``v_bias``,) ``wqk``, ``wv``, ``wo``, ``w_gate_up`` and ``w_down``, in
    arenas named ``weights`` and ``norms``, each part in the layout its decode op reads."""

    weights: Arg
    norms: Arg
    parts: tuple[View, ...]

    def part(self, name: str) -> View:
        return next(v for v in self.parts if v.name == name)


def layer_arenas(hidden: int, q_dim: int, kv_dim: int, intermediate: int, weights: str = "bf16",
                 qkv_bias: bool = False) -> LayerArenas:
    """The layout of a decoder layer's weights in two NPU buffers (patch_llama lays a layer out so, and the decode
    groups read it): [Wq; Wk], Wv, Wo, [gate | up] and Wdown in that order, each ``weight_arg``'s
    shape, starting at a whole shim DMA word and a whole row (so that a DMA window moves into the arena along its
    row dimension); then the input and post-attention norms and, with ``qkv_bias``, [bq | bk] and bv, likewise
    aligned."""
    _check_weights(weights)
    projections = (weight_arg("wqk", q_dim + kv_dim, hidden, weights), weight_arg("wv", kv_dim, hidden, weights),
                   weight_arg("wo", hidden, q_dim, weights), weight_arg("w_gate_up", intermediate, hidden, weights, 2),
                   weight_arg("w_down", hidden, intermediate, weights))
    norms = (Arg("input_norm", (hidden,), "bf16", W), Arg("post_attention_norm", (hidden,), "bf16", W))
    if qkv_bias:
        norms += (Arg("qk_bias", (q_dim + kv_dim,), "bf16", W), Arg("v_bias", (kv_dim,), "bf16", W))

    def laid_out(args, arena: str) -> tuple[tuple[View, ...], int]:
        views, end = [], 0
        for arg in args:
            align = math.lcm(max(1, DEVICE.dma_word_bytes // DTYPE_BYTES[arg.dtype]), arg.shape[-1])
            start = -(-end // align) * align
            views.append(View(arg.name, arena, start, arg.shape, arg.dtype))
            end = start + arg.numel
        return tuple(views), end

    weight_views, weight_numel = laid_out(projections, "weights")
    norm_views, norm_numel = laid_out(norms, "norms")
    return LayerArenas(Arg("weights", (weight_numel,), projections[0].dtype, W),
                       Arg("norms", (norm_numel,), "bf16", W), weight_views + norm_views)


# A decode group's per-layer weight arguments (decode_layers_program's names, the layer's index in the group after
# the last "_") as parts of the arenas of the group's layer j (their own) or j + 1 ("next_": the layer after it);
# "first_" ones are the group's first layer's (a _qkv group's).
_OWN_PARTS = {"wo": "wo", "norm_w": "post_attention_norm", "w_gate_up": "w_gate_up", "w_down": "w_down"}
_NEXT_PARTS = {"next_norm_w": "input_norm", "next_wqk": "wqk", "next_wv": "wv", "next_bqk": "qk_bias",
               "next_bv": "v_bias"}
_FIRST_PARTS = {"first_norm_w": "input_norm", "first_wqk": "wqk", "first_wv": "wv", "first_bqk": "qk_bias",
                "first_bv": "v_bias"}


def _group_weight_part(name: str) -> tuple[int, str] | None:
    """(the group's layer whose arenas hold it, its part) for a decode group's per-layer weight ``name``; None for
    the group's own (the final norm's, the LM head's)."""
    if name in _FIRST_PARTS:
        return 0, _FIRST_PARTS[name]
    base, _, index = name.rpartition("_")
    if base in _OWN_PARTS:
        return int(index), _OWN_PARTS[base]
    if base in _NEXT_PARTS:
        return int(index) + 1, _NEXT_PARTS[base]
    return None


def _weights_in_arenas(name: str, args, arenas: LayerArenas) -> tuple[list[Arg], list[View]]:
    """A decode group's arguments ``args`` with its layers' weights as views of two arenas per layer (``weights_<j>``,
    ``norms_<j>``, laid out as ``arenas``; decode_layers_program puts them in their places), and those views."""
    moved, views, placed = [], [], set()
    for arg in args:
        found = _group_weight_part(arg.name) if arg.role is W else None
        if found is None:
            moved.append(arg)
            continue
        layer, part = found
        view = arenas.part(part)
        if (view.shape, view.dtype) != (arg.shape, arg.dtype):
            raise ValueError(f"{name}: weight {arg.name!r} is {arg.dtype} {arg.shape}, its part {part!r} of a "
                             f"layer's arenas {view.dtype} {view.shape}")
        if layer not in placed:
            placed.add(layer)
            moved += [Arg(f"{a.name}_{layer}", a.shape, a.dtype, W) for a in (arenas.weights, arenas.norms)]
        views.append(View(arg.name, f"{view.arena}_{layer}", view.offset, view.shape, view.dtype))
    return moved, views


# Per layer of a group, its own arguments (the rest are the group's: the first layer's q and x, the length, the LUT
# row, the device-only scratches every layer reuses, the last layer's out and next_q_roped).
_GROUP_SHARED = ("length", "next_rope_lut", "attn", "res1", "act", "next_qk", "next_qk_proj", "next_v_proj")


def decode_layers_program(layers: int, hidden: int, q_dim: int, intermediate: int, eps: float, heads: int,
                          kv_heads: int, head_dim: int, capacity: int, next_eps: float,
                          weights: str = "bf16", ends_model: bool = False,
                          lm_head: tuple[int, float, str] | None = None, first_qkv: bool = False,
                          qkv_bias: bool = False) -> Program:
    """``layers`` decode layers in one dispatch, each from its attention on as decode_attn_o_gemv_ffn_rms_gemv_rope
    (decode attention, o_gemv_ffn, the next layer's rms_gemv_rope), layer j+1 attending with the query and hidden
    state layer j computed (device-only scratches).

    Host arguments: the group's ``q`` (the first layer's query), ``x`` (its input), ``length`` and ``next_rope_lut``
    (the step's), then per layer j of the group its caches ``k_cache_<j>`` and ``v_cache_<j>`` and its weights in
    two arenas, ``weights_<j>`` and ``norms_<j>`` (``layer_arenas``'s layout: a layer's weights are views of them,
    named as decode_attn_o_gemv_ffn_rms_gemv_rope's with the layer's index, ``wo_1``, ``next_wqk_1``...). Layer j's
    arenas hold its own weights and those the layer before it chains into (its input norm, [Wq; Wk], Wv), so a group
    that does not end the model takes the arenas of the layer after its last too (``weights_<layers>``,
    ``norms_<layers>``). Outputs: the last layer's ``out`` and ``next_q_roped``, then each layer's ``next_v_<j>``
    and ``next_k_roped_<j>``, the K/V rows of the layer after it. With ``ends_model`` (decode_layers<n>_final) the
    last layer is the model's last and runs as decode_attn_o_gemv_ffn: no next layer's weights, LUT use or rows for
    it, so the outputs are ``out`` and the rows of the layers before it. With ``lm_head`` = (LM-head rows, the final
    norm's eps, the LM head's weight format: bf16 when ``weights`` is, or any packed one) as well
    (decode_layers<n>_final_lm; decode_layers<n>_final_packed_lm for a packed LM head after bf16 layers), the
    model's final RMSNorm and its LM head follow in the same dispatch: host arguments ``final_norm_w`` and ``w_lm``
    after the layers', outputs ``final_normed`` (the final norm's bf16 output) and ``logits`` (lm_head_gemv's) after
    the others.

    With ``first_qkv`` (decode_layers<n>_qkv...) the first layer's own rms_gemv_rope runs first in the same dispatch,
    on ``x`` with ``next_eps`` (every layer of a group normalizes its input with one eps) and the step's LUT row,
    over the first layer's input norm, [Wq; Wk] and Wv (views ``first_norm_w``, ``first_wqk``, ``first_wv`` of its
    arenas); ``q`` becomes a device-only scratch, and its K/V rows ``first_v`` and ``first_k_roped`` follow ``out``
    (and ``next_q_roped``) among the outputs; bound to the first layer's cache rows at ``length``-1, its attention
    reads them in the same run.

    With ``qkv_bias`` (a family with Q/K/V biases: Qwen2) every rms_gemv_rope adds the layer's [bq | bk] and bv,
    parts of its norms arena (``next_bqk_<j>``, ``next_bv_<j>``, ``first_bqk``, ``first_bv``); the ops tell it from
    the norms arenas' size.

    Layer j+1 attends over ``k_cache_<j+1>``/``v_cache_<j+1>`` as they are when it runs: a caller that binds
    ``next_k_roped_<j>``/``next_v_<j>`` to those caches' rows at ``length``-1 (the ``.into`` overload, an
    NpuKVCache's next position) has it attend over the rows this run wrote there, as the layers one run each would
    (the launches of one ELF run in order, each finishing its DMAs before the next starts); bound elsewhere, the
    caches are read as given."""
    if layers not in DECODE_GROUP_SIZES:
        raise ValueError(f"a decode group chains {', '.join(map(str, DECODE_GROUP_SIZES))} layers, got {layers!r}")
    if lm_head is not None and not ends_model:
        raise ValueError("a decode group runs the LM head only when it ends the model (ends_model=True)")
    one = decode_attn_o_gemv_ffn_rms_gemv_rope_program(hidden, q_dim, intermediate, eps, heads, kv_heads, head_dim,
                                                       capacity, next_eps, weights, qkv_bias)
    last = layers - 1
    final = (decode_attn_o_gemv_ffn_program(hidden, q_dim, intermediate, eps, heads, kv_heads, head_dim, capacity,
                                            weights) if ends_model else one)

    def renamed(name: str, j: int) -> str:
        if name in _GROUP_SHARED:
            return name
        if name in ("q", "x"):  # the first layer's come from the host, the others' from the layer before
            return name if j == 0 else {"q": "q_mid", "x": "hidden_mid"}[name]
        if name in ("next_q_roped", "out"):  # the last layer's go to the host, the others' to the layer after
            return name if j == last else {"next_q_roped": "q_mid", "out": "hidden_mid"}[name]
        return f"{name}_{j}"

    by_name: dict[str, Arg] = {}
    for j in range(layers):
        for arg in (final if j == last else one).args:
            name = renamed(arg.name, j)
            role = S if name in ("q_mid", "hidden_mid") else arg.role
            by_name.setdefault(name, Arg(name, arg.shape, arg.dtype, role))
    launches = tuple(Launch(l.kind, l.params, tuple(renamed(n, j) for n in l.reads),
                            tuple(renamed(n, j) for n in l.writes))
                     for j in range(layers) for l in (final if j == last else one).launches)
    first_rows = []
    if first_qkv:
        qkv = rms_gemv_rope_program(hidden, heads, kv_heads, head_dim, next_eps, weights, qkv_bias)
        # its input and LUT row are the group's; its Q the first layer's attention reads; its scratch the group's
        qkv_names = {"x": "x", "rope_lut": "next_rope_lut", "q_roped": "q", "qk": "next_qk",
                     "v": "first_v", "k_roped": "first_k_roped", "qk_proj": "next_qk_proj", "v_proj": "next_v_proj"}
        first_rows = ["first_v", "first_k_roped"]
        by_name = {**{f"first_{a.name}": Arg(f"first_{a.name}", a.shape, a.dtype, a.role)
                      for a in qkv.args if a.role is Role.WEIGHT},
                   **by_name, "q": Arg("q", by_name["q"].shape, by_name["q"].dtype, S)}
        by_name.update({n: Arg(n, a.shape, a.dtype, a.role) for a in qkv.args
                        for n in [qkv_names.get(a.name)] if n is not None and n not in by_name})
        launches = tuple(Launch(l.kind, l.params, tuple(qkv_names.get(n, f"first_{n}") for n in l.reads),
                                tuple(qkv_names[n] for n in l.writes)) for l in qkv.launches) + launches
    ordered = list(by_name.values())
    outputs = (["out"] + ([] if ends_model else ["next_q_roped"]) + first_rows
               + [f"{n}_{j}" for j in range(last if ends_model else layers) for n in ("next_v", "next_k_roped")])
    args = ([a for a in ordered if a.role in (Role.INPUT, Role.WEIGHT)] + [a for a in ordered if a.role is S]
            + [by_name[n] for n in outputs])
    name = f"decode_layers{layers}" + ("_qkv" if first_qkv else "") + ("_final" if ends_model else "")
    params = (("layers", layers), *one.params, *((("first_qkv", 1),) if first_qkv else ()))
    if lm_head is not None:
        vocab, final_eps, head_weights = lm_head
        if weights != "bf16" and head_weights == "bf16":
            raise ValueError(f"a decode group's LM head is packed when its layers are: layers {weights!r}, LM head "
                             f"{head_weights!r}")
        name += "_packed_lm" if head_weights != weights == "bf16" else "_lm"
        head = lm_head_gemv_program(hidden, vocab, head_weights)
        params += (("vocab", vocab), ("final_eps", final_eps), ("head_weights", head_weights))
        hosts = [a for a in args if a.role in (Role.INPUT, Role.WEIGHT)]
        args = (hosts + [Arg("final_norm_w", (hidden,), "bf16", W), head.arg("w_lm")] + args[len(hosts):]
                + [Arg("final_normed", (hidden,), "bf16", O), head.arg("logits")])
        launches += (_launch("rmsnorm", ["out", "final_norm_w"], ["final_normed"], rows=1, cols=hidden, eps=final_eps),
                     *(Launch(l.kind, l.params, tuple("final_normed" if n == "x" else n for n in l.reads), l.writes)
                       for l in head.launches))
    name = _decode_name(name, weights)
    args, views = _scratch_in_arena(args)
    args, weight_views = _weights_in_arenas(name, args,
                                            layer_arenas(hidden, q_dim, kv_heads * head_dim, intermediate, weights,
                                                         qkv_bias))
    hosts = {a.name: a for a in args if a.role in (Role.INPUT, Role.WEIGHT)}
    order = ([] if first_qkv else ["q"]) + ["x", "length", "next_rope_lut"]
    order += [f"{n}_{j}" for j in range(layers) for n in ("k_cache", "v_cache", "weights", "norms")]
    order += ([] if ends_model else [f"weights_{layers}", f"norms_{layers}"])
    order += ["final_norm_w", "w_lm"] if lm_head is not None else []
    assert sorted(order) == sorted(hosts), (order, list(hosts))
    args = [hosts[n] for n in order] + [a for a in args if a.name not in hosts]
    return Program(name=name, params=params, args=tuple(args), launches=launches, compile_options=DECODE_OPTIONS,
                   views=tuple(views + weight_views))


def _scratch_in_arena(args) -> tuple[list[Arg], list[View]]:
    """A decode group's arguments ``args`` with its device-only scratches as views of one scratch argument per dtype
    (``scratch_<dtype>``, where the first of them was), and those views: its six bf16 scratches (seven in a _qkv
    group) take one of the ELF's argument slots (MAX_KERNEL_ARGS). Each view starts at a whole DMA word."""
    views, ends = [], {}
    for arg in args:
        if arg.role is not S:
            continue
        align = DEVICE.dma_word_bytes // DTYPE_BYTES[arg.dtype] or 1
        start = -(-ends.get(arg.dtype, 0) // align) * align
        views.append(View(arg.name, f"scratch_{arg.dtype}", start, arg.shape, arg.dtype))
        ends[arg.dtype] = start + arg.numel
    moved, placed = [], set()
    for arg in args:
        if arg.role is not S:
            moved.append(arg)
        elif arg.dtype not in placed:
            placed.add(arg.dtype)
            moved.append(Arg(f"scratch_{arg.dtype}", (ends[arg.dtype],), arg.dtype, S))
    return moved, views


# A patched model's LM head holds its weight rows padded with zero rows to a multiple of this (``lm_head_rows``), so
# that its GEMV's tiles walk few panels: Qwen2's 151936 rows (2^7 * 1187) give each of 8 tiles 18992 rows, in panels
# of at most 16 rows (1187 of them); 152064 rows (2^9 * 297) go in 132 panels of 144. Llama-3.2's 128256 and SmolLM2's
# 49152 are multiples already.
LM_HEAD_ROWS_MULTIPLE = 256


def lm_head_rows(vocab: int) -> int:
    """The rows of a patched model's LM-head weight buffer (and of lm_head_gemv's logits) for ``vocab`` tokens."""
    return -(-vocab // LM_HEAD_ROWS_MULTIPLE) * LM_HEAD_ROWS_MULTIPLE


def lm_head_gemv_program(hidden: int, vocab: int, weights: str = "bf16") -> Program:
    """Logits of one (already final-normed) row: a GEMV over the (vocab, hidden) LM-head weight.

    Logits leave the fp32 accumulator as fp32: bf16 logits (spacing 0.125 near 25) turn close
    candidates into ties that greedy decoding then breaks by token id.
    """
    _check_weights(weights)
    packed = {} if weights == "bf16" else {"weights": weights}
    return Program(
        name=_decode_name("lm_head_gemv", weights),
        params=(("hidden", hidden), ("vocab", vocab)),
        args=(
            Arg("x", (hidden,), "bf16", I),
            weight_arg("w_lm", vocab, hidden, weights),
            Arg("logits", (vocab,), "f32", O),
        ),
        launches=(
            _launch("gemv_f32", ["x", "w_lm"], ["logits"], K=hidden, N=vocab, **packed),
        ),
        compile_options=DECODE_OPTIONS,
    )


# The packed decode ops' factories (torch.ops.npu2.<op>_packed): the decode Programs over packed weights.
def _packed_only(weights: str) -> str:
    if weights == "bf16":
        raise ValueError("a packed decode Program takes a packed weight format, not 'bf16'")
    return weights


def rms_gemv_rope_packed_program(hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                                 weights: str, qkv_bias: bool = False) -> Program:
    return rms_gemv_rope_program(hidden, heads, kv_heads, head_dim, eps, _packed_only(weights), qkv_bias)


def o_gemv_ffn_packed_program(hidden: int, q_dim: int, intermediate: int, eps: float, weights: str) -> Program:
    return o_gemv_ffn_program(hidden, q_dim, intermediate, eps, _packed_only(weights))


def o_gemv_ffn_rms_gemv_rope_packed_program(hidden: int, q_dim: int, intermediate: int, eps: float, heads: int,
                                            kv_heads: int, head_dim: int, next_eps: float, weights: str,
                                            qkv_bias: bool = False) -> Program:
    return o_gemv_ffn_rms_gemv_rope_program(hidden, q_dim, intermediate, eps, heads, kv_heads, head_dim, next_eps,
                                            _packed_only(weights), qkv_bias)


def decode_attn_o_gemv_ffn_rms_gemv_rope_packed_program(hidden: int, q_dim: int, intermediate: int, eps: float,
                                                        heads: int, kv_heads: int, head_dim: int, capacity: int,
                                                        next_eps: float, weights: str,
                                                        qkv_bias: bool = False) -> Program:
    return decode_attn_o_gemv_ffn_rms_gemv_rope_program(hidden, q_dim, intermediate, eps, heads, kv_heads, head_dim,
                                                        capacity, next_eps, _packed_only(weights), qkv_bias)


def decode_attn_o_gemv_ffn_packed_program(hidden: int, q_dim: int, intermediate: int, eps: float, heads: int,
                                          kv_heads: int, head_dim: int, capacity: int, weights: str) -> Program:
    return decode_attn_o_gemv_ffn_program(hidden, q_dim, intermediate, eps, heads, kv_heads, head_dim, capacity,
                                          _packed_only(weights))


def lm_head_gemv_packed_program(hidden: int, vocab: int, weights: str) -> Program:
    return lm_head_gemv_program(hidden, vocab, _packed_only(weights))


def dequantize_rows_program(rows: int, in_features: int, weights: str) -> Program:
    """A packed weight's rows (kernels/quant.py, format ``weights``) as its (rows, in_features) bf16 weight, GGUF's
    values rounded once, made on the cores: what the prefill GEMMs read of a model that keeps its projections
    packed (a [gate | up] weight as 2·F rows, its two halves each packed on its own)."""
    return Program(
        name="dequantize_rows",
        params=(("rows", rows), ("in_features", in_features), ("weights", _packed_only(weights))),
        args=(
            weight_arg("w", rows, in_features, weights),
            Arg("out", (rows, in_features), "bf16", O),
        ),
        launches=(
            _launch("dequant_rows", ["w"], ["out"], K=in_features, N=rows, weights=weights),
        ),
        compile_options=DECODE_OPTIONS,
    )


def dequantize_programs(dims: ModelDims, weights: str) -> list[Program]:
    """The dequantize_rows Programs a model with packed projections runs before prefill's GEMMs: [Wq; Wk], Wv, Wo,
    [gate | up] and down."""
    d, packed = dims, _packed_only(weights)
    return [dequantize_rows_program(rows, k, packed) for rows, k in (
        (d.q_dim + d.kv_heads * d.head_dim, d.hidden), (d.kv_heads * d.head_dim, d.hidden), (d.hidden, d.q_dim),
        (2 * d.intermediate, d.hidden), (d.hidden, d.intermediate))]


# The Programs built per prefill bucket (the others, decode's and the LM head's, once per model).
PREFILL_PROGRAM_NAMES = ("rms_gemms_rope", "flash_attn", "o_ffn", "rms_gemms_rope_w8x2", "o_ffn_w8x2")


def prefill_programs(dims: ModelDims, seq: int, matmul_precision: str = DEFAULT_MATMUL_PRECISION) -> list[Program]:
    """A prefill bucket's trio: rms_gemms_rope, flash_attn and o_ffn at ``seq`` rows (their integer-GEMM Programs
    for "w8x2a16"; "auto" as for bf16 weights)."""
    d = dims
    matmul_precision = resolve_matmul_precision(matmul_precision, dims)
    if matmul_precision == INTEGER_PRECISION:
        return [rms_gemms_rope_w8x2_program(d.hidden, d.heads, d.kv_heads, d.head_dim, d.eps, seq, d.qkv_bias),
                flash_attn_program(d.heads, d.kv_heads, d.head_dim, seq),
                o_ffn_w8x2_program(d.hidden, d.q_dim, d.intermediate, d.eps, seq)]
    return [rms_gemms_rope_program(d.hidden, d.heads, d.kv_heads, d.head_dim, d.eps, seq, matmul_precision,
                                   d.qkv_bias),
            flash_attn_program(d.heads, d.kv_heads, d.head_dim, seq),
            o_ffn_program(d.hidden, d.q_dim, d.intermediate, d.eps, seq, matmul_precision)]


def programs_for_model(dims: ModelDims, prefill_buckets,
                       matmul_precision: str = DEFAULT_MATMUL_PRECISION, weights: str = "bf16",
                       lm_head_weights: str | None = None) -> list[Program]:
    """Every Program a model needs: the prefill trio per bucket (its GEMMs in ``matmul_precision``; "auto":
    ``default_matmul_precision``), the decode pair and their chain across a layer boundary (projection weights as
    ``weights``), and the LM head (``lm_head_weights``, by default ``weights``: a patched bf16 model's is
    ``default_lm_head_weights``); with packed ``weights`` and GEMMs over bf16 weights, the dequantize_rows Programs
    that make them."""
    matmul_precision = resolve_matmul_precision(matmul_precision, dims, weights)
    _check_precision(matmul_precision)
    _check_weights(weights)
    d = dims
    attn = (d.hidden, d.heads, d.kv_heads, d.head_dim, d.eps)
    ffn = (d.hidden, d.q_dim, d.intermediate, d.eps)
    out = [program for seq in prefill_buckets for program in prefill_programs(d, seq, matmul_precision)]
    out += [rms_gemv_rope_program(*attn, weights, d.qkv_bias), o_gemv_ffn_program(*ffn, weights),
            o_gemv_ffn_rms_gemv_rope_program(*ffn, d.heads, d.kv_heads, d.head_dim, d.eps, weights, d.qkv_bias),
            lm_head_gemv_program(d.hidden, lm_head_rows(d.vocab), lm_head_weights or weights)]
    if weights != "bf16" and matmul_precision != INTEGER_PRECISION:  # prefill's GEMMs read the projections in bf16
        out += dequantize_programs(d, weights)
    return out


def decode_attn_programs(dims: ModelDims, context: int, weights: str = "bf16") -> list[Program]:
    """Decode attention's Programs, alone and chained into a layer (with the next layer's Q/K/V, and for the last
    layer without; projection weights as ``weights``), at the shortest cache and the longest of a
    ``context``-position model. A patched model builds them at each capacity bucket it meets (any multiple of
    DECODE_ATTN_ROWS_MULTIPLE up to its context); they differ only in the cache's rows and the herd's trip count,
    always even, so a tile holds the same buffers at every capacity and the kernel's configuration is the same:
    these two stand for the rest."""
    _check_weights(weights)
    d = dims
    longest = context // DECODE_ATTN_ROWS_MULTIPLE * DECODE_ATTN_ROWS_MULTIPLE
    if longest < DECODE_ATTN_ROWS_MULTIPLE:
        raise ValueError(f"a model's context holds at least {DECODE_ATTN_ROWS_MULTIPLE} positions for decode "
                         f"attention, got context={context!r}")
    capacities = sorted({DECODE_ATTN_ROWS_MULTIPLE, longest})
    return [program for capacity in capacities for program in (
        decode_attn_program(d.heads, d.kv_heads, d.head_dim, capacity),
        decode_attn_o_gemv_ffn_rms_gemv_rope_program(d.hidden, d.q_dim, d.intermediate, d.eps, d.heads, d.kv_heads,
                                                     d.head_dim, capacity, d.eps, weights, d.qkv_bias),
        decode_attn_o_gemv_ffn_program(d.hidden, d.q_dim, d.intermediate, d.eps, d.heads, d.kv_heads, d.head_dim,
                                       capacity, weights))]
