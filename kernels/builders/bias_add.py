"""bias_add(rows, cols): ``out[r] = x[r] + bias`` (a projection's bias, Qwen2's q/k/v), 16-lane bf16 vector code.

A launch of its own after the projection, not the GEMM's epilogue: a GEMM tile's two input channels already carry
the activations and the weights, and a third stream for the bias is a routing aiecc refuses. Rounding: the
projection rounds to bf16 and the sum rounds again, where HF's bf16 ``F.linear`` rounds once.

Schedule: add's (rowwise.py), the bias one row that every row of x reads: a tile holding whole rows loads it once.
"""
from __future__ import annotations

from .add import add_chunk
from .ir import LaunchIR
from .rowwise import build_binary

KIND = "bias_add"
PARAMS = ("rows", "cols")
TUNING = ("herd", "chunk")


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    return build_binary(KIND, ("x", "bias", "out"), params, operands, tuning, add_chunk, row_rhs=True)
