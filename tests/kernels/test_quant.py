"""kernels/quant.py: the packed row layout holds GGUF's blocks losslessly, dequantizes exactly as gguf-py does, and
quantizes a bf16 weight to the bytes gguf-py's Q4_1 quantizer gives."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_npu2.kernels import quant

gguf = pytest.importorskip("gguf", reason="the gguf package is the reference of GGUF's block formats")
TYPES = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
         "q8_0": gguf.GGMLQuantizationType.Q8_0}


def _weight(N: int, K: int) -> torch.Tensor:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(N * K))
    w[0, :32] = 0  # a block of zeros: d = 0
    w[1, 32:64] = 1e-6  # a constant block
    return w


@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("K", [64, 576, 1536, 2048, 3072, 4864, 5632])
def test_dequantize_equals_gguf(name, K):
    fmt = quant.weight_format(name)
    raw = gguf.quants.quantize(_weight(8, K).numpy(), TYPES[name])
    packed = quant.from_gguf_blocks(fmt, torch.from_numpy(raw), K)
    assert packed.shape == (8, fmt.row_bytes(K)) and packed.dtype == torch.uint8
    expected = torch.from_numpy(gguf.quants.dequantize(raw, TYPES[name]))
    assert torch.equal(quant.dequantize(fmt, packed, K), expected)


@pytest.mark.parametrize("name", sorted(TYPES))
def test_dequantize_into_bf16_rows_rounds_gguf_once(name):
    """``out=``: a slice of a bf16 buffer's rows gets GGUF's fp32 weights rounded to bf16 once, nothing else of the
    buffer changes; an ``out`` of another shape is refused before anything is written."""
    fmt, K = quant.weight_format(name), 2048
    raw = gguf.quants.quantize(_weight(6, K).numpy(), TYPES[name])
    packed = quant.from_gguf_blocks(fmt, torch.from_numpy(raw), K)
    buffer = torch.full((10, K), 7.0, dtype=torch.bfloat16)
    quant.dequantize(fmt, packed[1:5], K, out=buffer[3:7])
    expected = torch.from_numpy(gguf.quants.dequantize(raw, TYPES[name]))[1:5].to(torch.bfloat16)
    assert torch.equal(buffer[3:7], expected)
    assert bool((buffer[:3] == 7).all() and (buffer[7:] == 7).all())
    with pytest.raises(ValueError, match=rf"{name}: out must be \(4, 2048\), got \(5, 2048\)"):
        quant.dequantize(fmt, packed[1:5], K, out=buffer[3:8])
    assert bool((buffer[7:] == 7).all())


def test_a_wrong_scale_plane_is_seen():
    fmt, K = quant.Q4_1, 2048
    raw = gguf.quants.quantize(_weight(4, K).numpy(), TYPES["q4_1"])
    packed = quant.from_gguf_blocks(fmt, torch.from_numpy(raw), K)
    G = quant.Q4_1.group_blocks(K)
    packed[2, G * 16 + 1] ^= 0x04  # one bit of the first block's scale
    expected = torch.from_numpy(gguf.quants.dequantize(raw, TYPES["q4_1"]))
    assert not torch.equal(quant.dequantize(fmt, packed, K), expected)


def _kernel_vector_loads(fmt, K: int, row: int):
    """(byte offset, bytes) of each vector load gemv.cc's packed path makes in row ``row`` of a call's rows: in
    element-order groups a block's quants per block; in groups of 32 blocks, 32-byte runs of quants and the 64-byte
    (32 x int16) scale and min planes."""
    start, G = row * fmt.row_bytes(K), fmt.group_blocks(K)
    loads = []
    for g in range(K // 32 // G):
        group = start + g * fmt.padded_group_bytes(G)
        if not quant.transposed(K):
            loads += [(group + b * fmt.quant_bytes, fmt.quant_bytes) for b in range(G)]
            continue
        loads += [(group + 32 * run, 32) for run in range(G * fmt.quant_bytes // 32)]
        loads += [(group + G * fmt.quant_bytes + 2 * G * plane, 64) for plane in range(1 + fmt.has_min)]
    return loads


@pytest.mark.parametrize("K", [576, 896, 1536, 2048, 4864, 5632, 8192])
def test_every_vector_load_of_a_packed_row_is_aligned_to_its_size(K):
    """AIE2P drops an unaligned vector load's low address bits (aie_api's vector_ldst_align): every load the kernel
    makes, in every row of a call, must start at a multiple of its size (Q8_0 rows of 576 once started 16 bytes
    off every other row)."""
    for fmt in quant.FORMATS.values():
        for row in range(4):
            misaligned = [(offset, size) for offset, size in _kernel_vector_loads(fmt, K, row) if offset % size]
            assert not misaligned, (fmt.name, K, row, misaligned[:3])


@pytest.mark.parametrize("K", [576, 2048])
def test_rows_are_aligned_and_groups_contiguous(K):
    for fmt in quant.FORMATS.values():
        assert fmt.row_bytes(K) % fmt.row_align == 0


@pytest.mark.parametrize("K", [4864, 5632])
def test_a_long_row_splits_into_groups_one_bd_dimension_moves(K):
    """A row of K not a multiple of 1024 whose bytes exceed one BD dimension of words (Qwen2.5-0.5B's and
    TinyLlama's down projections) is several equal groups, each within the limit, and a chunk of whole groups has
    the row's groups: its bytes are its share of the row's."""
    for fmt in quant.FORMATS.values():
        G = fmt.group_blocks(K)
        assert 1 < K // 32 // G and fmt.padded_group_bytes(G) <= quant.MAX_GROUP_BYTES
        assert fmt.group_blocks(G * 32) == G and fmt.row_bytes(K) == K // 32 // G * fmt.row_bytes(G * 32)
    assert quant.Q4_1.group_blocks(576) == 18  # a row that fits stays one group
    # Llama-3.2-1B's rows need no padding, and a 1024-element chunk is a whole number of groups
    assert quant.Q4_1.row_bytes(2048) == 2048 // 32 * 20 == 2 * quant.Q4_1.row_bytes(1024)


@pytest.mark.parametrize("K", [64, 576, 2048])
def test_quantize_q4_1_equals_gguf(K):
    w = _weight(16, K).to(torch.bfloat16)
    ours = quant.quantize_q4_1(w)
    theirs = quant.from_gguf_blocks(quant.Q4_1, torch.from_numpy(gguf.quants.quantize(w.float().numpy(),
                                                                                      TYPES["q4_1"])), K)
    assert torch.equal(ours, theirs)


def test_smollm2_tensors_load_exactly():
    from torch_npu2.patch_llama.models import default_model_path
    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    reader = gguf.GGUFReader(path)
    for tensor in reader.tensors:
        if tensor.name not in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
            continue
        fmt = quant.weight_format(tensor.tensor_type.name.lower())
        K, N = (int(s) for s in tensor.shape)
        packed = quant.from_gguf_blocks(fmt, torch.from_numpy(np.array(tensor.data)), K)
        expected = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).reshape(N, K)
        assert torch.equal(quant.dequantize(fmt, packed, K), torch.from_numpy(expected)), tensor.name
