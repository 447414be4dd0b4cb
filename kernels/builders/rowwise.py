"""Work split shared by the elementwise kinds (add, silu_mul, bias_add): fixed-size chunks of a (rows, cols) array,
and the one builder of the binary kinds (``out = f(lhs, rhs)``), which differ only in what a chunk computes.

Each row is cut into chunks of ``chunk`` elements. Several rows (prefill) go to a row-parallel herd whole:
a tile takes ``rows / herd`` rows and walks each row's chunks. A single row (decode) has its chunks spread
over the herd, so a decode row of 1536 still runs on several tiles. Every chunk streams DDR → L1 and
back; nothing is reused, so there is no memtile staging.

DMA offsets stay affine without floordiv/mod (a row loop around a chunk loop, never one loop over
``row * chunks_per_row + chunk``): AIR 0e3df89d folds a DMA's enclosing loops into its access pattern as
if every offset were linear in the loop indices, and turns floordiv/mod offsets into wrong strides.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from ..device import DEVICE
from .ir import L1, L1_BUFFER_GRANULE, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, rows_window
from .npu2 import (L1_AVAILABLE, LaunchConstraintError, check_budget, check_operands, divisors_descending,
                   l1_elements, nbytes, pingpong_copies, require, row_shapes)

MAX_CHUNK = 2048  # elements per DMA: long enough to amortize a transfer, small enough to double-buffer


@dataclass(frozen=True)
class ChunkPlan:
    herd: int
    chunk: int
    chunks_per_row: int
    rows_per_tile: int    # whole rows per tile; 0 for a single row split across the herd
    chunks_per_tile: int  # chunks of that single row per tile (single-row plans)


def plan_chunks(kind: str, rows: int, cols: int, tuning: dict, live_buffers: int) -> ChunkPlan:
    """Picks (herd, chunk): widest herd first, then the longest chunk that fits L1, unless tuning fixes them."""
    granule = l1_elements(DEVICE.vector_lanes, "bf16")
    require(cols % granule == 0, kind, "cols", cols, f"must be a multiple of {granule} (whole {DEVICE.vector_lanes}-"
                                                     f"lane vectors in chunk buffers of whole {L1_BUFFER_GRANULE}-byte "
                                                     f"runs)")
    chunks = [c for c in divisors_descending(cols, MAX_CHUNK) if c % granule == 0]
    if "chunk" in tuning:
        chunk = tuning["chunk"]
        require(chunk % granule == 0 and cols % chunk == 0, kind, "chunk", chunk,
                f"must be a multiple of {granule} that divides cols={cols}")
        chunks = [chunk]
    herds = [tuning["herd"]] if "herd" in tuning else list(DEVICE.herd_candidates)
    for herd in herds:
        require(herd <= DEVICE.columns, kind, "herd", herd,
                f"a row-parallel herd spans at most {DEVICE.columns} columns")
        plans = []
        for chunk in chunks:
            per_row = cols // chunk
            if rows == 1 and per_row % herd == 0:
                plans.append(ChunkPlan(herd, chunk, per_row, 0, per_row // herd))
            elif rows > 1 and rows % herd == 0:
                plans.append(ChunkPlan(herd, chunk, per_row, rows // herd, per_row))
        if plans:
            plan = next((p for p in plans if sum(l1_bytes(p, live_buffers).values()) <= L1_AVAILABLE), plans[-1])
            check_budget(kind, "L1", l1_bytes(plan, live_buffers), "lower chunk")
            return plan
    # Herd 1 always divides, so only an explicit herd can leave no split.
    what = f"the chunk count of a {cols}-wide row for chunk in {chunks}" if rows == 1 else f"rows={rows}"
    raise LaunchConstraintError(kind, "herd", tuning["herd"], f"must divide {what}")


def l1_bytes(plan: ChunkPlan, live_buffers: int) -> dict[str, int]:
    """The chunk buffers, copied by AIR's ping-pong over the innermost loop that fills them."""
    trips = (plan.chunks_per_tile if not plan.rows_per_tile
             else plan.chunks_per_row if plan.chunks_per_row > 1 else plan.rows_per_tile)
    copies = pingpong_copies(trips)
    return {f"{live_buffers} buffers x{copies} (ping-pong)": copies * live_buffers * nbytes((plan.chunk,), "bf16")}


