"""Plain-PyTorch references for the npu2 ops: the same math as HuggingFace's Llama modules.

RMSNorm normalizes in fp32, casts to the input dtype, then multiplies by the weight; projections are
bf16 ``F.linear``; RoPE is half-split (``rotate_half``) with a LUT row per position
``[cos_0 .. cos_{d/2-1}, sin_0 .. sin_{d/2-1}]`` (ops/rope.py builds it); attention is causal GQA with an
fp32 softmax; the MLP is SwiGLU. ``<op>_reference`` is the reference of ``torch.ops.npu2.<op>``. Used by
tests, never on the NPU path.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels import int_gemm, quant
from ..kernels.catalog import DECODE_GROUP_SIZES, decode_attn_length_value, layer_arenas


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_half_split(x: torch.Tensor, lut: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rotate every head of ``x`` (rows, heads*head_dim) by the per-row LUT (rows, head_dim)."""
    rows = x.shape[:-1]
    half = head_dim // 2
    xh = x.reshape(*rows, -1, head_dim)
    cos = lut[..., :half].unsqueeze(-2)
    sin = lut[..., half:].unsqueeze(-2)
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    rotated = torch.cat((-xh[..., half:], xh[..., :half]), -1)
    return (xh * cos + rotated * sin).reshape(x.shape)


def gqa_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Seq-first causal GQA: q (S, H*D), k/v (S, Hkv*D) → (S, H*D); fp32 softmax, bf16 matmuls like HF eager."""
    seq = q.shape[0]
    qh = q.reshape(seq, -1, head_dim).transpose(0, 1)
    kh = k.reshape(seq, -1, head_dim).transpose(0, 1)
    vh = v.reshape(seq, -1, head_dim).transpose(0, 1)
    group = qh.shape[0] // kh.shape[0]
    kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * (1.0 / math.sqrt(head_dim))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1).reshape(seq, -1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rms_gemms_rope_reference(x, norm_w, wq, wk, wv, rope_lut, eps, biases=(None, None, None)):
    """Reference of npu2.rms_gemms_rope: returns (v, q_roped, k_roped). ``biases``: the projections' (bq, bk, bv),
    as HF's biased ``F.linear``."""
    head_dim = rope_lut.shape[-1]
    normed = rms_norm(x, norm_w, eps)
    q, k, v = (F.linear(normed, w, b) for w, b in zip((wq, wk, wv), biases))
    return v, rope_half_split(q, rope_lut, head_dim), rope_half_split(k, rope_lut, head_dim)


def _split_qk(wqk, wv, biases):
    """A decode op's wqk = [Wq; Wk] as (Wq, Wk) (Wk has wv's rows), and its biases (bqk, bv) as (bq, bk, bv)."""
    kv = wv.shape[0]
    bqk, bv = biases
    return wqk[:-kv], wqk[-kv:], (None, None, None) if bqk is None else (bqk[:-kv], bqk[-kv:], bv)


def rms_gemv_rope_reference(x, norm_w, wqk, wv, rope_lut, eps, biases=(None, None)):
    """Reference of npu2.rms_gemv_rope: rms_gemms_rope's on one row, Q and K from wqk = [Wq; Wk]; ``biases``: (bqk,
    bv), bqk = [bq | bk]."""
    wq, wk, split = _split_qk(wqk, wv, biases)
    return rms_gemms_rope_reference(x, norm_w, wq, wk, wv, rope_lut, eps, split)


def _plus_biases(projections, biases):
    """Projections already rounded to bf16, plus their biases (if any), rounded again."""
    return tuple(y if b is None else y + b for y, b in zip(projections, biases))


def o_ffn_reference(attn, wo, x, norm_w, w_gate_up, w_down, eps):
    """Reference of npu2.o_ffn and npu2.o_gemv_ffn: the rest of a decoder layer after attention (w_gate_up is
    [w_gate | w_up], the two weights side by side in each row)."""
    w_gate, w_up = w_gate_up.chunk(2, dim=1)
    res1 = x + F.linear(attn, wo)
    normed = rms_norm(res1, norm_w, eps)
    return res1 + F.linear(silu_mul(F.linear(normed, w_gate), F.linear(normed, w_up)), w_down)


