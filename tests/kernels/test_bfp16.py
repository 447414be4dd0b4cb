"""bf16 → bfp16ebs8: the host model (kernels/aie2p/bfp16.h, built by g++ through bfp16_convert.cc) and the
emulator's torch version (torch_npu2/emulator/bfp16.py) agree bit for bit, and both give the values the
format's definition gives on hand-worked blocks."""
from __future__ import annotations

import ctypes

import pytest
import torch

from torch_npu2.emulator.bfp16 import quantize_bf16_to_bfp16
from torch_npu2.kernels import host_build

needs_host_compiler = pytest.mark.skipif(host_build.host_compiler() is None,
                                         reason="no host C++ compiler (g++): bfp16.h's host model cannot be built")


def host_quantize(x: torch.Tensor) -> torch.Tensor:
    """bfp16_quantize_bf16 over a bf16 tensor whose size is a multiple of 8; float32 out."""
    x = x.detach().contiguous()
    kernel = host_build.load("bfp16_convert.cc").bfp16_quantize_bf16
    kernel.argtypes, kernel.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32], None
    out = torch.empty(x.shape, dtype=torch.float32)
    kernel(x.data_ptr(), out.data_ptr(), x.numel() // 8)
    return out


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)


def from_bits(values) -> torch.Tensor:
    """bf16 tensor from 16-bit patterns."""
    return torch.tensor(values, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def hard_operands() -> torch.Tensor:
    """Blocks of 8 that exercise every rule: random magnitudes, exact ties at the truncation point, zeros of
    both signs, mixed exponents up to beyond the 8-bit mantissa's reach, subnormals, all-subnormal blocks,
    the largest finite values, inf and NaN."""
    g = torch.Generator().manual_seed(14)
    cases = [
        torch.randn(4096, generator=g),                                       # LLM-like activations
        torch.randn(4096, generator=g) * torch.exp2(torch.randint(-40, 40, (4096,), generator=g).float()),
        torch.randn(4096, generator=g) * 1e-3,
    ]
    blocks = []
    # Ties: with a block max of 1.0 a mantissa step is 2^-6; k/2 steps sit exactly halfway.
    blocks += [[1.0] + [(k + 0.5) * 2.0 ** -6 * s for k in range(7)] for s in (1, -1)]
    blocks += [[0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0], [1.0, -0.0, 0.0, -1.0, 2.0 ** -40, -2.0 ** -40, 0, 0]]
    blocks += [[-1.0, 1.0, -0.5, 0.5, -0.25, 0.25, -2.0 ** -7, 2.0 ** -7],          # exact and truncated powers
               [1.9921875, -1.9921875, 1.0078125, -1.0078125, 3.0, -3.0, 0.75, -0.75]]
    blocks += [[2.0 ** e * s for e in range(0, 64, 8)] for s in (1, -1)]           # one value per shift range
    cases += [torch.tensor(blocks, dtype=torch.float32).flatten()]
    subnormal = from_bits([0x0001, 0x8001, 0x007F, 0x807F, 0x0040, 0x8040, 0x0000, 0x8000])  # all-subnormal
    mixed_subnormal = from_bits([0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x8080, 0x3F80, 0x0000])
    extremes = from_bits([0x7F7F, 0xFF7F, 0x0080, 0x8080, 0x3F80, 0xBF80, 0x7F00, 0x0001])
    non_finite = from_bits([0x7F80, 0xFF80, 0x7FC0, 0x3F80, 0xBF80, 0x0000, 0x4000, 0xC000])
    random_bits = torch.randint(-32768, 32767, (8192,), generator=g, dtype=torch.int32).to(torch.int16)
    # every bf16 bit pattern, in blocks of neighbours and shuffled into blocks of strangers
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    shuffled = every[torch.randperm(every.numel(), generator=g)]
    return torch.cat([*(c.to(torch.bfloat16) for c in cases), subnormal, mixed_subnormal, extremes, non_finite,
                      random_bits.view(torch.bfloat16), every.view(torch.bfloat16), shuffled.view(torch.bfloat16)])


@needs_host_compiler
def test_host_model_and_emulator_agree_bit_for_bit():
    x = hard_operands()
    host, emulated = host_quantize(x), quantize_bf16_to_bfp16(x).float()
    nan = host.isnan()
    assert torch.equal(nan, emulated.isnan())
    mismatch = (bits(host) != bits(emulated)) & ~nan
    first = int(mismatch.nonzero()[0]) if mismatch.any() else None
    assert first is None, (f"{int(mismatch.sum())} of {x.numel()} values differ; first at {first} "
                           f"(block {x[first // 8 * 8:first // 8 * 8 + 8].tolist()}): host {host[first].item()!r}, "
                           f"emulator {emulated[first].item()!r}")


@needs_host_compiler
def test_host_model_reports_a_wrong_conversion():
    """The bit-for-bit comparison above can fail: round-to-nearest instead of truncation is caught."""
    x = torch.tensor([1.0] + [(k + 0.75) * 2.0 ** -6 for k in range(7)], dtype=torch.bfloat16)
    nearest = torch.round(x.float() * 64) / 64
    assert not torch.equal(bits(host_quantize(x)), bits(nearest))


@pytest.mark.parametrize("block, expected", [
    # A block max of 1.0 (exponent 127): a mantissa step is 2^-6, values truncate towards minus infinity.
    ([1.0, 0.5, 0.3, -0.3, 0.01, -0.01, 1.99, -2.0],
     # the max is -2.0 (exponent 128): step 2^-5; 1.99 -> 63/32, -0.01 -> -1/32, 0.01 -> 0
     [1.0, 0.5, 9 / 32, -10 / 32, 0.0, -1 / 32, 63 / 32, -2.0]),
    ([3.0, 0.0, -0.0, 1.0, -1.0, 2 ** -10, -(2 ** -10), 2 ** -100],
     [3.0, 0.0, 0.0, 1.0, -1.0, 0.0, -(2 ** -5), 0.0]),
])
def test_emulator_conversion_matches_hand_worked_blocks(block, expected):
    x = torch.tensor(block, dtype=torch.bfloat16)
    assert quantize_bf16_to_bfp16(x).float().tolist() == expected


def test_conversion_rejects_bad_operands():
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_bf16_to_bfp16(torch.zeros(2, 12, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="torch.bfloat16"):
        quantize_bf16_to_bfp16(torch.zeros(8))
