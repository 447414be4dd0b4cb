"""Work split shared by the elementwise kinds (add, silu_mul): fixed-size chunks of a (rows, cols) array.

The array is cut into chunks of ``chunk`` elements within a row (so a decode row of 1536 can still
spread over several tiles) and each tile of a row-parallel herd takes a contiguous run of chunks. Each
chunk streams DDR → L1 and back; nothing is reused, so there is no memtile staging.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from .ir import LaunchBuilder
from .npu2 import (COLUMNS, HERD_CANDIDATES, L1_AVAILABLE, VECTOR_LANES, LaunchConstraintError, check_budget,
                   divisors_descending, nbytes, require)

MAX_CHUNK = 2048  # elements per DMA: long enough to amortize a transfer, small enough to double-buffer


@dataclass(frozen=True)
class ChunkPlan:
    herd: int
    chunk: int
    chunks_per_row: int
    chunks_per_tile: int


def plan_chunks(kind: str, rows: int, cols: int, tuning: dict, live_buffers: int) -> ChunkPlan:
    """Picks (herd, chunk): widest herd first, then the longest chunk, unless tuning fixes them."""
    require(cols % VECTOR_LANES == 0, kind, "cols", cols, f"must be a multiple of {VECTOR_LANES} (vector lanes)")
    fit = L1_AVAILABLE // (2 * live_buffers * nbytes((1,), "bf16"))
    chunks = [c for c in divisors_descending(cols, min(MAX_CHUNK, fit)) if c % VECTOR_LANES == 0]
    if "chunk" in tuning:
        chunk = tuning["chunk"]
        require(chunk % VECTOR_LANES == 0 and cols % chunk == 0, kind, "chunk", chunk,
                f"must be a multiple of {VECTOR_LANES} that divides cols={cols}")
        chunks = [chunk]
    herds = [tuning["herd"]] if "herd" in tuning else list(HERD_CANDIDATES)
    for herd in herds:
        require(herd <= COLUMNS, kind, "herd", herd, f"a row-parallel herd spans at most {COLUMNS} columns")
        for chunk in chunks:
            total = rows * (cols // chunk)
            if total % herd == 0:
                check_budget(kind, "L1", {f"{live_buffers} buffers x2 (double-buffered)":
                                          2 * live_buffers * nbytes((chunk,), "bf16")}, "lower chunk")
                return ChunkPlan(herd, chunk, cols // chunk, total // herd)
    # Herd 1 always divides, so only an explicit herd can leave no split.
    raise LaunchConstraintError(kind, "herd", tuning["herd"],
                                f"must divide the chunk count of a {rows}x{cols} array for chunk in {chunks}")


@contextmanager
def chunk_loop(b: LaunchBuilder, plan: ChunkPlan, tx: str, one_dimensional: bool):
    """Loops over the tile's chunks; yields (row, col) element offsets (row is 0 for a 1-D operand)."""
    with b.loop(0, plan.chunks_per_tile, 1, "n") as n:
        item = f"s0 * {plan.chunks_per_tile} + s1"
        if one_dimensional:
            yield 0, b.affine(f"({item}) * {plan.chunk}", [tx, n], "col")
        elif plan.chunks_per_row == 1:
            yield b.affine(item, [tx, n], "row"), 0
        else:
            row = b.affine(f"({item}) floordiv {plan.chunks_per_row}", [tx, n], "row")
            col = b.affine(f"(({item}) mod {plan.chunks_per_row}) * {plan.chunk}", [tx, n], "col")
            yield row, col
