"""Integer prefill GEMMs with int8 weights, the one definition of their numerics: what a GEMM of matmul
precision "int8" (W8A8), "w8a16" (int8 weights, int16 activations) or "w8x2a16" (two int8 terms per weight, int16
activations) computes, bit for bit.

* Weights (N × K, HF's layout): per output channel (row of W), symmetric. ``scale = absmax / 127`` in fp32,
  ``q = clamp(rint(w · fp32(127 / absmax)), −127, 127)`` with the product rounded to fp32 and rint rounding half
  to even. A row of zeros has scale 0 and q 0. Done once, when the weights are prepared.
* Activations (M × K): per row (token), symmetric, the same formula with ``qmax`` instead of 127, on the device
  before the GEMM. "int8": qmax 127. "w8a16" and "w8x2a16": the largest qmax ≤ 32767 for which no int32 sum of K
  products can overflow, ``(2^31 − 1) // (127 · K)`` (K = 576: 29354; K = 2048: 8256; K = 8192: 2064), so the int32
  accumulator is exact whatever the values.
* ``acc = Σ_k qa · qw`` exactly in int32 (never overflows: 127 · 127 · K < 2^31 for K < 133,144 at W8A8, and by
  the choice of qmax at W8A16); ``out = bf16(fp32(acc) · fp32(scale_a · scale_w))``: the int32 → fp32 and bf16
  conversions and both products round to nearest even.

"w8x2a16", two int8 terms per weight under the one per-channel scale: with ``x = fp32(w · fp32(127 / absmax))`` (the
product the int8 weight rounds), ``hi = clamp(rint(x), −127, 127)`` (the "w8a16" weight) and
``lo = clamp(rint(256 · (x − hi)), −127, 127)``: ``x − hi`` is exact in fp32 (hi is x's nearest integer, or 127 a
rounding away) and the product by 256 exact, so x = hi + lo / 256 to within 1 / 512, or 1 / 256 where x is exactly
halfway (its ±0.5 residual clamps to ±127/256). Two int32 accumulators over the same quantized activations,
``acc_hi = Σ qa · hi`` and ``acc_lo = Σ qa · lo``, each exact by W8A16's bound (|lo| ≤ 127 as |hi|);
``out = bf16((fp32(acc_hi) + fp32(acc_lo) · 2⁻⁸) · fp32(scale_a · scale_w))``: both conversions, the sum, both
products and the bf16 conversion round to nearest even; the product by 2⁻⁸ is exact.

Non-finite inputs are outside the definition (their absmax is not finite). Measured against fp32 and bf16 runs
in README, "Matmul precision".
"""
from __future__ import annotations

import torch

WEIGHT_QMAX = 127
ACTIVATION_BITS = {"int8": 8, "w8a16": 16, "w8x2a16": 16}
WEIGHT_TERMS = {"int8": 1, "w8a16": 1, "w8x2a16": 2}
LO_SHIFT = 8  # the second weight term's weight: 2^-LO_SHIFT
INT32_MAX = 2 ** 31 - 1


def activation_qmax(precision: str, K: int) -> int:
    """The largest |quantized activation| of a GEMM over K at ``precision``."""
    if precision == "int8":
        return 127
    if precision in ("w8a16", "w8x2a16"):
        return min(2 ** 15 - 1, INT32_MAX // (WEIGHT_QMAX * K))
    raise ValueError(f"activation_qmax: precision must be one of {', '.join(map(repr, ACTIVATION_BITS))}, "
                     f"got {precision!r}")


def quantize_rows(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: each row of ``x`` (bf16 or fp32, last dimension K) as integers in [−qmax, qmax] (int32
    tensor) and its fp32 scale (shape ``x.shape[:-1] + (1,)``), with x ≈ q · scale."""
    scaled, scale = _scaled_rows(x, qmax)
    return torch.clamp(torch.round(scaled), -qmax, qmax).to(torch.int32), scale


def _scaled_rows(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp32(x · fp32(qmax / absmax)), absmax / qmax)`` per row: the values quantize_rows rounds, and the scale."""
    x = x.float()
    absmax = x.abs().amax(-1, keepdim=True)
    inverse = torch.where(absmax > 0, torch.tensor(float(qmax)) / absmax, torch.zeros_like(absmax))
    return x * inverse, absmax / qmax


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (N × K) per output channel: int8 values and fp32 scales of shape (N,)."""
    q, scale = quantize_rows(w, WEIGHT_QMAX)
    return q.to(torch.int8), scale.reshape(-1)


def quantize_weight_terms(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W (N × K) as "w8x2a16" holds it: ``(hi, lo, scale)``, hi and lo int8 (N × K), fp32 scales (N,);
    hi and scale are ``quantize_weight``'s."""
    scaled, scale = _scaled_rows(w, WEIGHT_QMAX)
    hi = torch.clamp(torch.round(scaled), -WEIGHT_QMAX, WEIGHT_QMAX)
    lo = torch.clamp(torch.round((scaled - hi) * 2.0 ** LO_SHIFT), -WEIGHT_QMAX, WEIGHT_QMAX)
    return hi.to(torch.int8), lo.to(torch.int8), scale.reshape(-1)


def prepared_weight(w: torch.Tensor, precision: str) -> tuple[torch.Tensor, ...]:
    """W as a GEMM at ``precision`` takes it: ``(q, scale)``, or ``(hi, lo, scale)`` for "w8x2a16"."""
    if WEIGHT_TERMS[precision] == 2:
        return quantize_weight_terms(w)
    return quantize_weight(w)


def integer_gemm(a: torch.Tensor, *weight: torch.Tensor, precision: str) -> torch.Tensor:
    """bf16 ``A · Wᵀ`` of the quantized GEMM: A (M × K, bf16) quantized per row at ``precision``, ``weight`` as
    ``prepared_weight`` gives it: int8 (N × K) terms (one, or hi and lo for "w8x2a16"), then fp32 scales (N,)."""
    *terms, scale_w = weight
    if len(terms) != WEIGHT_TERMS[precision]:
        raise ValueError(f"integer_gemm: {precision!r} takes {WEIGHT_TERMS[precision]} weight term(s), "
                         f"got {len(terms)}")
    qa, scale_a = quantize_rows(a, activation_qmax(precision, a.shape[-1]))
    # Integer sums below 2^31 are exact in fp64 (products and partial sums stay under 2^53), and fp64 → fp32
    # rounds to nearest even like the core's int32 → fp32 conversion.
    acc = torch.matmul(qa.double(), terms[0].double().T).float()
    if len(terms) == 2:
        acc = acc + torch.matmul(qa.double(), terms[1].double().T).float() * 2.0 ** -LO_SHIFT
    return (acc * (scale_a * scale_w.reshape(1, -1))).to(torch.bfloat16)
