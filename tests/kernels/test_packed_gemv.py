"""gemv.cc's packed-weight GEMVs (gemv_q_*), host path, against the exact dequantization of kernels/quant.py.

The kernels sum exact weights (GGUF's fp32 dequantization) times x in fp32: against torch's fp32 matmul of the
dequantized weight they differ only in summation order (tolerance as test_aie2p_host.py's gemv: atol 2^-16 ·
sum|w x|), and when every product and partial sum is exact in fp32 (small-integer x, power-of-two scales and mins)
they agree bit for bit, whatever the order, chunking or tile rows.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torch_npu2.kernels import host_build, quant

pytestmark = pytest.mark.skipif(host_build.host_compiler() is None,
                                reason="no host C++ compiler (g++): the kernels' host path cannot be built")
gguf = pytest.importorskip("gguf", reason="the gguf package quantizes the test weights as GGUF does")
FORMATS = ("q4_0", "q4_1", "q8_0")


def _packed(name: str, w: torch.Tensor) -> torch.Tensor:
    raw = gguf.quants.quantize(w.float().numpy(), getattr(gguf.GGMLQuantizationType, name.upper()))
    return quant.from_gguf_blocks(quant.weight_format(name), torch.from_numpy(raw), w.shape[1])


def _exact_case(name: str, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed weight whose scales and mins are powers of two and an x of small integers: every product and
    every partial sum is exact in fp32."""
    gen = torch.Generator().manual_seed(K)
    fmt = quant.weight_format(name)
    blocks = K // quant.BLOCK
    quants = torch.randint(0, 256, (N, blocks, fmt.quant_bytes), dtype=torch.uint8, generator=gen)
    # powers of two of either sign; every other row's are fp16 subnormals (below 2^-14): each branch of the kernels'
    # exact fp16 -> bf16 scale split (a row's exponents span few enough bits for its sums to stay exact)
    base = torch.where(torch.arange(N) % 2 == 1, -19, 0).reshape(N, 1, 1)
    sign = 1 - 2 * torch.randint(0, 2, (N, blocks, 1), generator=gen)
    scales = (sign * 2.0 ** (base + torch.randint(-3, 2, (N, blocks, 1), generator=gen))).half().view(torch.uint8)
    pieces = [scales]
    if fmt.has_min:
        mins = -(2.0 ** (base + torch.randint(-2, 2, (N, blocks, 1), generator=gen)))
        pieces.append(mins.half().view(torch.uint8))
    raw = torch.cat(pieces + [quants], dim=-1)
    x = torch.randint(-4, 5, (K,), generator=gen).to(torch.bfloat16)
    return quant.from_gguf_blocks(fmt, raw, K), x


def _one_group(name: str, K: int) -> int:
    """Elements of one group of a packed row of K: a chunk the K-split GEMVs take."""
    return quant.weight_format(name).group_blocks(K) * quant.BLOCK


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("K, k_chunk", [(576, None), (1536, None), (2048, None), (2048, 1024), (8192, 1024),
                                        (4864, None), (4864, "group"), (5632, "group")])
def test_bit_exact_when_sums_are_exact(name, K, k_chunk):
    """Rows of K = 4864 and 5632 (Qwen2.5-0.5B's and TinyLlama's down projections) are several element-order
    groups (kernels/quant.py), whole or a group per call."""
    k_chunk = _one_group(name, K) if k_chunk == "group" else k_chunk
    packed, x = _exact_case(name, 24, K)
    expected = F.linear(x.float(), quant.dequantize(quant.weight_format(name), packed, K))
    actual = host_build.gemv_packed(packed, x, name, tile_rows=8, k_chunk=k_chunk)
    assert torch.equal(actual, expected)
    rounded = host_build.gemv_packed(packed, x, name, tile_rows=4, out_dtype=torch.bfloat16)
    assert torch.equal(rounded, expected.to(torch.bfloat16))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("K, k_chunk", [(576, None), (2048, 1024), (4864, "group")])
def test_random_weights_within_fp32_summation(name, K, k_chunk):
    k_chunk = _one_group(name, K) if k_chunk == "group" else k_chunk
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(40, K, generator=gen)
    x = torch.randn(K, generator=gen).to(torch.bfloat16)
    packed = _packed(name, w)
    exact = quant.dequantize(quant.weight_format(name), packed, K)
    expected = F.linear(x.float(), exact)
    actual = host_build.gemv_packed(packed, x, name, tile_rows=8, k_chunk=k_chunk)
    bound = 2.0 ** -16 * F.linear(x.float().abs(), exact.abs())
    assert ((actual - expected).abs() <= bound).all()


