"""Predicted NPU2 times of Llama-3.2-1B's Programs, and upstream's measured kernels replayed through the same model:
a timing MODEL (``kernels/timing.py``), never a measurement.

Every prediction is a range: its fast end and its slow end each follow from stated assumptions
(``timing.FAST``, ``timing.SLOW``), and both come from what we emit and what the core executes; nothing is fitted
to what the predictions are checked on.

Checks against silicon, none of which set a constant of the model:
- upstream's seven standalone drain GEMMs (mlir-air kernel registry, BFP16 multiplies), built by our gemm builder
  at upstream's tiling; only the DDR rate of the fast end comes from one of them (2048×8192×2048);
- upstream's standalone flash attention at its tested causal shapes (kernel registry, details/
  FlashAttention_bf16.md), built by our attention builder, with BFP16 multiplies as upstream's and exact ones as
  ours;
- upstream's standalone GEMVs at Llama-3.2-1B's shapes (details/GEMV_bf16.md), built by our gemv builder at
  upstream's structure; the slow end's DDR rate comes from its other shapes (``timing.UPSTREAM_GEMV_STREAMS``).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from functools import lru_cache

from torch_npu2.kernels import catalog, core_ops, timing
from torch_npu2.kernels.catalog import DEFAULT_MATMUL_PRECISION, INTEGER_PRECISION, resolve_matmul_precision
from torch_npu2.kernels.device import DEVICE
from torch_npu2.kernels.timing import ENDS

from . import common

LLAMA_1B_LAYERS = 16
REFERENCE_SEQ = 2048
PROMPTS = (32, 128, 2048)
# The headline decode context: decode attention reads the KV cache's capacity bucket of it.
DECODE_CONTEXT = 1024

PUBLISHED_MS = {  # upstream llama32_1b on Strix, per call (KERNELS.md)
    ("rms_gemms_rope", REFERENCE_SEQ): 7.3, ("flash_attn", REFERENCE_SEQ): 21.6, ("o_ffn", REFERENCE_SEQ): 41.0,
    ("rms_gemv_rope", None): 0.9, ("o_gemv_ffn", None): 3.6, ("lm_head_gemv", None): 13.6,
}
GEMM_PROGRAMS = ("rms_gemms_rope", "o_ffn")  # the Programs whose GEMMs take a matmul precision
PRECISIONS = ("bf16", "bfp16_gate_up", "bfp16", INTEGER_PRECISION)
PUBLISHED_PREFILL_2048_S = 1.21          # every prompt padded to 2048
PUBLISHED_DECODE_TOKENS_PER_S = 12.2

# Upstream's standalone flash attention measured on NPU2 (mlir-air programming_examples/kernel_registry/details/
# FlashAttention_bf16.md at d395847, "Tested shapes"; BFP16 multiplies): the causal head_dim-64 rows,
# (seq, heads, kv_heads, head_dim) → measured ms (low, high). Its 21.6 ms in llama32_1b's profile includes buffer
# writes.
UPSTREAM_FLASH_ATTENTION = {
    (2048, 32, 8, 64): (15.4, 16.1), (2048, 32, 32, 64): (16.9, 16.9), (2048, 14, 2, 64): (7.27, 7.27),
    (16384, 2, 2, 64): (39.6, 39.6),
}
# Upstream's standalone GEMVs at Llama-3.2-1B's shapes (details/GEMV_bf16.md at 45c69ab, "Tested shapes"):
# (M, K) → ((herd_m, tile_m, m_input), measured µs). matvec.py runs them with ping-pong off and runtime loop tiling
# [4, 4]; each launch step computes herd_m · tile_m rows, m_input rows per kernel call.
UPSTREAM_LLAMA_GEMVS = {
    (2048, 2048): ((8, 8, 8), 330), (512, 2048): ((8, 8, 8), 136), (8192, 2048): ((8, 8, 8), 1067),
    (2048, 8192): ((8, 2, 2), 1082), (16384, 2048): ((8, 8, 8), 2193),
}

Range = tuple[float, float]


def _scaled(values, factor: float) -> list[float]:
    return [v * factor for v in values]


def _verdict(predicted: Range, measured: Range) -> str:
    """Where a measurement lies against a predicted range: inside it, or how far outside which end."""
    if measured[1] < predicted[0]:
        return f"{1 - measured[1] / predicted[0]:.1%} below the fast end"
    if measured[0] > predicted[1]:
        return f"{measured[0] / predicted[1] - 1:.1%} above the slow end"
    return "inside"


# ---- Llama-3.2-1B predictions -------------------------------------------------------------------------------
def llama_1b_dims():
    from torch_npu2.kernels.catalog import ModelDims

    return ModelDims.from_config(common.llama_config(**common.LLAMA_1B_SHAPE))


# Qwen2.5-0.5B's dims (its config.json): hidden 896, 14 heads over 2 KV heads of 64, intermediate 4864, vocabulary
# 151936 (tied), RMSNorm eps 1e-6, q/k/v biases; 24 layers.
QWEN25_05B_DIMS = catalog.ModelDims(896, 14, 2, 64, 4864, 151936, 1e-6, qkv_bias=True)
QWEN25_05B_LAYERS = 24


def program(name: str, dims, seq: int | None = None, precision: str = "bf16", weights: str = "bf16"):
    """Llama-3.2-1B's Program ``name`` (prefill Programs at ``seq`` rows, their GEMMs at matmul ``precision``;
    decode Programs with their projection weights as ``weights``: bf16 or a packed format)."""
    from torch_npu2.kernels import catalog

    d = dims
    precision = resolve_matmul_precision(precision, dims)
    if name in GEMM_PROGRAMS and precision == INTEGER_PRECISION:  # rms_gemms_rope_w8x2, o_ffn_w8x2
        return next(p for p in catalog.prefill_programs(d, seq, precision) if p.name == f"{name}_w8x2")
    build = {
        "rms_gemms_rope": lambda: catalog.rms_gemms_rope_program(d.hidden, d.heads, d.kv_heads, d.head_dim, d.eps, seq,
                                                                 precision, d.qkv_bias),
        "flash_attn": lambda: catalog.flash_attn_program(d.heads, d.kv_heads, d.head_dim, seq),
        "o_ffn": lambda: catalog.o_ffn_program(d.hidden, d.q_dim, d.intermediate, d.eps, seq, precision),
        "rms_gemv_rope": lambda: catalog.rms_gemv_rope_program(d.hidden, d.heads, d.kv_heads, d.head_dim, d.eps,
                                                               weights, d.qkv_bias),
        "o_gemv_ffn": lambda: catalog.o_gemv_ffn_program(d.hidden, d.q_dim, d.intermediate, d.eps, weights),
        "o_gemv_ffn_rms_gemv_rope": lambda: catalog.o_gemv_ffn_rms_gemv_rope_program(
            d.hidden, d.q_dim, d.intermediate, d.eps, d.heads, d.kv_heads, d.head_dim, d.eps, weights, d.qkv_bias),
        "lm_head_gemv": lambda: catalog.lm_head_gemv_program(d.hidden, catalog.lm_head_rows(d.vocab), weights),
        # decode attention at a capacity of ``seq`` positions
        "decode_attn": lambda: catalog.decode_attn_program(d.heads, d.kv_heads, d.head_dim, seq),
        "decode_attn_o_gemv_ffn_rms_gemv_rope": lambda: catalog.decode_attn_o_gemv_ffn_rms_gemv_rope_program(
            d.hidden, d.q_dim, d.intermediate, d.eps, d.heads, d.kv_heads, d.head_dim, seq, d.eps,
            qkv_bias=d.qkv_bias),
    }
    return build[name]()


def program_range(prog) -> tuple[timing.ProgramCost, ...]:
    """The Program's predicted cost at each end (``timing.ENDS``: fast, slow)."""
    return tuple(timing.program_cost(prog, end) for end in ENDS)


