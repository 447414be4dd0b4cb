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


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("K, k_chunk", [(576, None), (1536, None), (2048, None), (2048, 1024), (8192, 1024)])
def test_bit_exact_when_sums_are_exact(name, K, k_chunk):
    packed, x = _exact_case(name, 24, K)
    expected = F.linear(x.float(), quant.dequantize(quant.weight_format(name), packed, K))
    actual = host_build.gemv_packed(packed, x, name, tile_rows=8, k_chunk=k_chunk)
    assert torch.equal(actual, expected)
    rounded = host_build.gemv_packed(packed, x, name, tile_rows=4, out_dtype=torch.bfloat16)
    assert torch.equal(rounded, expected.to(torch.bfloat16))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("K, k_chunk", [(576, None), (2048, 1024)])
def test_random_weights_within_fp32_summation(name, K, k_chunk):
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
