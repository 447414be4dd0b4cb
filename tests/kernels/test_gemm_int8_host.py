"""The integer GEMMs' host builds (kernels/aie2p/quantize_rows.cc and gemm_int8.cc, the ``#else`` paths), driven tile
by tile as their launches' herds drive them (kernels/host_build.py's quantize_rows and gemm_int), against
kernels/int_gemm.py bit for bit: activation rows (a row that takes the rescale branch among them) at the models' K,
in one chunk and in several, and the GEMM with the plain and the SwiGLU drain over prepared weights."""
from __future__ import annotations

import pytest
import torch

from torch_npu2.emulator.launches import gemm_int, gemm_int_swiglu, silu_mul
from torch_npu2.kernels import host_build, int_gemm

pytestmark = pytest.mark.skipif(host_build.host_compiler() is None, reason="no host C++ compiler (g++)")

QMAX = int_gemm.ACTIVATION_QMAX["w8x2a16"]


def activations(M: int, K: int, seed: int) -> torch.Tensor:
    """Rows of mixed scales with an outlier channel, a zero row, and a row whose values are spread evenly (its Σ|q| at
    32767 / absmax overflows 127 · Σ|q| ≤ 2³¹ − 1 for K ≥ 517: the rescale branch)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-6, 6, (M, 1), generator=g).float())
    a[:, 5] *= 200
    a[7] = 0
    a[3] = torch.where(torch.rand(K, generator=g) < 0.5, -0.75, 0.75)
    a[3, :K // 3] *= 1.0078125  # not all equal: the rescaled inverse still rounds values both ways
    return a.bfloat16()


def weight(N: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    w[3] = 0
    return w.bfloat16()


@pytest.mark.parametrize("K, chunk", [(576, 576), (1536, 384), (2048, 512), (8192, 2048), (8192, 8192)])
def test_quantize_rows_matches_the_definition(K, chunk):
    a = activations(16, K, 1)
    spent = int_gemm.quantize_activations(a, QMAX)[0].abs().sum(-1)
    q, scale = int_gemm.quantize_activations(a[3:4], QMAX)
    first = torch.round(a[3].float() * (QMAX / a[3].float().abs().max())).abs().sum()
    assert first * 127 > 2 ** 31 - 1 and (spent * 127 <= 2 ** 31 - 1).all()  # row 3 took the rescale branch
    got = host_build.quantize_rows(a, chunk=chunk)
    assert torch.equal(got, int_gemm.pack_activations(*int_gemm.quantize_activations(a, QMAX)))


def test_a_row_in_the_rescale_branch_is_rescaled_by_the_kernel_too():
    """Row 3 quantized by the kernel: the scale is the rescaled one, not 32767 / absmax's reciprocal."""
    a = activations(16, 2048, 2)
    q, scale = int_gemm.unpack_activations(host_build.quantize_rows(a), 2048)
    plain = torch.reciprocal(torch.tensor(QMAX) / a[3].float().abs().max())
    assert scale[3, 0] > plain and q[3].abs().max() < QMAX


@pytest.mark.parametrize("M, K, N, tile_m, drain_n", [(64, 576, 576, 64, None), (32, 2048, 128, 16, 16),
                                                      (64, 256, 192, 32, 8)])
def test_gemm_matches_the_emulator_bit_for_bit(M, K, N, tile_m, drain_n):
    a, w = activations(M, K, 3), weight(N, K, 4)
    tile_n = int_gemm.weight_tile_n(N)
    aq, prepared = int_gemm.pack_activations(*int_gemm.quantize_activations(a, QMAX)), int_gemm.prepare_weight(w)
    out = host_build.gemm_int(aq, prepared, N, tile_n=tile_n, tile_m=tile_m, drain_n=drain_n)
    expected = gemm_int(dict(M=M, K=K, N=N, tile_n=tile_n), aq, prepared)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("M, K, N, tile_m, drain_n", [(64, 576, 1536, 64, None), (32, 256, 192, 16, 8)])
def test_swiglu_drain_matches_the_emulator_bit_for_bit(M, K, N, tile_m, drain_n):
    a, gate, up = activations(M, K, 5), weight(N, K, 6), weight(N, K, 7)
    tile_n = int_gemm.weight_tile_n(N, 2)
    aq = int_gemm.pack_activations(*int_gemm.quantize_activations(a, QMAX))
    prepared = int_gemm.prepare_weight(torch.cat([gate, up]), halves=2)
    out = host_build.gemm_int(aq, prepared, N, tile_n=tile_n, tile_m=tile_m, drain_n=drain_n, swiglu=True)
    expected = gemm_int_swiglu(dict(M=M, K=K, N=N, tile_n=tile_n), aq, prepared)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    # and that is silu_mul of the two integer projections
    projections = [int_gemm.integer_gemm(a, half, "w8x2a16") for half in (gate, up)]
    assert torch.equal(expected.view(torch.int16), silu_mul({}, *projections).view(torch.int16))


def test_the_second_weight_term_counts():
    """The drain adds the lo accumulator: without it (lo = 0) the result changes, and is further from the bf16 GEMM."""
    M, K, N = 32, 256, 64
    a, w = activations(M, K, 8), weight(N, K, 9)
    aq = int_gemm.pack_activations(*int_gemm.quantize_activations(a, QMAX))
    hi, lo, scale = int_gemm.quantize_weight_terms(w)
    tile_n = int_gemm.weight_tile_n(N)
    out = host_build.gemm_int(aq, int_gemm.tile_weights(hi, lo, scale, tile_n), N, tile_n=tile_n, tile_m=32)
    without_lo = host_build.gemm_int(aq, int_gemm.tile_weights(hi, torch.zeros_like(lo), scale, tile_n), N,
                                     tile_n=tile_n, tile_m=32)
    exact = torch.nn.functional.linear(a.float(), w.float())
    error = lambda c: ((c.float() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert error(out) * 2 < error(without_lo)  # the lo term: error down to the bf16 output's rounding


def test_a_wrong_layout_is_seen():
    """The comparison can fail: the A windows cut with the rows' scale block moved first change the result."""
    M, K, N = 32, 256, 64
    a, w = activations(M, K, 10), weight(N, K, 11)
    aq = int_gemm.pack_activations(*int_gemm.quantize_activations(a, QMAX))
    runs = aq.view(torch.int16).reshape(M, K // 32, 36)
    shifted = torch.cat([runs[..., 32:], runs[..., :32]], -1).reshape(M, -1).view(torch.int32)
    prepared, tile_n = int_gemm.prepare_weight(w), int_gemm.weight_tile_n(N)
    expected = gemm_int(dict(M=M, K=K, N=N, tile_n=tile_n), aq, prepared)
    wrong = host_build.gemm_int(shifted.contiguous(), prepared, N, tile_n=tile_n, tile_m=32)
    assert not torch.equal(wrong.view(torch.int16), expected.view(torch.int16))