@lru_cache(maxsize=None)
def _seconds(name: str, dims, seq: int | None, precision: str = "bf16", weights: str = "bf16") -> Range:
    return tuple(cost.seconds for cost in program_range(program(name, dims, seq, precision, weights)))


DECODE_PROGRAMS = ("o_gemv_ffn_rms_gemv_rope", "rms_gemv_rope", "o_gemv_ffn", "lm_head_gemv")


def _head_weights(weights: str, lm_head: str | None) -> str:
    return lm_head or catalog.default_lm_head_weights(weights)


def _decode_programs(dims, weights: str, lm_head: str | None):
    """DECODE_PROGRAMS with the projection weights as ``weights``, the LM head's as ``lm_head`` (None: a patched
    model's default for ``weights``)."""
    return [program(name, dims, None, "bf16", _head_weights(weights, lm_head) if name == "lm_head_gemv" else weights)
            for name in DECODE_PROGRAMS]


def decode_ms(dims, layers: int, weights: str = "bf16", lm_head: str | None = None) -> Range:
    """NPU time of one decode token, following NpuDecoderLayer: rms_gemv_rope for the first layer, then per layer
    o_gemv_ffn_rms_gemv_rope (its o_gemv_ffn and the next layer's rms_gemv_rope in one dispatch), o_gemv_ffn for
    the last; then the LM head (the projection weights as ``weights``, the LM head's as ``lm_head``: None, the
    patched model's default)."""
    parts = [tuple(cost.seconds for cost in program_range(prog)) for prog in _decode_programs(dims, weights, lm_head)]
    return tuple((chained * (layers - 1) + first + last + head) * 1e3 for chained, first, last, head in zip(*parts))


# The longest cache decode attention's buckets are computed against (a multiple of its 64-row granule).
DECODE_ATTN_MAX_LEN = 131072


@lru_cache(maxsize=None)
def decode_attention_ms(dims, layers: int, context: int) -> Range:
    """NPU time of one token's decode attention over ``context`` cached positions (the new token's included): one
    decode_attn run, its own dispatch, per layer at the capacity bucket of ``context``. The run streams the whole
    bucket, and the model charges every tile's call at its full work (kernels/core_ops.py: WORK_ARGUMENTS), so a
    context inside a bucket is charged as the bucket's end."""
    from torch_npu2.kernels import catalog

    capacity = catalog.decode_attn_capacity(context, DECODE_ATTN_MAX_LEN)
    prog = catalog.decode_attn_program(dims.heads, dims.kv_heads, dims.head_dim, capacity)
    return tuple(cost.seconds * layers * 1e3 for cost in program_range(prog))


