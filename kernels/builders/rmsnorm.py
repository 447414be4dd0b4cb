"""rmsnorm(rows, cols, eps): ``out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w``.

Schedule: a row-parallel herd of up to 8 tiles (one per column), each normalizing its contiguous block of
rows one row at a time. Rows are not reused, so they stream DDR → L1 directly (no memtile staging); the
weight row is loaded once per tile and stays resident (one broadcast stream for the herd).

Compute is vector code (16 lanes): squares in bf16, widened to f32 and summed in an f32 L1 accumulator,
the statistic ``rsqrt(mean + eps)`` in f32, the scaling ``(x * rstd) * w`` in bf16 (HF's order). The
square makes a round trip through the output row (overwritten by the scaling afterwards) and the
accumulator lives in memory, not in a loop-carried vector: AIE vector legalization rejects an f32 add fed
straight by the multiply and splits loop-carried wide vectors. A scratch buffer used only inside the
square loop would make AIR 0e3df89d double-buffer that inner loop as well as the row loop, which its
ping-pong transform cannot do (fixed upstream in mlir-air #1626). f32 vector multiplies do not legalize
either, so rstd is rounded to bf16 before scaling, where HF scales in f32: up to half a bf16 ulp of extra
relative error per row.

Constraints: cols a multiple of 16; herd (default: the largest of 8, 4, 2, 1 dividing rows) divides rows;
double-buffered x and out rows plus the weight row fit L1 (cols up to about 6400).
"""
from __future__ import annotations

from ..device import DEVICE
from .ir import L1, WHOLE, LaunchBuilder, LaunchIR, MemRef, Window, rows_window
from .npu2 import check_budget, check_operands, largest_dividing, nbytes, pingpong_copies, require, row_shapes

KIND = "rmsnorm"
PARAMS = ("rows", "cols", "eps")
TUNING = ("herd",)


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    rows, cols, eps = params["rows"], params["cols"], float(params["eps"])
    check_operands(KIND, operands, [("x", row_shapes(rows, cols), "bf16"), ("weight", {(cols,)}, "bf16"),
                                    ("out", row_shapes(rows, cols), "bf16")])
    require(cols % DEVICE.vector_lanes == 0, KIND, "cols", cols,
            f"must be a multiple of {DEVICE.vector_lanes} (vector lanes)")
    herd = tuning.get("herd", largest_dividing(rows, DEVICE.herd_candidates))
    require(herd <= DEVICE.columns, KIND, "herd", herd, f"a row-parallel herd spans at most {DEVICE.columns} columns")
    require(rows % herd == 0, KIND, "herd", herd, f"must divide rows={rows}")
    row_bytes, copies = nbytes((cols,), "bf16"), pingpong_copies(rows // herd)
    # the accumulator is zeroed in every trip of the row loop, so the ping-pong transform copies it like the rows
    l1 = {f"x row x{copies} (ping-pong)": copies * row_bytes, f"out row x{copies}": copies * row_bytes,
          "weight": row_bytes, f"f32 accumulator x{copies}": copies * nbytes((DEVICE.vector_lanes,), "f32")}
    check_budget(KIND, "L1", l1, "cols is too wide to normalize a row in one tile")

    b = LaunchBuilder(KIND, operands, ("x", "weight", "out"))
    b.comment(f"rmsnorm rows={rows} cols={cols} eps={eps}: herd {herd}x1, {rows // herd} rows per tile")
    with b.launch("rmsnorm", (1, 1), b.operands) as (_, _, launch_args):
        with b.segment("rmsnorm_seg", launch_args) as (_, _, segment_args):
            with b.herd("rmsnorm_herd", (herd, 1), segment_args) as ((tx, _), _, (x, weight, out)):
                _emit_tile(b, x, weight, out, tx, rows // herd, cols, eps)
    return b.finish(l1)


def _emit_tile(b: LaunchBuilder, x, weight, out, tx, rows_per_tile, cols, eps) -> None:
    row_type = MemRef((cols,), "bf16", L1)
    w_buf = b.alloc(row_type, "w_l1")
    x_buf = b.alloc(row_type, "x_l1")
    out_buf = b.alloc(row_type, "out_l1")
    acc = b.alloc(MemRef((DEVICE.vector_lanes,), "f32", L1), "sumsq_l1")
    b.broadcast_dma(w_buf, WHOLE, weight, Window((0,), (cols,), (1,)))
    bf16_vec, f32_vec = f"vector<{DEVICE.vector_lanes}xbf16>", f"vector<{DEVICE.vector_lanes}xf32>"
    with b.loop(0, rows_per_tile, 1, "r") as r:
        row = b.affine(f"s0 * {rows_per_tile} + s1", [tx, r], "row") if len(x.type.shape) == 2 else 0
        b.dma(x_buf, WHOLE, x, rows_window(x.type, row, 1, 0, cols))
        c0 = b.const(0)
        zeros = b.assign("zeros", f"vector.broadcast {b.const(0.0, 'f32')} : f32 to {f32_vec}", f32_vec)
        b.vector_write(zeros, acc, c0)
        with b.loop(0, cols, DEVICE.vector_lanes, "j") as j:
            v = b.vector_read(x_buf, j, DEVICE.vector_lanes, "xv")
            square = b.assign("sq", f"arith.mulf {v.ssa}, {v.ssa} : {bf16_vec}", bf16_vec)
            b.vector_write(square, out_buf, j)
            reread = b.vector_read(out_buf, j, DEVICE.vector_lanes, "sqv")
            wide = b.assign("sqf", f"arith.extf {reread.ssa} : {bf16_vec} to {f32_vec}", f32_vec)
            running = b.vector_read(acc, c0, DEVICE.vector_lanes, "accv")
            total = b.assign("accn", f"arith.addf {running.ssa}, {wide.ssa} : {f32_vec}", f32_vec)
            b.vector_write(total, acc, c0)
        sums = b.vector_read(acc, c0, DEVICE.vector_lanes, "sums")
        sumsq = b.assign("sumsq", f"vector.reduction <add>, {sums.ssa} : {f32_vec} into f32", "f32")
        mean = b.assign("mean", f"arith.mulf {sumsq.ssa}, {b.const(1.0 / cols, 'f32')} : f32", "f32")
        shifted = b.assign("var_eps", f"arith.addf {mean.ssa}, {b.const(eps, 'f32')} : f32", "f32")
        rstd = b.assign("rstd", f"math.rsqrt {shifted.ssa} : f32", "f32")
        rstd_bf16 = b.assign("rstd_bf16", f"arith.truncf {rstd.ssa} : f32 to bf16", "bf16")
        scale = b.assign("rstd_v", f"vector.broadcast {rstd_bf16.ssa} : bf16 to {bf16_vec}", bf16_vec)
        with b.loop(0, cols, DEVICE.vector_lanes, "j") as j:
            xv = b.vector_read(x_buf, j, DEVICE.vector_lanes, "xv")
            wv = b.vector_read(w_buf, j, DEVICE.vector_lanes, "wv")
            normed = b.assign("normed", f"arith.mulf {xv.ssa}, {scale.ssa} : {bf16_vec}", bf16_vec)
            weighted = b.assign("y", f"arith.mulf {normed.ssa}, {wv.ssa} : {bf16_vec}", bf16_vec)
            b.vector_write(weighted, out_buf, j)
        b.dma(out, rows_window(out.type, row, 1, 0, cols), out_buf, WHOLE)
    b.dealloc(w_buf, x_buf, out_buf, acc)
