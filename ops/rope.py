"""The layout of the ``rope_lut`` argument of npu2.rms_gemms_rope and npu2.rms_gemv_rope.

One row per position, ``[cos_0 .. cos_{d/2-1}, sin_0 .. sin_{d/2-1}]``: half-split RoPE (HF's
``rotate_half``), so each half of HF's cos/sin is stored once. The patched layers build it on every forward
from the model's own rotary embedding (llama3 rope scaling included), which puts it on the op path.
"""
from __future__ import annotations

import torch


def build_rope_lut(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """LUT rows from HF's rotary embedding outputs (..., head_dim), whose two halves repeat."""
    half = cos.shape[-1] // 2
    return torch.cat((cos[..., :half], sin[..., :half]), -1)
