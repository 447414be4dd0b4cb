"""The integer GEMM's host build (kernels/aie2p/gemm_int8.cc and quantize_rows.cc, the ``#else`` paths), driven
tile by tile in the layouts the kernels state, against the emulator's definition (torch_npu2/emulator/int8.py):
bit for bit, W8A8, W8A16 and W8x2A16 (two weight terms), with the plain and the SwiGLU drain."""
from __future__ import annotations

import ctypes

import pytest
import torch

from torch_npu2.emulator import int8
from torch_npu2.emulator.launches import silu_mul
from torch_npu2.kernels import host_build

pytestmark = pytest.mark.skipif(host_build.host_compiler() is None, reason="no host C++ compiler (g++)")

ACT_DTYPE = {8: torch.int8, 16: torch.int16}
PRECISION_BITS = {"int8": 8, "w8a16": 16, "w8x2a16": 16}


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def host_quantize(x: torch.Tensor, qmax: int, bits: int, rows_per_call: int = 4):
    M, K = x.shape
    lib = host_build.load("quantize_rows.cc", {"QUANT_ROWS": rows_per_call, "QUANT_K": K, "QUANT_QMAX": qmax,
                                               "QUANT_ACT_BITS": bits})
    q = torch.empty(M, K, dtype=ACT_DTYPE[bits])
    scale = torch.empty(M, dtype=torch.float32)
    for r in range(0, M, rows_per_call):
        lib.quantize_rows_bf16(ptr(x[r:]), ptr(q[r:]), ptr(scale[r:]))
    return q, scale