@contextmanager
def chunk_loop(b: LaunchBuilder, plan: ChunkPlan, tx: str):
    """Loops over the tile's chunks; yields (row, col) element offsets (row 0 for a single-row plan)."""
    if not plan.rows_per_tile:
        with b.loop(0, plan.chunks_per_tile, 1, "n") as n:
            yield 0, b.affine(f"(s0 * {plan.chunks_per_tile} + s1) * {plan.chunk}", [tx, n], "col")
        return
    with b.loop(0, plan.rows_per_tile, 1, "r") as r:
        row = b.affine(f"s0 * {plan.rows_per_tile} + s1", [tx, r], "row")
        if plan.chunks_per_row == 1:
            yield row, 0
        else:
            with b.loop(0, plan.chunks_per_row, 1, "c") as c:
                yield row, b.affine(f"s0 * {plan.chunk}", [c], "col")


# Emits what one chunk computes: (builder, plan, lhs chunk, rhs chunk, out chunk), all L1 buffers.
ChunkCompute = Callable[[LaunchBuilder, ChunkPlan, Value, Value, Value], None]


def build_binary(kind: str, roles: tuple[str, str, str], params: dict, operands, tuning: dict,
                 compute: ChunkCompute, link_with: str | None = None, row_rhs: bool = False) -> LaunchIR:
    """``out = f(lhs, rhs)`` over (rows, cols) bf16 operands named ``roles``: each chunk of lhs and rhs goes
    DDR → L1, ``compute`` writes the out chunk, which goes back to DDR.

    ``row_rhs``: rhs is one (cols,) row applied to every row of lhs (a bias). When a row is one chunk, each tile
    loads it once, before its row loop, as one broadcast stream for the herd; otherwise its chunk comes with lhs's."""
    rows, cols = params["rows"], params["cols"]
    shapes = row_shapes(rows, cols)
    check_operands(kind, operands, [(role, {(cols,)} if row_rhs and role == roles[1] else shapes, "bf16")
                                    for role in roles])
    plan = plan_chunks(kind, rows, cols, tuning, live_buffers=3)
    rhs_once = row_rhs and plan.rows_per_tile > 0 and plan.chunks_per_row == 1

    b = LaunchBuilder(kind, operands, roles)
    b.comment(f"{kind} rows={rows} cols={cols}: herd {plan.herd}x1, {plan.chunks_per_tile} chunks of "
              f"{plan.chunk} per {'row per ' if plan.rows_per_tile else ''}tile")
    with b.launch(kind, (1, 1), b.operands) as (_, _, launch_args):
        with b.segment(f"{kind}_seg", launch_args) as (_, _, segment_args):
            with b.herd(f"{kind}_herd", (plan.herd, 1), segment_args, link_with=link_with) as (
                    (tx, _), _, (lhs, rhs, out)):
                chunk_type = MemRef((plan.chunk,), "bf16", L1)
                lhs_buf, rhs_buf, out_buf = (b.alloc(chunk_type, f"{role}_l1") for role in roles)
                if rhs_once:
                    b.broadcast_dma(rhs_buf, WHOLE, rhs, rows_window(rhs.type, 0, 1, 0, plan.chunk))
                with chunk_loop(b, plan, tx) as (row, col):
                    b.dma(lhs_buf, WHOLE, lhs, rows_window(lhs.type, row, 1, col, plan.chunk))
                    if not rhs_once:
                        b.dma(rhs_buf, WHOLE, rhs, rows_window(rhs.type, 0 if row_rhs else row, 1, col, plan.chunk))
                    compute(b, plan, lhs_buf, rhs_buf, out_buf)
                    b.dma(out, rows_window(out.type, row, 1, col, plan.chunk), out_buf, WHOLE)
                b.dealloc(lhs_buf, rhs_buf, out_buf)
    if not rhs_once:
        return b.finish(l1_bytes(plan, live_buffers=3))
    return b.finish({**l1_bytes(plan, live_buffers=2), "row_rhs chunk": nbytes((plan.chunk,), "bf16")})