def o_gemv_ffn_rms_gemv_rope_reference(attn, wo, x, norm_w, w_gate_up, w_down, next_norm_w, next_wqk, next_wv,
                                       next_rope_lut, eps, next_eps, biases=(None, None)):
    """Reference of npu2.o_gemv_ffn_rms_gemv_rope: (out, next layer's v, q_roped, k_roped)."""
    out = o_ffn_reference(attn, wo, x, norm_w, w_gate_up, w_down, eps)
    return (out, *rms_gemv_rope_reference(out, next_norm_w, next_wqk, next_wv, next_rope_lut, next_eps, biases))


def flash_attn_reference(q, k, v, head_dim):
    return gqa_causal_attention(q, k, v, head_dim)


def decode_attn_reference(q, k_cache, v_cache, length, head_dim):
    """Reference of npu2.decode_attn: one query row's GQA attention over the first ``length`` rows of the cache,
    fp32 scores and softmax, probabilities rounded to bf16, P.V in fp32 rounded to bf16 once (the host attention's
    numerics, patch_llama/layer.py)."""
    n = decode_attn_length_value(length.float().tolist())
    qh = q.reshape(-1, head_dim).float()
    kh, vh = (t[:n].reshape(n, -1, head_dim).transpose(0, 1).float() for t in (k_cache, v_cache))
    group = qh.shape[0] // kh.shape[0]
    kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    scores = torch.matmul(kh, qh[:, :, None])[..., 0] * (1.0 / math.sqrt(head_dim))
    probs = torch.softmax(scores, dim=-1).to(torch.bfloat16).float()
    return torch.matmul(probs[:, None, :], vh)[:, 0].to(torch.bfloat16).reshape(-1)


def decode_attn_o_gemv_ffn_rms_gemv_rope_reference(q, k_cache, v_cache, length, wo, x, norm_w, w_gate_up, w_down,
                                                   next_norm_w, next_wqk, next_wv, next_rope_lut, head_dim, eps,
                                                   next_eps, biases=(None, None)):
    """Reference of npu2.decode_attn_o_gemv_ffn_rms_gemv_rope: decode attention, then o_gemv_ffn_rms_gemv_rope."""
    attn = decode_attn_reference(q, k_cache, v_cache, length, head_dim)
    return o_gemv_ffn_rms_gemv_rope_reference(attn, wo, x, norm_w, w_gate_up, w_down, next_norm_w, next_wqk, next_wv,
                                              next_rope_lut, eps, next_eps, biases)


def decode_attn_o_gemv_ffn_reference(q, k_cache, v_cache, length, wo, x, norm_w, w_gate_up, w_down, head_dim, eps):
    """Reference of npu2.decode_attn_o_gemv_ffn: decode attention, then o_gemv_ffn (o_ffn's reference on one row)."""
    return o_ffn_reference(decode_attn_reference(q, k_cache, v_cache, length, head_dim), wo, x, norm_w, w_gate_up,
                           w_down, eps)


def lm_head_gemv_reference(x, w_lm):
    """fp32 logits of one row (the op keeps its fp32 accumulator rather than rounding logits to bf16)."""
    return F.linear(x.float(), w_lm.float())


# ---- the packed decode ops: the projections of GGUF's exact dequantization in fp32, rounded to bf16 once --------
def _linear_packed(x, w, weights):
    """bf16 ``W x`` for a packed (out, row bytes) weight: exact weights, fp32 sums, one rounding."""
    return F.linear(x.float(), quant.dequantize(quant.weight_format(weights), w, x.shape[-1])).to(torch.bfloat16)


def rms_gemv_rope_packed_reference(x, norm_w, wqk, wv, rope_lut, eps, weights, biases=(None, None)):
    """Reference of npu2.rms_gemv_rope_packed: (v, q_roped, k_roped); wqk = [Wq; Wk] in packed rows."""
    head_dim = rope_lut.shape[-1]
    normed = rms_norm(x, norm_w, eps)
    wq, wk, split = _split_qk(wqk, wv, biases)
    q, k, v = _plus_biases((_linear_packed(normed, w, weights) for w in (wq, wk, wv)), split)
    return v, rope_half_split(q, rope_lut, head_dim), rope_half_split(k, rope_lut, head_dim)


