"""add(rows, cols): ``out = a + b`` elementwise (the residual adds), 16-lane bf16 vector code.

Schedule: see rowwise.py — chunks of each row spread over a row-parallel herd, DDR → L1 → DDR.

Constraints: cols a multiple of 16; chunk a multiple of 16 dividing cols; herd divides the chunk count;
three double-buffered chunks fit L1.
"""
from __future__ import annotations

from ..device import DEVICE
from .ir import LaunchBuilder, LaunchIR, Value
from .rowwise import ChunkPlan, build_binary

KIND = "add"
PARAMS = ("rows", "cols")
TUNING = ("herd", "chunk")


def add_chunk(b: LaunchBuilder, plan: ChunkPlan, lhs: Value, rhs: Value, out: Value) -> None:
    vec = f"vector<{DEVICE.vector_lanes}xbf16>"
    with b.loop(0, plan.chunk, DEVICE.vector_lanes, "j") as j:
        av = b.vector_read(lhs, j, DEVICE.vector_lanes, "av")
        bv = b.vector_read(rhs, j, DEVICE.vector_lanes, "bv")
        total = b.assign("sum", f"arith.addf {av.ssa}, {bv.ssa} : {vec}", vec)
        b.vector_write(total, out, j)


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    return build_binary(KIND, ("a", "b", "out"), params, operands, tuning, add_chunk)
