"""add(rows, cols): ``out = a + b`` elementwise (the residual adds), 16-lane bf16 vector code.

Schedule: see rowwise.py — chunks of each row spread over a row-parallel herd, DDR → L1 → DDR.

Constraints: cols a multiple of 16; chunk a multiple of 16 dividing cols; herd divides the chunk count;
three double-buffered chunks fit L1.
"""
from __future__ import annotations

from .ir import L1, WHOLE, LaunchBuilder, LaunchIR, MemRef, rows_window
from .npu2 import VECTOR_LANES, check_operands, check_params, check_tuning, row_shapes
from .rowwise import chunk_loop, plan_chunks

KIND = "add"
PARAMS = ("rows", "cols")
TUNING = ("herd", "chunk")


def build(params: dict, operands, tuning: dict | None = None) -> LaunchIR:
    tuning = dict(tuning or {})
    check_params(KIND, params, PARAMS)
    check_tuning(KIND, tuning, TUNING)
    rows, cols = params["rows"], params["cols"]
    shapes = row_shapes(rows, cols)
    check_operands(KIND, operands, [("a", shapes, "bf16"), ("b", shapes, "bf16"), ("out", shapes, "bf16")])
    plan = plan_chunks(KIND, rows, cols, tuning, live_buffers=3)

    b = LaunchBuilder(KIND, operands, ("a", "b", "out"))
    b.comment(f"add rows={rows} cols={cols}: herd {plan.herd}x1, {plan.chunks_per_tile} chunks of "
              f"{plan.chunk} per {'row per ' if plan.rows_per_tile else ''}tile")
    vec = f"vector<{VECTOR_LANES}xbf16>"
    with b.launch("add", (1, 1), b.operands) as (_, _, launch_args):
        with b.segment("add_seg", launch_args) as (_, _, segment_args):
            with b.herd("add_herd", (plan.herd, 1), segment_args) as ((tx, _), _, (lhs, rhs, out)):
                chunk_type = MemRef((plan.chunk,), "bf16", L1)
                lhs_buf, rhs_buf, out_buf = (b.alloc(chunk_type, n) for n in ("a_l1", "b_l1", "out_l1"))
                with chunk_loop(b, plan, tx) as (row, col):
                    b.dma(lhs_buf, WHOLE, lhs, rows_window(lhs.type, row, 1, col, plan.chunk))
                    b.dma(rhs_buf, WHOLE, rhs, rows_window(rhs.type, row, 1, col, plan.chunk))
                    with b.loop(0, plan.chunk, VECTOR_LANES, "j") as j:
                        av = b.vector_read(lhs_buf, j, VECTOR_LANES, "av")
                        bv = b.vector_read(rhs_buf, j, VECTOR_LANES, "bv")
                        total = b.assign("sum", f"arith.addf {av.ssa}, {bv.ssa} : {vec}", vec)
                        b.vector_write(total, out_buf, j)
                    b.dma(out, rows_window(out.type, row, 1, col, plan.chunk), out_buf, WHOLE)
                b.dealloc(lhs_buf, rhs_buf, out_buf)
    return b.finish()
