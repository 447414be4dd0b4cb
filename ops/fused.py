"""The fused ops: how each op's tensor shapes determine its Program.

A model dimension appears in several arguments; each is taken from the size most of them agree on (ties go
to the weight, listed first), so that the registry's shape check blames the one argument that disagrees.
"""
from __future__ import annotations

from collections import Counter

import torch

from ..kernels import catalog, int_gemm
from .registry import BadArgument, FusedOp, register, register_into


def _agreed(*sizes: int) -> int:
    return Counter(sizes).most_common(1)[0][0]  # most_common keeps first-seen order among ties


def _heads(rows: int, head_dim: int, what: str) -> int:
    if head_dim <= 0 or rows % head_dim:
        raise ValueError(f"{what} rows ({rows}) must be a multiple of head_dim ({head_dim})")
    return rows // head_dim


def _rope_head_dim(lut, wq, wk) -> int:
    """head_dim is the RoPE LUT's width; it must be even and divide wq's and wk's rows. When it divides
    exactly one of them, the other weight is the odd one out."""
    head_dim = lut[-1]
    fits_q, fits_k = head_dim > 0 and wq[0] % head_dim == 0, head_dim > 0 and wk[0] % head_dim == 0
    if head_dim > 0 and head_dim % 2 == 0 and fits_q != fits_k:
        arg, rows = ("wk", wk) if fits_q else ("wq", wq)
        raise BadArgument(arg, f"rows that are a multiple of head_dim {head_dim} (rope_lut's width)",
                          f"shape {rows}")
    if head_dim <= 0 or head_dim % 2 or not fits_q:
        raise BadArgument("rope_lut", f"an even width (head_dim) dividing the rows of wq ({wq[0]}) and wk ({wk[0]})",
                          f"shape {lut}")
    return head_dim


def _qkv_dims(shapes):
    x, norm_w, wq, wk, wv, lut = shapes
    head_dim = _rope_head_dim(lut, wq, wk)
    hidden = _agreed(norm_w[0], wq[1], wk[1], wv[1], x[-1])
    return hidden, wq[0] // head_dim, _agreed(wk[0], wv[0]) // head_dim, head_dim


def _qk_head_dim(lut, wqk, wv) -> int:
    """A decode op's head_dim: the RoPE LUT's width, even, dividing wv's rows and wqk's (= [Wq; Wk], more rows than
    wv). When it fits exactly one of the two weights, the other is the odd one out (as _rope_head_dim)."""
    head_dim = lut[-1]
    fits_v = head_dim > 0 and wv[0] % head_dim == 0
    fits_qk = head_dim > 0 and wqk[0] % head_dim == 0 and wqk[0] > wv[0]
    if head_dim > 0 and head_dim % 2 == 0 and fits_v != fits_qk:
        if fits_v:
            raise BadArgument("wqk", f"[Wq; Wk]: the Q rows, then as many K rows as wv has ({wv[0]}), a multiple of "
                              f"head_dim {head_dim} (rope_lut's width) in all", f"shape {wqk}")
        raise BadArgument("wv", f"rows that are a multiple of head_dim {head_dim} (rope_lut's width)", f"shape {wv}")
    if head_dim <= 0 or head_dim % 2 or not fits_v:
        raise BadArgument("rope_lut", f"an even width (head_dim) dividing the rows of wqk ({wqk[0]}) and wv ({wv[0]})",
                          f"shape {lut}")
    return head_dim


def _decode_qkv_dims(shapes):
    """A decode op's (hidden, heads, kv_heads, head_dim) from x, norm_w, wqk = [Wq; Wk], wv and the LUT row."""
    x, norm_w, wqk, wv, lut = shapes
    head_dim = _qk_head_dim(lut, wqk, wv)
    hidden = _agreed(norm_w[0], wqk[1], wv[1], x[-1])
    return hidden, (wqk[0] - wv[0]) // head_dim, wv[0] // head_dim, head_dim


