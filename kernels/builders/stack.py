"""stack(rows, cols, head_dim): the launch's two (rows, cols) inputs into one buffer out (2, rows, cols), head by
head (cols = heads * head_dim), each head's first input then its second, each in 8-column blocks: element (r, c)
of input i, c = h*head_dim + j, at ``out.flat[h*2*head_dim*rows + i*head_dim*rows + (j//8)*rows*8 + r*8 + j%8]``.

It gathers a layer's keys and values into one buffer so that attention can fetch each key/value block with
one DMA: a compute tile has two input DMA channels, and attention needs one of them for queries. The blocks
let that DMA lay a block out in the 8x8 blocks attention.cc's mmuls take with a 3-D pattern (a shim BD's
dimensions; the row-major layout would need a 4th). A KV head's keys and values are one run of the buffer, so
that the stream of every key/value block, which each round of attention repeats, is one shim task with a repeat
count (with all heads' keys before their values, each round took a task of its own, and past 2048 positions
aiecc ran out of shim buffer descriptors).

Schedule: a row of ``herd`` tiles, at most one per column: each tile streams through two shim channels each
way, a column's shim tile has two of each, and AIR's airrt-to-npu could not place the channels of a herd with a
second row. With at least as many heads as the array has columns, tile x takes the x-th share of the heads and
all rows; with fewer, every head and the x-th share of the rows. A tile walks its heads and,
for each, its rows in blocks of ``block``: a block of one head's columns of one input goes DDR → L1 (rows of
head_dim) → DDR (its 8-column blocks, each ``block`` rows of 8), unchanged (no compute). The loop over a head's
blocks folds into each transfer's pattern, so a shim task moves a tile's share of one head of one input.

Constraints: head_dim a multiple of 16 dividing cols; block a multiple of 8 dividing rows (and the herd's share);
two double-buffered blocks in L1.
"""
from __future__ import annotations

from ..device import DEVICE
from .ir import L1, WHOLE, LaunchBuilder, LaunchIR, MemRef, Window
from .npu2 import (L1_AVAILABLE, check_budget, check_operands, divisors_descending, nbytes, pingpong_copies,
                   require)

KIND = "stack"
PARAMS = ("rows", "cols", "head_dim")
TUNING = ("herd", "block")
BLOCK = 8
BLOCK_CANDIDATES = (64, 32, 16, 8)


def _l1_bytes(block: int, head_dim: int, blocks_per_tile: int) -> dict[str, int]:
    copies = pingpong_copies(blocks_per_tile)
    return {f"2 blocks x{copies} (ping-pong)": 2 * copies * nbytes((block, head_dim), "bf16")}


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    rows, cols, head_dim = params["rows"], params["cols"], params["head_dim"]
    check_operands(KIND, operands, [("first", {(rows, cols)}, "bf16"), ("second", {(rows, cols)}, "bf16"),
                                    ("out", {(2, rows, cols)}, "bf16")])
    require(head_dim % DEVICE.vector_lanes == 0 and cols % head_dim == 0, KIND, "head_dim", head_dim,
            f"must be a multiple of {DEVICE.vector_lanes} dividing cols={cols}")
    heads = cols // head_dim
    require(rows % BLOCK == 0, KIND, "rows", rows, f"must be a multiple of {BLOCK} (blocks of 8-row multiples)")
    on_heads = heads >= DEVICE.columns  # the herd spreads the heads, else the rows
    # the longest block that fits L1 with the most ping-pong copies (3: an odd trip count) and, when the herd spreads
    # the rows, still gives every column a share; else the shortest, which the L1 check below judges with its own copies
    fitting = [b for b in BLOCK_CANDIDATES
               if rows % b == 0 and sum(_l1_bytes(b, head_dim, 3).values()) <= L1_AVAILABLE]
    block = tuning.get("block", next((b for b in fitting if on_heads or rows // b >= DEVICE.columns),
                                     fitting[-1] if fitting else BLOCK))
    require(block % BLOCK == 0 and rows % block == 0, KIND, "block", block,
            f"must be a multiple of {BLOCK} dividing rows={rows}")
    spread = heads if on_heads else rows // block
    herd = tuning.get("herd", divisors_descending(spread, DEVICE.columns)[0])
    require(herd <= DEVICE.columns and spread % herd == 0, KIND, "herd", herd,
            f"must divide the {spread} {'heads' if on_heads else f'blocks of {block} rows'} and be at most "
            f"{DEVICE.columns} (the array's columns)")
    heads_per_tile = heads // herd if on_heads else heads
    blocks_per_tile = rows // block if on_heads else rows // block // herd
    l1 = _l1_bytes(block, head_dim, blocks_per_tile if blocks_per_tile > 1 else heads_per_tile)
    check_budget(KIND, "L1", l1, "lower block")

    b = LaunchBuilder(KIND, operands, ("first", "second", "out"))
    b.comment(f"stack rows={rows} cols={cols} head_dim={head_dim}: herd {herd}x1, {heads_per_tile} heads and "
              f"{blocks_per_tile} blocks of {block} rows per tile")
    with b.launch("stack", (1, 1), b.operands) as (_, _, launch_args):
        with b.segment("stack_seg", launch_args) as (_, _, segment_args):
            with b.herd("stack_herd", (herd, 1), segment_args) as ((tx, _), _, (first, second, out)):
                buffers = [b.alloc(MemRef((block * head_dim,), "bf16", L1), f"{name}_l1")
                           for name in ("first", "second")]
                with b.loop(0, heads_per_tile, 1, "h") as h:
                    head = b.affine(f"s0 * {heads_per_tile} + s1", [tx, h], "head") if on_heads else h
                    col = b.affine(f"s0 * {head_dim}", [head], "col")
                    with b.loop(0, blocks_per_tile, 1, "blk") as blk:
                        row = (b.affine(f"s0 * {block}", [blk], "row") if on_heads
                               else b.affine(f"(s0 * {blocks_per_tile} + s1) * {block}", [tx, blk], "row"))
                        for index, (source, buffer) in enumerate(zip((first, second), buffers)):
                            b.dma(buffer, WHOLE, source, Window((row, col), (block, head_dim), (cols, 1)))
                            # the block's rows, each in its head's 8-column blocks of this input
                            b.dma(out, Window((index, head, row, 0, 0, 0), (1, 1, 1, block, head_dim // BLOCK, BLOCK),
                                              (head_dim * rows, 2 * head_dim * rows, BLOCK, BLOCK, rows * BLOCK, 1)),
                                  buffer, WHOLE)
                b.dealloc(*buffers)
    return b.finish(l1)