def o_gemv_ffn_packed_reference(attn, wo, x, norm_w, w_gate_up, w_down, eps, weights):
    """Reference of npu2.o_gemv_ffn_packed (w_gate_up: each row a packed gate row, then a packed up row)."""
    w_gate, w_up = w_gate_up.reshape(w_gate_up.shape[0], 2, -1).unbind(1)
    res1 = (x.float() + _linear_packed(attn, wo, weights).float()).to(torch.bfloat16)
    normed = rms_norm(res1, norm_w, eps)
    act = silu_mul(_linear_packed(normed, w_gate.contiguous(), weights), _linear_packed(normed, w_up.contiguous(), weights))
    return (res1.float() + _linear_packed(act, w_down, weights).float()).to(torch.bfloat16)


def o_gemv_ffn_rms_gemv_rope_packed_reference(attn, wo, x, norm_w, w_gate_up, w_down, next_norm_w, next_wqk, next_wv,
                                              next_rope_lut, eps, next_eps, weights, biases=(None, None)):
    """Reference of npu2.o_gemv_ffn_rms_gemv_rope_packed: (out, next layer's v, q_roped, k_roped)."""
    out = o_gemv_ffn_packed_reference(attn, wo, x, norm_w, w_gate_up, w_down, eps, weights)
    return (out, *rms_gemv_rope_packed_reference(out, next_norm_w, next_wqk, next_wv, next_rope_lut, next_eps,
                                                 weights, biases))


def decode_attn_o_gemv_ffn_rms_gemv_rope_packed_reference(q, k_cache, v_cache, length, wo, x, norm_w, w_gate_up,
                                                          w_down, next_norm_w, next_wqk, next_wv, next_rope_lut,
                                                          head_dim, eps, next_eps, weights, biases=(None, None)):
    """Reference of npu2.decode_attn_o_gemv_ffn_rms_gemv_rope_packed."""
    attn = decode_attn_reference(q, k_cache, v_cache, length, head_dim)
    return o_gemv_ffn_rms_gemv_rope_packed_reference(attn, wo, x, norm_w, w_gate_up, w_down, next_norm_w, next_wqk,
                                                     next_wv, next_rope_lut, eps, next_eps, weights, biases)


def decode_attn_o_gemv_ffn_packed_reference(q, k_cache, v_cache, length, wo, x, norm_w, w_gate_up, w_down, head_dim,
                                            eps, weights):
    """Reference of npu2.decode_attn_o_gemv_ffn_packed."""
    return o_gemv_ffn_packed_reference(decode_attn_reference(q, k_cache, v_cache, length, head_dim), wo, x, norm_w,
                                       w_gate_up, w_down, eps, weights)


def lm_head_gemv_packed_reference(x, w_lm, weights):
    """fp32 logits of one row over a packed LM-head weight."""
    return F.linear(x.float(), quant.dequantize(quant.weight_format(weights), w_lm, x.shape[-1]))


def dequantize_rows_reference(w, in_features, weights):
    """Reference of npu2.dequantize_rows: GGUF's exact weights of packed rows, rounded to bf16 once."""
    return quant.dequantize(quant.weight_format(weights), w, in_features).to(torch.bfloat16)


