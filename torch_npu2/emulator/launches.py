"""What each launch kind computes on the emulated NPU2, with the NPU's numerics.

Inputs arrive as tensors viewing device memory (bf16); matmuls and reductions accumulate in fp32 and
round once; elementwise kernels round where HF's modules round (the kernels are written to reproduce
HF's bf16 results, so per-layer comparisons measure the NPU path, not a different rounding order).
Results are written back in their buffer's dtype: bf16 between launches, fp32 only for the LM head's logits.
A decode GEMV over packed block-quantized weights (launch param ``weights``) multiplies by GGUF's exact
dequantization (kernels/quant.py) with fp32 sums, then rounds where the bf16 GEMV rounds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import host_build, int_gemm, quant
from ..kernels.catalog import decode_attn_length_value
from .bfp16 import quantize_bf16_to_bfp16


def rmsnorm(p, x, weight):
    # Normalized values are rounded to bf16 before the weight multiply, HF's (and our kernel's) order.
    h = x.reshape(p["rows"], p["cols"]).float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + p["eps"])).to(torch.bfloat16)
    return h * weight


def packed_matvec(p, x, w):
    """fp32 ``W x`` of a packed weight: GGUF's exact weights, fp32 sums. The host build of gemv.cc's gemv_q_*
    runs it (the same sums; widening the weight in torch every token costs several times more); without a host
    compiler, torch on the dequantized weight."""
    K, rows = p["K"], w.reshape(p["N"], -1)
    if host_build.host_compiler() is None:
        return F.linear(x.reshape(-1).float(), quant.dequantize(quant.weight_format(p["weights"]), rows, K))
    return host_build.gemv_packed(rows, x.reshape(-1), p["weights"], tile_rows=p["N"], fast=True)


def matmul(p, a, w):
    # torch's bf16 CPU matmul accumulates in fp32 and rounds once: the AIE2P bf16 GEMM contract. W's rows may be
    # longer than K (w_cols, the launch's K from w_col0).
    if "weights" in p:  # a decode GEMV over packed rows, rounded to bf16 once
        return packed_matvec(p, a, w).to(torch.bfloat16)
    K, col0 = p["K"], p.get("w_col0", 0)
    a, w = a.reshape(-1, K), w.reshape(p["N"], p.get("w_cols", K))[:, col0:col0 + K]
    if p.get("precision") in int_gemm.WEIGHT_TERMS:
        # an integer precision studied over bf16 weights (benchmarks/precision.py): kernels/int_gemm.py's numerics
        return int_gemm.integer_gemm(a, w, p["precision"])
    if p.get("precision") == "bfp16":
        # A GEMM built with BFP16 emulation first converts both operands to bfp16ebs8 (blocks of 8 along K);
        # the converted values are bf16 values and their products exact, so the bf16 matmul then matches.
        a, w = quantize_bf16_to_bfp16(a), quantize_bf16_to_bfp16(w)
    return F.linear(a, w)


def gemv_add(p, x, w, residual):
    # The projection rounds to bf16, then the residual add in fp32 rounds once: the unfused gemv → add.
    return add(p, residual, matmul(p, x, w).reshape(-1))


def gemm_swiglu(p, a, w):
    # W is [Wg | Wu] (N × 2K); gate and up rounded to bf16, then silu_mul's rounding: gemm, gemm → silu_mul.
    gate, up = (matmul(dict(p, w_cols=2 * p["K"], w_col0=col0), a, w) for col0 in (0, p["K"]))
    return silu_mul(p, gate, up)


def quantize_rows(p, x):
    """Each row quantized to int16 for the integer GEMMs, written as their runs (kernels/int_gemm.py)."""
    q, scale = int_gemm.quantize_activations(x.reshape(p["M"], p["K"]), int_gemm.ACTIVATION_QMAX["w8x2a16"])
    return int_gemm.pack_activations(q, scale)


def _integer_projection(p, a, terms):
    q, scale = int_gemm.unpack_activations(a.reshape(p["M"], -1), p["K"])
    return int_gemm.integer_product(q, scale, *terms)


def gemm_int(p, a, w):
    """bf16 output of quantized activations times prepared two-term weights (kernels/int_gemm.py's numerics)."""
    return _integer_projection(p, a, int_gemm.untile_weights(w, p["N"], p["K"], p["tile_n"]))


def gemm_int_swiglu(p, a, w):
    # a [gate | up] pair: both projections rounded to bf16, then silu_mul's rounding, as gemm_swiglu
    hi, lo, scale = int_gemm.untile_weights(w, 2 * p["N"], p["K"], p["tile_n"], halves=2)
    gate, up = (_integer_projection(p, a, (hi[half], lo[half], scale[half]))
                for half in (slice(0, p["N"]), slice(p["N"], None)))
    return silu_mul(p, gate, up)


def rms_gemv(p, x, norm_w, w):
    # RMSNorm, then the projection rounded to bf16: the unfused rmsnorm → gemv. With ``swiglu`` (over
    # [w_gate | w_up] rows, interleaved gate and up), silu_mul's rounding on each pair: the unfused gemv → silu_mul.
    y = matmul(p, rmsnorm(dict(rows=1, cols=p["K"], eps=p["eps"]), x, norm_w).reshape(-1), w)
    if not p.get("swiglu"):
        return y
    pairs = y.reshape(-1, 2)
    return silu_mul(p, pairs[:, 0], pairs[:, 1])


def rope(p, x, lut):
    # bf16 products, then a bf16 sum: the rounding points of HF's (q * cos) + (rotate_half(q) * sin).
    rows, heads, hd = p["rows"], p["heads"], p["head_dim"]
    half = hd // 2
    xh = x.reshape(rows, heads, hd)
    table = lut.reshape(rows, 1, hd)
    cos, sin = table[..., :half], table[..., half:]
    lo, hi = xh[..., :half], xh[..., half:]
    return torch.cat((lo * cos + (-hi) * sin, hi * cos + lo * sin), -1)


def rope_qk(p, qk, lut):
    # one position's Q and K rows (the row [q | k]), each head as rope rotates it
    q_dim = p["heads"] * p["head_dim"]
    flat = qk.reshape(-1)
    return (rope(dict(rows=1, heads=p["heads"], head_dim=p["head_dim"]), flat[:q_dim], lut),
            rope(dict(rows=1, heads=p["kv_heads"], head_dim=p["head_dim"]), flat[q_dim:], lut))


def silu_mul(p, gate, up):
    # SiLU in fp32 rounded to bf16, then the bf16 product: HF's act_fn(gate) * up.
    return F.silu(gate) * up


def add(p, a, b):
    return a.float() + b.float()


def bias_add(p, x, bias):
    # the projection's bf16 result plus the bias, rounded once more (builders/bias_add.py)
    return x.reshape(p["rows"], p["cols"]).float() + bias.float()


ATTENTION_QUERY_BLOCK = 256


KV_BLOCK = 8  # stack lays each input out in 8-column blocks (kernels/builders/stack.py), attention reads them


def stack(p, first, second):
    """[head][first, second][8-column block][row][8] (builders/stack.py), as a (2, rows, cols) tensor."""
    rows, cols, hd = p["rows"], p["cols"], p["head_dim"]
    pair = torch.stack((first.reshape(rows, cols), second.reshape(rows, cols)))
    blocks = pair.reshape(2, rows, cols // hd, hd // KV_BLOCK, KV_BLOCK).permute(2, 0, 3, 1, 4)
    return blocks.reshape(2, rows, cols)


def exact_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Q·Kᵀ of bf16 (heads, rows, head_dim) queries and (keys, head_dim) keys, fp32 sums of exact products."""
    return torch.matmul(q.float(), k.float().T)


def exact_mix(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """P·V of fp32 probabilities, rounded to bf16 as they enter the mmul, and bf16 (keys, head_dim) values."""
    return torch.matmul(probs.to(torch.bfloat16), v)


def attention(p, q, kv, scores_of=exact_scores, mix_of=exact_mix):
    """Scores accumulate in fp32, softmax in fp32, probabilities enter the P·V matmul as bf16 (as the
    kernel's bf16 mmul and HF's eager attention do). Query blocks of one KV head's group at a time: a block
    only scores the keys causality lets it see, which bounds memory and skips the masked half. ``scores_of`` and
    ``mix_of``: the two products (benchmarks/precision.py's attention studies swap them)."""
    seq, heads, kv_heads, hd = p["seq"], p["heads"], p["kv_heads"], p["head_dim"]
    group = heads // kv_heads
    qh = q.reshape(seq, heads, hd).transpose(0, 1)
    # stack's layout: [KV head][keys, values][8-column block][position][8]
    kh, vh = kv.reshape(kv_heads, 2, hd // KV_BLOCK, seq, KV_BLOCK).permute(1, 0, 3, 2, 4).reshape(2, kv_heads, seq, hd)
    out = torch.empty(heads, seq, hd, dtype=torch.bfloat16)
    for start in range(0, seq, ATTENTION_QUERY_BLOCK):
        stop = min(seq, start + ATTENTION_QUERY_BLOCK)
        visible = stop if p["causal"] else seq
        hidden = (torch.arange(start, stop)[:, None] < torch.arange(visible)[None, :]) if p["causal"] else None
        for g in range(kv_heads):
            heads_g = slice(g * group, (g + 1) * group)
            scores = scores_of(qh[heads_g, start:stop], kh[g, :visible]) * hd ** -0.5
            if hidden is not None:
                scores.masked_fill_(hidden, float("-inf"))
            out[heads_g, start:stop] = mix_of(torch.softmax(scores, dim=-1), vh[g, :visible])
    return out.transpose(0, 1)


# decode_attention.cc's constants: its mask value (-2^100), and exp2's scale in fp32
DECODE_MASKED = -2.0 ** 100
LOG2E = 1.4426950408889634


def decode_attention(p, q, k, v, length):
    """decode_attention.cc's arithmetic, tile by tile, all KV heads at once: fp32 scores, a running max rounded to
    bf16, probabilities exp2((s - max) * scale * log2 e) rounded to bf16 and rescaled sums and P.V in fp32, the
    output acc * (1 / sum) rounded once. Positions at or past the length (``length``'s digits, clamped to the
    capacity) are not read."""
    capacity, heads, kv_heads, hd, tile = (p[n] for n in ("capacity", "heads", "kv_heads", "head_dim", "tile_kv"))
    group = heads // kv_heads
    valid = max(0, min(decode_attn_length_value(length.float().tolist()), capacity))
    logit_scale = float(torch.tensor(hd ** -0.5 * LOG2E, dtype=torch.float32))  # the kernel's fp32 constant
    queries = q.reshape(kv_heads, group, hd).float()
    keys, values = (t.reshape(capacity, kv_heads, hd)[:valid].transpose(0, 1).float() for t in (k, v))
    row_max = torch.full((kv_heads, group), DECODE_MASKED)
    row_sum = torch.zeros(kv_heads, group)
    acc = torch.zeros(kv_heads, group, hd)
    for first in range(0, valid, tile):
        scores = torch.matmul(queries, keys[:, first:first + tile].transpose(1, 2))
        new_max = torch.maximum(row_max, scores.amax(-1).to(torch.bfloat16).float())
        scale = torch.where(row_max > DECODE_MASKED / 2,
                            torch.exp2((row_max - new_max) * logit_scale).to(torch.bfloat16).float(), 0.0)
        probs = torch.exp2((scores - new_max[..., None]) * logit_scale).to(torch.bfloat16).float()
        row_sum = row_sum * scale + probs.sum(-1)
        acc = acc * scale[..., None] + torch.matmul(probs, values[:, first:first + tile])
        row_max = new_max
    inverse = torch.where(row_sum > 0, 1.0 / row_sum, 0.0)
    return (acc * inverse[..., None]).to(torch.bfloat16).reshape(heads * hd)


def gemv_f32(p, x, w):
    """fp32 logits (the LM head keeps its accumulator). torch has no CPU bf16 GEMV with an fp32 output, and
    widening the whole weight every token costs ~10× the GEMV, so our C++ kernel's host build runs it, in one
    call over all rows; without a host compiler, torch in fp32."""
    if "weights" in p:
        return packed_matvec(p, x, w)
    if host_build.host_compiler() is None:
        return torch.mv(w.reshape(p["N"], p["K"]).float(), x.float())
    return host_build.gemv(w.reshape(p["N"], p["K"]), x, tile_rows=p["N"], out_dtype=torch.float32, fast=True)


def dequant_rows(p, w):
    """Packed rows as bf16 weights: GGUF's exact fp32 values (kernels/quant.py), rounded once."""
    K = p["K"]
    return quant.dequantize(quant.weight_format(p["weights"]), w.reshape(p["N"], -1), K,
                            out=torch.empty(p["N"], K, dtype=torch.bfloat16))


LAUNCH_KINDS = {
    "rmsnorm": rmsnorm,
    "gemm": matmul,
    "gemm_swiglu": gemm_swiglu,
    "gemv": matmul,
    "rope": rope,
    "rope_qk": rope_qk,
    "silu_mul": silu_mul,
    "add": add,
    "bias_add": bias_add,
    "attention": attention,
    "stack": stack,
    "decode_attention": decode_attention,
    "gemv_f32": gemv_f32,
    "gemv_add": gemv_add,
    "rms_gemv": rms_gemv,
    "quantize_rows": quantize_rows,
    "gemm_int": gemm_int,
    "gemm_int_swiglu": gemm_int_swiglu,
    "dequant_rows": dequant_rows,
}


def run_launch(launch, reads) -> tuple[torch.Tensor, ...]:
    """What ``launch`` writes on the values it ``reads``: one tensor per name of ``launch.writes``, in order."""
    result = LAUNCH_KINDS[launch.kind](launch.p, *reads)
    return result if isinstance(result, tuple) else (result,)
