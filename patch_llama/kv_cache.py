"""NpuKVCache: HF's Cache API over K and V slabs in NPU buffers, the default cache of a patched model's generate().

Layout (what the decode-attention op reads): per layer, K and V are each one contiguous bf16 tensor of shape
(batch, capacity, kv_heads * head_dim) in its own NPU buffer (``ops.device_empty``), position-major: a token's K
row for all KV heads is contiguous, and sequence b's slab is ``k[b]``, a contiguous (capacity, kv_dim) view. The
buffer holds ``SPARE_ROWS`` more rows past the last slab, which a left-padded sequence's decode attention streams
(and never reads) when its capacity bucket, taken from its first real row, runs past its slab. Rows
0..length-1 hold the cached positions; rows past them are unspecified. A decode step's new K and V rows are written
by the NPU: the patched layers pass the next position's rows (``k[b, length]``) to the decode ops' ``.into``
overloads, which the runtime binds as sub-buffers of the slabs' BOs, and only those rows' bytes are synced back to
the host. Every host write to the slabs (prefill, ``update``, growing, reordering) is followed by ``device_written``
of just the rows written. The ops never sync the slabs whole.

Capacity: generate() sizes the cache for its own call (prompt + max_new_tokens), so a generate() never grows it.
A cache reused across turns grows when a write needs more rows: to the larger of twice its capacity and the
rows needed rounded up to ``GROW_TOKENS``, never past ``limit`` (the model's context, config.max_position_embeddings);
a write past the limit raises ``KVCacheFullError`` before anything changes. Growing copies the cached rows into
new buffers, at most once per doubling, never per token; preallocating the whole context instead would take
4.3 GB per sequence for Llama-3.2-1B's 131072 tokens.

Every Cache method generate() uses works on the slabs: ``update`` (HF's (batch, kv_heads, len, head_dim) in and
out, the returned keys and values being transposed views of the slabs, no copy), ``get_seq_length``,
``get_mask_sizes`` (as HF's DynamicLayer, so masks are the ones HF builds for its default cache), ``crop``,
``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave`` and ``reset``.
"""
from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..kernels.catalog import DECODE_ATTN_ROWS_MULTIPLE
from ..ops import device_empty, device_written

GROW_TOKENS = 1024  # a cache reused across turns grows to a multiple of this many rows (at least doubling)
DEFAULT_TOKENS = 256  # rows of a cache created without a length (before its first write says more)
SPARE_ROWS = DECODE_ATTN_ROWS_MULTIPLE  # rows past the last sequence's slabs in each buffer (_allocate says why)
# transformers 5.0–5.?: crop(max_length), a positive length kept or a negative count removed; later releases:
# crop(tokens_to_remove), a negative count only (0 removes nothing)
_CROP_TAKES_LENGTH = "max_length" in inspect.signature(DynamicLayer.crop).parameters


class KVCacheFullError(ValueError):
    """A write that would take an NpuKVCache past its limit (the model's context)."""