def decode_with_attention_ms(dims, layers: int, context: int, weights: str = "bf16",
                             lm_head: str | None = None) -> Range:
    """``decode_ms`` plus decode attention on the NPU (``decode_attention_ms``): a token whose every step runs on the
    NPU, the layers still dispatched as today plus one decode_attn dispatch per layer."""
    return tuple(a + b for a, b in zip(decode_ms(dims, layers, weights, lm_head),
                                       decode_attention_ms(dims, layers, context)))


def decode_chained_ms(dims, layers: int, context: int, weights: str = "bf16", lm_head: str | None = None) -> Range:
    """A token as the patched model runs it (patch_llama/layer.py, ``NpuDecoderLayer._decode_group``): every layer
    from its attention on, up to ``DECODE_GROUP_SIZES[-1]`` in one dispatch (``decode_group_runs``), the first group
    starting with the first layer's rms_gemv_rope (decode_layers<n>_qkv; a first layer alone runs it as a dispatch
    of its own), the last group running the model's final norm and LM head too (decode_layers<n>_final_lm); a last
    layer alone (decode_attn_o_gemv_ffn) leaves the LM head a dispatch of its own (projection weights as
    ``weights``, the LM head's as ``lm_head``: None, the patched model's default, a bf16 model's Q8_0 copy)."""
    d, head_weights = dims, _head_weights(weights, lm_head)
    capacity = catalog.decode_attn_capacity(context, DECODE_ATTN_MAX_LEN)
    runs, sizes = [], decode_group_runs(layers)
    for index, n in enumerate(sizes):
        ends_model = index == len(sizes) - 1
        if n > 1:
            head = (catalog.lm_head_rows(d.vocab), d.eps, head_weights) if ends_model else None
            run = catalog.decode_layers_program(n, d.hidden, d.q_dim, d.intermediate, d.eps, d.heads, d.kv_heads,
                                                d.head_dim, capacity, d.eps, weights, ends_model, head,
                                                first_qkv=index == 0, qkv_bias=d.qkv_bias)
        else:  # only the last run can be shorter than a full group: the model's last layer alone
            assert ends_model, sizes
            run = catalog.decode_attn_o_gemv_ffn_program(d.hidden, d.q_dim, d.intermediate, d.eps, d.heads,
                                                         d.kv_heads, d.head_dim, capacity, weights)
            runs.append(program_range(catalog.lm_head_gemv_program(d.hidden, catalog.lm_head_rows(d.vocab),
                                                                   head_weights)))
        runs.append(program_range(run))
    if sizes[0] == 1:
        runs.append(program_range(program("rms_gemv_rope", dims, None, "bf16", weights)))
    return tuple(sum(run[end].seconds for run in runs) * 1e3 for end in range(len(ENDS)))


def decode_per_layer_ms(dims, layers: int, context: int, weights: str = "bf16", lm_head: str | None = None) -> Range:
    """A token with one dispatch per layer (patch_llama's ``decode_layers_per_dispatch=1``): the first layer's
    rms_gemv_rope, each layer from its attention on (decode_attn_o_gemv_ffn_rms_gemv_rope, the last
    decode_attn_o_gemv_ffn), then the LM head: ``layers`` + 2 dispatches (weights and LM head as
    ``decode_chained_ms``)."""
    d = dims
    capacity = catalog.decode_attn_capacity(context, DECODE_ATTN_MAX_LEN)
    chained = catalog.decode_attn_o_gemv_ffn_rms_gemv_rope_program(
        d.hidden, d.q_dim, d.intermediate, d.eps, d.heads, d.kv_heads, d.head_dim, capacity, d.eps, weights, d.qkv_bias)
    last = catalog.decode_attn_o_gemv_ffn_program(d.hidden, d.q_dim, d.intermediate, d.eps, d.heads, d.kv_heads,
                                                  d.head_dim, capacity, weights)
    runs = [(program_range(program("rms_gemv_rope", dims, None, "bf16", weights)), 1),
            (program_range(chained), layers - 1), (program_range(last), 1),
            (program_range(program("lm_head_gemv", dims, None, "bf16", _head_weights(weights, lm_head))), 1)]
    return tuple(sum(run[end].seconds * count for run, count in runs) * 1e3 for end in range(len(ENDS)))