def test_a_wrong_nibble_order_is_seen():
    """The check above is not blind to the layout: GGUF's own nibble order (j, j + 16) read as ours fails it."""
    packed, x = _exact_case("q4_1", 8, 576)
    fmt = quant.Q4_1
    q, d, m = quant.unpack_fields(fmt, packed, 576)
    gguf_order = q.view(8, -1, 2, 16).transpose(-1, -2).reshape(8, 576)  # elements 0,16,1,17,... as 0,1,2,3,...
    expected = F.linear(x.float(), (d.repeat_interleave(32, 1) * gguf_order.float() + m.repeat_interleave(32, 1)))
    assert not torch.equal(host_build.gemv_packed(packed, x, "q4_1", tile_rows=8), expected)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()  # round to nearest even


def _split(v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    hi = _bf16(v)
    mid = _bf16(v - hi)
    return hi, mid, _bf16(v - hi - mid)


def _scale_parts(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """gemv.cc's exact_scale_bits: fp16 bits h as three bf16 values whose sum is h's value."""
    h = h.int() & 0xFFFF
    sign, field = h & 0x8000, (h >> 10) & 31
    n = torch.where(field > 0, 1024, 0) | (h & 1023)
    e = field.clamp(min=1) - 25
    bits = (sign | ((e + 138) << 7) | (n >> 4), sign | ((e + 131) << 7) | ((n & 15) << 3),
            (sign ^ 0x8000) | ((e + 138) << 7) | 1)
    return tuple((b.int() << 16).view(torch.float32) for b in bits)


def _lane_model(name: str, packed: torch.Tensor, x: torch.Tensor, K: int) -> torch.Tensor:
    """README's description of the transposed path, in torch fp32: a lane per block, (128 + q) x summed in element
    order, 128 (Q4_0: 136) sum(x) taken away, the lane's sum in three bf16 parts times d's three, sum(x)'s times m's,
    the lanes folded in halves."""
    fmt = quant.weight_format(name)
    q, d, m = quant.unpack_fields(fmt, packed, K)
    N, groups = q.shape[0], K // 1024
    q = q.float().view(N, groups, 32, 32)
    xs = x.float().view(groups, 32, 32)
    offset, bias = (128, 136 if name == "q4_0" else 128) if fmt.quant_bytes == 16 else (0, 0)
    x_sums = torch.zeros(groups, 32)
    for i in range(32):
        x_sums = x_sums + xs[:, :, i]
    x_parts = _split(x_sums)
    acc = torch.zeros(N, 32)
    for g in range(groups):
        dot = torch.zeros(N, 32)
        for i in range(32):
            dot = dot + (offset + q[:, g, :, i]) * xs[g, :, i]
        for part in x_parts if bias else ():
            dot = dot + part[g] * -bias
        blocks = slice(32 * g, 32 * g + 32)
        for part in _split(dot):
            for piece in _scale_parts(d[:, blocks].half().view(torch.int16)):
                acc = acc + part * piece
        for part in x_parts if m is not None else ():
            for piece in _scale_parts(m[:, blocks].half().view(torch.int16)):
                acc = acc + part[g] * piece
    half = 16
    while half:
        acc = acc[:, :half] + acc[:, half:2 * half]
        half //= 2
    return acc[:, 0]


@pytest.mark.parametrize("name", FORMATS)
def test_transposed_rows_compute_what_the_readme_says(name):
    """The host path (the emulator's) is the described order of operations, bit for bit, on random weights."""
    gen = torch.Generator().manual_seed(11)
    K = 2048
    packed = _packed(name, torch.randn(16, K, generator=gen))
    x = torch.randn(K, generator=gen).to(torch.bfloat16)
    assert torch.equal(host_build.gemv_packed(packed, x, name, tile_rows=8), _lane_model(name, packed, x, K))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("K", [576, 1536, 2048, 8192, 4864])
def test_dequant_rows_is_ggufs_dequantization_rounded_once(name, K):
    """gemv_q_dequant_bf16 (npu2.dequantize_rows' kernel) gives each weight GGUF's fp32 value rounded to bf16 once, bit
    for bit: GGUF-quantized random weights, and rows whose scales and mins span fp16's normals and subnormals; whole
    1024-element groups (transposed quants) and rows of another length, several rows per call."""
    gen = torch.Generator().manual_seed(K + 1)
    w = torch.randn(12, K, generator=gen) * torch.logspace(-3, 1, 12).reshape(12, 1) + torch.randn(12, 1, generator=gen)
    for packed in (_packed(name, w), _exact_case(name, 12, K)[0]):
        expected = quant.dequantize(quant.weight_format(name), packed, K, out=torch.empty(12, K, dtype=torch.bfloat16))
        actual = host_build.dequant_rows(packed, K, name, tile_rows=4)
        assert torch.equal(actual.view(torch.int16), expected.view(torch.int16))
