"""silu_mul(rows, cols): ``out = silu(gate) * up`` (SwiGLU), through the external ``silu_mul_bf16``.

Schedule: see rowwise.py — chunks of each row spread over a row-parallel herd, DDR → L1 → DDR; one
kernel call per chunk (silu_mul.o built with SILU_MUL_LEN = chunk).

Constraints: as add (rowwise.py): cols and chunk multiples of 16, herd dividing the chunk count, three
double-buffered chunks in L1.
"""
from __future__ import annotations

from .ir import L1, WHOLE, LaunchBuilder, LaunchIR, MemRef, rows_window
from .npu2 import check_operands, check_params, check_tuning, row_shapes
from .rowwise import chunk_loop, plan_chunks

KIND = "silu_mul"
PARAMS = ("rows", "cols")
TUNING = ("herd", "chunk")
OBJECT = "silu_mul.o"


def build(params: dict, operands, tuning: dict | None = None) -> LaunchIR:
    tuning = dict(tuning or {})
    check_params(KIND, params, PARAMS)
    check_tuning(KIND, tuning, TUNING)
    rows, cols = params["rows"], params["cols"]
    shapes = row_shapes(rows, cols)
    check_operands(KIND, operands, [("gate", shapes, "bf16"), ("up", shapes, "bf16"), ("out", shapes, "bf16")])
    plan = plan_chunks(KIND, rows, cols, tuning, live_buffers=3)

    b = LaunchBuilder(KIND, operands, ("gate", "up", "out"))
    b.comment(f"silu_mul rows={rows} cols={cols}: herd {plan.herd}x1, {plan.chunks_per_tile} chunks of "
              f"{plan.chunk} per {'row per ' if plan.rows_per_tile else ''}tile")
    with b.launch("silu_mul", (1, 1), b.operands) as (_, _, launch_args):
        with b.segment("silu_mul_seg", launch_args) as (_, _, segment_args):
            with b.herd("silu_mul_herd", (plan.herd, 1), segment_args, link_with=OBJECT) as (
                    (tx, _), _, (gate, up, out)):
                chunk_type = MemRef((plan.chunk,), "bf16", L1)
                gate_buf, up_buf, out_buf = (b.alloc(chunk_type, n) for n in ("gate_l1", "up_l1", "out_l1"))
                with chunk_loop(b, plan, tx) as (row, col):
                    b.dma(gate_buf, WHOLE, gate, rows_window(gate.type, row, 1, col, plan.chunk))
                    b.dma(up_buf, WHOLE, up, rows_window(up.type, row, 1, col, plan.chunk))
                    b.call("silu_mul_bf16", [gate_buf, up_buf, out_buf], {"SILU_MUL_LEN": plan.chunk})
                    b.dma(out, rows_window(out.type, row, 1, col, plan.chunk), out_buf, WHOLE)
                b.dealloc(gate_buf, up_buf, out_buf)
    return b.finish()