def qwen2_predictions(context: int = DECODE_CONTEXT) -> dict:
    """Qwen2.5-0.5B's shape (QWEN25_05B_DIMS: its q/k/v biases added on the NPU), NPU time only: prefill at 2048
    tokens per matmul precision, and a decode token at ``context`` per weight format (bf16 with the LM head's Q8_0
    copy, or packed; each the patched model's default LM head), grouped as the patched model runs it and with one
    dispatch per layer."""
    d, layers = QWEN25_05B_DIMS, QWEN25_05B_LAYERS
    prefill = {precision: list(prefill_ms(d, layers, [(0, REFERENCE_SEQ, REFERENCE_SEQ)], precision))
               for precision in PRECISIONS}
    decode = {weights: {"grouped_ms": list(token_ms(d, layers, context, weights)),
                        "per_layer_dispatch_ms": list(decode_per_layer_ms(d, layers, context, weights)),
                        "weight_bytes_per_token": decode_weight_bytes(d, layers, weights)}
              for weights in catalog.DECODE_WEIGHTS}
    return {"model": f"Qwen2.5-0.5B shape ({layers} layers, hidden {d.hidden}, {d.heads}/{d.kv_heads} heads of "
                     f"{d.head_dim}, intermediate {d.intermediate}, vocabulary {d.vocab}, q/k/v biases)",
            "prefill_2048_ms": prefill, "decode_context": context, "decode": decode,
            "dispatches_per_token": {"grouped": decode_dispatches(layers), "per_layer": layers + 2}}


def decode_group_runs(layers: int) -> list[int]:
    """How many layers each dispatch from attention on takes in a token of ``layers`` layers, in runs of up to
    DECODE_GROUP_SIZES[-1], the last ending with the model's last layer (decode_layers<n>_final, or
    decode_attn_o_gemv_ffn alone): what NpuDecoderLayer does when every layer can join a group (same dims and
    weight format, no Q/K/V biases, no hooks)."""
    from torch_npu2.kernels.catalog import DECODE_GROUP_SIZES

    sizes, left = [], layers
    while left:
        sizes.append(min(DECODE_GROUP_SIZES[-1], left))
        left -= sizes[-1]
    return sizes


def decode_dispatches(layers: int) -> int:
    """Dispatches per decode token: the runs of layers, the first of which runs the first layer's rms_gemv_rope
    unless it is a layer alone (rms_gemv_rope then a dispatch of its own), the last the LM head unless it is a layer
    alone (the LM head then a dispatch of its own)."""
    runs = decode_group_runs(layers)
    return len(runs) + (runs[0] == 1) + (runs[-1] == 1)


def token_ms(dims, layers: int, context: int, weights: str = "bf16", lm_head: str | None = None) -> Range:
    """NPU time of the decode token a patched model runs at ``context``: each layer from its attention on as one
    dispatch (``decode_chained_ms``), with bf16 or packed weights (and the LM head's as ``lm_head``: None, the
    patched model's default)."""
    return decode_chained_ms(dims, layers, context, weights, lm_head)


def decode_weight_bytes(dims, layers: int, weights: str = "bf16", lm_head: str | None = None) -> int:
    """Weight bytes one decode token streams from DDR (every weight argument of the decode Programs, once each)."""
    counts = (layers - 1, 1, 1, 1)
    return sum(count * sum(a.nbytes for a in prog.args if a.role.value == "weight")
               for prog, count in zip(_decode_programs(dims, weights, lm_head), counts))


@lru_cache(maxsize=None)
def dequantize_ms(dims, weights: str) -> Range:
    """NPU time of one layer's dequantize_rows Programs (its packed projections to the bf16 rows prefill's GEMMs
    read: what a layer with packed weights runs once per prefill, before its GEMMs)."""
    from torch_npu2.kernels import catalog

    costs = [program_range(prog) for prog in catalog.dequantize_programs(dims, weights)]
    return tuple(sum(ends[index].seconds for ends in costs) * 1e3 for index in range(len(ENDS)))


def prefill_ms(dims, layers: int, chunks, precision: str = "bf16", weights: str = "bf16",
               lm_head: str | None = None) -> Range:
    """NPU time of a prefill over ``chunks`` [(start, stop, padded)] with the GEMMs at matmul ``precision``,
    following NpuDecoderLayer: each layer's packed projections dequantized once (``weights`` a packed format; not
    with the integer GEMMs, which read copies prepared from the packed rows at patch time), then per chunk its
    GEMMs; flash_attn runs on the NPU only for a single chunk (several chunks attend on the host, not modelled
    here); then the LM head on the last row (in ``lm_head``'s format: None, the patched model's default)."""
    ends = []
    dequantizes = weights != "bf16" and precision != INTEGER_PRECISION
    for index in range(len(ENDS)):
        per_layer = dequantize_ms(dims, weights)[index] / 1e3 if dequantizes else 0.0
        for _, _, padded in chunks:
            per_layer += (_seconds("rms_gemms_rope", dims, padded, precision)[index]
                          + _seconds("o_ffn", dims, padded, precision)[index])
            if len(chunks) == 1:
                per_layer += _seconds("flash_attn", dims, padded)[index]
        head = _seconds("lm_head_gemv", dims, None, "bf16", _head_weights(weights, lm_head))[index]
        ends.append((layers * per_layer + head) * 1e3)
    return tuple(ends)


