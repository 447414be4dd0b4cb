"""The AIE2P kernels' host path (kernels/aie2p/*.cc built by g++) against ops/reference.py.

Each kernel is checked against an fp64 evaluation of the same math on the same bf16 inputs (the kernel's own
accuracy) and against the PyTorch reference the npu2 ops are held to. rope and silu_mul round where HF's bf16
torch ops round (see their headers), so they are held bit for bit to the reference and to the emulated NPU's
launches (torch_npu2/emulator/launches.py). gemv and attention round once at the end and the reference at more
places, so those comparisons have tolerances.

Tolerances (|actual - expected| <= atol + rtol * |expected|). Half a bf16 ulp is at most 2^-8 of the value.

| kernel     | vs fp64 of the same math                     | vs ops/reference.py                              |
|------------|----------------------------------------------|--------------------------------------------------|
| rope       | rtol 2^-8, atol (2^-8 + 2^-15) * (|a cos| +  | bit-exact (and so is the emulator's launch)      |
|            | |b sin|) (half an ulp of each rounded        |                                                  |
|            | product and of their sum)                    |                                                  |
| silu_mul   | rtol 2^-7 (half an ulp of silu(gate) and of  | bit-exact (and so is the emulator's launch)      |
|            | the product)                                 |                                                  |
| gemv       | rtol 2^-8, atol K * 2^-24 * sum|w x| (fp32   | rtol 2^-7, atol 2^-16 * sum|w x| (a different    |
|            | summation bound)                             | fp32 summation order)                            |
| attention  | rtol 2^-8, atol 2^-8 * max|v| (probs rounded | rtol 2^-6, atol 2^-6 * max|v| (it rounds logits, |
|            | to bf16 before the PV product)               | their scaling and the output to bf16)            |
| gemm       | rtol 2^-8, atol K * 2^-24 * sum|a w| (as     | rtol 2^-7, atol 2^-16 * sum|a w|; bit-exact when |
|            | gemv); its fp32 accumulator rounds to bf16   | every partial sum is exact in fp32 (small-integer|
|            | bit-exactly as torch rounds it               | inputs), whatever the tiling                     |
"""
from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torch_npu2.emulator import launches
from torch_npu2.kernels import ModelDims, host_build, programs_for_model
from torch_npu2.kernels.builders import EXTERNAL_KERNELS, build_launch
from torch_npu2.ops import build_rope_lut, reference

pytestmark = pytest.mark.skipif(host_build.host_compiler() is None,
                                reason="no host C++ compiler (g++): the AIE2P kernels' host path cannot be built")

SMOLLM2 = dict(head_dim=64, heads=9, kv_heads=3, hidden=576, ffn=1536, rope_theta=1e5)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float | torch.Tensor = 0.0):
    actual, expected = actual.double(), expected.double()
    excess = (actual - expected).abs() - (atol + rtol * expected.abs())
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"{int((excess > 0).sum())} of {excess.numel()} elements out of tolerance; worst at "
                               f"{worst}: {actual.flatten()[worst].item()} vs {expected.flatten()[worst].item()}")


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor):
    """The same bf16 bits, signed zeros included; NaN exactly where expected has NaN, whatever its bits (torch
    canonicalizes a NaN's sign and payload, the kernels keep them)."""
    actual, expected = actual.to(torch.bfloat16).contiguous(), expected.to(torch.bfloat16).contiguous()
    assert actual.shape == expected.shape
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), "NaN in different places"
    differ = ((actual.view(torch.int16) != expected.view(torch.int16)) & ~nan).flatten()
    first = int(differ.int().argmax())
    assert not differ.any(), (f"{int(differ.sum())} of {differ.numel()} elements differ; first at {first}: "
                              f"{actual.flatten()[first].item()!r} vs {expected.flatten()[first].item()!r}")