# ---- the integer-GEMM prefill ops ("w8x2a16"): kernels/int_gemm.py's numerics, HF's rounding points between -------
def _linear_w8x2(x, words, halves: int = 1):
    """bf16 outputs of x (rows, K) times a prepared weight (a pair gives (gate, up))."""
    K = x.shape[-1]
    C = halves * int_gemm.prepared_out_features(tuple(words.shape), K, halves)
    hi, lo, scale = int_gemm.untile_weights(words, C, K, int_gemm.weight_tile_n(C // halves, halves), halves)
    q, scale_a = int_gemm.quantize_activations(x.reshape(-1, K), int_gemm.ACTIVATION_QMAX["w8x2a16"])
    outs = [int_gemm.integer_product(q, scale_a, hi[h], lo[h], scale[h]).reshape(*x.shape[:-1], -1)
            for h in (slice(i * C // halves, (i + 1) * C // halves) for i in range(halves))]
    return outs[0] if halves == 1 else outs


def rms_gemms_rope_w8x2_reference(x, norm_w, wq, wk, wv, rope_lut, eps, biases=(None, None, None)):
    """Reference of npu2.rms_gemms_rope_w8x2: (v, q_roped, k_roped)."""
    head_dim = rope_lut.shape[-1]
    normed = rms_norm(x, norm_w, eps)
    q, k, v = _plus_biases((_linear_w8x2(normed, w) for w in (wq, wk, wv)), biases)
    return v, rope_half_split(q, rope_lut, head_dim), rope_half_split(k, rope_lut, head_dim)


def o_ffn_w8x2_reference(attn, wo, x, norm_w, w_gate_up, w_down, eps):
    """Reference of npu2.o_ffn_w8x2 (w_gate_up a prepared [gate | up] pair)."""
    res1 = x + _linear_w8x2(attn, wo)
    normed = rms_norm(res1, norm_w, eps)
    return res1 + _linear_w8x2(silu_mul(*_linear_w8x2(normed, w_gate_up, halves=2)), w_down)


# ---- the biased twins (``<op>_qkv_bias``): the biases follow wv (next_wv) in the op's arguments: bq, bk, bv for
# prefill rows, bqk and bv for a decode token ---------------------------------------------------------------------
def _qkv_biased(reference, at: int, count: int):
    def biased(*args):
        return reference(*args[:at], *args[at + count:], biases=tuple(args[at:at + count]))
    return biased


rms_gemms_rope_qkv_bias_reference = _qkv_biased(rms_gemms_rope_reference, 5, 3)
rms_gemv_rope_qkv_bias_reference = _qkv_biased(rms_gemv_rope_reference, 4, 2)
rms_gemv_rope_packed_qkv_bias_reference = _qkv_biased(rms_gemv_rope_packed_reference, 4, 2)
rms_gemms_rope_w8x2_qkv_bias_reference = _qkv_biased(rms_gemms_rope_w8x2_reference, 5, 3)
o_gemv_ffn_rms_gemv_rope_qkv_bias_reference = _qkv_biased(o_gemv_ffn_rms_gemv_rope_reference, 9, 2)
o_gemv_ffn_rms_gemv_rope_packed_qkv_bias_reference = _qkv_biased(o_gemv_ffn_rms_gemv_rope_packed_reference, 9, 2)
decode_attn_o_gemv_ffn_rms_gemv_rope_qkv_bias_reference = _qkv_biased(
    decode_attn_o_gemv_ffn_rms_gemv_rope_reference, 12, 2)
decode_attn_o_gemv_ffn_rms_gemv_rope_packed_qkv_bias_reference = _qkv_biased(
    decode_attn_o_gemv_ffn_rms_gemv_rope_packed_reference, 12, 2)


# ---- the decode groups (npu2.decode_layers<n>, catalog.decode_layers_program) -------------------------------------
def _decode_layers(layers: int, layer_reference, last_reference=None):
    """Reference of a decode group of ``layers`` layers: ``layer_reference`` (a decode_attn_o_gemv_ffn_rms_gemv_rope
    reference) per layer, each on the q and hidden state the one before returned, the caches as given; returns the
    last layer's out and q, then each layer's (next_v, next_k_roped). With ``last_reference`` (a
    decode_attn_o_gemv_ffn reference: a _final group), the last layer is the model's last, with no next layer: it
    returns only out, and the rows are those of the layers before it. ``biases``: per layer of the group and the one
    after it, its (bqk, bv), for a family with Q/K/V biases."""
    first, per_layer = 13, 9
    ends_model = last_reference is not None
    tensor_count = first + per_layer * (layers - 1) - (3 if ends_model else 0)

    def reference(*args, biases=None):
        tensors, scalars = args[:tensor_count], args[tensor_count:]
        q, k_cache, v_cache, length, wo, x, *rest = tensors[:first]
        lut = rest[-1]
        own = [(k_cache, v_cache, wo, *rest[:-1])]
        own += [tensors[first + per_layer * j:first + per_layer * (j + 1)] for j in range(layers - 1)]
        rows = []
        for j, (k_cache, v_cache, wo, norm_w, w_gate_up, w_down, *next_qkv) in enumerate(own):
            if ends_model and j == layers - 1:  # head_dim, eps and the weight format: next_eps is not its
                x = last_reference(q, k_cache, v_cache, length, wo, x, norm_w, w_gate_up, w_down, scalars[0],
                                   scalars[1], *scalars[3:])
                return (x, *rows)
            x, next_v, q, next_k = layer_reference(q, k_cache, v_cache, length, wo, x, norm_w, w_gate_up, w_down,
                                                   *next_qkv, lut, *scalars, **_biases_of(biases, j + 1))
            rows += [next_v, next_k]
        return (x, q, *rows)

    return reference


# npu2.decode_layers<n>[_final][_packed]'s references over weights one tensor each (the group's
# per-weight form: _from_arenas hands them the arenas' parts), by op name
_PER_WEIGHT_GROUP_REFERENCES = {
    f"decode_layers{n}{'_final' if final else ''}{suffix}": _decode_layers(n, layer, last if final else None)
    for n in DECODE_GROUP_SIZES for final in (False, True)
    for suffix, layer, last in (
        ("", decode_attn_o_gemv_ffn_rms_gemv_rope_reference, decode_attn_o_gemv_ffn_reference),
        ("_packed", decode_attn_o_gemv_ffn_rms_gemv_rope_packed_reference, decode_attn_o_gemv_ffn_packed_reference))}


def _biases_of(biases, j: int) -> dict:
    """The keyword giving a layer reference layer ``j``'s Q/K/V biases, if the layers have them."""
    return {} if biases is None else {"biases": biases[j]}


def _with_lm_head(group_reference, head_reference, layers_packed: bool):
    """Reference of a decode_layers<n>_final_lm op: the _final group (``group_reference``) on all but the last two
    tensors, then the model's final RMSNorm (``final_norm_w``, the ``final_eps`` scalar after the group's own) and the
    LM head (``w_lm``, in its own format: the op's last scalar when packed) on its output; returns the group's
    results, then final_normed and logits. ``layers_packed``: the layers' format follows final_eps (a _packed op)."""
    def reference(*args, biases=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        scalars = args[len(tensors):]
        final_norm_w, w_lm = tensors[-2:]
        final_eps, formats = scalars[3], scalars[4:]
        packed, head_format = (formats[:1], formats[1:]) if layers_packed else ((), formats)
        results = group_reference(*tensors[:-2], *scalars[:3], *packed, biases=biases)
        normed = rms_norm(results[0], final_norm_w, final_eps)
        return (*results, normed, head_reference(normed, w_lm, *head_format))
    return reference


_PER_WEIGHT_GROUP_REFERENCES.update({
    f"decode_layers{n}_final_lm{suffix}": _with_lm_head(
        _PER_WEIGHT_GROUP_REFERENCES[f"decode_layers{n}_final{suffix}"], head, bool(suffix))
    for n in DECODE_GROUP_SIZES
    for suffix, head in (("", lm_head_gemv_reference), ("_packed", lm_head_gemv_packed_reference))})
_PER_WEIGHT_GROUP_REFERENCES.update({
    f"decode_layers{n}_final_packed_lm": _with_lm_head(_PER_WEIGHT_GROUP_REFERENCES[f"decode_layers{n}_final"],
                                                       lm_head_gemv_packed_reference, False)
    for n in DECODE_GROUP_SIZES})


def _with_first_qkv(group_reference, qkv_reference, ends_model: bool, lm_head: bool, packed: bool):
    """Reference of a decode_layers<n>_qkv[_final[_lm]] op: the first layer's rms_gemv_rope (its weights the first
    three tensors, on the group's x and LUT row with next_eps, in the group's weight format: with ``packed``, the
    scalar after final_eps in a _final_lm op) makes the q the group (``group_reference``) then takes first; its K/V
    rows follow the group's out (and next_q_roped)."""
    def reference(*args, biases=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        scalars = args[len(tensors):]
        first, rest = tensors[:3], tensors[3:]
        x, lut = rest[4], rest[11]  # k_cache, v_cache, length, wo, x, ..., next_rope_lut
        weights = scalars[4 if lm_head else 3:][:1] if packed else ()
        v, q, k = qkv_reference(x, *first, lut, scalars[2], *weights, **_biases_of(biases, 0))
        results = group_reference(q, *rest, *scalars, biases=biases)
        kept = 1 if ends_model else 2
        return (*results[:kept], v, k, *results[kept:])
    return reference


_PER_WEIGHT_GROUP_REFERENCES.update({
    f"decode_layers{n}_qkv{ends}{suffix}": _with_first_qkv(
        _PER_WEIGHT_GROUP_REFERENCES[f"decode_layers{n}{ends}{suffix}"], qkv, bool(ends), ends.endswith("_lm"),
        bool(suffix))
    for n in DECODE_GROUP_SIZES for ends in ("", "_final", "_final_lm", "_final_packed_lm")
    for suffix, qkv in (("", rms_gemv_rope_reference), ("_packed", rms_gemv_rope_packed_reference))
    if f"decode_layers{n}{ends}{suffix}" in _PER_WEIGHT_GROUP_REFERENCES})


def _from_arenas(per_weight, layers: int, ends_model: bool, lm_head: bool, first_qkv: bool, packed: bool):
    """Reference of a decode group op over weight arenas: each layer's parts of its two arenas (catalog.layer_arenas)
    as the weights they hold, handed in the per-weight form's order (its first layer's decode_attn_o_gemv_ffn_
    rms_gemv_rope tensors, then each further layer's caches, o/FFN weights and the next layer's input norm, [Wq; Wk]
    and Wv) to ``per_weight``, the group's reference over such weights, with its scalars (no heads, intermediate)
    and, when the norms arenas hold Q/K/V biases, each layer's; ``packed``: the layers' format is the scalar after
    next_eps (after final_eps in a _final_lm op)."""
    lead = 0 if first_qkv else 1

    def reference(*args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        head_dim, heads, intermediate, *scalars = args[len(tensors):]
        fmt = (scalars[3:] if lm_head else scalars[2:])[:1] if packed else ["bf16"]
        x, length, lut = tensors[lead:lead + 3]
        per_layer = tensors[lead + 3:]
        caches = [per_layer[4 * j:4 * j + 2] for j in range(layers)]
        # each layer's caches then arenas; the layer after the group (unless it ends the model): its arenas only
        arenas = [per_layer[4 * j + 2:4 * j + 4] for j in range(layers)]
        arenas += [] if ends_model else [per_layer[4 * layers:4 * layers + 2]]
        biased = layer_arenas(x.shape[0], heads * head_dim, caches[0][0].shape[1], intermediate, fmt[0], True)
        layout = biased if arenas[0][1].shape == biased.norms.shape else \
            layer_arenas(x.shape[0], heads * head_dim, caches[0][0].shape[1], intermediate, fmt[0])

        def part(j: int, name: str) -> torch.Tensor:
            view = layout.part(name)
            return view.of(arenas[j][0 if view.arena == "weights" else 1])

        def qkv(j: int) -> list:  # layer j's input norm, [Wq; Wk] and Wv
            return [part(j, "input_norm"), part(j, "wqk"), part(j, "wv")]

        ffn = [[part(j, n) for n in ("post_attention_norm", "w_gate_up", "w_down")] for j in range(layers)]
        given = (qkv(0) if first_qkv else [tensors[0]]) + [*caches[0], length, part(0, "wo"), x, *ffn[0], *qkv(1),
                                                            lut]
        for j in range(1, layers):
            given += [*caches[j], part(j, "wo"), *ffn[j], *([] if ends_model and j == layers - 1 else qkv(j + 1))]
        given += tensors[-2:] if lm_head else []
        biases = [(part(j, "qk_bias"), part(j, "v_bias")) for j in range(len(arenas))] if layout is biased else None
        return per_weight(*given, head_dim, *scalars, biases=biases)
    return reference


# npu2.decode_layers<n>[_qkv][_final[_lm]][_packed]'s and decode_layers<n>[_qkv]_final_packed_lm's references, by
# op name
DECODE_GROUP_REFERENCES = {
    name: _from_arenas(per_weight, int(name[len("decode_layers")]), "_final" in name, "_lm" in name, "_qkv" in name,
                       name.endswith("_packed"))
    for name, per_weight in _PER_WEIGHT_GROUP_REFERENCES.items()}