def _summary(costs: tuple[timing.ProgramCost, ...]) -> dict:
    """A Program's predicted range: total, per launch, per compute class; branches as the fast end counts them."""
    fast, slow = costs
    classes = sorted(set(fast.compute_s()) | set(slow.compute_s()))
    return {"program": fast.name, "predicted_ms": [c.seconds * 1e3 for c in costs],
            "launch_iterations": sum(l.iterations for l in fast.launches),
            "ddr_mb": sum(l.ddr_bytes for l in fast.launches) / 1e6,
            "compute_ms_by_class": {k: [c.compute_s().get(k, 0.0) * 1e3 for c in costs] for k in classes},
            "launches": [{"kind": f.kind, "predicted_ms": [f.seconds * 1e3, s.seconds * 1e3],
                          "iterations": f.iterations} for f, s in zip(fast.launches, slow.launches)],
            "conditions": [{"launch": l.kind, **asdict(c)} for l in fast.launches for c in l.conditions]}


def per_program(dims) -> list[dict]:
    """Each Program upstream publishes a time for, its range next to upstream's time; a prefill Program also with
    its GEMMs at bfp16 (upstream's mode: its published times are of BFP16-emulated GEMMs), with only its gate/up
    GEMM at bfp16 and as its integer-GEMM Program (w8x2a16); flash_attn also with its multiplies through BFP16, as upstream's (ours are exact)."""
    rows = []
    for (name, seq), published in PUBLISHED_MS.items():
        prog = program(name, dims, seq)
        row = _summary(program_range(prog))
        gemms = name in GEMM_PROGRAMS
        row["predicted_ms_w8x2a16"] = _scaled(_seconds(name, dims, seq, INTEGER_PRECISION), 1e3) if gemms else None
        row["predicted_ms_bfp16_gate_up"] = _scaled(_seconds(name, dims, seq, "bfp16_gate_up"), 1e3) if gemms else None
        row["predicted_ms_bfp16"] = (_scaled(_seconds(name, dims, seq, "bfp16"), 1e3) if gemms
                                     else list(_tuned_range(prog, precision="bfp16")) if name == "flash_attn" else None)
        like_for_like = row["predicted_ms_bfp16"] or row["predicted_ms"]
        rows.append({**row, "seq": seq, "upstream_published_ms": published,
                     "upstream_against_range": _verdict(like_for_like, (published, published))})
    return rows


def predictions(prompts=PROMPTS, host: dict | None = None) -> dict:
    """Prefill ranges per matmul precision and the decode range; ``host`` is the host-overhead section's
    measurement (``host_measurement``), added to the predicted NPU time of a decode token when given."""
    from .work import prefill_settings

    dims, layers, state = llama_1b_dims(), LLAMA_1B_LAYERS, prefill_settings()
    prefill = []
    for length in prompts:
        chunks = state.chunks(length)
        prefill.append({"prompt_tokens": length, "buckets": [p for _, _, p in chunks],
                        "upstream_published_ms": PUBLISHED_PREFILL_2048_S * 1e3,
                        **{f"predicted_ms_{precision}": list(prefill_ms(dims, layers, chunks, precision))
                           for precision in PRECISIONS},
                        # a model whose projections are packed Q4_1 (their default: bf16 GEMMs on the weights
                        # dequantize_rows makes once per layer)
                        "predicted_ms_bf16_q4_1_weights": list(prefill_ms(dims, layers, chunks, "bf16", "q4_1"))})
    npu_ms = token_ms(dims, layers, DECODE_CONTEXT)
    host_ms = host["token_ms"] if host else None
    total = [ms + (host_ms or 0.0) for ms in npu_ms]
    decode = {"npu_ms_per_token": list(npu_ms), "dispatches_per_token": decode_dispatches(layers),
              "host_ms_per_token_measured_here": host_ms, "host_measurement": host,
              "total_ms_per_token": total, "tokens_per_s": [1e3 / ms for ms in reversed(total)],
              "upstream_published_tokens_per_s": PUBLISHED_DECODE_TOKENS_PER_S,
              "upstream_published_ms_per_token": 1e3 / PUBLISHED_DECODE_TOKENS_PER_S}
    return {"prefill": prefill, "decode": decode}


def headline() -> dict:
    """Llama-3.2-1B in the default matmul precision, NPU time only: a prefill of 2048 tokens (one bucket, 16 layers
    and the LM head) and one decode token at DECODE_CONTEXT, its attention on the NPU as the patched model runs it (``token_ms``)."""
    dims = llama_1b_dims()
    prefill = prefill_ms(dims, LLAMA_1B_LAYERS, [(0, REFERENCE_SEQ, REFERENCE_SEQ)], DEFAULT_MATMUL_PRECISION)
    return {"prefill_2048_s": [ms / 1e3 for ms in prefill],
            "decode_token_s": [ms / 1e3 for ms in token_ms(dims, LLAMA_1B_LAYERS, DECODE_CONTEXT)]}


# ---- upstream's measured kernels through the model ---------------------------------------------------------------
def gemm_program(M: int, K: int, N: int, precision: str = "bfp16", compile_options=None):
    """A Program of one prefill GEMM, ``C = A · Wᵀ`` (the prefill Programs' aircc options unless given)."""
    from torch_npu2.kernels.catalog import PREFILL_OPTIONS
    from torch_npu2.kernels.program import Arg, Launch, Program, Role

    return Program("gemm", (Arg("a", (M, K), "bf16", Role.INPUT), Arg("w", (N, K), "bf16", Role.WEIGHT),
                            Arg("c", (M, N), "bf16", Role.OUTPUT)),
                   (Launch("gemm", (("M", M), ("K", K), ("N", N), ("precision", precision)), ("a", "w"), ("c",)),),
                   compile_options=compile_options or PREFILL_OPTIONS)


