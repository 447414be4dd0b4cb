"""Packed block-quantized weights: GGUF's Q4_0, Q4_1 and Q8_0 in the row layout the decode GEMVs read.

GGUF stores a quantized (N, K) weight as N·K/32 blocks of 32 consecutive row elements, each block its fp16
scale (and for Q4_1 its fp16 min) followed by its quants. We keep every bit of that and only move the pieces:

    one packed row (uint8) = its groups, each [quant plane][scale plane][min plane (Q4_1 only)], then zero padding

* a group is 32 blocks (1024 elements) when K is a multiple of 1024, else the whole row when its bytes fit
  ``MAX_GROUP_BYTES`` (one BD dimension of 4-byte words), else the most blocks dividing the row that do (TinyLlama's
  K = 5632 in Q4_1: two groups of 88 blocks; Qwen2.5-0.5B's 4864: two of 76): a K chunk of whole groups is one
  contiguous run of a row's bytes that one BD dimension moves, so the decode FFN's K-split GEMVs move chunks as
  they move rows. A chunk of whole groups has groups of the same size as its row's (the most blocks dividing the
  row that fit also divide the chunk), so its layout is that of a row of the chunk's K;
* quant plane of a group of 32 blocks (K a multiple of 1024): transposed, so that one vector load takes the
  same element of all 32 blocks (kernels/aie2p/gemv.cc gives each block a lane). Q4_0 and Q4_1: 16 runs of 32
  bytes, run t's byte l holding block l's elements 2t (low nibble) and 2t + 1 (high nibble), GGUF's unsigned q
  (Q4_0's still offset by 8); Q8_0: 32 runs of 32 int8, run i's byte l block l's element i;
* quant plane of a whole-row group (K not a multiple of 1024): the blocks' quants in element order. Q4_1: byte j
  of a block holds element 2j in its low nibble and 2j + 1 in its high nibble (the order of an AIE ``uint4``
  vector; GGUF's own order, j and j + 16, is a reordering away); Q4_0: the same nibbles as two's-complement
  ``int4``, q − 8 (GGUF's q XOR 8); Q8_0: GGUF's int8 quants as they are;
* scale plane and min plane: the group's fp16 scales d (and mins m), the file's bits;
* each group padded with zeros to a multiple of the format's ``row_align`` bytes: its block's quants, the vector
  an element-order group loads per block (16 bytes of Q4, 32 of Q8_0), so every group and row starts aligned. AIE2P loads a vector from an address aligned to
  its size and silently drops the low bits of one that is not (aie_api ``detail/ld_st.hpp``, ``vector_ldst_align``
  for ``__AIE_ARCH__`` 21; ``utils::floor_ptr`` mimics it), so with Q8_0's rows at 16 bytes every other row of
  K = 576 would be read 16 bytes early. Groups of 32 blocks are multiples of 64 bytes as they are, which their
  512-bit scale loads need (Llama-3.2-1B's rows need no padding: K = 2048 → 1280 bytes in Q4_1).

A weight is then a (N, row_bytes) uint8 tensor (bound by the Programs as (N, row_bytes / 4) int32 words): rows stay rows, so the GEMVs' panel loop moves whole rows as it
moves bf16 ones, and a kernel call walks its rows' blocks with the scales at a fixed offset.

Dequantization, exactly GGUF's (gguf-py ``quants.py``): Q4_0 ``d · (q − 8)``, Q4_1 ``d · q + m``, Q8_0 ``d · q``, in
fp32 from the fp16 scales (``dequantize``). ``quantize_q4_1`` is GGUF's Q4_1 round-to-nearest per block, on torch
tensors, so a bf16 checkpoint can be packed at patch time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .device import DEVICE

BLOCK = 32
GROUP_BLOCKS = 32  # blocks per group when K is a multiple of 32 blocks (1024 elements)
MAX_GROUP_BYTES = 4 * DEVICE.bd_dim_max_elements  # an element-order group: at most one BD dimension of words


def transposed(K: int) -> bool:
    """Whether rows of K elements hold their quants transposed per group (groups of 32 blocks)."""
    return K % (GROUP_BLOCKS * BLOCK) == 0


@dataclass(frozen=True)
class WeightFormat:
    name: str
    quant_bytes: int   # bytes of one block's quants
    has_min: bool

    def block_bytes(self) -> int:
        return self.quant_bytes + 2 + (2 if self.has_min else 0)

    @property
    def row_align(self) -> int:
        """The alignment of each row's start (module docstring): one vector load of a block's quants."""
        return self.quant_bytes

    def padded_group_bytes(self, blocks: int) -> int:
        """Bytes of a group of ``blocks`` blocks, padded to ``row_align``."""
        return -(-blocks * self.block_bytes() // self.row_align) * self.row_align

    def group_blocks(self, K: int) -> int:
        """Blocks per group of a row of K elements (module docstring)."""
        self._check_k(K)
        if transposed(K):
            return GROUP_BLOCKS
        blocks = K // BLOCK
        return next(g for g in range(blocks, 0, -1)
                    if blocks % g == 0 and self.padded_group_bytes(g) <= MAX_GROUP_BYTES)

    def row_bytes(self, K: int) -> int:
        """Bytes of one packed row of K elements (K a multiple of 32), or of a chunk of K elements of a longer
        row made of whole groups."""
        G = self.group_blocks(K)
        return K // BLOCK // G * self.padded_group_bytes(G)

    def _check_k(self, K: int) -> None:
        if K <= 0 or K % BLOCK:
            raise ValueError(f"{self.name}: a row of {K} elements is not a whole number of {BLOCK}-element blocks")

    def bits_per_weight(self, K: int) -> float:
        return 8 * self.row_bytes(K) / K


Q4_0 = WeightFormat("q4_0", 16, False)
Q4_1 = WeightFormat("q4_1", 16, True)
Q8_0 = WeightFormat("q8_0", 32, False)
FORMATS = {f.name: f for f in (Q4_0, Q4_1, Q8_0)}
# GGUF's block of each format: fp16 d, fp16 m (Q4_1), then the quants (ggml's block_q4_0, block_q4_1, block_q8_0)
GGUF_TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 8}  # gguf.GGMLQuantizationType values
GEMV_QUANT = {"q4_0": 40, "q4_1": 41, "q8_0": 80}  # kernels/aie2p/gemv.cc's -DGEMV_QUANT of each format


def weight_format(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(FORMATS)}") from None


def _empty(fmt: WeightFormat, N: int, K: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(N, fmt.row_bytes(K), dtype=torch.uint8)
    if tuple(out.shape) != (N, fmt.row_bytes(K)) or out.dtype != torch.uint8:
        raise ValueError(f"{fmt.name}: out must be ({N}, {fmt.row_bytes(K)}) uint8, got {tuple(out.shape)} {out.dtype}")
    return out


def from_gguf_blocks(fmt: WeightFormat, blocks: torch.Tensor, K: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack GGUF's raw blocks of an (N, K) weight (uint8, N rows of K/32 blocks in GGUF's byte layout) into the
    row layout, in ``out`` if given (e.g. a BO-backed buffer): bytes moved and nibbles reordered, nothing
    converted."""
    blocks = blocks.reshape(-1, K // BLOCK, fmt.block_bytes())
    N = blocks.shape[0]
    head = 4 if fmt.has_min else 2
    quants = blocks[..., head:]
    G = fmt.group_blocks(K)
    if fmt.quant_bytes == 16:  # GGUF: byte j = elements j (low nibble), j + 16 (high); ours: 2j, 2j + 1
        elements = torch.cat((quants & 0x0F, quants >> 4), dim=-1)
        if fmt.name == "q4_0" and not transposed(K):
            elements = elements ^ 8  # q − 8 as two's-complement int4
        quants = elements[..., 0::2] | (elements[..., 1::2] << 4)
    if transposed(K):  # (blocks, bytes) → (bytes, blocks) within each group
        quants = quants.reshape(N, -1, G, fmt.quant_bytes).transpose(-1, -2).reshape(N, K // BLOCK, -1)
    pieces = [quants, blocks[..., 0:2]] + ([blocks[..., 2:4]] if fmt.has_min else [])
    grouped = torch.cat([p.reshape(N, K // BLOCK // G, -1) for p in pieces], dim=-1)
    out = _empty(fmt, N, K, out)
    padded = out.view(N, K // BLOCK // G, fmt.padded_group_bytes(G))
    padded[..., :grouped.shape[-1]] = grouped
    padded[..., grouped.shape[-1]:] = 0
    return out


def as_bytes(data: torch.Tensor) -> torch.Tensor:
    """A packed weight's rows as bytes, given as bytes or as the int32 words the Programs bind."""
    return data.contiguous().view(torch.uint8) if data.dtype == torch.int32 else data


def unpack_fields(fmt: WeightFormat, data: torch.Tensor, K: int):
    """(q, d, m) of a packed weight (bytes or int32 words): q (N, K) the integer quants as GGUF defines them (Q4_0's
    still offset by 8), d and m (N, K/32) fp32 from the fp16 planes (m None without one)."""
    data = as_bytes(data)
    N, G = data.shape[0], fmt.group_blocks(K)
    groups = data.reshape(N, K // BLOCK // G, -1)[..., :G * fmt.block_bytes()]
    q_end, d_end = G * fmt.quant_bytes, G * (fmt.quant_bytes + 2)
    raw = groups[..., :q_end]
    if transposed(K):
        raw = raw.reshape(N, -1, fmt.quant_bytes, G).transpose(-1, -2)
    raw = raw.reshape(N, K // BLOCK, fmt.quant_bytes)
    if fmt.quant_bytes == 16:
        # each byte widened to 16 bits as (high nibble << 8 | low nibble): read as two bytes of a little-endian
        # host (x86, Arm Linux), the block's elements in order (one pass per step over contiguous data, where
        # splitting the nibbles into an interleaved tensor is a strided write)
        wide = raw.to(torch.int16, memory_format=torch.contiguous_format)
        wide = (wide & 0x0F) | ((wide & 0xF0) << 4)
        if fmt.name == "q4_0" and not transposed(K):
            wide ^= 0x0808
        q = wide.view(torch.uint8).reshape(N, K)
    else:
        q = raw.view(torch.int8).reshape(N, K)
    d = groups[..., q_end:d_end].contiguous().view(torch.float16).float().reshape(N, -1)
    m = groups[..., d_end:].contiguous().view(torch.float16).float().reshape(N, -1) if fmt.has_min else None
    return q, d, m


def dequantize(fmt: WeightFormat, data: torch.Tensor, K: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 (N, K) weight, exactly as GGUF dequantizes it; with ``out`` (an (N, K) tensor of another dtype,
    e.g. bf16), written there instead, rounded once from those fp32 values."""
    N = data.shape[0]
    if out is not None and tuple(out.shape) != (N, K):
        raise ValueError(f"{fmt.name}: out must be ({N}, {K}), got {tuple(out.shape)}")
    q, d, m = unpack_fields(fmt, data, K)
    w = q.view(N, K // BLOCK, BLOCK).float()  # every product below is exact in fp32: d is fp16, |q| < 2^8
    if fmt.name == "q4_0":
        w.sub_(8).mul_(d[..., None])
    elif fmt.name == "q4_1":
        w.mul_(d[..., None]).add_(m[..., None])
    else:
        w.mul_(d[..., None])
    if out is None:
        return w.reshape(N, K)
    out.copy_(w.view(N, K))
    return out


def quantize_q4_1(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF's Q4_1 quantization of an (N, K) weight, round to nearest per 32-element block, packed: the same
    bytes gguf-py's ``quants.quantize(w, Q4_1)`` gives for the same fp32 values, in the row layout."""
    N, K = weight.shape
    blocks = weight.float().reshape(N, K // BLOCK, BLOCK)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = (high - low) / 15
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((blocks - low) * inverse + 0.5).clamp(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    raw = torch.cat((d.half().view(torch.uint8), low.half().view(torch.uint8), nibbles), dim=-1)
    return from_gguf_blocks(Q4_1, raw, K, out)


def describe(fmt: WeightFormat, shape) -> str:
    N, K = shape
    return (f"{fmt.name.upper()} packed {N}×{K} ({fmt.bits_per_weight(K):.2f} bits/weight, "
            f"{N * fmt.row_bytes(K)} bytes)")