def host_gemm(qa, scale_a, qw_kn, scale_w, bits, tile_m=32, tile_k=32, tile_n=32, drain_n=16, up=None):
    """C = rescaled qa · qw_kn over (tile_m × tile_n) tiles, each accumulated over K in tile_k calls and drained in
    drain_n chunks; qw_kn: the (K × N) int8 weight, or a list of its terms (hi, lo); ``up``: (qw_kn, scale_w) of the
    up projection, drained through SwiGLU with the first as gate."""
    M, K = qa.shape
    terms = len(qw_kn) if isinstance(qw_kn, list) else 1
    N = (qw_kn[0] if terms > 1 else qw_kn).shape[1]
    km = 8 if bits == 8 else 4
    defines = {"GEMM_TILE_M": tile_m, "GEMM_TILE_K": tile_k, "GEMM_TILE_N": tile_n, "GEMM_DRAIN_N": drain_n,
               "GEMM_ACT_BITS": bits, **({"GEMM_WEIGHT_TERMS": terms} if terms > 1 else {})}
    lib = host_build.load("gemm_int8.cc", defines)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    for m0 in range(0, M, tile_m):
        for n0 in range(0, N, tile_n):
            accs = []
            for w_kn in ([qw_kn] if up is None else [qw_kn, up[0]]):
                w_terms = w_kn if terms > 1 else [w_kn]
                acc = torch.empty(terms, tile_n // 8, tile_m // 8, 8, 8, dtype=torch.int32)
                lib.gemm_zero_i32(ptr(acc))
                for k0 in range(0, K, tile_k):
                    # A [KB][MB][8 m][KM k], W [T][KB][NB][KM k][8 n]
                    a_t = qa[m0:m0 + tile_m, k0:k0 + tile_k].reshape(tile_m // 8, 8, tile_k // km, km)
                    a_t = a_t.permute(2, 0, 1, 3).contiguous()
                    w_t = torch.stack([t[k0:k0 + tile_k, n0:n0 + tile_n].reshape(tile_k // km, km, tile_n // 8, 8)
                                       .permute(0, 2, 1, 3) for t in w_terms]).contiguous()
                    lib.gemm_int_i32_wkn(ptr(a_t), ptr(w_t), ptr(acc))
                accs.append(acc)
            rows = scale_a[m0:m0 + tile_m].contiguous()
            for c0 in range(0, tile_n, drain_n):
                chunk = torch.empty(drain_n // 8, tile_m // 8, 8, 8, dtype=torch.bfloat16)
                # a drain reads the chunk's blocks in place: term t's at t · tile_m · tile_n further
                pieces = [acc[0, c0 // 8] for acc in accs]
                if up is None:
                    lib.gemm_i32_to_bf16(ptr(pieces[0]), ptr(rows), ptr(scale_w[n0 + c0:].contiguous()), ptr(chunk))
                else:
                    lib.gemm_i32_swiglu_to_bf16(ptr(pieces[0]), ptr(pieces[1]), ptr(rows),
                                                ptr(scale_w[n0 + c0:].contiguous()),
                                                ptr(up[1][n0 + c0:].contiguous()), ptr(chunk))
                # [n/8][m/8][8 m][8 n] → (m, n)
                out[m0:m0 + tile_m, n0 + c0:n0 + c0 + drain_n] = chunk.permute(1, 2, 0, 3).reshape(tile_m, drain_n)
    return out


def operands(M, K, N, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-6, 6, (M, 1), generator=g).float())
    a[:, 5] *= 200  # an outlier channel
    a[7] = 0        # a zero row
    w = torch.randn(N, K, generator=g) * 0.04
    w[3] = 0
    return a.bfloat16(), w.bfloat16()


@pytest.mark.parametrize("precision", ["int8", "w8a16"])
def test_quantize_rows_matches_the_definition(precision):
    a, _ = operands(16, 256, 16, 1)
    qmax = int8.activation_qmax(precision, 256)
    q, scale = host_quantize(a, qmax, PRECISION_BITS[precision])
    q_ref, scale_ref = int8.quantize_rows(a, qmax)
    assert torch.equal(q.to(torch.int32), q_ref)
    assert torch.equal(scale.view(torch.int32), scale_ref.reshape(-1).view(torch.int32))


def weight_kn(w, precision):
    """(the kernel's (K, N) weight or its terms, the scales, the definition's prepared weight)"""
    *terms, scale = prepared = int8.prepared_weight(w, precision)
    kn = [t.T.contiguous() for t in terms]
    return (kn if len(kn) > 1 else kn[0]), scale, prepared


@pytest.mark.parametrize("precision", ["int8", "w8a16", "w8x2a16"])
def test_gemm_matches_the_emulator_bit_for_bit(precision):
    M, K, N = 64, 128, 64
    a, w = operands(M, K, N, 2)
    bits = PRECISION_BITS[precision]
    qa, scale_a = host_quantize(a, int8.activation_qmax(precision, K), bits)
    kn, scale_w, prepared = weight_kn(w, precision)
    out = host_gemm(qa, scale_a, kn, scale_w, bits)
    expected = int8.integer_gemm(a, *prepared, precision=precision)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_the_second_weight_term_counts():
    """W8x2A16's drain adds the lo accumulator: dropping it (lo = 0) changes the result, and the result is closer to
    the bf16 GEMM than W8A16's."""
    M, K, N = 32, 128, 32
    a, w = operands(M, K, N, 6)
    qa, scale_a = host_quantize(a, int8.activation_qmax("w8x2a16", K), 16)
    (hi, lo), scale_w, _ = weight_kn(w, "w8x2a16")
    out = host_gemm(qa, scale_a, [hi, lo], scale_w, 16)
    without_lo = host_gemm(qa, scale_a, [hi, torch.zeros_like(lo)], scale_w, 16)
    assert torch.equal(without_lo.view(torch.int16),
                       int8.integer_gemm(a, *int8.prepared_weight(w, "w8a16"), precision="w8a16").view(torch.int16))
    exact = torch.nn.functional.linear(a.float(), w.float())
    error = lambda c: ((c.float() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert error(out) * 2 < error(without_lo)


@pytest.mark.parametrize("precision", ["w8a16", "w8x2a16"])
def test_swiglu_drain_matches_the_emulator_bit_for_bit(precision):
    M, K, N = 32, 64, 32
    a, wg = operands(M, K, N, 3)
    _, wu = operands(M, K, N, 4)
    qa, scale_a = host_quantize(a, int8.activation_qmax(precision, K), 16)
    (g_kn, sg, g), (u_kn, su, u) = weight_kn(wg, precision), weight_kn(wu, precision)
    out = host_gemm(qa, scale_a, g_kn, sg, 16, up=(u_kn, su))
    expected = silu_mul({}, int8.integer_gemm(a, *g, precision=precision),
                        int8.integer_gemm(a, *u, precision=precision))
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_a_wrong_layout_is_seen():
    """The comparison can fail: W's blocks handed over (n, k) instead of (k, n) change the result."""
    M, K, N = 32, 64, 32
    a, w = operands(M, K, N, 5)
    qa, scale_a = host_quantize(a, 127, 8)
    qw, scale_w = int8.quantize_weight(w)
    wrong = host_gemm(qa, scale_a, qw[:, :N].contiguous() if K == N else qw.T.flip(0).contiguous(), scale_w, 8)
    expected = int8.integer_gemm(a, qw, scale_w, precision="int8")
    assert not torch.equal(wrong.view(torch.int16), expected.view(torch.int16))