def _tuned_costs(prog, tuning: dict | None = None, precision: str | None = None) -> list[list[timing.LaunchCost]]:
    """A Program's launch costs at each end, its launches built with ``tuning`` and their multiplies at
    ``precision`` when given (else the builders' choice and the launch's own)."""
    from torch_npu2.kernels.builders import build_launch

    irs = [build_launch(prog, launch, tuning) for launch in prog.launches]
    return [[timing.launch_cost(ir, prog.compile_options, end, precision or launch.p.get("precision"))
             for ir, launch in zip(irs, prog.launches)] for end in ENDS]


def _tuned_range(prog, tuning: dict | None = None, precision: str | None = None) -> Range:
    """A Program's predicted ms at each end (see ``_tuned_costs``), one dispatch included (``timing.run_seconds``)."""
    return tuple(timing.run_seconds(launches, end) * 1e3
                 for end, launches in zip(ENDS, _tuned_costs(prog, tuning, precision)))


def _replay_row(measured_ms: Range, predicted_ms: Range, **fields) -> dict:
    middle = sum(measured_ms) / 2
    return {**fields, "measured_ms": list(measured_ms), "predicted_ms": list(predicted_ms),
            "predicted_over_measured": [p / middle for p in predicted_ms],
            "measured_against_range": _verdict(predicted_ms, measured_ms)}


def upstream_gemm_replay() -> list[dict]:
    """Each of upstream's measured drain GEMMs (``timing.UPSTREAM_DRAIN_GEMMS``) through the model: our gemm builder
    at upstream's shape and tiling, BFP16 multiplies, one dispatch; and the shape at the tiling our builder
    chooses."""
    rows = []
    for (M, K, N), ((tile_m, tile_k_l2, tile_k_l1, tile_n), gflops) in timing.UPSTREAM_DRAIN_GEMMS.items():
        prog = gemm_program(M, K, N)
        tuning = {"herd_m": 8, "herd_n": 4, "tile_m": tile_m, "tile_n": tile_n, "tile_k_l1": tile_k_l1,
                  "tile_k_l2": tile_k_l2, "drain_n": tile_n}  # upstream's drain rounds the whole tile
        measured = timing.measured_gemm_s((M, K, N), gflops) * 1e3
        rows.append(_replay_row((measured, measured), _tuned_range(prog, tuning), shape=[M, K, N],
                                tiles=[tile_m, tile_k_l2, tile_k_l1, tile_n],
                                predicted_ours_ms=list(_tuned_range(prog))))
    return rows


def upstream_attention_replay() -> list[dict]:
    """Upstream's standalone flash attention (``UPSTREAM_FLASH_ATTENTION``, 32 tiles at every shape) against our
    flash_attn Program of the same shape (its stack launch included; its herd spans 32 tiles where four query heads
    share a KV head, or where the rows take parts of the sequence instead): multiplies through
    BFP16 as upstream's, and exact as ours."""
    from torch_npu2.kernels import catalog

    rows = []
    for (seq, heads, kv_heads, head_dim), measured in UPSTREAM_FLASH_ATTENTION.items():
        prog = catalog.flash_attn_program(heads, kv_heads, head_dim, seq)
        tiles = max(l.tiles for l in _tuned_costs(prog)[0])
        rows.append(_replay_row(measured, _tuned_range(prog, precision="bfp16"), seq=seq, heads=heads,
                                kv_heads=kv_heads, head_dim=head_dim, tiles=tiles, upstream_tiles=32,
                                predicted_exact_bf16_ms=list(_tuned_range(prog))))
    return rows


def gemv_program(M: int, K: int):
    """A Program of one decode GEMV, ``y = W · x`` (W M×K), compiled as upstream's matvec.py is: ping-pong off,
    runtime loop tiling [4, 4]."""
    from torch_npu2.kernels.program import Arg, CompileOptions, Launch, Program, Role

    return Program("gemv", (Arg("x", (K,), "bf16", Role.INPUT), Arg("w", (M, K), "bf16", Role.WEIGHT),
                            Arg("y", (M,), "bf16", Role.OUTPUT)),
                   (Launch("gemv", (("K", K), ("N", M)), ("x", "w"), ("y",)),),
                   compile_options=CompileOptions(runtime_loop_tiling_sizes=(4, 4), omit_pingpong="all"))


