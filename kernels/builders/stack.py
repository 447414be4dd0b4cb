"""stack(rows, cols): ``out[i] = inputs[i]`` for the launch's two (rows, cols) inputs, out (2, rows, cols).

It gathers a layer's keys and values into one buffer so that attention can fetch each key/value block with
one DMA: a compute tile has two input DMA channels, and attention needs one of them for queries.

Schedule: see rowwise.py — chunks of each row spread over a row-parallel herd; every chunk goes DDR → L1 →
DDR unchanged (no compute).

Constraints: as add (rowwise.py): cols and chunk multiples of 16, herd dividing rows, two
double-buffered chunks in L1.
"""
from __future__ import annotations

from .ir import L1, WHOLE, LaunchBuilder, LaunchIR, MemRef, Window, rows_window
from .npu2 import check_operands
from .rowwise import chunk_loop, l1_bytes, plan_chunks

KIND = "stack"
PARAMS = ("rows", "cols")
TUNING = ("herd", "chunk")


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    rows, cols = params["rows"], params["cols"]
    check_operands(KIND, operands, [("first", {(rows, cols)}, "bf16"), ("second", {(rows, cols)}, "bf16"),
                                    ("out", {(2, rows, cols)}, "bf16")])
    plan = plan_chunks(KIND, rows, cols, tuning, live_buffers=2)

    b = LaunchBuilder(KIND, operands, ("first", "second", "out"))
    b.comment(f"stack rows={rows} cols={cols}: herd {plan.herd}x1, {plan.chunks_per_tile} chunks of {plan.chunk} "
              f"per row per tile")
    with b.launch("stack", (1, 1), b.operands) as (_, _, launch_args):
        with b.segment("stack_seg", launch_args) as (_, _, segment_args):
            with b.herd("stack_herd", (plan.herd, 1), segment_args) as ((tx, _), _, (first, second, out)):
                buffers = [b.alloc(MemRef((plan.chunk,), "bf16", L1), f"{name}_l1") for name in ("first", "second")]
                with chunk_loop(b, plan, tx) as (row, col):
                    for index, (source, buffer) in enumerate(zip((first, second), buffers)):
                        b.dma(buffer, WHOLE, source, rows_window(source.type, row, 1, col, plan.chunk))
                        b.dma(out, Window((index, row, col), (1, 1, plan.chunk), (rows * cols, cols, 1)), buffer,
                              WHOLE)
                b.dealloc(*buffers)
    return b.finish(l1_bytes(plan, live_buffers=2))
