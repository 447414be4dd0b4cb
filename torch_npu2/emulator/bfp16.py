"""AIE2P's bf16 → bfp16ebs8 conversion on torch tensors: what a GEMM built with BFP16 emulation multiplies.

Blocks of 8 consecutive values along the last dimension (a GEMM operand's K) share the largest exponent
field of the block; each value keeps floor(significand / 2^(17 + shared − own exponent)), a signed 8-bit
mantissa, worth ``mantissa · 2^(shared − 133)``. The facts, their sources and the edge cases (zeros,
subnormals, inf/NaN) are written down once, in ``kernels/aie2p/bfp16.h``, the host model this function
agrees with bit for bit (tests/kernels/test_bfp16.py).
"""
from __future__ import annotations

import torch

BLOCK = 8
_NON_FINITE_EXPONENT = 0xFF


def quantize_bf16_to_bfp16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (bf16, last dimension a multiple of 8) as bfp16ebs8 represents it, in bf16 (every converted
    value is exactly a bf16 value, so bf16 × bf16 → fp32 products of converted operands stay exact)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"quantize_bf16_to_bfp16: x must be a torch.bfloat16 tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"quantize_bf16_to_bfp16: x's last dimension must be a multiple of {BLOCK}, "
                         f"got shape {tuple(x.shape)}")
    bits = x.view(torch.int16).to(torch.int32) << 16  # the fp32 bit pattern of each bf16 value
    exponent = (bits >> 23) & 0xFF
    significand = (bits & 0x7FFFFF) | ((exponent != 0).to(torch.int32) << 23)
    signed_significand = torch.where(bits < 0, -significand, significand)
    blocks = exponent.unflatten(-1, (-1, BLOCK))
    shared = blocks.amax(-1, keepdim=True)
    # |signed_significand| < 2^24: shifting by 31 already gives the floor's 0 or -1.
    mantissa = signed_significand >> (17 + shared - blocks).clamp(max=31).flatten(-2)
    shared = shared.expand_as(blocks).flatten(-2)
    # 2^(shared - 133) as fp32 bits: a normal number from shared = 7 up, a subnormal below. |mantissa| < 2^7,
    # so the product, and then its bf16 rounding, are exact.
    scale = torch.where(shared >= 7, (shared - 6) << 23, 1 << (shared + 16).clamp(max=30)).view(torch.float32)
    converted = (mantissa.float() * scale).to(torch.bfloat16)
    return torch.where(exponent == _NON_FINITE_EXPONENT, x, converted)