def rope_lut(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """The LUT a Llama model gives: HF's cos/sin for these positions, as half-split bf16 rows."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), -1)
    return build_rope_lut(angles.cos(), angles.sin()).to(torch.bfloat16)


def rope_exact(x: torch.Tensor, lut: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 RoPE of the bf16 inputs, and the |a cos| + |b sin| (|b cos| + |a sin|) its roundings scale with."""
    half = head_dim // 2
    xh = x.double().reshape(x.shape[0], -1, head_dim)
    cos, sin = lut.double()[:, None, :half], lut.double()[:, None, half:]
    a, b = xh[..., :half], xh[..., half:]
    exact = torch.cat((a * cos - b * sin, b * cos + a * sin), -1).reshape(x.shape)
    magnitude = torch.cat(((a * cos).abs() + (b * sin).abs(), (b * cos).abs() + (a * sin).abs()), -1)
    return exact, magnitude.reshape(x.shape)


def check_rope(x: torch.Tensor, lut: torch.Tensor, head_dim: int, tile_rows: int):
    y = host_build.rope_half_split(x, lut, head_dim, tile_rows=tile_rows)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    rows, heads = x.shape[0], x.shape[1] // head_dim
    assert_bitwise(y, reference.rope_half_split(x, lut, head_dim))
    assert_bitwise(y, launches.rope(dict(rows=rows, heads=heads, head_dim=head_dim), x, lut).reshape(x.shape))
    exact, magnitude = rope_exact(x, lut, head_dim)
    # Two bf16 roundings of the products, then one of their sum: see the module's table. Among subnormals each
    # loses up to 2^-134 (half bf16's smallest step) absolutely, hence 2^-132 for the three.
    assert_within(y, exact, rtol=2**-8, atol=(2**-8 + 2**-15) * magnitude + 2**-132)


@pytest.mark.parametrize("rows, heads, head_dim, tile_rows", [
    (1, SMOLLM2["heads"], 64, 1),        # SmolLM2 decode, Q
    (37, SMOLLM2["kv_heads"], 64, 8),    # SmolLM2 prefill, K; rows not a multiple of the tile
    (5, 2, 128, 4),
    (3, 5, 32, 2),
])
def test_rope_half_split(rows, heads, head_dim, tile_rows):
    torch.manual_seed(rows * 100 + heads)
    x = torch.randn(rows, heads * head_dim).to(torch.bfloat16)
    lut = rope_lut(torch.arange(rows) * 97 + 3, head_dim, SMOLLM2["rope_theta"])
    check_rope(x, lut, head_dim, tile_rows)


def test_rope_half_split_extreme_values():
    """Signed zeros, exact cancellations, and products from 2^20 down to fp32 subnormals and below."""
    torch.manual_seed(0)
    rows, heads, head_dim, half = 16, 4, 64, 32
    x = torch.randn(rows, heads, head_dim) * 2.0 ** torch.randint(-70, 21, (rows, heads, head_dim))
    x[torch.rand(x.shape) < 0.1] *= 0.0  # keeps the sign: +0 and -0
    x[:, 0, half:] = x[:, 0, :half]  # head 0: b = a ...
    lut = torch.rand(rows, head_dim) * 2.0 ** torch.randint(-70, 1, (rows, head_dim))
    lut[:, half:half + 8] = lut[:, :8]  # ... and sin = cos on 8 lanes: y = a cos - a sin cancels exactly
    check_rope(x.reshape(rows, -1).to(torch.bfloat16), lut.to(torch.bfloat16), head_dim, tile_rows=4)


def check_silu_mul(gate: torch.Tensor, up: torch.Tensor, tile: int) -> torch.Tensor:
    out = host_build.silu_mul(gate, up, tile=tile)
    assert out.dtype == torch.bfloat16 and out.shape == gate.shape
    # Bit for bit, though torch's vectorized silu uses its own exp: measured on every bf16 gate (the test
    # below), its fp32 silu rounds to the same bf16 as the kernel's libm exp.
    assert_bitwise(out, reference.silu_mul(gate, up))
    assert_bitwise(out, launches.silu_mul({}, gate, up))
    return out


@pytest.mark.parametrize("shape, tile", [
    ((1, SMOLLM2["ffn"]), 512),          # SmolLM2 decode
    ((6, SMOLLM2["ffn"]), 1536),         # SmolLM2 prefill rows
    ((3, 1000), 96),                     # length not a multiple of the tile (and of torch's vector width)
])
def test_silu_mul(shape, tile):
    torch.manual_seed(shape[1])
    gate = (torch.randn(shape) * 4).to(torch.bfloat16)
    up = torch.randn(shape).to(torch.bfloat16)
    out = check_silu_mul(gate, up, tile)
    g, u = gate.double(), up.double()
    assert_within(out, g * torch.sigmoid(g) * u, rtol=2**-7)


def test_silu_mul_every_bf16_gate():
    """All 65536 bf16 bit patterns as gate: every finite value, both infinities, NaNs."""
    gate = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    torch.manual_seed(1)
    check_silu_mul(gate, torch.randn(gate.shape).to(torch.bfloat16), tile=512)
    check_silu_mul(gate, torch.ones_like(gate), tile=512)  # out is bf16(silu(gate)) itself


def test_silu_mul_extremes():
    gate = torch.tensor([-200.0, -90.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 90.0, 3e38] + [1.0] * 6)
    gate = gate.to(torch.bfloat16)
    up = torch.full_like(gate, 2.0)
    out = check_silu_mul(gate, up, tile=16).double()
    # exp(-g) overflows fp32 below g ~ -88.7: silu is then -0, in HF as in the kernel.
    assert (out[:2] == 0).all() and torch.signbit(out[:2]).all() and out[2] < 0
    g = gate.double()
    assert_within(out[2:9], (g * torch.sigmoid(g) * 2)[2:9], rtol=2**-7)
    assert out[9] == math.inf  # 2 * 3e38 overflows bf16: rounds to inf, as nearest-even must


@pytest.mark.parametrize("rows, depth, tile_rows", [
    (SMOLLM2["hidden"], SMOLLM2["hidden"], 32),   # q / o projection
    (SMOLLM2["kv_heads"] * 64, SMOLLM2["hidden"], 32),  # k / v projection
    (SMOLLM2["ffn"], SMOLLM2["hidden"], 64),      # gate / up projection
    (SMOLLM2["hidden"], SMOLLM2["ffn"], 16),      # down projection
    (37, 100, 8),                                 # odd
])
def test_gemv(rows, depth, tile_rows):
    torch.manual_seed(rows + depth)
    w = (torch.randn(rows, depth) / math.sqrt(depth)).to(torch.bfloat16)
    x = torch.randn(depth).to(torch.bfloat16)
    y = host_build.gemv(w, x, tile_rows=tile_rows)
    assert y.dtype == torch.bfloat16 and y.shape == (rows,)
    magnitude = w.double().abs() @ x.double().abs()
    assert_within(y, w.double() @ x.double(), rtol=2**-8, atol=depth * 2**-24 * magnitude)
    assert_within(y, F.linear(x, w), rtol=2**-7, atol=2**-16 * magnitude)


def test_gemv_fp32_output_is_the_unrounded_sum():
    torch.manual_seed(7)
    w = (torch.randn(100, 576) / 24).to(torch.bfloat16)
    x = torch.randn(576).to(torch.bfloat16)
    y32 = host_build.gemv(w, x, tile_rows=4, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    magnitude = w.double().abs() @ x.double().abs()
    assert_within(y32, w.double() @ x.double(), rtol=0, atol=576 * 2**-24 * magnitude)
    assert torch.equal(y32.to(torch.bfloat16), host_build.gemv(w, x, tile_rows=4))


def test_fp32_to_bf16_rounds_to_nearest_even():
    """Through gemv, whose fp32 sums of these pairs are exact: ties go to the even mantissa."""
    one, bf16_max = 1.0, (2 - 2**-7) * 2.0**127
    cases = [  # (w0, w1) with x = (1, 1): y = w0 + w1 exactly in fp32, then rounded to bf16
        ((one, 2**-8), 1.0),                       # tie between 1 and 1 + 2^-7: even is 1
        ((one, 3 * 2**-8), 1.0 + 2**-6),           # tie between 1 + 2^-7 and 1 + 2^-6: even is the upper one
        ((one, 2**-8 + 2**-15), 1.0 + 2**-7),      # just above the tie: up
        ((-one, -3 * 2**-8), -(1.0 + 2**-6)),      # sign-symmetric
        ((bf16_max, bf16_max), math.inf),          # fp32 overflow is inf
    ]
    w = torch.zeros(8, 2)
    for row, ((w0, w1), _) in enumerate(cases):
        w[row] = torch.tensor([w0, w1])
    w[len(cases)] = torch.tensor([math.inf, -math.inf])  # inf - inf = NaN stays NaN
    w_bf16 = w.to(torch.bfloat16)
    assert (w_bf16.float() == w).all(), "the test's weights must be exact in bf16"
    y = host_build.gemv(w_bf16, torch.ones(2, dtype=torch.bfloat16), tile_rows=8).float()
    for row, (_, expected) in enumerate(cases):
        assert y[row].item() == expected, f"case {row}: {y[row].item()} != {expected}"
    assert math.isnan(y[len(cases)].item())


SMOLLM2_DIMS = ModelDims(SMOLLM2["hidden"], SMOLLM2["heads"], SMOLLM2["kv_heads"], SMOLLM2["head_dim"], SMOLLM2["ffn"],
                         49152, 1e-5)
LLAMA32_1B_DIMS = ModelDims(2048, 32, 8, 64, 8192, 128256, 1e-5)
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
# (tile_m, tile_k, tile_n, drain_n) of every gemm.cc build the builders make for SmolLM2-135M and Llama-3.2-1B
# prefill.
GEMM_TILE_CONFIGS = [(16, 32, 48, 48), (16, 32, 128, 128), (32, 32, 48, 48), (32, 32, 128, 128), (64, 32, 48, 48),
                     (64, 32, 128, 16)]
# ... and of every gemm_swiglu build, by its output tile (tile_m, tile_k, tile_n, drain_n): gemm.cc is built 2·tile_n wide
GEMM_SWIGLU_TILE_CONFIGS = [(16, 32, 64, 64), (32, 32, 64, 64), (64, 32, 64, 16)]


def builder_gemm_tile_configs(kind: str = "gemm") -> set[tuple[int, int, int]]:
    configs = set()
    for dims in (SMOLLM2_DIMS, LLAMA32_1B_DIMS):
        for program in programs_for_model(dims, PREFILL_BUCKETS, "bf16"):  # gemm.cc's GEMMs (bf16 weights)
            for launch in (l for l in program.launches if l.kind == kind):
                defines = dict(build_launch(program, launch).externs[0].defines)
                configs.add((defines["GEMM_TILE_M"], defines["GEMM_TILE_K"], defines["GEMM_TILE_N"],
                             defines["GEMM_DRAIN_N"]))
    return configs


def test_gemm_tests_cover_every_tile_configuration_the_builders_choose():
    assert builder_gemm_tile_configs() == set(GEMM_TILE_CONFIGS)
    # gemm_swiglu builds gemm.cc twice as wide as its output tile: gate and up columns
    assert {(m, k, 2 * n, d) for m, k, n, d in GEMM_SWIGLU_TILE_CONFIGS} == builder_gemm_tile_configs("gemm_swiglu")


@pytest.mark.parametrize("tile_m, tile_k, tile_n, drain_n", GEMM_SWIGLU_TILE_CONFIGS)
def test_gemm_swiglu_is_silu_mul_of_the_two_projections(tile_m, tile_k, tile_n, drain_n):
    """The fused launch's host path is, bit for bit, silu_mul of the gate and up GEMMs at the same tiles (the same
    fp32 sums in the same order, then silu_mul's rounding points), and of torch's when the sums are exact."""
    generator = torch.Generator().manual_seed(tile_m + tile_n + drain_n)
    m, k, n = 2 * tile_m, 3 * tile_k, 2 * tile_n
    a = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    w_gate, w_up = ((torch.randn(n, k, generator=generator) / math.sqrt(k)).to(torch.bfloat16) for _ in range(2))
    tiles = dict(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n, drain_n=drain_n)
    fused = host_build.gemm_swiglu(a, torch.cat((w_gate, w_up), dim=1), **tiles)
    gate, up = host_build.gemm(a, w_gate, **tiles), host_build.gemm(a, w_up, **tiles)
    assert_bitwise(fused, reference.silu_mul(gate, up))
    exact = [small_integers(rows, k, generator) for rows in (m, n, n)]
    fused = host_build.gemm_swiglu(exact[0], torch.cat(exact[1:], dim=1), **tiles)
    assert_bitwise(fused, launches.gemm_swiglu(dict(K=k, N=n), exact[0], torch.cat(exact[1:], dim=1)))


def test_gemm_swiglu_wrapper_refuses_what_does_not_tile():
    a = torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"w_gate_up \(64, 64\): expected rows of 2K=128"):
        host_build.gemm_swiglu(a, torch.zeros(64, 64, dtype=torch.bfloat16), tile_m=16, tile_k=32, tile_n=32, drain_n=8)
    with pytest.raises(ValueError, match=r"tile_n=32: expected a multiple of 24"):
        host_build.gemm_swiglu(a, torch.zeros(64, 128, dtype=torch.bfloat16), tile_m=16, tile_k=32, tile_n=32,
                               drain_n=24)


def test_gemm_swiglu_covers_every_finite_bf16_gate():
    """A = I makes the gate projection W_gᵀ itself, so 256×256 gates are every finite bf16 value (the overflow of
    exp(-g) to -0 included; an infinite or NaN weight would reach every sum through 0 · w, and silu_mul's own test
    covers those gates): the fused drain is silu_mul of the two projections, bit for bit."""
    eye = torch.eye(256, dtype=torch.bfloat16)
    gates = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    gates = torch.where(gates.isfinite(), gates, torch.ones_like(gates))
    up = torch.randn(256, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    tiles = dict(tile_m=64, tile_k=32, tile_n=64, drain_n=16)
    fused = host_build.gemm_swiglu(eye, torch.cat((gates.T, up.T), dim=1), **tiles)
    projections = [host_build.gemm(eye, w.T.contiguous(), **tiles) for w in (gates, up)]
    assert torch.equal(projections[0].abs(), gates.abs())  # every finite gate value reaches the drain
    assert_bitwise(fused, reference.silu_mul(*projections))


def small_integers(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """bf16 values in [-8, 8] in steps of 1/2: every product and every partial sum of a GEMM with K < 2^14 is exact
    in fp32, so any summation order gives the same fp32 result and the same bf16."""
    return (torch.randint(-16, 17, (rows, cols), generator=generator) / 2).to(torch.bfloat16)


@pytest.mark.parametrize("tile_m, tile_k, tile_n, drain_n", GEMM_TILE_CONFIGS)
def test_gemm_is_bit_exact_when_the_sums_are_exact(tile_m, tile_k, tile_n, drain_n):
    """Two tiles along M and N and three K steps: a block or tile put in the wrong place changes the result."""
    generator = torch.Generator().manual_seed(tile_m * tile_n + tile_k)
    m, k, n = 2 * tile_m, 3 * tile_k, 2 * tile_n
    a, w = small_integers(m, k, generator), small_integers(n, k, generator)
    out = host_build.gemm(a, w, tile_m=tile_m, tile_k=tile_k, tile_n=tile_n, drain_n=drain_n)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert_bitwise(out, (a.float() @ w.float().T).to(torch.bfloat16))
    assert_bitwise(out, F.linear(a, w))


@pytest.mark.parametrize("tile_m, tile_k, tile_n, drain_n", GEMM_TILE_CONFIGS)
def test_gemm_random_within_fp32_summation_bounds(tile_m, tile_k, tile_n, drain_n):
    generator = torch.Generator().manual_seed(tile_m + tile_n + tile_k)
    m, k, n = 2 * tile_m, 4 * tile_k, 2 * tile_n
    a = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=generator) / math.sqrt(k)).to(torch.bfloat16)
    magnitude = a.double().abs() @ w.double().abs().T
    exact = a.double() @ w.double().T
    acc = host_build.gemm(a, w, tile_m=tile_m, tile_k=tile_k, tile_n=tile_n, out_dtype=torch.float32)
    assert acc.dtype == torch.float32
    assert_within(acc, exact, rtol=0, atol=k * 2**-24 * magnitude)
    out = host_build.gemm(a, w, tile_m=tile_m, tile_k=tile_k, tile_n=tile_n, drain_n=drain_n)
    assert_bitwise(out, acc.to(torch.bfloat16))  # the drain rounds to nearest-even, as torch does
    assert_within(out, exact, rtol=2**-8, atol=k * 2**-24 * magnitude)
    assert_within(out, F.linear(a, w), rtol=2**-7, atol=2**-16 * magnitude)


def test_gemm_model_shape_with_the_builders_tiles():
    """SmolLM2's k/v projection at the 16-row bucket, tiled as the builder tiles it (K=576: 18 K steps)."""
    program = next(p for p in programs_for_model(SMOLLM2_DIMS, (16,), "bf16") if p.name == "rms_gemms_rope")
    launch = next(l for l in program.launches if l.kind == "gemm" and l.p["N"] == 192)
    defines = dict(build_launch(program, launch).externs[0].defines)
    generator = torch.Generator().manual_seed(576)
    a = torch.randn(16, 576, generator=generator).to(torch.bfloat16)
    w = (torch.randn(192, 576, generator=generator) / 24).to(torch.bfloat16)
    out = host_build.gemm(a, w, tile_m=defines["GEMM_TILE_M"], tile_k=defines["GEMM_TILE_K"],
                          tile_n=defines["GEMM_TILE_N"], drain_n=defines["GEMM_DRAIN_N"])
    magnitude = a.double().abs() @ w.double().abs().T
    assert_within(out, a.double() @ w.double().T, rtol=2**-8, atol=576 * 2**-24 * magnitude)


def test_gemm_wrapper_refuses_what_does_not_tile():
    a, w = torch.zeros(32, 64, dtype=torch.bfloat16), torch.zeros(48, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"N=48: expected a multiple of its tile 32"):
        host_build.gemm(a, w, tile_m=16, tile_k=32, tile_n=32)
    with pytest.raises(ValueError, match=r"expected the same K"):
        host_build.gemm(a, w[:, :32], tile_m=16, tile_k=32, tile_n=48)
    with pytest.raises(TypeError, match="bfloat16"):
        host_build.gemm(a.float(), w, tile_m=16, tile_k=32, tile_n=48)
    with pytest.raises(ValueError, match=r"drain_n=32: expected a positive multiple of 8 dividing tile_n=48"):
        host_build.gemm(a, w, tile_m=16, tile_k=32, tile_n=48, drain_n=32)


@pytest.mark.parametrize("rows, depth, tile_rows, k_chunk", [
    (SMOLLM2["hidden"], SMOLLM2["hidden"], 8, None),    # o projection + residual, K whole
    (SMOLLM2["hidden"], SMOLLM2["ffn"], 8, 512),        # down projection + residual, K in chunks
    (64, 8192, 8, 512),                                 # Llama-3.2-1B's down projection depth
])
def test_gemv_add_is_the_unfused_gemv_then_add(rows, depth, tile_rows, k_chunk):
    """Chunked fp32 partial sums in one order, so bit for bit the one-call gemv rounded, then the add launch."""
    torch.manual_seed(rows + depth)
    w = (torch.randn(rows, depth) / math.sqrt(depth)).to(torch.bfloat16)
    x, residual = torch.randn(depth).to(torch.bfloat16), torch.randn(rows).to(torch.bfloat16)
    y = host_build.gemv_add(w, x, residual, tile_rows=tile_rows, k_chunk=k_chunk)
    projection = host_build.gemv(w, x, tile_rows=tile_rows)
    unfused = launches.add(dict(rows=1, cols=rows), residual, projection).to(torch.bfloat16)
    if k_chunk is None:
        assert_bitwise(y, unfused)
    else:  # the chunks are summed in another order: within the gemv's own fp32 bound, then rounded twice
        magnitude = w.double().abs() @ x.double().abs()
        assert_within(y, unfused, rtol=2**-7, atol=depth * 2**-24 * magnitude + 2**-8 * projection.double().abs())
    exact = w.double() @ x.double() + residual.double()
    assert_within(y, exact, rtol=2**-7, atol=2**-7 * (w.double() @ x.double()).abs() + depth * 2**-23 * (
        w.double().abs() @ x.double().abs()))


def test_gemv_add_refuses_a_chunk_that_does_not_divide_k():
    w, x, r = torch.zeros(8, 96, dtype=torch.bfloat16), torch.zeros(96, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_chunk"):
        host_build.gemv_add(w, x, r, tile_rows=8, k_chunk=64)


@pytest.mark.parametrize("depth", [SMOLLM2["hidden"], 2048])
def test_rmsnorm_kernel(depth):
    torch.manual_seed(depth)
    x, weight = (torch.randn(depth) * 3).to(torch.bfloat16), (1 + torch.randn(depth) / 8).to(torch.bfloat16)
    out = host_build.rmsnorm(x, weight, 1e-5)
    # The emulator's rmsnorm launch rounds at the same two points; sum order and 1/sqrt vs rsqrt may move a
    # value across one rounding boundary, so one ulp.
    emulated = launches.rmsnorm(dict(rows=1, cols=depth, eps=1e-5), x, weight).reshape(-1)
    assert_within(out, emulated, rtol=2**-7)
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean() + 1e-5) * weight.double()
    assert_within(out, exact, rtol=2**-7)


@pytest.mark.parametrize("rows, depth, tile_rows", [(SMOLLM2["ffn"], SMOLLM2["hidden"], 8), (64, 2048, 4)])
def test_rms_gemv_rows_is_rmsnorm_then_gemv(rows, depth, tile_rows):
    """Each call's rows land at their own offset of one buffer: bit for bit the gemv of the normed row."""
    torch.manual_seed(rows)
    x, norm_w = torch.randn(depth).to(torch.bfloat16), (1 + torch.randn(depth) / 8).to(torch.bfloat16)
    w = (torch.randn(rows, depth) / math.sqrt(depth)).to(torch.bfloat16)
    y = host_build.rms_gemv_rows(x, norm_w, w, 1e-5, tile_rows=tile_rows)
    assert_bitwise(y, host_build.gemv(w, host_build.rmsnorm(x, norm_w, 1e-5), tile_rows=tile_rows))


def test_swiglu_is_silu_mul():
    """swiglu_bf16 over interleaved (gate, up) pairs, as rms_gemv over [w_gate | w_up] leaves them."""
    torch.manual_seed(3)
    gate_up = (torch.randn(SMOLLM2["ffn"], 2) * 4).to(torch.bfloat16)
    act = host_build.swiglu(gate_up)
    assert_bitwise(act, host_build.silu_mul(gate_up[:, 0], gate_up[:, 1], tile=SMOLLM2["ffn"]))
    assert_bitwise(act, launches.silu_mul({}, gate_up[:, 0], gate_up[:, 1]))
    with pytest.raises(ValueError, match=r"expected \(n, 2\)"):
        host_build.swiglu(gate_up.reshape(2, -1))


def attention_exact(q, k, v, head_dim: int, q_offset: int = 0) -> torch.Tensor:
    """fp64 causal GQA over the bf16 inputs; query row i sits at position q_offset + i."""
    qh = q.double().reshape(q.shape[0], -1, head_dim).transpose(0, 1)
    kh = k.double().reshape(k.shape[0], -1, head_dim).transpose(0, 1)
    vh = v.double().reshape(v.shape[0], -1, head_dim).transpose(0, 1)
    group = qh.shape[0] // kh.shape[0]
    kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    scores = qh @ kh.transpose(1, 2) / math.sqrt(head_dim)
    visible = torch.arange(k.shape[0])[None, :] <= (q_offset + torch.arange(q.shape[0]))[:, None]
    probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
    return (probs @ vh).transpose(0, 1).reshape(q.shape[0], -1)


def qkv(seq: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, heads * head_dim, generator=generator).to(torch.bfloat16)
    k = torch.randn(seq, kv_heads * head_dim, generator=generator).to(torch.bfloat16)
    v = torch.randn(seq, kv_heads * head_dim, generator=generator).to(torch.bfloat16)
    return q, k, v


@pytest.mark.parametrize("seq, heads, kv_heads, head_dim, tile_q, tile_k", [
    (96, SMOLLM2["heads"], SMOLLM2["kv_heads"], 64, 32, 32),   # SmolLM2, whole tiles
    (70, SMOLLM2["heads"], SMOLLM2["kv_heads"], 64, 16, 32),   # partial last tiles, tile_q < tile_k
    (45, 4, 1, 128, 32, 16),                                   # tile_q > tile_k, head_dim 128
    (1, 2, 2, 64, 8, 16),                                      # a single token
])
def test_flash_attention_from_tiles(seq, heads, kv_heads, head_dim, tile_q, tile_k):
    q, k, v = qkv(seq, heads, kv_heads, head_dim, seed=seq)
    out = host_build.flash_attention(q, k, v, head_dim, tile_q=tile_q, tile_k=tile_k)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    v_max = v.float().abs().max()
    assert_within(out, attention_exact(q, k, v, head_dim), rtol=2**-8, atol=2**-8 * v_max)
    assert_within(out, reference.gqa_causal_attention(q, k, v, head_dim), rtol=2**-6, atol=2**-6 * v_max)


def test_decode_attention_against_cache():
    """One new token at position p attends to cache rows 0..p: the prefill kernel with q_start = p."""
    head_dim, heads, kv_heads, cached = 64, SMOLLM2["heads"], SMOLLM2["kv_heads"], 75
    q_all, k, v = qkv(cached, heads, kv_heads, head_dim, seed=7)
    out = host_build.flash_attention(q_all[-1:], k, v, head_dim, tile_q=8, tile_k=32, q_offset=cached - 1)
    full = reference.gqa_causal_attention(q_all, k, v, head_dim)[-1:]
    v_max = v.float().abs().max()
    exact = attention_exact(q_all[-1:], k, v, head_dim, q_offset=cached - 1)
    assert_within(out, exact, rtol=2**-8, atol=2**-8 * v_max)
    assert_within(out, full, rtol=2**-6, atol=2**-6 * v_max)


MASKED = -(2.0**100)


def test_attention_scores_are_dot_products_with_the_causal_mask():
    """Scores are q . k in fp32 (the softmax applies the scale), held in 8x8 blocks, masked by position."""
    head_dim, tile_q, tile_k = 64, 16, 32
    tiles = host_build.AttentionTiles(head_dim, tile_q, tile_k)
    q, k, _ = qkv(tile_k, 1, 1, head_dim, seed=3)
    q = q[:tile_q].contiguous()
    state = tiles.new_state()
    q_start, k_start = 40, 30  # row i sees keys j <= i + 10
    tiles.qk(state, q, k, q_start, k_start)
    visible = torch.arange(tile_k)[None, :] <= torch.arange(tile_q)[:, None] + (q_start - k_start)
    dots = q.double() @ k.double().T
    scores = host_build.attention_unblocks(state["scores"]).double()
    assert (scores[~visible] == MASKED).all()
    assert_within(scores[visible], dots[visible], rtol=2**-20, atol=2**-20)


def test_attention_block_layouts_round_trip():
    m = torch.arange(16 * 24, dtype=torch.float32).reshape(16, 24)
    blocks = torch.cat([m[r:r + 8, c:c + 8].reshape(-1) for r in (0, 8) for c in (0, 8, 16)]).reshape(16, 24)
    assert torch.equal(host_build.attention_unblocks(blocks), m)
    heads = host_build.attention_head_blocks(m).reshape(-1)
    assert torch.equal(heads[64:72], m[8, :8]) and torch.equal(heads[128:136], m[0, 8:16])
    assert torch.equal(host_build.attention_head_unblocks(host_build.attention_head_blocks(m)), m)
    kv = host_build.attention_kv_blocks(m[:, :16], -m[:, :16]).reshape(2, -1)
    # key half: block (dim block 0, key block 1) follows block (0, 0): keys 8..15, dims 0..7
    assert torch.equal(kv[0, 64:72], m[8, :8]) and torch.equal(kv[0, 128:136], m[0, 8:16])
    assert torch.equal(kv[1, :8], -m[0, :8])


def test_attention_fully_masked_tile_changes_nothing():
    head_dim, tile_q, tile_k = 64, 8, 16
    tiles = host_build.AttentionTiles(head_dim, tile_q, tile_k)
    q, k, v = qkv(2 * tile_k, 1, 1, head_dim, seed=5)
    q = q[:tile_q].contiguous()
    state = tiles.new_state()
    tiles.accumulate(state, q, k[:tile_k], v[:tile_k], q_start=tile_k, k_start=0)
    before = {name: tensor.clone() for name, tensor in state.items()}
    tiles.accumulate(state, q, k[tile_k:], v[tile_k:], q_start=tile_k, k_start=tile_k + tile_q)  # all in the future
    for name in ("row_max", "row_sum", "acc"):
        assert torch.equal(state[name], before[name]), name
    assert (state["row_scale"] == 1).all() and (state["probs"] == 0).all()


def test_attention_row_without_visible_keys_outputs_zero():
    head_dim, tile_q, tile_k, first_key = 64, 8, 16, 4
    tiles = host_build.AttentionTiles(head_dim, tile_q, tile_k)
    q, k, v = qkv(tile_k, 1, 1, head_dim, seed=11)
    q = q[:tile_q].contiguous()
    state = tiles.new_state()
    # Keys at positions 4..19 against queries 0..7 (a tile order a builder may choose): rows 0..3 see no key.
    tiles.accumulate(state, q, k, v, q_start=0, k_start=first_key)
    out = tiles.finalize(state)
    assert (out[:first_key] == 0).all()
    rows = []
    for i in range(first_key, tile_q):
        keys, values = k[:i - first_key + 1].double(), v[:i - first_key + 1].double()
        rows.append(((keys @ q[i].double()) / math.sqrt(head_dim)).softmax(0) @ values)
    expected = torch.stack(rows)
    assert_within(out[first_key:], expected, rtol=2**-8, atol=2**-8 * v.float().abs().max())


def test_renamed_symbols_let_two_variants_coexist():
    """Two K of one source, renamed with -D as an ELF holding both would need, loaded side by side."""
    narrow = host_build.load("gemv.cc", {"GEMV_ROWS": 4, "GEMV_K": 64, "gemv_bf16": "gemv_k64_bf16"})
    wide = host_build.load("gemv.cc", {"GEMV_ROWS": 4, "GEMV_K": 128, "gemv_bf16": "gemv_k128_bf16"})
    with pytest.raises(AttributeError):
        narrow.gemv_bf16
    for library, symbol, depth in ((narrow, "gemv_k64_bf16", 64), (wide, "gemv_k128_bf16", 128)):
        w = torch.randn(4, depth).to(torch.bfloat16)
        x = torch.randn(depth).to(torch.bfloat16)
        y = torch.empty(4, dtype=torch.bfloat16)
        getattr(library, symbol)(ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(x.data_ptr()),
                                 ctypes.c_void_p(y.data_ptr()))
        magnitude = w.double().abs() @ x.double().abs()
        assert_within(y, w.double() @ x.double(), rtol=2**-8, atol=depth * 2**-24 * magnitude)


def test_build_is_cached_by_source_and_defines(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_NPU2_HOST_KERNEL_CACHE", str(tmp_path))
    first = host_build.build("silu_mul.cc", {"SILU_MUL_LEN": 32})
    stamp = first.stat().st_mtime_ns
    assert host_build.build("silu_mul.cc", {"SILU_MUL_LEN": 32}) == first and first.stat().st_mtime_ns == stamp
    assert host_build.build("silu_mul.cc", {"SILU_MUL_LEN": 48}) != first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in tmp_path.glob("silu_mul-*.so"))


def test_concurrent_builds_of_one_variant_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_NPU2_HOST_KERNEL_CACHE", str(tmp_path))
    results, errors = [], []

    def build():
        try:
            results.append(host_build.build("gemv.cc", {"GEMV_ROWS": 3, "GEMV_K": 40}))
        except Exception as error:  # surfaced below: a thread cannot fail the test by itself
            errors.append(error)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no partial files left behind
    ctypes.CDLL(str(results[0])).gemv_bf16


def test_tile_constraints_are_compile_errors():
    with pytest.raises(host_build.HostBuildError, match="ROPE_HEAD_DIM must be even"):
        host_build.build("rope_half_split.cc", {"ROPE_HEAD_DIM": 63})
    with pytest.raises(host_build.HostBuildError, match="ATTN_TQ must be a positive multiple of 8"):
        host_build.build("attention.cc", {"ATTN_TQ": 12})
    with pytest.raises(host_build.HostBuildError, match="GEMM_TILE_M must be a positive multiple of 16"):
        host_build.build("gemm.cc", {"GEMM_TILE_M": 24})


def test_wrappers_take_bf16_only():
    with pytest.raises(TypeError, match="bfloat16"):
        host_build.gemv(torch.randn(4, 8), torch.randn(8))


def _symbols_by_source() -> dict[str, list[str]]:
    """Each C++ source's extern "C" entry points, as the builders declare them (EXTERNAL_KERNELS)."""
    by_source: dict[str, set[str]] = {}
    for kernel in EXTERNAL_KERNELS:
        by_source.setdefault(kernel.source, set()).update(kernel.symbols)
    return {source: sorted(symbols) for source, symbols in by_source.items()}


KERNEL_SYMBOLS = _symbols_by_source()


def renamed(symbols: list[str], prefix: str) -> list[str]:
    return [f"-D{symbol}={prefix}_{symbol}" for symbol in symbols]


def exported_functions(nm: str, path: Path) -> set[str]:
    """Global functions an object defines (nm type T)."""
    listing = subprocess.run([nm, "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    return {fields[2] for fields in map(str.split, listing.splitlines()) if len(fields) == 3 and fields[1] == "T"}


@pytest.mark.parametrize("source", sorted(KERNEL_SYMBOLS))
def test_two_renamed_variants_link_into_one_library(tmp_path, source):
    """Everything but the extern "C" entry points has internal linkage, so two variants never collide."""
    compiler = host_build.host_compiler()
    objects = []
    for prefix in ("first", "second"):
        obj = tmp_path / f"{prefix}.o"
        subprocess.run([compiler, "-O2", "-fPIC", "-std=c++20", "-c", str(host_build.KERNEL_DIR / source),
                        *renamed(KERNEL_SYMBOLS[source], prefix), "-o", str(obj)], check=True)
        objects.append(str(obj))
        if shutil.which("nm"):
            assert exported_functions("nm", obj) == {f"{prefix}_{symbol}" for symbol in KERNEL_SYMBOLS[source]}
    both = tmp_path / "both.so"
    subprocess.run([compiler, "-shared", *objects, "-o", str(both)], check=True, capture_output=True, text=True)
    library = ctypes.CDLL(str(both))
    for prefix in ("first", "second"):
        for symbol in KERNEL_SYMBOLS[source]:
            getattr(library, f"{prefix}_{symbol}")


def peano_toolchain() -> tuple[Path, Path] | None:
    """($PEANO_INSTALL_DIR/bin/clang++, the include dir holding aie_api/aie.hpp), when both are installed."""
    peano, mlir_aie = os.environ.get("PEANO_INSTALL_DIR"), os.environ.get("MLIR_AIE_INSTALL_DIR")
    if not peano or not mlir_aie:
        return None
    clang, include = Path(peano) / "bin" / "clang++", Path(mlir_aie) / "include"
    return (clang, include) if clang.exists() and (include / "aie_api" / "aie.hpp").exists() else None


@pytest.mark.npu
@pytest.mark.skipif(peano_toolchain() is None,
                    reason="Peano and the AIE API headers are not installed (PEANO_INSTALL_DIR, MLIR_AIE_INSTALL_DIR)")
@pytest.mark.parametrize("source", sorted(KERNEL_SYMBOLS))
def test_aie_path_compiles_with_peano(tmp_path, source):
    """The AIE path, as the compile pipeline builds it, with its entry points renamed as a second variant would be."""
    clang, include = peano_toolchain()
    obj = tmp_path / "kernel.o"
    subprocess.run([str(clang), "-O2", "-std=c++20", "--target=aie2p-none-unknown-elf", "-DNDEBUG", f"-I{include}",
                    *renamed(KERNEL_SYMBOLS[source], "variant"), "-c", str(host_build.KERNEL_DIR / source),
                    "-o", str(obj)], check=True)
    nm = clang.parent / "llvm-nm"
    nm = str(nm) if nm.exists() else shutil.which("llvm-nm")
    if nm is None:
        pytest.skip("compiled; no llvm-nm to list the object's symbols")
    assert exported_functions(nm, obj) == {f"variant_{symbol}" for symbol in KERNEL_SYMBOLS[source]}
