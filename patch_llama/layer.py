"""The patched forwards: a Llama decoder layer and the LM head through the npu2 ops.

Prefill (more than one new token) runs rms_gemms_rope → flash_attn → o_ffn on each sequence's real
tokens, padded at the end to a compiled bucket length; decode (one new token) runs rms_gemv_rope →
attention over the KV cache → o_gemv_ffn. The Cache object generate() hands the layers stays the single
source of truth for K/V, so every generate() feature that relies on it keeps working. With an NpuKVCache
(patch_llama/kv_cache.py, the patched model's default) decode writes the new K/V rows into its slabs and
attends over them on the NPU (npu2.decode_attn, chained with the layer's FFN where it can be; a left-padded
sequence from its first real row), or on the host for a mask other than causal plus left padding; with HF's own
caches it attends over HF's tensors on the host (``_host_attention``).

In decode, a layer followed by another runs o_gemv_ffn_rms_gemv_rope instead of o_gemv_ffn: the next
layer's rms_gemv_rope in the same dispatch, on this layer's output. The next layer takes those results
only if the hidden state it is handed is that output, unmodified, at the same positions; otherwise (a
hook replaced or edited it, layers were reordered) it runs rms_gemv_rope itself: at the head of the decode group
it leads with the layers after it (npu2.decode_layers<n>_qkv, ``NpuDecoderLayer._qkv_group``), else alone.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..host_memory import release_free_heap
from ..kernels import quant
from ..kernels.catalog import (DECODE_ATTN_ROWS_MULTIPLE, DECODE_GROUP_SIZES, DEFAULT_BF16_WEIGHT_PRECISION,
                               decode_attn_capacity)
from ..kernels.program import pad_rows
from ..ops import (ALL_OPS, INTO, QKV_BIASED, build_rope_lut, decode_attn, decode_attn_length, decode_attn_o_gemv_ffn,
                   decode_attn_o_gemv_ffn_packed, decode_attn_o_gemv_ffn_rms_gemv_rope,
                   decode_attn_o_gemv_ffn_rms_gemv_rope_packed, dequantize_rows, device_empty, device_only_empty,
                   device_written, flash_attn, lm_head_gemv, lm_head_gemv_packed, o_ffn, o_gemv_ffn, o_gemv_ffn_packed,
                   o_ffn_w8x2, o_gemv_ffn_rms_gemv_rope, o_gemv_ffn_rms_gemv_rope_packed, rms_gemms_rope,
                   rms_gemms_rope_w8x2, rms_gemv_rope, rms_gemv_rope_packed)
from .kv_cache import NpuKVCache
from .transformers_compat import LayerSignature, sees_layer_outputs

# The .into overloads of the decode ops that produce K and V rows: with an NpuKVCache the NPU writes those rows into it
rms_gemv_rope_into, rms_gemv_rope_packed_into = INTO[rms_gemv_rope], INTO[rms_gemv_rope_packed]
o_gemv_ffn_rms_gemv_rope_into = INTO[o_gemv_ffn_rms_gemv_rope]
o_gemv_ffn_rms_gemv_rope_packed_into = INTO[o_gemv_ffn_rms_gemv_rope_packed]
decode_attn_o_gemv_ffn_rms_gemv_rope_into = INTO[decode_attn_o_gemv_ffn_rms_gemv_rope]
decode_attn_o_gemv_ffn_rms_gemv_rope_packed_into = INTO[decode_attn_o_gemv_ffn_rms_gemv_rope_packed]
# (layers, packed, qkv, ends) → the .into overload of the decode group op that runs that many layers in one
# dispatch: qkv "_qkv" (its first layer's rms_gemv_rope too) or ""; ends "" (layers go on after it), "_final" (its last
# layer is the model's last), "_final_lm" (then the model's final norm and LM head too) or, bf16 layers only,
# "_final_packed_lm" (the LM head packed)
decode_layers_into = {(n, packed, qkv, ends):
                      INTO[ALL_OPS[f"decode_layers{n}{qkv}{ends}" + ("_packed" if packed else "")]]
                      for n in DECODE_GROUP_SIZES for packed in (False, True) for qkv in ("", "_qkv")
                      for ends in ("", "_final", "_final_lm") + (() if packed else ("_final_packed_lm",))}


class ChainedQkv(NamedTuple):
    """A decode layer's rms_gemv_rope results, computed by the layer before it, and what they were computed
    from: the hidden state that layer returned (and its version), the LUT rows and the eps."""

    layer: object  # the NpuDecoderLayer they are for
    hidden: torch.Tensor
    version: int
    lut_rows: tuple
    eps: float
    rows: list  # per sequence, (v, q_roped, k_roped); (None, q_roped, None) when the NPU wrote K and V into the cache
    placed: tuple | None  # (NpuKVLayer, position) the NPU wrote the K and V rows at, if it did


class GroupedLayers(NamedTuple):
    """Layers a group run (``NpuDecoderLayer._decode_group``) computed before HF calls them: each, called in turn
    with the group's output, returns it as it is."""

    layers: list  # the NpuDecoderLayers still to be called, in order
    hidden: torch.Tensor  # the group's output, which HF hands each of them
    version: int
    lut_rows: tuple  # the decode step's LUT rows: a new step's differ, so a group left by an interrupted forward is not taken


class HeadResults(NamedTuple):
    """The model's final norm and logits, computed by the decode group that ran its last layer (a _final_lm group),
    for HF's model.norm and lm_head calls that follow in the forward (``NpuFinalNorm``, ``NpuLmHead``)."""

    hidden: torch.Tensor  # the group's output, which HF hands model.norm
    version: int
    normed: torch.Tensor  # (batch, 1, hidden): what model.norm returns for it
    normed_version: int
    logits: torch.Tensor  # (batch, 1, vocab): what lm_head returns for ``normed`` (or HF's last-row view of it)


@dataclass(frozen=True)
class PrefillSettings:
    """What patch_llama chose for a model's prompts, fixed until it is unpatched: the compiled bucket lengths, the
    prefill GEMMs' precision and the model's context (config.max_position_embeddings: longer prompts are refused)."""

    buckets: tuple[int, ...]
    matmul_precision: str = DEFAULT_BF16_WEIGHT_PRECISION
    context: int | None = None

    def bucket(self, rows: int) -> int:
        # a scan rather than bisect: dynamo cannot trace the C bisect, and there are few buckets
        return next(b for b in self.buckets if b >= rows)

    def chunks(self, rows: int) -> list[tuple[int, int, int]]:
        """(start, stop, padded length) pieces covering ``rows``; long prompts split at the largest bucket."""
        largest, out, start = self.buckets[-1], [], 0
        while start < rows:
            stop = min(rows, start + largest)
            out.append((start, stop, self.bucket(stop - start)))
            start = stop
        return out