def upstream_gemv_replay() -> list[dict]:
    """Upstream's standalone GEMVs at Llama-3.2-1B's shapes (``UPSTREAM_LLAMA_GEMVS``) through the model: our gemv
    builder at upstream's structure (herd_m tiles, herd_m · tile_m rows per launch step, m_input rows per call)."""
    rows = []
    for (M, K), ((herd_m, tile_m, m_input), us) in UPSTREAM_LLAMA_GEMVS.items():
        tuning = {"herd": herd_m, "steps": M // (herd_m * tile_m), "tile_n": tile_m, "rows_per_call": m_input}
        rows.append(_replay_row((us / 1e3, us / 1e3), _tuned_range(gemv_program(M, K), tuning), shape=[M, K],
                                tiles=[herd_m, tile_m, m_input]))
    return rows


# ---- output ------------------------------------------------------------------------------------------------------
def host_measurement(out_dir) -> dict | None:
    """Host time per decode token measured by the host section (``benchmarks/host_overhead.py``) in ``out_dir``,
    at its shortest context, if it ran there: the whole token with the NPU's arithmetic removed, host attention
    included (decode attention runs on the CPU in this design, in series with the NPU launches)."""
    path = out_dir / "host_overhead.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    shortest = result["contexts"][0]
    return {"token_ms": shortest["token_ms"], "host_attention_ms": shortest["host_attention_ms"],
            "host_overhead_ms": shortest["host_overhead_ms"], "context_tokens": shortest["context_tokens"],
            "mode": result["mode"], "finished": result["finished"]}


def span(values, digits: int = 1, unit: str = "") -> str:
    """A predicted range as text: ``low–high`` (one number when both ends agree at that precision)."""
    low, high = (f"{v:.{digits}f}" for v in values)
    return f"{low}{unit}" if low == high else f"{low}–{high}{unit}"


def decode_line(decode: dict) -> str:
    """The decode prediction in words, labelled: predicted NPU time, plus the host time measured here if any."""
    host_ms, host = decode["host_ms_per_token_measured_here"], decode.get("host_measurement")
    if host_ms is None:
        total = (f"NPU {span(decode['npu_ms_per_token'])} ms ({span(decode['tokens_per_s'])} tok/s, NPU only: no "
                 f"host measurement in this run)")
    else:
        where = (f" (the host section, {host['mode']} mode, context {host['context_tokens']}: overhead "
                 f"{host['host_overhead_ms']:.2f} ms + host attention {host['host_attention_ms']:.2f} ms)"
                 if host else "")
        total = (f"{span(decode['total_ms_per_token'])} ms ({span(decode['tokens_per_s'])} tok/s) = predicted NPU "
                 f"{span(decode['npu_ms_per_token'])} ms + measured host {host_ms:.2f} ms{where}")
    return (f"Decode per token at context {DECODE_CONTEXT}, attention on the NPU: {total}; upstream published {decode['upstream_published_tokens_per_s']} tok/s "
            f"({decode['upstream_published_ms_per_token']:.0f} ms).")


def constants() -> dict:
    return {"clock_hz": DEVICE.clock_hz, "tile_channel_gb_per_s": DEVICE.tile_channel_bytes_per_s / 1e9,
            "shim_column_gb_per_s": timing.SHIM_COLUMN_BYTES_PER_S / 1e9,
            "launch_iteration_us": timing.LAUNCH_ITERATION_S * 1e6,
            "ends": {end.name: {**asdict(end), "ddr_gb_per_s": end.ddr_bytes_per_s / 1e9} for end in ENDS},
            "throughput": {name: {"per_cycle_per_tile": list(t.per_cycle), "unit": t.unit, "source": t.source}
                           for name, t in timing.THROUGHPUT.items()},
            "mmul_instructions": {f"{precision} {'x'.join(map(str, shape))}": asdict(emitted)
                                  for (precision, shape), emitted in core_ops.MMUL_INSTRUCTIONS.items()}}


def plot(data: dict, path) -> None:
    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    rows = data["per_program"]
    names = [f"{r['program']}\n{r['seq'] or 'decode'}" for r in rows]
    positions = range(len(rows))
    for key, offset, color, label in (("predicted_ms", -0.15, "tab:blue", "ours, bf16 (MODEL, fast–slow end)"),
                                      ("predicted_ms_bfp16", 0.15, "tab:green", "ours, bfp16 multiplies (MODEL)")):
        shown = [(p + offset, r[key]) for p, r in zip(positions, rows) if r[key]]
        left.bar([x for x, _ in shown], [high - low for _, (low, high) in shown],
                 bottom=[low for _, (low, _) in shown], width=0.3, color=color, label=label)
    left.scatter(positions, [r["upstream_published_ms"] for r in rows], color="tab:red", zorder=3,
                 label="upstream (published)")
    left.set_xticks(list(positions), names, fontsize=7)
    left.set_yscale("log")
    left.set_ylim(bottom=0.5 * min(r["predicted_ms"][0] for r in rows))
    left.set_ylabel("ms per call")
    left.set_title("Predicted ranges (MODEL, not measured) vs upstream, Llama-3.2-1B", fontsize=10)
    left.legend(fontsize=8)
    prefill = data["predictions"]["prefill"]
    lengths = [r["prompt_tokens"] for r in prefill]
    for precision, color in (("bf16", "tab:blue"), ("bfp16", "tab:green")):
        ends = [r[f"predicted_ms_{precision}"] for r in prefill]
        right.fill_between(lengths, [e[0] for e in ends], [e[1] for e in ends], color=color, alpha=0.4,
                           label=f"ours, {precision} GEMMs (MODEL)")
    right.plot(lengths, [r["upstream_published_ms"] for r in prefill], marker="o", color="tab:red",
               label="upstream, pad to 2048 (published)")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("prompt tokens")
    right.set_ylabel("prefill ms (NPU)")
    right.set_title("Prefill: MODEL, not a measurement", fontsize=10)
    right.legend(fontsize=8)
    common.save_figure(fig, path)


def run(mode: str, out_dir, log=print) -> dict:
    started = time.perf_counter()
    dims = llama_1b_dims()
    rows = per_program(dims)
    data = {
        "label": "MODEL (predicted NPU2 times from our emitted IR and what the core executes), not a measurement; "
                 "every prediction a [fast end, slow end] range",
        "method": f"{timing.__doc__.strip()}\n\n{__doc__.strip()}",
        "constants": constants(),
        "headline": headline(),
        "headline_note": f"Llama-3.2-1B, matmul precision "
                         f"{resolve_matmul_precision(DEFAULT_MATMUL_PRECISION, llama_1b_dims())} (the default), NPU "
                         "time only, "
                         f"[fast end, slow end] in seconds; decode at context {DECODE_CONTEXT} with its attention on the NPU "
                         "(host overhead comes on top)",
        "per_program": rows,
        "predictions": predictions(host=host_measurement(out_dir)),
        "upstream_gemm_replay": upstream_gemm_replay(),
        "upstream_attention_replay": upstream_attention_replay(),
        "upstream_gemv_replay": upstream_gemv_replay(),
        "qwen2": qwen2_predictions(),
    }
    for end in ENDS:
        log(f"{end.name} end: {end.assumption}")
    for r in rows:
        bfp16 = f" ({span(r['predicted_ms_bfp16'], 2)} ms with bfp16 multiplies)" if r["predicted_ms_bfp16"] else ""
        log(f"{r['program']:>15} {str(r['seq'] or 'decode'):>6}: predicted {span(r['predicted_ms'], 2)} ms{bfp16}; "
            f"upstream {r['upstream_published_ms']:.1f} ms, against the like-for-like range: "
            f"{r['upstream_against_range']}")
        for c in r["conditions"]:
            log(f"{'':>23} {c['launch']}: {c['text']}: " + (
                f"NOT EVALUATED ({c['unevaluated']}), counted as always taken" if c["unevaluated"] else
                f"taken in {c['work_share']:.1%} of executions, {c['time_share']:.1%} for the slowest tile"))
    for p in data["predictions"]["prefill"]:
        log(f"prefill {p['prompt_tokens']:5d} tokens: predicted " + ", ".join(
            f"{span(p[f'predicted_ms_{precision}'], 0)} ms ({precision})" for precision in PRECISIONS)
            + f", {span(p['predicted_ms_bf16_q4_1_weights'], 0)} ms (bf16, over Q4_1 weights dequantized on the NPU)"
            + f"; upstream published {p['upstream_published_ms']:.0f} ms")
    log(decode_line(data["predictions"]["decode"]))
    head = data["headline"]
    log(f"headline (Llama-3.2-1B, default precision, NPU only): prefill 2048 {span(head['prefill_2048_s'], 2)} s, "
        f"decode {span(_scaled(head['decode_token_s'], 1e3))} ms per token")
    qwen = data["qwen2"]
    log(f"{qwen['model']}, NPU only: prefill 2048 " + ", ".join(
        f"{span(ms, 0)} ms ({precision})" for precision, ms in qwen["prefill_2048_ms"].items())
        + f"; decode at context {qwen['decode_context']} in {qwen['dispatches_per_token']['grouped']} dispatches "
        f"(one per layer: {qwen['dispatches_per_token']['per_layer']}): " + ", ".join(
            f"{span(row['grouped_ms'])} ms ({span(row['per_layer_dispatch_ms'])}) {weights}"
            for weights, row in qwen["decode"].items()))
    log("upstream's measured kernels through the model (measured ms; predicted fast–slow ms; predicted / measured):")
    for title, key, label in (("drain GEMMs (M×K×N, upstream's tiling)", "upstream_gemm_replay", "shape"),
                              ("GEMVs (M×K, upstream's structure)", "upstream_gemv_replay", "shape")):
        log(f"  {title}:")
        for r in data[key]:
            log(f"  {'x'.join(map(str, r[label])):>15}: {span(r['measured_ms'], 3)}; {span(r['predicted_ms'], 3)} "
                f"(×{span(r['predicted_over_measured'], 2)}, {r['measured_against_range']})")
    log("  flash attention (seq, heads/kv heads, our tiles; BFP16 multiplies; exact bf16 as ours):")
    for r in data["upstream_attention_replay"]:
        log(f"  {r['seq']:>6} {r['heads']}/{r['kv_heads']}, {r['tiles']} tiles: {span(r['measured_ms'], 2)}; "
            f"{span(r['predicted_ms'], 2)} (×{span(r['predicted_over_measured'], 2)}, {r['measured_against_range']}); "
            f"exact {span(r['predicted_exact_bf16_ms'], 2)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(data, out_dir / "cost_model.png")
    common.write_result("cost_model", data, out_dir, mode, started)
    return data
