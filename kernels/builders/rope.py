"""rope(rows, heads, head_dim): half-split rotary embedding through the external ``rope_half_split_bf16``.

``x`` is (rows, heads*head_dim) seq-first; the LUT is (rows, head_dim), one row per position
``[cos_0..cos_{d/2-1}, sin_0..sin_{d/2-1}]`` shared by every head of that row.

Schedule: a row-parallel herd of up to 8 tiles, each taking a contiguous block of rows ``tile_rows`` at a
time (x rows and their LUT rows DDR → L1, one kernel call, result L1 → DDR). Nothing is reused across
tiles, so there is no memtile staging. rope.o is built for (tile_rows, heads, head_dim).

Constraints: head_dim a multiple of 32 (each half whole 16-lane vectors); herd divides rows; tile_rows
divides each tile's rows; double-buffered x, out and LUT rows fit L1.

rope_qk(heads, kv_heads, head_dim): a decode token's Q and K rows rotated in one launch (one position, one LUT
row), so a decode layer enters one rope device instead of two (kernels/timing.py: each launch is a device of its
own). Its input is the row [q | k] the Q and K projection writes (kernels/catalog.py: one GEMV over [Wq; Wk]); the
segment stages it in a memtile buffer, one tile takes it with one stream and the LUT row with its other (a compute
tile has two input channels), rotates all heads + kv_heads heads in one call, and writes the rotated Q and K rows
out over its two output channels.
"""
from __future__ import annotations

from ..device import DEVICE
from .ir import L1, L2, WHOLE, LaunchBuilder, LaunchIR, MemRef, Window, rows_window
from .npu2 import (L1_AVAILABLE, check_budget, check_operands, largest_dividing, nbytes, pingpong_copies, require,
                   row_shapes)

KIND = "rope"
PARAMS = ("rows", "heads", "head_dim")
TUNING = ("herd", "tile_rows")
OBJECT = "rope.o"
TILE_ROWS_CANDIDATES = (4, 2, 1)
QK_KIND = "rope_qk"
QK_PARAMS = ("heads", "kv_heads", "head_dim")
QK_TUNING = ()