@dataclass
class ForwardMemos:
    """What every layer of one forward derives alike from the same inputs HF hands each of them (the RoPE tables,
    the mask, the attention length), worked out by the first layer and kept one entry deep, keyed by the input's
    identity; and the decode step's inputs in NPU buffers every layer binds."""

    lut_memo: tuple = (None, None, None)  # (cos tensor, its RoPE LUT, decode rows); holding cos keeps its id unique
    mask_memo: tuple = (None, None)  # (mask tensor, per-row first real token or None)
    decode_mask_memo: tuple = (None, None)  # (decode mask tensor, per-row first key it may see, or None)
    # a decode step's inputs every layer reads (the LUT rows, the attention length), each in an NPU buffer of its
    # own that is rewritten once per step (the runs of a step end before the next step writes): bound, not copied
    step_inputs: dict = field(default_factory=dict)
    length_memo: dict = field(default_factory=dict)  # slot → (length, its digits in step_inputs)

    def rope_lut(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a memo would make dynamo guard on it and recompile every step
            return build_rope_lut(cos, sin).contiguous()
        if self.lut_memo[0] is not cos:
            self.lut_memo = (cos, build_rope_lut(cos, sin).contiguous(), None)
        return self.lut_memo[1]

    def decode_lut_rows(self, cos: torch.Tensor, sin: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
        """Per sequence, the 1-D LUT row of its one new position. Outside torch.compile every layer of a decode
        step gets the same row tensors, so the runtime can tell that it already holds them on the device."""
        if torch.compiler.is_compiling():
            return _lut_rows(self.rope_lut(cos, sin), batch)
        lut = self.rope_lut(cos, sin)
        rows = self.lut_memo[2]
        if rows is None or len(rows) != batch:
            rows = tuple(self.step_input(("lut", b), row) for b, row in enumerate(_lut_rows(lut, batch)))
            self.lut_memo = (cos, lut, rows)
        return rows

    def step_input(self, name, host: torch.Tensor) -> torch.Tensor:
        """``host`` written into the step input buffer ``name``."""
        buffer = _npu_buffer(self.step_inputs, name, tuple(host.shape), host.dtype)
        buffer.copy_(host)
        device_written(buffer)
        return buffer

    def length_digits(self, length: int, slot: int = 0) -> torch.Tensor:
        """npu2.decode_attn's length argument for this step's ``length`` (every layer passes the same one), in the
        step input buffer ``slot``: one per length a step attends over (a left-padded sequence's own, from its first
        real row, takes 1 + the sequence's index)."""
        memo = self.length_memo.get(slot)
        if memo is None or memo[0] != length:
            memo = self.length_memo[slot] = (length, self.step_input(("length", slot), _length_digits(length)))
        return memo[1]

    def first_real_tokens(self, mask, batch: int, seq: int):
        """Per row, the index of its first real (non-left-pad) token, when ``mask`` is causal plus left padding.

        Returns None for any other mask (the layer then attends on the host with HF's mask as given).
        """
        if mask is None:
            return [0] * batch
        if torch.compiler.is_compiling():
            # Reading the mask's values would break the graph in every layer, and each layer's code after the
            # break would compile once per layer_idx: compiled code attends on the host with the mask as given.
            return None
        if self.mask_memo[0] is not mask:
            self.mask_memo = (mask, _left_padding_starts(mask, seq))
        return self.mask_memo[1]


    def decode_starts(self, mask, batch: int, kv_len: int):
        """Per sequence, the first of the ``kv_len`` cached positions its new token attends to, when ``mask`` is
        causal plus left padding (one forward's layers share the answer); None for any other mask."""
        if mask is None:
            return (0,) * batch
        if self.decode_mask_memo[0] is not mask:
            self.decode_mask_memo = (mask, _decode_starts(mask, batch, kv_len))
        return self.decode_mask_memo[1]


@dataclass
class SharedState:
    """What the layers of one patched model share: its prefill settings, the memos of a forward, and what one
    decode layer hands the next within a forward."""

    settings: PrefillSettings
    decode_group: int = DECODE_GROUP_SIZES[-1]  # the most layers one decode dispatch runs (patch_llama's choice)
    memos: ForwardMemos = field(default_factory=ForwardMemos)
    chained: ChainedQkv | None = None  # the next layer's rms_gemv_rope results, computed by the layer before it
    grouped: GroupedLayers | None = None  # layers a group run of an earlier layer already computed
    warned_attentions: bool = False  # output_attentions=True ran HF's layers, and the user was told once
    head: NpuFinalNorm | None = None  # the model's final norm, whose LM head the last decode group can run too
    head_results: HeadResults | None = None  # that group's final norm and logits, until HF asks for them
    # packed projections' bf16 copies for prefill: per projection one NPU buffer, only ever touched by ops, into which
    # each layer's prefill has npu2.dequantize_rows write its own rows before its ops run (a layer's runs end before
    # the next layer's write)
    dequantized: dict = field(default_factory=dict)


def _npu_buffer(buffers: dict, name, shape: tuple, dtype: torch.dtype, make=device_empty) -> torch.Tensor:
    """``buffers[name]``, an NPU buffer (``make``: ``device_empty``, or ``device_only_empty`` for one only ops touch)
    made on first use or when its shape or dtype changes."""
    buffer = buffers.get(name)
    if buffer is None or tuple(buffer.shape) != shape or buffer.dtype != dtype:
        buffer = buffers[name] = make(shape, dtype)
    return buffer


def _decode_starts(mask: torch.Tensor, batch: int, kv_len: int):
    if mask.dim() != 4 or tuple(mask.shape) != (batch, 1, 1, kv_len):
        return None
    rows = mask[:, 0, 0]
    if rows.dtype == torch.bool:
        allowed, masked = rows, ~rows
    else:  # additive: 0 where a key is seen, the dtype's minimum where it is not (HF's eager masks)
        allowed, masked = rows == 0, rows == torch.finfo(rows.dtype).min
    first = allowed.to(torch.uint8).argmax(dim=1)
    positions = torch.arange(kv_len)
    expected = positions >= first[:, None]  # left padding, then every key
    if not (bool(allowed.any(dim=1).all()) and torch.equal(allowed, expected) and bool((allowed | masked).all())):
        return None
    return tuple(first.tolist())


def _lut_rows(lut: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
    rows = lut.view(lut.shape[0], -1).unbind(0)  # (batch or 1, 1, head_dim): one position per sequence
    return rows * batch if len(rows) == 1 else rows


def _cache_rows(slabs, batch: int) -> tuple[int, list]:
    """Room in an NpuKVLayer for this step's K and V rows at its next position: (that position, each sequence's
    (K row, V row) views of the slabs), which a decode op's ``.into`` overload has the NPU write."""
    position = slabs.length
    slabs.reserve(batch, position + 1)
    return position, [(k[position], v[position]) for k, v in slabs.sequences]


def _sequence_rows(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each sequence's part of a (batch, …) tensor as a 1-D view: for one sequence, a view of the whole
    tensor (an op output stays BO-backed at offset 0, so the next op binds it without a copy)."""
    return (t.reshape(-1),) if t.shape[0] == 1 else t.reshape(t.shape[0], -1).unbind(0)


def _from_sequence_rows(rows) -> torch.Tensor:
    """The (batch, 1, n) tensor of per-sequence 1-D op outputs: for one sequence, a view of its output (still
    BO-backed at offset 0, so the next op binds it without a copy)."""
    return rows[0].view(1, 1, -1) if len(rows) == 1 else torch.stack(rows).unsqueeze(1)


def _left_padding_starts(mask: torch.Tensor, seq: int):
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2] != seq or mask.shape[-1] < seq:
        return None
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    if allowed[..., seq:].any():  # a static cache's unused tail must be masked out
        return None
    allowed = allowed[..., :seq]
    valid_keys = allowed[:, -1, :]
    starts = []
    for row, keys in zip(allowed, valid_keys):
        start = int(keys.float().argmax()) if keys.any() else seq
        expected = torch.ones(seq, seq, dtype=torch.bool).tril()
        expected[:, :start] = False
        if not torch.equal(row[start:], expected[start:]):
            return None
        starts.append(start)
    return starts


class PromptTooLongError(ValueError):
    """A prompt that does not fit the model's context (config.max_position_embeddings), refused before any work.
    ``most`` is how many tokens it may have: the context for a forward pass, one less where an answer must follow;
    ``cached`` how many of its ``tokens`` a cache already holds (a conversation continued)."""

    def __init__(self, tokens: int, context: int, most: int | None = None, cached: int = 0):
        most = context if most is None else most
        counted = f"{tokens} tokens ({cached} of them already cached)" if cached else f"{tokens} tokens"
        limit = (f"the model's context of {context} tokens" if most == context else
                 f"the {most} that leave room for an answer in the model's context of {context} tokens")
        super().__init__(f"the prompt has {counted}, more than {limit} (config.max_position_embeddings)")
        self.tokens, self.context, self.most = tokens, context, most


class PrefillChunk(NamedTuple):
    """One rms_gemms_rope call of a prefill: sequence rows ``start:stop`` padded to ``padded`` (a bucket), and
    the op's outputs, whose rows past ``stop - start`` are padding."""

    start: int
    stop: int
    padded: int
    v: torch.Tensor
    q_roped: torch.Tensor
    k_roped: torch.Tensor


# fp32 scores computed at a time by the host attention: at 8k tokens the whole score matrix of SmolLM2's 9 heads
# is 2.3 GB (Llama-3.2-1B's 32 heads: 8.3 GB), so long prompts attend in blocks of queries of about this size. Each
# block runs a fixed handful of torch ops, whose threads wait on each other when the machine is busy: fewer, larger
# blocks keep that wait small (16 MiB blocks took 2.4 times as long as 64 MiB ones at 8k tokens on a loaded machine).
HOST_ATTENTION_BLOCK_BYTES = 64 << 20
_MASKED = torch.finfo(torch.float32).min  # a finite minimum, as HF's eager attention uses


def _host_attention(q, k, v, mask, scale):
    """Attention on the host over HF's cache (decode, prefill over several chunks or with a mask the kernels do
    not take, and prefill that continues a cached context). Returns (batch, heads, q_len, head_dim), a view of a
    (batch, q_len, heads, head_dim) tensor: the layout the O projection reads.

    Same numerics as the NPU attention kernel: fp32 scores and softmax, probabilities rounded to bf16, then
    multiplied by V with fp32 accumulation and rounded to bf16 once. Each KV head's query group is one batched
    matmul, which on CPUs without bf16 matmul units runs several times faster than torch's bf16
    scaled_dot_product_attention for a single query. Masked scores get a finite minimum, as in HF's eager
    attention, so a fully masked (padding) row stays finite.

    Queries go in blocks whose fp32 scores take at most HOST_ATTENTION_BLOCK_BYTES, so memory stays bounded
    however long the prompt; a block reads only the keys one of its rows may see (causally: the keys up to its
    last query), so a long causal prompt computes half the score matrix. Each row's softmax still spans all
    its keys at once: blocking changes which rows are computed together, not the arithmetic. A KV head's
    queries are laid out row by row, its group's heads side by side, so a block of rows is one slice of them;
    the blocks share two work buffers, allocated once per call.
    """
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    if mask is None and q_len > 1 and q_len != kv_len:
        raise RuntimeError("torch_npu2: a causal mask is needed when queries continue a cached context")
    fp32 = dict(dtype=torch.float32, memory_format=torch.contiguous_format)
    pairs = batch * kv_heads  # one batched matmul entry per (sequence, KV head)
    queries = q.view(batch, kv_heads, group, q_len, head_dim).transpose(2, 3).to(**fp32).view(
        pairs, q_len * group, head_dim)
    keys, values = (t.to(**fp32).view(pairs, kv_len, head_dim) for t in (k, v))
    out = q.new_empty(batch, q_len, kv_heads, group, head_dim)  # (batch, q_len, heads, head_dim), bf16
    rows = max(1, min(q_len, HOST_ATTENTION_BLOCK_BYTES // (batch * heads * kv_len * 4)))
    scores_buf = torch.empty(pairs * group * rows * kv_len)
    rounded_buf = torch.empty_like(scores_buf, dtype=torch.bfloat16)
    # causal without a mask: query i of a block sees the block's keys up to its own position
    future = torch.ones(rows, rows, dtype=torch.bool).triu(1) if mask is None and q_len > 1 else None
    for start in range(0, q_len, rows):
        stop = min(q_len, start + rows)
        block_mask = None if mask is None else mask[:, :, start:stop]
        if mask is None:  # the queries are the last q_len positions: each sees the keys up to itself
            seen = kv_len - q_len + stop
        else:  # reading the mask's values would make dynamo guard on them: compiled code reads every key
            seen = kv_len if torch.compiler.is_compiling() else _keys_seen(block_mask, kv_len)
        shape = (pairs, group * (stop - start), seen)
        size = shape[0] * shape[1] * seen
        scores = scores_buf[:size].view(shape)
        block_q = queries[:, start * group:stop * group]
        torch.baddbmm(scores, block_q, keys[:, :seen].transpose(1, 2), beta=0, alpha=scale, out=scores)  # q·k · scale
        by_row = scores.view(batch, kv_heads, stop - start, group, seen)
        if future is not None:  # only the block's own keys (the diagonal) hold future positions
            by_row[..., start:].masked_fill_(future[: stop - start, None, : stop - start], _MASKED)
        elif mask is not None and mask.dtype == torch.bool:
            by_row.masked_fill_(~block_mask[:, :, :, None, :seen], _MASKED)
        elif mask is not None:
            by_row.add_(block_mask[:, :, :, None, :seen].float())
        torch.softmax(scores, dim=-1, out=scores)
        scores.copy_(rounded_buf[:size].view(shape).copy_(scores))  # probabilities rounded to bf16, back in fp32
        # P·V in fp32, rounded to bf16 once (torch.bmm into a slice of a larger tensor takes twice as long)
        out[:, start:stop] = torch.bmm(scores, values[:, :seen]).view(
            batch, kv_heads, stop - start, group, head_dim).transpose(1, 2)
    return out.view(batch, q_len, heads, head_dim).transpose(1, 2)


def _keys_seen(block_mask: torch.Tensor, kv_len: int) -> int:
    """How many leading keys a block of queries needs: up to the last key any of its rows may see. A row that
    sees no key at all (padding) spreads its softmax over every key, so a block holding one keeps them all."""
    allowed = block_mask if block_mask.dtype == torch.bool else block_mask > torch.finfo(block_mask.dtype).min
    allowed = allowed.reshape(-1, allowed.shape[-1])
    if not bool(allowed.any(dim=-1).all()):
        return kv_len
    return int(allowed.any(dim=0).nonzero()[-1]) + 1


def _decode_attention(q: torch.Tensor, k_slab: torch.Tensor, v_slab: torch.Tensor, start: int, length: int,
                      head_dim: int, scale: float) -> torch.Tensor:
    """One sequence's decode attention over its NpuKVCache slabs.

    ``q``: the new token's roped queries, (heads * head_dim,) bf16 (rms_gemv_rope's output). ``k_slab``,
    ``v_slab``: the sequence's (capacity, kv_heads * head_dim) bf16 slabs, position-major and contiguous, whose
    row ``length - 1`` already holds the new token's K/V. Attends to rows ``start``..``length - 1`` (``start``:
    the sequence's left padding), GQA with ``heads // kv_heads`` queries per KV head, scores scaled by ``scale``.
    Returns (heads * head_dim,) bf16, the input o_gemv_ffn reads.

    On the NPU (``npu2.decode_attn`` over a capacity bucket of rows from ``start``, ``length - start`` of them valid,
    as data) when the scale is 1/sqrt(head_dim) and the slabs' storage holds the bucket (``_from_row``: an
    NpuKVCache's does), the kernel's; otherwise on the host with
    ``_host_attention``'s operations for one query (fp32 scores and softmax, probabilities rounded to bf16, P·V
    accumulated in fp32 and rounded to bf16 once). The two differ in where the probabilities round (ARCHITECTURE.md,
    "Decode attention"): within 2 bf16 ulps of the output's scale."""
    on_device = _on_device_attention(q, k_slab, v_slab, start, length, head_dim, scale)
    if on_device is not None:
        return decode_attn(*on_device, head_dim)
    rows, kv_dim = length - start, k_slab.shape[1]
    kv_heads = kv_dim // head_dim
    # fp32 copies in the slabs' own position-major layout (a straight conversion: regathering them head-major
    # took 10 times as long at 2k tokens), then (kv_heads, rows, head_dim) views whose rows are kv_dim apart, which
    # the batched matmuls read in place; each KV head's query group, (kv_heads, group, head_dim), is one matmul
    keys, values = (slab[start:length].to(torch.float32).view(rows, kv_heads, head_dim).transpose(0, 1)
                    for slab in (k_slab, v_slab))
    queries = q.view(kv_heads, -1, head_dim).to(torch.float32)
    scores = torch.empty(kv_heads, queries.shape[1], rows)
    torch.baddbmm(scores, queries, keys.transpose(1, 2), beta=0, alpha=scale, out=scores)
    torch.softmax(scores, dim=-1, out=scores)
    probabilities = scores.to(torch.bfloat16).to(torch.float32)
    return torch.bmm(probabilities, values).to(torch.bfloat16).view(-1)


class DeviceAttention(NamedTuple):
    """npu2.decode_attn's tensor arguments for one sequence: its queries, its slabs' first capacity-bucket rows and
    its length, as data."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    length: torch.Tensor


def _on_device_attention(q, k_slab, v_slab, start: int, length: int, head_dim: int, scale: float, digits=None):
    """The DeviceAttention of a ``_decode_attention`` call the NPU kernel takes (the kernel's 1/sqrt(head_dim)
    scale; a left-padded sequence's cache read from its first real row, ``_from_row``), else None. ``digits``: the
    argument of the length it attends over, ``length - start``, if the caller holds it."""
    if scale != head_dim ** -0.5:
        return None
    if start:
        k_slab, v_slab = _from_row(k_slab, start), _from_row(v_slab, start)
    length -= start
    capacity = _capacity(k_slab, length)
    if capacity is None:
        return None
    return DeviceAttention(q, k_slab[:capacity], v_slab[:capacity],
                           _length_digits(length) if digits is None else digits)


def _slab_attention(q, slabs, b: int, start: int, length: int, head_dim: int, scale: float, digits):
    """``_on_device_attention`` over sequence ``b`` of an NpuKVLayer, with the views it takes kept in the layer's
    ``view_memo`` (per sequence, first row and capacity bucket, until the slabs are reallocated): a decode step
    reuses the step before's until the length crosses into the next bucket."""
    if scale != head_dim ** -0.5:
        return None
    memo = slabs.view_memo
    rows = memo.get((b, start))
    if rows is None:
        k, v = slabs.sequences[b]
        rows = memo[(b, start)] = (_from_row(k, start), _from_row(v, start)) if start else (k, v)
    capacity = _capacity(rows[0], length - start)
    if capacity is None:
        return None
    views = memo.get((b, start, capacity))
    if views is None:
        views = memo[(b, start, capacity)] = (rows[0][:capacity], rows[1][:capacity])
    return DeviceAttention(q, *views, digits)


def _capacity(rows: torch.Tensor, length: int) -> int | None:
    """The capacity bucket decode attention reads of ``rows`` (a slab, or its rows from a first real one) to attend
    over their first ``length``, or None if they do not reach that far."""
    held = rows.shape[0]
    return None if held < length else decode_attn_capacity(length, held)


def _from_row(slab: torch.Tensor, start: int) -> torch.Tensor:
    """A (rows, kv_dim) view of ``slab``'s storage from row ``start`` on, as many whole decode-attention granules
    (DECODE_ATTN_ROWS_MULTIPLE rows) as the storage holds from there (the caller checks that they reach its length).
    Its rows past the slab's end are the next sequence's or the NpuKVCache's spare rows: a capacity bucket streams
    them, the kernel never reads a row at or past the length."""
    kv_dim = slab.shape[1]
    first = slab.storage_offset() + start * kv_dim
    rows = (slab.untyped_storage().nbytes() // slab.element_size() - first) // kv_dim
    rows -= rows % DECODE_ATTN_ROWS_MULTIPLE
    return slab.as_strided((max(rows, 0), kv_dim), (kv_dim, 1), first)


@functools.lru_cache(maxsize=16)
def _length_digits(length: int) -> torch.Tensor:
    """npu2.decode_attn's length argument, one tensor per length: every layer of a decode step passes the same one."""
    return decode_attn_length(length)


class _PositionedCache:
    """HF's cache for one call of a transformers ≤ 5.3 layer, whose caches take the rows' positions in
    ``update`` (a StaticCache writes the rows at position 0 without them)."""

    def __init__(self, cache, cache_position):
        self.cache, self.cache_position = cache, cache_position

    def update(self, k, v, layer_idx):
        return self.cache.update(k, v, layer_idx, {"cache_position": self.cache_position})

    def get_seq_length(self, layer_idx):
        return self.cache.get_seq_length(layer_idx)


@dataclass
class Projections:
    """A decoder layer's projection weights in NPU buffers, in the form its decode ops read: ``wqk`` holds the Q
    projection's rows, then the K projection's ([Wq; Wk]), ``gate_up`` the gate and up projections together."""

    wqk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class PackedProjections(Projections):
    """The projections as packed block-quantized rows (kernels/quant.py), int32 words: what the decode ops read.
    ``gate_up`` holds each row's packed gate row, then its packed up row."""

    format: str = field(kw_only=True)

    DEQUANTIZE_ROWS = 256  # rows widened to fp32 at a time: a whole [gate | up]'s fp32 temporaries take GiBs

    def dequantized(self, name: str, in_features: int) -> torch.Tensor:
        """A projection as bf16 on the host, GGUF's exact weights rounded once (what the integer prefill GEMMs' weights
        are prepared from when the projections are packed): the packed rows' shape, each ``in_features`` wide
        (gate_up's twice)."""
        fmt = quant.weight_format(self.format)
        packed = getattr(self, name)
        rows = packed.reshape(2 * packed.shape[0], -1) if name == "gate_up" else packed  # each half packed alone
        out = torch.empty(packed.shape[0], rows.shape[0] // packed.shape[0] * in_features, dtype=torch.bfloat16)
        flat = out.view(rows.shape[0], in_features)
        for start in range(0, rows.shape[0], self.DEQUANTIZE_ROWS):
            chunk = rows[start:start + self.DEQUANTIZE_ROWS]
            quant.dequantize(fmt, chunk, in_features, out=flat[start:start + chunk.shape[0]])
        return out


@dataclass
class PreparedProjections:
    """The projections prepared for the integer prefill GEMMs (matmul precision "w8x2a16": kernels/int_gemm.py's
    tiles of two int8 terms and their scales, int32 words), beside the weights decode reads (bf16 or packed).
    ``gate_up`` is the [gate | up] pair, tile by tile."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class NpuDecoderLayer:
    """Callable that replaces one ``LlamaDecoderLayer.forward`` (bound per instance)."""

    def __init__(self, layer, shared: SharedState, signature: LayerSignature, *, gate_up: torch.Tensor | None = None,
                 qk: torch.Tensor | None = None, qk_bias: torch.Tensor | None = None,
                 packed: PackedProjections | None = None, prepared: PreparedProjections | None = None,
                 arenas: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``signature``: the installed transformers' decoder-layer signature, whose names the layer takes its
        arguments by. Either ``gate_up`` and ``qk``, the layer's gate and up weights side by side, [gate | up]
        (F × 2H), and its Q and K weights stacked, [Wq; Wk], whose parts its gate_proj.weight, up_proj.weight,
        q_proj.weight and k_proj.weight are (patch_llama lays them out so), or ``packed``, the projections as packed
        rows, when the model runs with quantized weights; ``qk_bias``: [bq | bk], whose parts q_proj.bias and
        k_proj.bias are, when the family has Q/K/V biases; ``prepared``, the projections prepared for integer
        prefill GEMMs when the model runs them; ``arenas``, the layer's two weight arenas (catalog.layer_arenas),
        whose parts its projections (or the packed rows), norms and biases are, which the decode groups take."""
        self.signature = signature
        self.module = layer
        self.hf_forward = functools.partial(type(layer).forward, layer)  # HF's own layer, for output_attentions
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.heads = attn.q_proj.weight.shape[0] // self.head_dim
        self.kv_heads = attn.k_proj.weight.shape[0] // self.head_dim
        # the norms themselves, not their eps: a variance_epsilon changed after patching still applies
        self.input_norm, self.post_attention_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.packed, self.prepared, self.arenas = packed, prepared, arenas
        # Q/K/V biases (a family with them, patch_llama/families.py): bf16 in every weight format, taken by the ops'
        # _qkv_bias twins after wv: (bq, bk, bv) by prefill's, ([bq | bk], bv) by decode's
        self.qkv_biases = tuple(p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj) if p.bias is not None)
        decode_biases = (qk_bias, attn.v_proj.bias) if self.qkv_biases else ()
        # the decode ops' norm weight, [Wq; Wk], Wv and biases
        if packed is None:
            self.qkv_weights = (layer.input_layernorm.weight, qk, attn.v_proj.weight, *decode_biases)
            self.ffn_weights = (attn.o_proj.weight, layer.post_attention_layernorm.weight, gate_up,
                                mlp.down_proj.weight)
        else:
            self.qkv_weights = (layer.input_layernorm.weight, packed.wqk, packed.wv, *decode_biases)
            self.ffn_weights = (packed.wo, layer.post_attention_layernorm.weight, packed.gate_up, packed.down)
        self.hidden_size, self.q_dim = attn.q_proj.weight.shape[1], attn.q_proj.weight.shape[0]
        self.intermediate = mlp.down_proj.weight.shape[1]
        # what a layer must share with another to run in one decode group with it
        self.group_key = (self.hidden_size, self.q_dim, self.intermediate, self.heads, self.kv_heads, self.head_dim,
                          self.scale, None if packed is None else packed.format, bool(self.qkv_biases))
        self.shared = shared
        self.next_layer: NpuDecoderLayer | None = None  # the decoder layer after this one (patch_llama links them)

    def __call__(self, *args, **kwargs):
        hidden, arguments = self.signature.bind(args, kwargs)
        if self.shared.grouped is not None and self._ran_in_group(hidden, arguments):
            return hidden
        if arguments.get("output_attentions"):
            return self._hf_layer_forward(hidden, arguments)
        cache = arguments.get(self.signature.cache)
        if cache is not None and self.signature.cache_position and type(cache) is not NpuKVCache:
            # transformers ≤ 5.3: HF's caches place rows by cache_position (an NpuKVCache appends, as DynamicCache)
            cache = _PositionedCache(cache, arguments.get("cache_position"))
        position_embeddings = arguments.get("position_embeddings")
        if position_embeddings is None:
            raise ValueError("torch_npu2 decoder layer: position_embeddings (cos, sin) is required; HF's LlamaModel "
                             "computes it from position_ids")
        mask = arguments.get("attention_mask")
        if torch.is_grad_enabled():  # generate() runs without grad: no second no_grad block per layer
            with torch.no_grad():
                return self._forward(hidden, mask, cache, position_embeddings)
        return self._forward(hidden, mask, cache, position_embeddings)

    def _hf_layer_forward(self, hidden, arguments):
        """HF's own decoder layer on the host, for a call that asks for attention weights: the fused attention
        never materializes them. It reads the same weights (views of the NPU buffers) and writes HF's cache the
        same way, so the next call can go back to the NPU."""
        if not self.shared.warned_attentions:
            self.shared.warned_attentions = True
            warnings.warn("torch_npu2: output_attentions=True runs HF's own decoder layers on the CPU for the calls "
                          "that ask for them (the fused NPU attention never materializes the weights)", stacklevel=3)
        return self.hf_forward(hidden, **arguments)

    def _forward(self, hidden, mask, cache, position_embeddings):
        batch = hidden.shape[0]
        if hidden.shape[1] == 1:
            return self._decode(hidden, self.shared.memos.decode_lut_rows(*position_embeddings, batch), mask, cache)
        # cos/sin have batch 1 when every row shares its positions
        lut = self.shared.memos.rope_lut(*position_embeddings).expand(batch, -1, -1)
        return self._prefill(hidden, lut, mask, cache)

    def _update_cache(self, cache, k, v):
        return (k, v) if cache is None else cache.update(k, v, self.layer_idx)

    @property
    def eps_attn(self) -> float:
        return float(self.input_norm.variance_epsilon)

    @property
    def eps_mlp(self) -> float:
        return float(self.post_attention_norm.variance_epsilon)

    def _projecting(self, op):
        """``op``, an op computing this layer's Q/K/V, or its _qkv_bias twin when the projections have biases."""
        return QKV_BIASED[op] if self.qkv_biases else op

    def _chained_rows(self, hidden, lut_rows, eps, slabs):
        """The rms_gemv_rope results the previous layer computed for this one, if they are of ``hidden`` (and, when
        the NPU wrote their K and V rows, into ``slabs`` at its next position)."""
        chained, self.shared.chained = self.shared.chained, None
        if (chained is not None and chained.layer is self and chained.hidden is hidden
                and hidden._version == chained.version and chained.lut_rows is lut_rows and chained.eps == eps
                and (chained.placed[0] is slabs and chained.placed[1] == slabs.length if chained.placed
                     else slabs is None)):
            return chained.rows
        return None

    def _ran_in_group(self, hidden, arguments: dict) -> bool:
        """Whether a group run of an earlier layer of this decode step computed this layer (``_decode_group``): then
        HF hands it the group's output, which it returns as it is. A group runs its layers before HF calls them, so a
        call out of the order patch_llama linked the layers in, or with another hidden state, is an error. Checked
        first in the call: a grouped layer has nothing else to do."""
        grouped, memos = self.shared.grouped, self.shared.memos
        position_embeddings = arguments.get("position_embeddings")
        # the step's LUT rows are those of the RoPE tables this call has (a group left by an interrupted forward is
        # another step's)
        if (grouped is None or arguments.get("output_attentions") or position_embeddings is None
                or memos.lut_memo[0] is not position_embeddings[0] or memos.lut_memo[2] is not grouped.lut_rows):
            return False
        expected = grouped.layers[0]
        if expected is not self or hidden is not grouped.hidden or hidden._version != grouped.version:
            self.shared.grouped = None
            raise RuntimeError(
                f"torch_npu2: decoder layer {self.layer_idx} was called while layer {expected.layer_idx}, which an "
                "earlier layer's NPU run already computed, was due with that run's output; the patched layers must "
                "run in the order patch_llama linked them (unpatch_llama and patch again after changing "
                "model.model.layers)")
        grouped.layers.pop(0)
        if not grouped.layers:
            self.shared.grouped = None
        return True

    def _decode(self, hidden, lut_rows, mask, cache):
        batch, heads, kv_heads, head_dim = hidden.shape[0], self.heads, self.kv_heads, self.head_dim
        inputs, eps = _sequence_rows(hidden), self.eps_attn
        # under torch.compile the layers do not chain: identity checks on a side channel would make dynamo guard
        compiling = torch.compiler.is_compiling()
        # With an NpuKVCache the NPU writes each step's K and V rows into it (the ops' .into overloads)
        slabs = cache.layers[self.layer_idx] if type(cache) is NpuKVCache and not compiling else None
        rows = None if compiling else self._chained_rows(hidden, lut_rows, eps, slabs)
        packed = () if self.packed is None else (self.packed.format,)
        if rows is None and slabs is not None:  # no run made this layer's Q/K/V: with the layers after it, if any join
            result = self._qkv_group(inputs, lut_rows, mask, cache, slabs, packed)
            if result is not None:
                return result
            _, targets = _cache_rows(slabs, batch)
            into = self._projecting(rms_gemv_rope_into if self.packed is None else rms_gemv_rope_packed_into)
            rows = [(None, into(x, *self.qkv_weights, lut, k_row, v_row, eps, *packed), None)
                    for x, lut, (k_row, v_row) in zip(inputs, lut_rows, targets)]
        elif rows is None:
            qkv_op = self._projecting(rms_gemv_rope if self.packed is None else rms_gemv_rope_packed)
            rows = [qkv_op(x, *self.qkv_weights, lut, eps, *packed) for x, lut in zip(inputs, lut_rows)]
        on_device = None
        if slabs is not None:
            attn, on_device = self._attend_over_slabs(slabs, rows, mask)
        else:
            # (batch, heads, 1, head_dim) views of the op outputs; stacking only when there are several rows
            v, q, k = (rows[0][i].view(1, n, 1, head_dim) if batch == 1 else
                       torch.stack([r[i] for r in rows]).view(batch, n, 1, head_dim)
                       for i, n in ((0, kv_heads), (1, heads), (2, kv_heads)))
            keys, values = self._update_cache(cache, k, v)
            attn = _sequence_rows(_host_attention(q, keys, values, mask, self.scale))
        wo, norm2_w, w_gate_up, w_down = self.ffn_weights
        eps, following = self.eps_mlp, self.next_layer
        ffn_op = o_gemv_ffn if self.packed is None else o_gemv_ffn_packed
        if following is None or compiling or (following.packed is None) != (self.packed is None):
            if on_device is not None:  # attention and this layer's rest: one run
                last_op = decode_attn_o_gemv_ffn if self.packed is None else decode_attn_o_gemv_ffn_packed
                return _from_sequence_rows([last_op(*a, wo, x, norm2_w, w_gate_up, w_down, head_dim, eps, *packed)
                                            for a, x in zip(on_device, inputs)])
            return _from_sequence_rows([ffn_op(a, wo, x, norm2_w, w_gate_up, w_down, eps, *packed)
                                        for a, x in zip(attn, inputs)])
        next_eps = following.eps_attn
        # the next layer's K and V rows: into its cache slabs (NpuKVCache), else returned
        placed, targets = None, [()] * batch
        if slabs is not None:
            next_slabs = cache.layers[following.layer_idx]
            position, targets = _cache_rows(next_slabs, batch)
            placed = (next_slabs, position)
        if on_device is not None and placed:  # with the layers after it, if they can join: one run
            result = self._decode_group(on_device, inputs, lut_rows, mask, cache, targets, packed)
            if result is not None:
                return result
        if on_device is not None:  # attention, this layer's rest and the next's QKV: one run
            if placed:
                layer_op = (decode_attn_o_gemv_ffn_rms_gemv_rope_into if self.packed is None
                            else decode_attn_o_gemv_ffn_rms_gemv_rope_packed_into)
            else:
                layer_op = (decode_attn_o_gemv_ffn_rms_gemv_rope if self.packed is None
                            else decode_attn_o_gemv_ffn_rms_gemv_rope_packed)
            layer_op = following._projecting(layer_op)
            chained = [layer_op(*a, wo, x, norm2_w, w_gate_up, w_down, *following.qkv_weights, lut, *rows_into,
                                head_dim, eps, next_eps, *packed)
                       for a, x, lut, rows_into in zip(on_device, inputs, lut_rows, targets)]
        else:
            if placed:
                chain_op = (o_gemv_ffn_rms_gemv_rope_into if self.packed is None
                            else o_gemv_ffn_rms_gemv_rope_packed_into)
            else:
                chain_op = o_gemv_ffn_rms_gemv_rope if self.packed is None else o_gemv_ffn_rms_gemv_rope_packed
            chain_op = following._projecting(chain_op)
            chained = [chain_op(a, wo, x, norm2_w, w_gate_up, w_down, *following.qkv_weights, lut, *rows_into, eps,
                                next_eps, *packed) for a, x, lut, rows_into in zip(attn, inputs, lut_rows, targets)]
        result = _from_sequence_rows([c[0] for c in chained])
        rows = [(None, c[1], None) for c in chained] if placed else [c[1:] for c in chained]
        self.shared.chained = ChainedQkv(following, result, result._version, lut_rows, next_eps, rows, placed)
        return result

    def _joins(self, layer, cache, length: int) -> bool:
        """Whether ``layer`` can run in this layer's decode group: it is like this one (dims, weight format, Q/K/V
        biases or not, eps), and so is the layer after it, which it chains into, if it has one (a layer with none,
        the model's last, ends the group: a _final group); its slabs are one step behind ``length``; and nothing but
        HF's layer loop sees its output."""
        if layer is None:
            return False
        following = layer.next_layer
        return (layer.group_key == self.group_key and layer.eps_mlp == self.eps_mlp
                and (following is None or following.group_key == self.group_key
                     and following.eps_attn == self.next_layer.eps_attn)
                and cache.layers[layer.layer_idx].length == length - 1
                and not sees_layer_outputs(layer.module, layer))

    def _qkv_group(self, inputs, lut_rows, mask, cache, slabs, packed):
        """This layer whole and the layers after it that can join, in one run per sequence of
        npu2.decode_layers<n>_qkv.into: ``_decode_group``, with this layer's rms_gemv_rope first in the same run,
        writing its K/V rows into ``slabs`` at this step's position, where its attention reads them. None if this
        layer cannot lead such a group (its Q/K/V normalized with another eps than the group's next_eps, a next layer
        of another weight format, a mask or views the NPU kernel cannot take, no layer joining): then nothing ran and
        no layer's length moved."""
        following, batch = self.next_layer, len(inputs)
        if (following is None or self.shared.decode_group < 2
                or (following.packed is None) != (self.packed is None) or self.eps_attn != following.eps_attn
                or sees_layer_outputs(self.module, self)):
            return None
        position, own_rows = _cache_rows(slabs, batch)
        length, memos = position + 1, self.shared.memos
        starts = memos.decode_starts(mask, batch, length)
        if starts is None:
            return None
        digits = [memos.length_digits(length - s, slot=b + 1 if s else 0) for b, s in enumerate(starts)]
        on_device = [_slab_attention(None, slabs, b, starts[b], length, self.head_dim, self.scale, digits[b])
                     for b in range(batch)]
        if any(a is None for a in on_device):
            return None
        _, targets = _cache_rows(cache.layers[following.layer_idx], batch)
        slabs.length = length
        result = self._decode_group(on_device, inputs, lut_rows, mask, cache, targets, packed, own_rows)
        if result is None:
            slabs.length = position
        return result

    def _decode_group(self, on_device, inputs, lut_rows, mask, cache, targets, packed, own_rows=None):
        """This layer from its attention on and the layers after it that can join (``_joins``; at most
        ``SharedState.decode_group`` in all, patch_llama's decode_layers_per_dispatch), one run per sequence of
        npu2.decode_layers<n>.into: each layer's K/V rows of the layer after it go into that layer's slabs at this
        step's position, where that layer's attention reads them in the same run. Returns the last layer's output
        (HF hands it to each of them in turn: ``_ran_in_group``) after leaving the next layer's Q for it as a
        ChainedQkv, unless the last is the model's last layer (npu2.decode_layers<n>_final); None if no layer joins
        (or their slabs cannot be read in place: nothing was run then, and no layer's length moved). Layers with
        Q/K/V biases (Qwen2) group too: the biases are parts of their norms arenas. ``own_rows``: this layer's own K/V
        rows per sequence when its rms_gemv_rope runs first in the run (``_qkv_group``; ``on_device``'s q is None
        then)."""
        length, batch = cache.layers[self.layer_idx].length, len(inputs)
        members, layer = [], self.next_layer
        # a hook on this layer would see the last layer's output
        if sees_layer_outputs(self.module, self):
            return None
        while len(members) + 1 < self.shared.decode_group and self._joins(layer, cache, length):
            members.append(layer)
            layer = layer.next_layer
        if not members:
            return None
        ends_model = members[-1].next_layer is None
        head = self.shared.head  # the final norm and LM head join a group ending the model, packed if its layers are
        if not (ends_model and head is not None and head.joins() and not (packed and head.lm_head.packed is None)):
            head = None
        packed_head = head is not None and head.lm_head.packed is not None
        # room for the K/V rows of the layer after each member that has one (which may grow its slabs), then the
        # members' views
        nexts = [_cache_rows(cache.layers[member.next_layer.layer_idx], batch)
                 for member in (members[:-1] if ends_model else members)]
        starts = self.shared.memos.decode_starts(mask, batch, length)
        views = [[_slab_attention(None, slabs, b, starts[b], length, self.head_dim, self.scale, on_device[b].length)
                  for b in range(batch)] for slabs in (cache.layers[member.layer_idx] for member in members)]
        if any(view is None for member_views in views for view in member_views):
            return None
        for member in members:
            cache.layers[member.layer_idx].length = length
        ends = ("_final_lm" if packed or not packed_head else "_final_packed_lm") if head else \
            "_final" if ends_model else ""
        op = decode_layers_into[(1 + len(members), self.packed is not None, "" if own_rows is None else "_qkv", ends)]
        # the final norm's weight and the LM head's rows; the final eps; the LM head's own format when packed
        head_args = ((head.norm.weight, head.lm_head.rows), (head.eps,),
                     head.lm_head.packed[:1] if packed_head else ()) if head else ((), (), ())
        # each layer's weights in its two arenas; the layer after the group's (unless it ends the model) too
        after = () if ends_model else members[-1].next_layer.arenas
        scalars = (self.head_dim, self.heads, self.intermediate, self.eps_mlp, self.next_layer.eps_attn, *head_args[1],
                   *packed, *head_args[2])
        results = []
        for b, (a, x, lut) in enumerate(zip(on_device, inputs, lut_rows)):
            caches = [(a.k_cache, a.v_cache)] + [(v[b].k_cache, v[b].v_cache) for v in views]
            tensors = [*(() if own_rows is not None else (a.q,)), x, a.length, lut]
            for (k_cache, v_cache), layer in zip(caches, (self, *members)):
                tensors += [k_cache, v_cache, *layer.arenas]
            rows = [*(() if own_rows is None else own_rows[b]), *targets[b],
                    *(row for _, next_targets in nexts for row in next_targets[b])]
            out = op(*tensors, *after, *head_args[0], *rows, *scalars)
            results.append((out,) if ends_model and not head else out)
        result = _from_sequence_rows([r[0] for r in results])
        if head:
            normed = _from_sequence_rows([r[1] for r in results])
            vocab = head.lm_head.weight.shape[0]
            self.shared.head_results = HeadResults(result, result._version, normed, normed._version,
                                                   _from_sequence_rows([r[2][:vocab] for r in results]))
        last = members[-1].next_layer
        if last is not None:
            self.shared.chained = ChainedQkv(last, result, result._version, lut_rows, last.eps_attn,
                                             [(None, r[1], None) for r in results],
                                             (cache.layers[last.layer_idx], nexts[-1][0]))
        self.shared.grouped = GroupedLayers(members, result, result._version, lut_rows)
        return result

    def _attend_over_slabs(self, slabs, rows, mask):
        """Decode attention with an NpuKVCache, whose next position already holds each sequence's new K/V rows (the
        NPU wrote them: ``rows`` are (None, q, None)); it now counts them. Returns (attention outputs, None),
        computed by ``_decode_attention`` per sequence, or (None, a DeviceAttention per sequence) when the NPU
        kernel takes every sequence: the caller runs it, alone or chained with the layer's FFN. A mask other than
        causal plus left padding attends on the host over the slabs' HF views, with the mask as given."""
        batch = len(rows)
        slabs.length = length = slabs.length + 1
        starts = self.shared.memos.decode_starts(mask, batch, length)
        if starts is None:
            q = torch.stack([r[1] for r in rows]).view(batch, self.heads, 1, self.head_dim)
            return list(_sequence_rows(_host_attention(q, slabs.keys, slabs.values, mask, self.scale))), None
        memos = self.shared.memos
        # every sequence without padding shares slot 0; a padded one has its own, written before any run reads it
        digits = [memos.length_digits(length - s, slot=b + 1 if s else 0) for b, s in enumerate(starts)]
        on_device = [_slab_attention(r[1], slabs, b, starts[b], length, self.head_dim, self.scale, digits[b])
                     for b, r in enumerate(rows)]
        if all(a is not None for a in on_device):
            return None, on_device
        return [_decode_attention(r[1], *slabs.sequences[b], starts[b], length, self.head_dim, self.scale)
                for b, r in enumerate(rows)], None

    def _qkv(self, x, weights, lut):
        """rms_gemms_rope (integer GEMMs or bf16 weights) on ``weights``: _prefill_weights("qkv")."""
        if self.prepared is not None:
            return self._projecting(rms_gemms_rope_w8x2)(x, *weights, lut, self.eps_attn)
        return self._projecting(rms_gemms_rope)(x, *weights, lut, self.eps_attn, self.shared.settings.matmul_precision)

    def _ffn(self, attn, wo, x, norm_w, w_gate_up, w_down):
        if self.prepared is not None:
            return o_ffn_w8x2(attn, wo, x, norm_w, w_gate_up, w_down, self.eps_mlp)
        return o_ffn(attn, wo, x, norm_w, w_gate_up, w_down, self.eps_mlp, self.shared.settings.matmul_precision)

    def _prefill_weights(self, which: str):
        """The weights prefill's GEMMs take: the layer's own bf16 ones, those prepared for integer GEMMs, or its
        packed projections dequantized on the NPU (the prefill GEMMs do not read packed rows themselves); "qkv": the
        norm weight, the three projections (Q's and K's the two parts of one buffer, [Wq; Wk]) and their biases if
        any."""
        norm = self.qkv_weights[0]
        if self.prepared is not None:
            p = self.prepared
            return (norm, p.wq, p.wk, p.wv, *self.qkv_biases) if which == "qkv" else \
                (p.wo, self.ffn_weights[1], p.gate_up, p.down)
        if self.packed is None:
            attn = self.module.self_attn
            return (norm, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, *self.qkv_biases) \
                if which == "qkv" else self.ffn_weights
        h = self.hidden_size
        if which == "qkv":
            qk = self._dequantized("wqk", h)
            return (norm, qk[:self.q_dim], qk[self.q_dim:], self._dequantized("wv", h), *self.qkv_biases)
        return (self._dequantized("wo", self.q_dim), self.ffn_weights[1], self._dequantized("gate_up", h),
                self._dequantized("down", self.intermediate))

    def _dequantized(self, name: str, in_features: int) -> torch.Tensor:
        """Packed projection ``name`` as bf16 for prefill, made on the NPU (npu2.dequantize_rows) in the model's NPU
        buffer for it: every layer rewrites the same buffers, so the copies cost one layer's bf16 weights and ops
        bind them without staging a host copy."""
        packed = getattr(self.packed, name)
        halves = 2 if name == "gate_up" else 1  # [gate | up]: each half packed on its own, dequantized as a row
        rows = packed.view(halves * packed.shape[0], packed.shape[1] // halves)
        if torch.compiler.is_compiling():  # a buffer shared across calls would be a graph input mutated in place
            return dequantize_rows(rows, in_features, self.packed.format).view(packed.shape[0], -1)
        buffer = _npu_buffer(self.shared.dequantized, name, (packed.shape[0], halves * in_features), torch.bfloat16,
                             device_only_empty)  # the host never reads it: no sync back of 100+ MiB per layer
        INTO[dequantize_rows](rows, buffer.view(rows.shape[0], in_features), in_features, self.packed.format)
        return buffer

    def _prefill(self, hidden, lut, mask, cache):
        batch, seq, _ = hidden.shape
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        if self.shared.settings.context is not None and past + seq > self.shared.settings.context:
            raise PromptTooLongError(past + seq, self.shared.settings.context, cached=past)
        starts = self.shared.memos.first_real_tokens(mask, batch, seq) if past == 0 else None
        # Rows to compute per sequence: its real tokens when the mask is plain causal + left padding.
        spans = [(s, seq) for s in starts] if starts is not None else [(0, seq)] * batch
        qkv_weights = self._prefill_weights("qkv")
        chunks_per_row: list[list[PrefillChunk]] = []
        k_new = hidden.new_zeros(batch, seq, self.kv_heads * self.head_dim)
        v_new = torch.zeros_like(k_new)
        for b, (first, last) in enumerate(spans):
            chunks = []
            for start, stop, padded in self.shared.settings.chunks(last - first):
                lo, hi = first + start, first + stop
                v, q, k = self._qkv(pad_rows(hidden[b, lo:hi], padded), qkv_weights, pad_rows(lut[b, lo:hi], padded))
                k_new[b, lo:hi], v_new[b, lo:hi] = k[: hi - lo], v[: hi - lo]
                chunks.append(PrefillChunk(lo, hi, padded, v, q, k))
            chunks_per_row.append(chunks)
        to_heads = (lambda t: t.view(batch, seq, -1, self.head_dim).transpose(1, 2))
        keys, values = self._update_cache(cache, to_heads(k_new), to_heads(v_new))
        on_npu = starts is not None and all(len(chunks) == 1 for chunks in chunks_per_row)
        if not on_npu:
            q_all = hidden.new_zeros(batch, seq, self.heads * self.head_dim)
            for b, chunks in enumerate(chunks_per_row):
                for c in chunks:
                    q_all[b, c.start:c.stop] = c.q_roped[: c.stop - c.start]
            attn_all = _host_attention(to_heads(q_all), keys, values, mask, self.scale)
            attn_all = attn_all.transpose(1, 2).reshape(batch, seq, -1)
        wo, norm2_w, w_gate_up, w_down = self._prefill_weights("ffn")
        result = None
        for b, chunks in enumerate(chunks_per_row):
            for c in chunks:
                lo, hi = c.start, c.stop
                attn = (flash_attn(c.q_roped, c.k_roped, c.v, self.head_dim) if on_npu
                        else pad_rows(attn_all[b, lo:hi], c.padded))
                out = self._ffn(attn, wo, pad_rows(hidden[b, lo:hi], c.padded), norm2_w, w_gate_up, w_down)
                if batch == 1 and hi - lo == seq == c.padded:
                    return out.view(1, seq, -1)  # the op's output is the layer's output: no copy
                if result is None:
                    result = hidden.clone()  # left-pad rows pass their input through (HF leaves them unspecified)
                result[b, lo:hi] = out[: hi - lo]
        if any(len(chunks) > 1 for chunks in chunks_per_row) and not torch.compiler.is_compiling():
            release_free_heap()  # a long prompt's short-lived tensors would stay in the heap (host_memory.py)
        return result


class NpuFinalNorm:
    """Replaces the forward of the model's final norm (``model.model.norm``): for the hidden state a _final_lm decode
    group returned, the final norm that group computed (it ran the LM head on it too: ``NpuLmHead`` hands out those
    logits); for anything else, HF's norm. The emulated NPU's RMSNorm is HF's bit for bit."""

    def __init__(self, norm, forward, lm_head: NpuLmHead, shared: SharedState):
        """``forward``: the norm's own forward (HF's), which every other call runs."""
        self.norm, self.forward, self.lm_head, self.shared = norm, forward, lm_head, shared

    @property
    def eps(self) -> float:
        return float(self.norm.variance_epsilon)

    def joins(self) -> bool:
        """Whether the last decode group may run this norm and the LM head: nothing but HF's forward sees what either
        returns (no hook or wrapper on them), so the results it hands back are all anyone reads."""
        return not (sees_layer_outputs(self.norm, self) or sees_layer_outputs(self.lm_head.module, self.lm_head))

    def __call__(self, hidden):
        results, self.shared.head_results = self.shared.head_results, None
        if results is not None and hidden is results.hidden and hidden._version == results.version:
            self.shared.head_results = results  # for the LM head, next
            return results.normed
        return self.forward(hidden)


class NpuLmHead:
    """Replaces ``lm_head.forward``: the one-row-per-sequence case (generate's ``logits_to_keep=1``) runs
    lm_head_gemv, unless the decode group that ran the model's last layer already ran it on this very input (the
    final norm it handed HF: ``NpuFinalNorm``); full-sequence logits, when asked for, use the same resident weight on
    the host. All give fp32 logits of bf16 products summed in fp32, so a token's logit does not depend on how it was
    asked for.

    A bf16 LM head whose NPU rows are a packed copy (patch_llama's ``lm_head="q8_0"``, the default for bf16 weights:
    the GEMV then streams about half the bytes) is *rescored*: each row's logits from the copy differ from the bf16
    weight's by at most ``bound`` times the input row's norm (``copy_error_bound``), so only the tokens within twice
    that of the row's best can have the largest bf16 logit, and those are computed again on the host from the bf16
    weight. The best token and every logit near it are then the bf16 head's (the full-sequence path reads the bf16
    weight for all); the others keep the copy's, each within the bound of its own."""

    VOCAB_CHUNK = 8192  # weight rows widened to fp32 at a time: bounds the host path's extra memory

    def __init__(self, lm_head, rows: tuple[str | None, torch.Tensor], shared: SharedState,
                 bound: float | None = None):
        """``rows``: (None, the bf16 weight's NPU buffer) or (format, its int32 words of packed rows) when the LM head
        runs on quantized weights; either buffer holds catalog.lm_head_rows(vocab) rows, zero past the vocabulary.
        ``bound``: with packed rows copied from the bf16 weight that stays, their ``copy_error_bound``."""
        self.module = lm_head
        self.weight = lm_head.weight
        fmt, buffer = rows
        self.packed = None if fmt is None else rows
        self.rows = buffer
        self.shared = shared
        self.bound = bound

    def __call__(self, hidden):
        results, self.shared.head_results = self.shared.head_results, None
        if results is not None and _views_whole(hidden, results.normed, results.normed_version):
            return self._rescored(results.logits, results.normed)
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._logits(hidden)
        return self._logits(hidden)

    def _logits(self, hidden):
        if hidden.dim() == 3 and hidden.shape[1] == 1:
            vocab = self.weight.shape[0]
            if self.packed is not None:
                fmt, words = self.packed
                return self._rescored(_from_sequence_rows([lm_head_gemv_packed(x, words, fmt)[:vocab]
                                                           for x in _sequence_rows(hidden)]), hidden)
            return _from_sequence_rows([lm_head_gemv(x, self.rows)[:vocab] for x in _sequence_rows(hidden)])
        rows = hidden.float()
        logits = rows.new_empty(*hidden.shape[:-1], self.weight.shape[0])
        vocab = self.weight.shape[0]
        for start in range(0, vocab, self.VOCAB_CHUNK):
            stop = min(start + self.VOCAB_CHUNK, vocab)
            if self.packed is None or self.bound is not None:
                chunk = self.weight[start:stop].float()
            else:  # the same exact weights the packed GEMV multiplies by
                fmt, words = self.packed
                chunk = quant.dequantize(quant.weight_format(fmt), words[start:stop], self.weight.shape[1])
            logits[..., start:start + chunk.shape[0]] = F.linear(rows, chunk)
        return logits

    def _rescored(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``logits`` (batch, 1, vocab) of ``hidden`` (batch, 1, hidden) from the packed copy, in place: in each row,
        every token that could hold the row's largest bf16 logit gets its logit from the bf16 weight; unchanged
        without a ``bound``. torch.compile calls it as an op it does not look into (the tokens' count is the data's)."""
        if self.bound is not None:
            rescore = _rescore_logits_op if torch.compiler.is_compiling() else _rescore_logits
            rescore(logits, hidden, self.weight, self.bound)
        return logits


def _rescore_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bound: float) -> None:
    """NpuLmHead._rescored's work on the logits of a packed copy of ``weight`` whose ``copy_error_bound`` is
    ``bound``."""
    for row, x in zip(logits[:, -1], hidden[:, -1].float()):
        margin = 2 * bound * float(torch.linalg.vector_norm(x, dtype=torch.float64))
        values = row.numpy()  # numpy's max and search over 128K logits: a few times faster than torch's
        threshold = float(values.max()) - margin
        limit = np.float32(threshold)  # compared in the logits' fp32: rounded down, or a token on it is missed
        if limit > threshold:
            limit = np.nextafter(limit, np.float32(-np.inf))
        tokens = torch.from_numpy(np.flatnonzero(values >= limit))
        row[tokens] = F.linear(x, weight.index_select(0, tokens).float())  # index_select: 2× faster than indexing


_rescore_logits_op = torch.library.custom_op("torch_npu2::rescore_logits", _rescore_logits, mutates_args=("logits",))
_rescore_logits_op.register_fake(lambda logits, hidden, weight, bound: None)


BOUND_ROWS = 1024  # rows copy_error_bound widens to fp64 at a time (16 MiB each at 2048 columns)


def copy_error_bound(weight: torch.Tensor, words: torch.Tensor, fmt: str) -> float:
    """The most a logit from a row of packed ``words`` (format ``fmt``, packed from ``weight``) can differ from the
    same token's logit from ``weight``, per unit of the input's norm, both summed in fp32 in any order: over rows w
    and their copies c, ‖w − c‖ + γ(‖w‖ + ‖c‖) (Cauchy–Schwarz; each product of bf16 values is exact in fp32, and an
    n-term fp32 sum is within γ = n·u/(1 − n·u), u = 2⁻²⁴, of the sum of the terms' magnitudes: Higham, "Accuracy
    and Stability of Numerical Algorithms", §3.1)."""
    n = weight.shape[1]
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    worst = 0.0
    for start in range(0, weight.shape[0], BOUND_ROWS):
        w = weight[start:start + BOUND_ROWS].detach().double()
        c = quant.dequantize(quant.weight_format(fmt), words[start:start + w.shape[0]], n).double()
        rows = torch.linalg.vector_norm(w - c, dim=1) + gamma * (torch.linalg.vector_norm(w, dim=1)
                                                                  + torch.linalg.vector_norm(c, dim=1))
        worst = max(worst, float(rows.max()))
    return worst


def _views_whole(t: torch.Tensor, of: torch.Tensor, version: int) -> bool:
    """Whether ``t`` is ``of`` or a view of all of it (HF's ``hidden[:, -1:, :]`` of a one-token step), unchanged
    since ``of`` had ``version``."""
    return (t.data_ptr() == of.data_ptr() and t.shape == of.shape and t.stride() == of.stride()
            and t.dtype == of.dtype and t._version == version)