def _rms_gemms_rope(shapes, eps, precision, qkv_bias=False):
    return catalog.rms_gemms_rope_program(*_qkv_dims(shapes), eps, shapes[0][0], precision, qkv_bias)


def _rms_gemv_rope(shapes, eps, qkv_bias=False):
    return catalog.rms_gemv_rope_program(*_decode_qkv_dims(shapes), eps, qkv_bias=qkv_bias)


def _ffn_dims(shapes):
    """w_gate_up is [w_gate | w_up]: the gate and up weights side by side in each row (F × 2H)."""
    attn, wo, x, norm_w, w_gate_up, w_down = shapes
    hidden = _agreed(wo[0], norm_w[0], w_gate_up[1] // 2, w_down[0], x[-1])
    return hidden, _agreed(wo[1], attn[-1]), _agreed(w_down[1], w_gate_up[0])  # a tie: w_gate_up is blamed


def _o_ffn(shapes, eps, precision):
    return catalog.o_ffn_program(*_ffn_dims(shapes), eps, shapes[0][0], precision)


def _o_gemv_ffn(shapes, eps):
    return catalog.o_gemv_ffn_program(*_ffn_dims(shapes), eps)


def _o_gemv_ffn_rms_gemv_rope(shapes, eps, next_eps, qkv_bias=False):
    """o_gemv_ffn's arguments, then the next layer's rms_gemv_rope weights and LUT (its input is this op's out)."""
    hidden, q_dim, intermediate = _ffn_dims(shapes[:6])
    try:
        _, heads, kv_heads, head_dim = _decode_qkv_dims(((hidden,),) + tuple(shapes[6:]))
    except BadArgument as exc:
        raise BadArgument("next_" + exc.arg, exc.expected, exc.given) from None
    return catalog.o_gemv_ffn_rms_gemv_rope_program(hidden, q_dim, intermediate, eps, heads, kv_heads, head_dim,
                                                    next_eps, qkv_bias=qkv_bias)


def _flash_attn(shapes, head_dim):
    q, k, v = shapes
    return catalog.flash_attn_program(_heads(q[-1], head_dim, "q"), _heads(k[-1], head_dim, "k"), head_dim, q[0])


def _decode_attn(shapes, head_dim):
    """q (heads*head_dim,), k_cache and v_cache a cache's first ``capacity`` rows (capacity, kv_heads*head_dim),
    length (1,) int32: the capacity bucket is k_cache's rows (catalog.decode_attn_capacity)."""
    q, k, v, _ = shapes
    for name, shape in (("q", q), ("k_cache", k)):
        if shape[-1] % head_dim:
            raise BadArgument(name, f"a width that is a multiple of head_dim {head_dim}", f"shape {shape}")
    heads, kv_heads = q[-1] // head_dim, k[-1] // head_dim
    if heads % kv_heads:
        raise BadArgument("k_cache", f"{kv_heads} KV heads dividing q's {heads} heads", f"shape {k}")
    if k[0] % catalog.DECODE_ATTN_ROWS_MULTIPLE:
        raise BadArgument("k_cache", f"rows a multiple of {catalog.DECODE_ATTN_ROWS_MULTIPLE} (a capacity bucket, "
                          "catalog.decode_attn_capacity)", f"shape {k}")
    return catalog.decode_attn_program(heads, kv_heads, head_dim, k[0])


def _decode_attn_o_gemv_ffn_rms_gemv_rope(shapes, head_dim, eps, next_eps, qkv_bias=False):
    """decode_attn's four tensors, then o_gemv_ffn_rms_gemv_rope's without attn (decode attention's output)."""
    attention = _decode_attn(shapes[:4], head_dim)
    heads, kv_heads, capacity = (dict(attention.params)[n] for n in ("heads", "kv_heads", "capacity"))
    hidden, q_dim, intermediate = _ffn_dims((shapes[0],) + tuple(shapes[4:9]))
    try:
        _decode_qkv_dims(((hidden,),) + tuple(shapes[9:]))
    except BadArgument as exc:
        raise BadArgument("next_" + exc.arg, exc.expected, exc.given) from None
    return catalog.decode_attn_o_gemv_ffn_rms_gemv_rope_program(hidden, q_dim, intermediate, eps, heads, kv_heads,
                                                                head_dim, capacity, next_eps, qkv_bias=qkv_bias)


def _decode_attn_o_gemv_ffn(shapes, head_dim, eps):
    """decode_attn's four tensors, then o_gemv_ffn's without attn (decode attention's output)."""
    attention = _decode_attn(shapes[:4], head_dim)
    heads, kv_heads, capacity = (dict(attention.params)[n] for n in ("heads", "kv_heads", "capacity"))
    hidden, q_dim, intermediate = _ffn_dims((shapes[0],) + tuple(shapes[4:]))
    return catalog.decode_attn_o_gemv_ffn_program(hidden, q_dim, intermediate, eps, heads, kv_heads, head_dim,
                                                  capacity)


def _decode_layers(layers: int, ends_model: bool = False, lm_head: bool = False, first_qkv: bool = False,
                   packed: bool = False, packed_head: bool = False):
    """The program_for of npu2.decode_layers<layers> (with ``ends_model``, of decode_layers<layers>_final; with
    ``lm_head`` too, of decode_layers<layers>_final_lm, whose last host tensor is the LM head's weight, its rows the
    logits; with ``first_qkv``, of the _qkv op, which takes no q) and, with ``packed``, of its _packed twin, which
    takes the layers' weight format (and, with ``packed_head`` too, the LM head's); with ``packed_head`` alone, of
    decode_layers<layers>_final_packed_lm (bf16 layers, the LM head's packed format a scalar): the dims come from x
    (hidden), the first layer's K cache (capacity, KV width) and the scalars, whether the layers have Q/K/V biases from
    the first layer's norms arena (which then holds them too); the registry's shape check holds every tensor, each
    layer's two weight arenas included, to the Program's."""
    lead = 0 if first_qkv else 1  # a group without its first layer's Q/K/V starts with that layer's query

    def program_for(shapes, head_dim, heads, intermediate, eps, next_eps, *rest):
        """``rest``: a _final_lm op's final_eps, then a _packed op's weights, then a packed LM head's format."""
        final_eps, rest = (rest[0], rest[1:]) if lm_head else (None, rest)
        weights, rest = (rest[0], rest[1:]) if packed else ("bf16", rest)
        head_weights = rest[0] if packed_head else weights
        k_cache = shapes[lead + 3]
        try:  # the first layer's attention: its heads and capacity bucket
            attention = dict(_decode_attn(((heads * head_dim,), k_cache, k_cache, None), head_dim).params)
        except BadArgument as exc:
            raise BadArgument("k_cache_0", exc.expected, exc.given) from None
        hidden, kv_dim = shapes[lead][0], attention["kv_heads"] * head_dim
        biased = catalog.layer_arenas(hidden, heads * head_dim, kv_dim, intermediate, weights, qkv_bias=True)
        program = catalog.decode_layers_program(layers, hidden, heads * head_dim, intermediate, eps,
                                                heads, attention["kv_heads"], head_dim, attention["capacity"],
                                                next_eps, weights, ends_model,
                                                (shapes[-1][0], final_eps, head_weights) if lm_head else None,
                                                first_qkv, tuple(shapes[lead + 6]) == biased.norms.shape)
        # the arenas' sizes follow from x's width: both of the first layer's off means x is
        arenas = [(a.shape, tuple(shapes[lead + i])) for i, a in ((5, program.arg("weights_0")),
                                                                   (6, program.arg("norms_0")))]
        if all(expected != given for expected, given in arenas):
            raise BadArgument("x", "the width of the model whose layer arenas weights_0 and norms_0 are",
                              f"shape {tuple(shapes[lead])}")
        return program
    return program_for


def _group_into(layers: int) -> tuple[tuple[str, str], ...]:
    """The K/V rows a decode group writes for the layer after each of its first ``layers`` layers (all of them, or
    all but a _final group's last), which ``.into`` writes into KV caches."""
    return tuple((f"{output}_{j}", f"{row}_{j}") for j in range(layers) for output, row in _NEXT_KV_ROWS)


def _decode_layers_ops() -> tuple[FusedOp, ...]:
    """npu2.decode_layers<n>, npu2.decode_layers<n>_final (a group ending with the model's last layer) and
    npu2.decode_layers<n>_final_lm (that group, then the model's final norm and LM head), each with a _qkv twin
    (decode_layers<n>_qkv[_final[_lm]]: the first layer's rms_gemv_rope too) and each with a _packed twin; and
    npu2.decode_layers<n>[_qkv]_final_packed_lm, bf16 layers ending with a packed LM head (patch_llama's Q8_0 copy
    of a bf16 model's LM head)."""
    scalars = (("head_dim", "int"), ("heads", "int"), ("intermediate", "int"), ("eps", "float"), ("next_eps", "float"))
    # (name suffix, ends the model, runs the LM head, layers' format, LM head's format)
    variants = [("", False, False, "bf16", None), ("_final", True, False, "bf16", None),
                ("_final_lm", True, True, "bf16", "bf16"), ("_final_packed_lm", True, True, "bf16", _EX_PACKED)]
    variants += [(suffix + "_packed", final, lm_head, _EX_PACKED, head and _EX_PACKED)
                 for suffix, final, lm_head, weights, head in variants[:3]]
    return tuple(
        FusedOp(f"decode_layers{n}{'_qkv' if first_qkv else ''}{suffix}",
                scalars + ((("final_eps", "float"),) if lm_head else ()) + (() if weights == "bf16" else (_WEIGHTS,))
                + ((("head_weights", "str"),) if head not in (None, "bf16") else ()),
                _decode_layers(n, final, lm_head, first_qkv, weights != "bf16", head not in (None, "bf16")),
                catalog.decode_layers_program(n, 64, 64, 128, 1e-5, 2, 1, 32, 128, 1e-5, weights, final,
                                              (256, 1e-6, head) if lm_head else None, first_qkv),
                (_FIRST_KV_ROWS if first_qkv else ()) + _group_into(n - 1 if final else n))
        for n in catalog.DECODE_GROUP_SIZES for first_qkv in (False, True)
        for suffix, final, lm_head, weights, head in variants)


def decode_attn_length(length: int) -> torch.Tensor:
    """npu2.decode_attn's ``length`` argument for ``length`` valid positions (bf16 base-256 digits: data the
    kernel reads, catalog.DECODE_ATTN_LENGTH_DIGITS says why bf16)."""
    return torch.tensor(catalog.decode_attn_length_digits(length), dtype=torch.bfloat16)


def _lm_head_gemv(shapes):
    x, w_lm = shapes
    return catalog.lm_head_gemv_program(_agreed(w_lm[1], x[0]), w_lm[0])


# Packed weights: a weight's second dimension is its packed row bytes, so the model dims come from the vectors
# (x, norm_w, attn, the LUT) and the weights' row counts; the registry's shape check then holds each weight to the
# row bytes its format gives.
def _rms_gemv_rope_packed(shapes, eps, weights, qkv_bias=False):
    x, norm_w, wqk, wv, lut = shapes
    head_dim = _qk_head_dim(lut, wqk, wv)
    return catalog.rms_gemv_rope_packed_program(_agreed(norm_w[0], x[-1]), (wqk[0] - wv[0]) // head_dim,
                                                wv[0] // head_dim, head_dim, eps, weights, qkv_bias)


def _ffn_dims_packed(shapes):
    attn, wo, x, norm_w, w_gate_up, w_down = shapes
    return _agreed(wo[0], norm_w[0], w_down[0], x[-1]), attn[-1], w_gate_up[0]


def _o_gemv_ffn_packed(shapes, eps, weights):
    return catalog.o_gemv_ffn_packed_program(*_ffn_dims_packed(shapes), eps, weights)


def _o_gemv_ffn_rms_gemv_rope_packed(shapes, eps, next_eps, weights, qkv_bias=False):
    hidden, q_dim, intermediate = _ffn_dims_packed(shapes[:6])
    norm_w, wqk, wv, lut = shapes[6:]
    try:
        head_dim = _qk_head_dim(lut, wqk, wv)
    except BadArgument as exc:
        raise BadArgument("next_" + exc.arg, exc.expected, exc.given) from None
    return catalog.o_gemv_ffn_rms_gemv_rope_packed_program(hidden, q_dim, intermediate, eps,
                                                           (wqk[0] - wv[0]) // head_dim, wv[0] // head_dim, head_dim,
                                                           next_eps, weights, qkv_bias)


def _decode_attn_o_gemv_ffn_rms_gemv_rope_packed(shapes, head_dim, eps, next_eps, weights, qkv_bias=False):
    """decode_attn's four tensors, then o_gemv_ffn_rms_gemv_rope_packed's without attn."""
    attention = _decode_attn(shapes[:4], head_dim)
    heads, kv_heads, capacity = (dict(attention.params)[n] for n in ("heads", "kv_heads", "capacity"))
    hidden, q_dim, intermediate = _ffn_dims_packed((shapes[0],) + tuple(shapes[4:9]))
    _, wqk, wv, lut = shapes[9:]
    try:
        _qk_head_dim(lut, wqk, wv)
    except BadArgument as exc:
        raise BadArgument("next_" + exc.arg, exc.expected, exc.given) from None
    return catalog.decode_attn_o_gemv_ffn_rms_gemv_rope_packed_program(hidden, q_dim, intermediate, eps, heads,
                                                                       kv_heads, head_dim, capacity, next_eps, weights,
                                                                       qkv_bias)


def _decode_attn_o_gemv_ffn_packed(shapes, head_dim, eps, weights):
    """decode_attn's four tensors, then o_gemv_ffn_packed's without attn."""
    attention = _decode_attn(shapes[:4], head_dim)
    heads, kv_heads, capacity = (dict(attention.params)[n] for n in ("heads", "kv_heads", "capacity"))
    hidden, q_dim, intermediate = _ffn_dims_packed((shapes[0],) + tuple(shapes[4:]))
    return catalog.decode_attn_o_gemv_ffn_packed_program(hidden, q_dim, intermediate, eps, heads, kv_heads, head_dim,
                                                         capacity, weights)


def _lm_head_gemv_packed(shapes, weights):
    x, w_lm = shapes
    return catalog.lm_head_gemv_packed_program(x[0], w_lm[0], weights)


def _dequantize_rows(shapes, in_features, weights):
    w, = shapes
    return catalog.dequantize_rows_program(w[0], in_features, weights)


# Integer GEMMs ("w8x2a16"): a prepared weight's shape is (windows, window words) of its tiles, so the in features
# come from the vectors and the out features from each weight at them; the registry's shape check then holds each
# weight to the shape the Program gives it.
def _prepared_out(name: str, shape, in_features: int, halves: int = 1) -> int:
    out = int_gemm.prepared_out_features(shape, in_features, halves)
    if out is None:
        raise BadArgument(name, f"a weight prepared for the integer GEMMs at {in_features} input features "
                          f"(kernels/int_gemm.py: prepare_weight)", f"shape {shape}")
    return out


def _rms_gemms_rope_w8x2(shapes, eps, qkv_bias=False):
    x, norm_w, wq, wk, wv, lut = shapes
    hidden, head_dim = _agreed(norm_w[0], x[-1]), lut[-1]
    q_dim, kv_dim = _prepared_out("wq", wq, hidden), _prepared_out("wk", wk, hidden)
    if head_dim <= 0 or head_dim % 2 or q_dim % head_dim or kv_dim % head_dim:
        raise BadArgument("rope_lut", f"an even width (head_dim) dividing wq's ({q_dim}) and wk's ({kv_dim}) out "
                          "features", f"shape {lut}")
    return catalog.rms_gemms_rope_w8x2_program(hidden, q_dim // head_dim, kv_dim // head_dim, head_dim, eps, x[0],
                                               qkv_bias)


def _o_ffn_w8x2(shapes, eps):
    attn, wo, x, norm_w, w_gate_up, w_down = shapes
    hidden = _agreed(norm_w[0], x[-1])
    return catalog.o_ffn_w8x2_program(hidden, attn[-1], _prepared_out("w_gate_up", w_gate_up, hidden, halves=2), eps,
                                      x[0])


# Small dims that fix each op's argument names and ranks for its schema.
_EX = dict(hidden=8, heads=2, kv_heads=1, head_dim=4, eps=1e-5)
_EX_FFN = dict(hidden=8, q_dim=8, intermediate=16, eps=1e-5)
# The bf16-weight prefill ops' matmul precision (one of catalog.BF16_WEIGHT_PRECISIONS); optional, so calls without
# it keep their default.
_PRECISION = ("precision", "str", catalog.DEFAULT_BF16_WEIGHT_PRECISION)
# The packed decode ops' weight format (kernels/quant.py), a required argument.
_WEIGHTS = ("weights", "str")
_EX_PACKED = "q4_1"
_EX_PACKED_DIMS = dict(hidden=64, heads=2, kv_heads=1, head_dim=32, eps=1e-5)
_EX_PACKED_FFN = dict(hidden=64, q_dim=64, intermediate=128, eps=1e-5)

# A decode op's K and V rows, which its ``.into`` overload writes into a KV cache's rows (the chained ops': the next
# layer's)
_KV_ROWS = (("k_roped", "k_row"), ("v", "v_row"))
_NEXT_KV_ROWS = (("next_k_roped", "next_k_row"), ("next_v", "next_v_row"))
_FIRST_KV_ROWS = (("first_k_roped", "first_k_row"), ("first_v", "first_v_row"))


def _qkv_op(name: str, scalars, program_for, example, qkv_bias: bool, into=()) -> FusedOp:
    """An op that projects Q/K/V; with ``qkv_bias``, its twin ``<name>_qkv_bias`` (Qwen2's biases), which takes the
    biases after wv: bq, bk, bv for prefill rows, bqk = [bq | bk] and bv for a decode token (next_bqk, next_bv after
    next_wv in the chained ops). ``example(qkv_bias)`` builds the op's example Program; the registry's shape check
    holds the biases to the Program's. ``into``: FusedOp.into, the same for both."""
    if not qkv_bias:
        return FusedOp(name, scalars, program_for, example(False), into)
    biased, unbiased = example(True), {arg.name for arg in example(False).host_args}
    at = next(i for i, arg in enumerate(biased.host_args) if arg.name not in unbiased)
    count = len(biased.host_args) - len(unbiased)

    def biased_program_for(shapes, *values):
        return program_for(shapes[:at] + shapes[at + count:], *values, qkv_bias=True)

    return FusedOp(name + "_qkv_bias", scalars, biased_program_for, biased, into)


def _qkv_ops(qkv_bias: bool) -> tuple[FusedOp, ...]:
    return (
        _qkv_op("rms_gemms_rope", (("eps", "float"), _PRECISION), _rms_gemms_rope,
                lambda b: catalog.rms_gemms_rope_program(**_EX, seq=2, qkv_bias=b), qkv_bias),
        _qkv_op("rms_gemv_rope", (("eps", "float"),), _rms_gemv_rope,
                lambda b: catalog.rms_gemv_rope_program(**_EX, qkv_bias=b), qkv_bias, _KV_ROWS),
        _qkv_op("o_gemv_ffn_rms_gemv_rope", (("eps", "float"), ("next_eps", "float")), _o_gemv_ffn_rms_gemv_rope,
                lambda b: catalog.o_gemv_ffn_rms_gemv_rope_program(**_EX_FFN, heads=2, kv_heads=1, head_dim=4,
                                                                   next_eps=1e-5, qkv_bias=b), qkv_bias,
                _NEXT_KV_ROWS),
        _qkv_op("decode_attn_o_gemv_ffn_rms_gemv_rope", (("head_dim", "int"), ("eps", "float"), ("next_eps", "float")),
                _decode_attn_o_gemv_ffn_rms_gemv_rope,
                lambda b: catalog.decode_attn_o_gemv_ffn_rms_gemv_rope_program(64, 64, 128, 1e-5, 2, 1, 32, 128, 1e-5,
                                                                               qkv_bias=b), qkv_bias, _NEXT_KV_ROWS),
        _qkv_op("rms_gemv_rope_packed", (("eps", "float"), _WEIGHTS), _rms_gemv_rope_packed,
                lambda b: catalog.rms_gemv_rope_program(**_EX_PACKED_DIMS, weights=_EX_PACKED, qkv_bias=b), qkv_bias,
                _KV_ROWS),
        _qkv_op("o_gemv_ffn_rms_gemv_rope_packed", (("eps", "float"), ("next_eps", "float"), _WEIGHTS),
                _o_gemv_ffn_rms_gemv_rope_packed,
                lambda b: catalog.o_gemv_ffn_rms_gemv_rope_program(**_EX_PACKED_FFN, heads=2, kv_heads=1, head_dim=32,
                                                                   next_eps=1e-5, weights=_EX_PACKED, qkv_bias=b),
                qkv_bias, _NEXT_KV_ROWS),
        _qkv_op("decode_attn_o_gemv_ffn_rms_gemv_rope_packed",
                (("head_dim", "int"), ("eps", "float"), ("next_eps", "float"), _WEIGHTS),
                _decode_attn_o_gemv_ffn_rms_gemv_rope_packed,
                lambda b: catalog.decode_attn_o_gemv_ffn_rms_gemv_rope_program(64, 64, 128, 1e-5, 2, 1, 32, 128, 1e-5,
                                                                               weights=_EX_PACKED, qkv_bias=b),
                qkv_bias, _NEXT_KV_ROWS),
        _qkv_op("rms_gemms_rope_w8x2", (("eps", "float"),), _rms_gemms_rope_w8x2,
                lambda b: catalog.rms_gemms_rope_w8x2_program(**_EX_PACKED_DIMS, seq=2, qkv_bias=b), qkv_bias),
    )


FUSED_OPS = {op.name: op for op in (
    *_qkv_ops(False),
    *_qkv_ops(True),
    FusedOp("flash_attn", (("head_dim", "int"),), _flash_attn, catalog.flash_attn_program(2, 1, 4, 2)),
    FusedOp("o_ffn", (("eps", "float"), _PRECISION), _o_ffn, catalog.o_ffn_program(**_EX_FFN, seq=2)),
    FusedOp("o_gemv_ffn", (("eps", "float"),), _o_gemv_ffn, catalog.o_gemv_ffn_program(**_EX_FFN)),
    FusedOp("decode_attn", (("head_dim", "int"),), _decode_attn, catalog.decode_attn_program(2, 1, 32, 128)),
    FusedOp("decode_attn_o_gemv_ffn", (("head_dim", "int"), ("eps", "float")), _decode_attn_o_gemv_ffn,
            catalog.decode_attn_o_gemv_ffn_program(64, 64, 128, 1e-5, 2, 1, 32, 128)),
    FusedOp("decode_attn_o_gemv_ffn_packed", (("head_dim", "int"), ("eps", "float"), _WEIGHTS),
            _decode_attn_o_gemv_ffn_packed,
            catalog.decode_attn_o_gemv_ffn_program(64, 64, 128, 1e-5, 2, 1, 32, 128, weights=_EX_PACKED)),
    FusedOp("lm_head_gemv", (), _lm_head_gemv, catalog.lm_head_gemv_program(8, 16)),
    FusedOp("o_gemv_ffn_packed", (("eps", "float"), _WEIGHTS), _o_gemv_ffn_packed,
            catalog.o_gemv_ffn_program(**_EX_PACKED_FFN, weights=_EX_PACKED)),
    FusedOp("lm_head_gemv_packed", (_WEIGHTS,), _lm_head_gemv_packed,
            catalog.lm_head_gemv_program(64, 16, weights=_EX_PACKED)),
    FusedOp("o_ffn_w8x2", (("eps", "float"),), _o_ffn_w8x2, catalog.o_ffn_w8x2_program(**_EX_PACKED_FFN, seq=2)),
    # packed rows to bf16 weights on the NPU (what prefill's GEMMs read of packed projections); ``.into`` writes them
    # into a buffer the caller keeps
    FusedOp("dequantize_rows", (("in_features", "int"), _WEIGHTS), _dequantize_rows,
            catalog.dequantize_rows_program(16, 64, _EX_PACKED), (("out", "out"),)),
    *_decode_layers_ops(),
)}

ALL_OPS = {name: register(op) for name, op in FUSED_OPS.items()}
rms_gemms_rope, flash_attn, o_ffn = ALL_OPS["rms_gemms_rope"], ALL_OPS["flash_attn"], ALL_OPS["o_ffn"]
rms_gemv_rope, o_gemv_ffn, lm_head_gemv = ALL_OPS["rms_gemv_rope"], ALL_OPS["o_gemv_ffn"], ALL_OPS["lm_head_gemv"]
o_gemv_ffn_rms_gemv_rope, decode_attn = ALL_OPS["o_gemv_ffn_rms_gemv_rope"], ALL_OPS["decode_attn"]
decode_attn_o_gemv_ffn_rms_gemv_rope = ALL_OPS["decode_attn_o_gemv_ffn_rms_gemv_rope"]
decode_attn_o_gemv_ffn, decode_attn_o_gemv_ffn_packed = (ALL_OPS["decode_attn_o_gemv_ffn"],
                                                         ALL_OPS["decode_attn_o_gemv_ffn_packed"])
rms_gemv_rope_packed, o_gemv_ffn_packed = ALL_OPS["rms_gemv_rope_packed"], ALL_OPS["o_gemv_ffn_packed"]
o_gemv_ffn_rms_gemv_rope_packed, lm_head_gemv_packed = (ALL_OPS["o_gemv_ffn_rms_gemv_rope_packed"],
                                                        ALL_OPS["lm_head_gemv_packed"])
decode_attn_o_gemv_ffn_rms_gemv_rope_packed = ALL_OPS["decode_attn_o_gemv_ffn_rms_gemv_rope_packed"]
rms_gemms_rope_w8x2, o_ffn_w8x2 = ALL_OPS["rms_gemms_rope_w8x2"], ALL_OPS["o_ffn_w8x2"]
dequantize_rows = ALL_OPS["dequantize_rows"]
# Each op with an ``.into`` overload → it: a decode op that projects K and V writes the K and V rows into a KV cache's
# rows, dequantize_rows its bf16 rows into a buffer the caller keeps.
INTO = {ALL_OPS[name]: register_into(op) for name, op in FUSED_OPS.items() if op.into}
# Each Q/K/V-projecting op → its biased twin (families with q/k/v biases, patch_llama/families.py); ``.into``
# overloads likewise.
QKV_BIASED = {ALL_OPS[name]: ALL_OPS[name + "_qkv_bias"] for name in ALL_OPS if name + "_qkv_bias" in ALL_OPS}
QKV_BIASED.update({INTO[op]: INTO[biased] for op, biased in QKV_BIASED.items() if op in INTO})