def _l1_bytes(tile_rows: int, width: int, head_dim: int, rows_per_tile: int) -> dict[str, int]:
    copies = pingpong_copies(rows_per_tile // tile_rows)
    return {f"x rows x{copies} (ping-pong)": copies * nbytes((tile_rows, width), "bf16"),
            f"out rows x{copies}": copies * nbytes((tile_rows, width), "bf16"),
            f"lut rows x{copies}": copies * nbytes((tile_rows, head_dim), "bf16")}


def _check_head_dim(kind: str, head_dim: int) -> None:
    require(head_dim % (2 * DEVICE.vector_lanes) == 0, kind, "head_dim", head_dim,
            f"must be a multiple of {2 * DEVICE.vector_lanes} so each rotated half is whole "
            f"{DEVICE.vector_lanes}-lane vectors")


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    rows, heads, head_dim = params["rows"], params["heads"], params["head_dim"]
    width = heads * head_dim
    check_operands(KIND, operands, [("x", row_shapes(rows, width), "bf16"),
                                    ("lut", row_shapes(rows, head_dim), "bf16"),
                                    ("out", row_shapes(rows, width), "bf16")])
    _check_head_dim(KIND, head_dim)
    herd = tuning.get("herd", largest_dividing(rows, DEVICE.herd_candidates))
    require(herd <= DEVICE.columns, KIND, "herd", herd, f"a row-parallel herd spans at most {DEVICE.columns} columns")
    require(rows % herd == 0, KIND, "herd", herd, f"must divide rows={rows}")
    rows_per_tile = rows // herd
    if "tile_rows" in tuning:
        tile_rows = tuning["tile_rows"]
        require(rows_per_tile % tile_rows == 0, KIND, "tile_rows", tile_rows,
                f"must divide the {rows_per_tile} rows each tile owns")
    else:
        fitting = [t for t in TILE_ROWS_CANDIDATES
                   if rows_per_tile % t == 0
                   and sum(_l1_bytes(t, width, head_dim, rows_per_tile).values()) <= L1_AVAILABLE]
        tile_rows = fitting[0] if fitting else 1
    l1 = _l1_bytes(tile_rows, width, head_dim, rows_per_tile)
    check_budget(KIND, "L1", l1, "lower tile_rows")

    b = LaunchBuilder(KIND, operands, ("x", "lut", "out"))
    b.comment(f"rope rows={rows} heads={heads} head_dim={head_dim}: herd {herd}x1, {tile_rows} rows per call")
    with b.launch("rope", (1, 1), b.operands) as (_, _, launch_args):
        with b.segment("rope_seg", launch_args) as (_, _, segment_args):
            with b.herd("rope_herd", (herd, 1), segment_args, link_with=OBJECT) as ((tx, _), _, (x, lut, out)):
                x_buf = b.alloc(MemRef((tile_rows * width,), "bf16", L1), "x_l1")
                lut_buf = b.alloc(MemRef((tile_rows * head_dim,), "bf16", L1), "lut_l1")
                out_buf = b.alloc(MemRef((tile_rows * width,), "bf16", L1), "out_l1")
                config = {"ROPE_ROWS": tile_rows, "ROPE_HEADS": heads, "ROPE_HEAD_DIM": head_dim}
                with b.loop(0, rows_per_tile, tile_rows, "r") as r:
                    row = b.affine(f"s0 * {rows_per_tile} + s1", [tx, r], "row") if len(x.type.shape) == 2 else 0
                    b.dma(x_buf, WHOLE, x, rows_window(x.type, row, tile_rows, 0, width))
                    b.dma(lut_buf, WHOLE, lut, rows_window(lut.type, row, tile_rows, 0, head_dim))
                    b.call("rope_half_split_bf16", [x_buf, lut_buf, out_buf], config)
                    b.dma(out, rows_window(out.type, row, tile_rows, 0, width), out_buf, WHOLE)
                b.dealloc(x_buf, lut_buf, out_buf)
    return b.finish(l1)


def build_qk(params: dict, operands, tuning: dict) -> LaunchIR:
    heads, kv_heads, head_dim = params["heads"], params["kv_heads"], params["head_dim"]
    q, kv = heads * head_dim, kv_heads * head_dim
    check_operands(QK_KIND, operands, [("qk", {(q + kv,)}, "bf16"), ("lut", {(head_dim,)}, "bf16"),
                                       ("q_out", {(q,)}, "bf16"), ("k_out", {(kv,)}, "bf16")])
    _check_head_dim(QK_KIND, head_dim)
    width = q + kv
    l1 = {"q and k": nbytes((width,), "bf16"), "lut": nbytes((head_dim,), "bf16"),
          "rotated q and k": nbytes((width,), "bf16")}
    check_budget(QK_KIND, "L1", l1, "fewer heads")

    b = LaunchBuilder(QK_KIND, operands, ("qk", "lut", "q_out", "k_out"))
    b.comment(f"rope_qk heads={heads} kv_heads={kv_heads} head_dim={head_dim}: one tile, one call over "
              f"{heads + kv_heads} heads")
    with b.launch(QK_KIND, (1, 1), b.operands) as (_, _, launch_args):
        with b.segment(f"{QK_KIND}_seg", launch_args) as (_, _, (sqk, slut, sq_out, sk_out)):
            qk = b.alloc(MemRef((width,), "bf16", L2), "qk_l2")
            b.dma(qk, WHOLE, sqk, WHOLE)
            with b.herd(f"{QK_KIND}_herd", (1, 1), [qk, slut, sq_out, sk_out], link_with=OBJECT) as (
                    _, _, (hqk, hlut, hq_out, hk_out)):
                x_buf = b.alloc(MemRef((width,), "bf16", L1), "x_l1")
                lut_buf = b.alloc(MemRef((head_dim,), "bf16", L1), "lut_l1")
                out_buf = b.alloc(MemRef((width,), "bf16", L1), "out_l1")
                b.dma(x_buf, WHOLE, hqk, WHOLE)
                b.dma(lut_buf, WHOLE, hlut, WHOLE)
                b.call("rope_half_split_bf16", [x_buf, lut_buf, out_buf],
                       {"ROPE_ROWS": 1, "ROPE_HEADS": heads + kv_heads, "ROPE_HEAD_DIM": head_dim})
                b.dma(hq_out, WHOLE, out_buf, Window((0,), (q,), (1,)))
                b.dma(hk_out, WHOLE, out_buf, Window((q,), (kv,), (1,)))
                b.dealloc(x_buf, lut_buf, out_buf)
            b.dealloc(qk)
    return b.finish(l1)