class NpuKVLayer(DynamicLayer):
    """One decoder layer's K and V slabs. A DynamicLayer to HF (not sliding, croppable, masks sized by the cached
    length), whose ``keys``/``values`` are views of the slabs' first ``length`` rows in HF's layout."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int, limit: int | None):
        super().__init__()
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.kv_dim = kv_heads * head_dim
        self.capacity_hint, self.limit = capacity, limit
        self.k: torch.Tensor | None = None  # (batch, capacity, kv_dim) bf16, NPU buffer
        self.v: torch.Tensor | None = None
        self.length = 0
        self._views: tuple | None = None  # (self.k they are of, per-sequence slabs, view memo): ``sequences``

    # HF's code (and DynamicLayer's own methods) read keys/values; they are views, computed when asked for
    @property
    def keys(self):
        return None if self.k is None else self._heads(self.k)

    @keys.setter
    def keys(self, value):
        self._refuse_assignment(value)

    @property
    def values(self):
        return None if self.v is None else self._heads(self.v)

    @values.setter
    def values(self, value):
        self._refuse_assignment(value)

    def _refuse_assignment(self, value) -> None:
        if value is not None:  # CacheLayerMixin.__init__ and DynamicLayer.reset assign None
            raise TypeError("NpuKVCache: keys and values are views of the cache's NPU buffers; write them through "
                            "update()")

    def _heads(self, slab: torch.Tensor) -> torch.Tensor:
        """(batch, kv_heads, length, head_dim): a view of the slab's first ``length`` rows."""
        batch = slab.shape[0]
        return slab[:, : self.length].view(batch, self.length, self.kv_heads, self.head_dim).transpose(1, 2)

    @property
    def sequences(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Per sequence, its (K slab, V slab): (capacity, kv_dim) views, made once per allocation (a decode step
        indexes them for every layer)."""
        return self._memos()[1]

    @property
    def view_memo(self) -> dict:
        """Views of the slabs that the decode layers derive alike at every step (patch_llama/layer.py), kept until the
        slabs are reallocated."""
        return self._memos()[2]

    def _memos(self) -> tuple:
        if self._views is None or self._views[0] is not self.k:
            self._views = (self.k, tuple(zip(self.k.unbind(0), self.v.unbind(0))), {})
        return self._views

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    @property
    def batch_size(self) -> int:
        return 0 if self.k is None else self.k.shape[0]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.k is None:
            self._allocate(key_states.shape[0], max(self.capacity_hint, key_states.shape[-2]))

    def _allocate(self, batch: int, rows: int) -> None:
        rows = -(-max(rows, 1) // DECODE_ATTN_ROWS_MULTIPLE) * DECODE_ATTN_ROWS_MULTIPLE  # what npu2.decode_attn reads
        self.dtype, self.device, self.is_initialized = torch.bfloat16, torch.device("cpu"), True
        # SPARE_ROWS past the last slab: a left-padded sequence's decode attention streams its bucket from its
        # first real row, so up to that many rows past its slab's end (read by the DMAs, never by the kernel)
        k, v = (device_empty((batch * rows + SPARE_ROWS, self.kv_dim), torch.bfloat16)[: batch * rows]
                .view(batch, rows, self.kv_dim) for _ in range(2))
        old_k, old_v, self.k, self.v = self.k, self.v, k, v
        self._views = None  # they are of the old slabs
        if old_k is not None and self.length:
            k[:, : self.length] = old_k[:, : self.length]
            v[:, : self.length] = old_v[:, : self.length]
            self._written(0, self.length)

    def _written(self, start: int, stop: int) -> None:
        """The host wrote positions start..stop-1 of every sequence's K and V: those rows (only) reach the device."""
        device_written(self.k[:, start:stop])
        device_written(self.v[:, start:stop])

    def reserve(self, batch: int, rows: int) -> None:
        """Room for ``rows`` positions of ``batch`` sequences: allocated on first use, grown (module docstring), or
        KVCacheFullError; nothing changes on an error."""
        if self.limit is not None and rows > self.limit:
            raise KVCacheFullError(f"NpuKVCache: {rows} positions do not fit its limit of {self.limit} (the model's "
                                   "context, config.max_position_embeddings)")
        if self.k is None:
            self._allocate(batch, max(self.capacity_hint, rows))
            return
        if batch != self.batch_size:
            raise ValueError(f"NpuKVCache: holds {self.batch_size} sequences, got a write for {batch} (a cache serves "
                             "one batch; start a new one, or reset() it, for another)")
        if rows > self.capacity:
            grown = max(2 * self.capacity, -(-rows // GROW_TOKENS) * GROW_TOKENS)
            self._allocate(batch, grown if self.limit is None else min(grown, self.limit))

    def append_rows(self, k_rows: torch.Tensor, v_rows: torch.Tensor) -> int:
        """Write (batch, n, kv_dim) rows at the next n positions; returns the first of them."""
        batch, n = k_rows.shape[0], k_rows.shape[1]
        start = self.length
        self.reserve(batch, start + n)
        self.k[:, start:start + n] = k_rows
        self.v[:, start:start + n] = v_rows
        self._written(start, start + n)
        self.length = start + n
        return start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """HF's update: (batch, kv_heads, n, head_dim) rows appended (positions from the cached length, as HF's
        DynamicLayer places them); returns all cached keys and values as views of the slabs."""
        batch, _, n, _ = key_states.shape
        self.append_rows(key_states.transpose(1, 2).reshape(batch, n, self.kv_dim),
                         value_states.transpose(1, 2).reshape(batch, n, self.kv_dim))
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens: int) -> None:
        """Drop cached positions: ``-n`` removes the last n; on transformers releases whose crop takes a length, a
        positive ``tokens`` keeps the first that many."""
        if tokens >= 0 and not _CROP_TAKES_LENGTH:
            if tokens > 0:
                raise ValueError(f"Calling `crop` with a positive value (`{tokens}`) is not supported. Use a negative "
                                 "integer to remove that number of tokens from the cache instead.")
            return
        self.length = max(0, self.length + tokens) if tokens < 0 else min(self.length, tokens)

    def reset(self) -> None:
        self.length = 0  # the buffers stay for the next sequence of the same batch

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.length:  # in place: the buffers stay the ones ops were handed
            index = beam_idx.to(self.k.device)
            self.k[:, : self.length] = self.k[index, : self.length]
            self.v[:, : self.length] = self.v[index, : self.length]
            self._written(0, self.length)

    def _rebatch(self, select) -> None:
        if self.length:
            k, v = select(self.k[:, : self.length]), select(self.v[:, : self.length])
            self.k = self.v = None
            self._allocate(k.shape[0], max(self.capacity_hint, self.length))
            self.k[:, : self.length], self.v[:, : self.length] = k, v
            self._written(0, self.length)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rebatch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rebatch(lambda t: t[indices])


class NpuKVCache(Cache):
    """A patched model's KV cache in NPU buffers: one ``NpuKVLayer`` per decoder layer (module docstring).

    ``max_length``: positions to allocate for up front (generate() passes its own maximum); ``limit``: the most
    it may hold (default: config.max_position_embeddings; None: no limit)."""

    def __init__(self, config, max_length: int | None = None, limit: int | None = -1):
        if limit == -1:
            limit = getattr(config, "max_position_embeddings", None)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = config.num_key_value_heads
        capacity = DEFAULT_TOKENS if max_length is None else max_length
        if limit is not None:
            capacity = min(capacity, limit)
        super().__init__(layers=[NpuKVLayer(kv_heads, head_dim, capacity, limit)
                                 for _ in range(config.num_hidden_layers)])

    def __repr__(self):
        first = self.layers[0] if self.layers else None
        held = f"{first.length} of {first.capacity} positions, batch {first.batch_size}" if first else "no layers"
        return f"NpuKVCache({len(self.layers)} layers, {held})"


__all__ = ["NpuKVCache", "NpuKVLayer", "KVCacheFullError", "GROW_TOKENS"]
