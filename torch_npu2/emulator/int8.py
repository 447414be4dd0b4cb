"""Integer prefill GEMMs with int8 weights, the one definition of their numerics: what a GEMM of matmul
precision "int8" (W8A8) or "w8a16" (int8 weights, int16 activations) computes, bit for bit.

* Weights (N × K, HF's layout): per output channel (row of W), symmetric. ``scale = absmax / 127`` in fp32,
  ``q = clamp(rint(w · fp32(127 / absmax)), −127, 127)`` with the product rounded to fp32 and rint rounding half
  to even. A row of zeros has scale 0 and q 0. Done once, when the weights are prepared.
* Activations (M × K): per row (token), symmetric, the same formula with ``qmax`` instead of 127, on the device
  before the GEMM. "int8": qmax 127. "w8a16": the largest qmax ≤ 32767 for which no int32 sum of K products
  can overflow, ``(2^31 − 1) // (127 · K)`` (K = 576: 29354; K = 2048: 8256; K = 8192: 2064), so the int32
  accumulator is exact whatever the values.
* ``acc = Σ_k qa · qw`` exactly in int32 (never overflows: 127 · 127 · K < 2^31 for K < 133,144 at W8A8, and by
  the choice of qmax at W8A16); ``out = bf16(fp32(acc) · fp32(scale_a · scale_w))``: the int32 → fp32 and bf16
  conversions and both products round to nearest even.

Non-finite inputs are outside the definition (their absmax is not finite). Measured against fp32 and bf16 runs
in README, "Matmul precision".
"""
from __future__ import annotations

import torch

WEIGHT_QMAX = 127
ACTIVATION_BITS = {"int8": 8, "w8a16": 16}
INT32_MAX = 2 ** 31 - 1


def activation_qmax(precision: str, K: int) -> int:
    """The largest |quantized activation| of a GEMM over K at ``precision``."""
    if precision == "int8":
        return 127
    if precision == "w8a16":
        return min(2 ** 15 - 1, INT32_MAX // (WEIGHT_QMAX * K))
    raise ValueError(f"activation_qmax: precision must be one of {', '.join(map(repr, ACTIVATION_BITS))}, "
                     f"got {precision!r}")


def quantize_rows(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: each row of ``x`` (bf16 or fp32, last dimension K) as integers in [−qmax, qmax] (int32
    tensor) and its fp32 scale (shape ``x.shape[:-1] + (1,)``), with x ≈ q · scale."""
    x = x.float()
    absmax = x.abs().amax(-1, keepdim=True)
    inverse = torch.where(absmax > 0, torch.tensor(float(qmax)) / absmax, torch.zeros_like(absmax))
    q = torch.clamp(torch.round(x * inverse), -qmax, qmax).to(torch.int32)
    return q, absmax / qmax


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (N × K) per output channel: int8 values and fp32 scales of shape (N,)."""
    q, scale = quantize_rows(w, WEIGHT_QMAX)
    return q.to(torch.int8), scale.reshape(-1)


def integer_gemm(a: torch.Tensor, qw: torch.Tensor, scale_w: torch.Tensor, precision: str) -> torch.Tensor:
    """bf16 ``A · Wᵀ`` of the quantized GEMM: A (M × K, bf16) quantized per row at ``precision``, W as
    ``quantize_weight`` gives it (int8 (N × K), fp32 scales (N,))."""
    qa, scale_a = quantize_rows(a, activation_qmax(precision, a.shape[-1]))
    # Integer sums below 2^31 are exact in fp64 (products and partial sums stay under 2^53), and fp64 → fp32
    # rounds to nearest even like the core's int32 → fp32 conversion.
    acc = torch.matmul(qa.double(), qw.double().T).float()
    return (acc * (scale_a * scale_w.reshape(1, -1))).to(torch.bfloat16)
