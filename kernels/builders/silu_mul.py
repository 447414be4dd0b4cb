"""silu_mul(rows, cols): ``out = silu(gate) * up`` (SwiGLU), through the external ``silu_mul_bf16``.

Schedule: see rowwise.py — chunks of each row spread over a row-parallel herd, DDR → L1 → DDR; one
kernel call per chunk (silu_mul.o built with SILU_MUL_LEN = chunk).

Constraints: as add (rowwise.py): cols and chunk multiples of 16, herd dividing the chunk count, three
double-buffered chunks in L1.
"""
from __future__ import annotations

from .ir import LaunchBuilder, LaunchIR, Value
from .rowwise import ChunkPlan, build_binary

KIND = "silu_mul"
PARAMS = ("rows", "cols")
TUNING = ("herd", "chunk")
OBJECT = "silu_mul.o"


def _silu_mul_chunk(b: LaunchBuilder, plan: ChunkPlan, gate: Value, up: Value, out: Value) -> None:
    b.call("silu_mul_bf16", [gate, up, out], {"SILU_MUL_LEN": plan.chunk})


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    return build_binary(KIND, ("gate", "up", "out"), params, operands, tuning, _silu_mul_chunk, link_with=OBJECT)
