"""quantize_rows(M, K): each row of x (M, K) bf16 quantized to int16 for the integer GEMMs and written as their runs,
``xq`` (M, int_gemm.activation_words(K)) int32 (kernels/int_gemm.py: quantize_activations, pack_activations), on
quantize_rows.cc.

Schedule: a row-parallel herd of up to 8 tiles (one per column), each quantizing its contiguous block of rows one
row at a time; rows stream DDR → L1 and their runs L1 → DDR directly (nothing is reused: no memtile staging). A row
must sit whole in L1 (its scale needs the whole row's absmax and Σ|q| before the first q can be written):
``quantize_rows_prepare`` takes the row and leaves its inverse and scale in a small state buffer, then
``quantize_rows_chunk`` packs ``chunk`` values at a time into a chunk buffer that streams out while the next chunk
is packed.

A row whose runs fit one chunk (K = 576: 1296 B) needs no chunk loop: the row loop then owns the row, the state and
the runs, and AIR double-buffers all three (the next row streams in while this one is quantized).

Why, with several chunks a row, the last row of a tile is peeled out of its row loop: AIR (0e3df89d) double-buffers
a buffer in the innermost loop that holds all its uses. A row loop owning the row buffer would double it (2 × 16 KiB
at K = 8192) and, with the chunk loop inside it owning the chunk buffers, label both loops for ping-pong, which this
AIR's transform cannot do (mlir-air #1626, #1628 fix it later). The peeled row uses the same row and state buffers
after the loop, so they stay single, allocated once per tile, and only the chunk loops (the loop's and the peeled
row's, each with its own chunk buffer) are double-buffered. The row's DMA in therefore runs in sequence with the
row's compute; its runs going out overlap the packing.

Checked with the real AIR (lowering, L1 placement, the ping-pong labels: tests/benchmarks/test_cost_model_pingpong.py)
and by the interpreter against the emulator bit for bit; not checked: a Peano build of quantize_rows.cc, the NPU.

Chunks: ``chunk`` values (a multiple of 64: the kernel packs runs in pairs) dividing K; by default the largest
giving an even count of at least 4 chunks (AIR overlaps those) of at most 64 runs (4.5 KiB), else the whole row.

Constraints: K a multiple of 64; the herd (default: the largest of 8, 4, 2, 1 dividing M) divides M; the row, the
state and the chunk buffers fit L1 (34,880 B at K = 8192: the row once, two chunk buffers of 4.5 KiB twice).
"""
from __future__ import annotations

from .. import int_gemm
from ..device import DEVICE
from .ir import L1, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window, rows_window
from .npu2 import (check_budget, check_operands, divisors_descending, l1_elements, largest_dividing, nbytes,
                   pingpong_copies, require)

KIND = "quantize_rows"
PARAMS = ("M", "K")
TUNING = ("herd", "chunk")
OBJECT = "quantize_rows.o"
PAIR = int_gemm.ROW_K_GRANULE   # values the kernel packs at a time: two runs
RUN_WORDS = int_gemm.CALL_COLS // 2
MAX_CHUNK_RUNS = 64
STATE_FLOATS = 16               # quantize_rows.cc's state


def _chunk_buffer_words(chunk: int) -> int:
    """A chunk buffer in whole 64-byte runs (npu2.l1_elements): aie-assign-buffer-addresses packs a tile's buffers
    end to end, so one of another size would leave the buffers after it off the 64-byte boundary a 512-bit vector
    load needs (kernels/budgets.py). The kernel writes the whole buffer; its DMAs move the chunk's own words."""
    return l1_elements(int_gemm.activation_words(chunk), "i32")


def _default_chunk(K: int) -> int:
    runs = K // int_gemm.CALL_K
    even = [r for r in divisors_descending(runs) if r % 2 == 0]
    overlapped = [r for r in even if r <= MAX_CHUNK_RUNS and runs // r >= 4 and (runs // r) % 2 == 0]
    return (overlapped or even)[0] * int_gemm.CALL_K


def _l1_bytes(K: int, chunk: int, rows_per_tile: int) -> dict[str, int]:
    chunk_bytes = nbytes((_chunk_buffer_words(chunk),), "i32")
    row, state = nbytes((K,), "bf16"), nbytes((STATE_FLOATS,), "f32")
    if chunk == K:  # one loop, over the rows, owns every buffer
        copies = pingpong_copies(rows_per_tile)
        return {f"x row x{copies} (ping-pong)": copies * row, f"state x{copies}": copies * state,
                f"q row x{copies}": copies * chunk_bytes}
    copies = pingpong_copies(K // chunk)
    l1 = {"x row": row, "state": state, f"q chunk x{copies} (ping-pong)": copies * chunk_bytes}
    if rows_per_tile > 1:
        l1[f"the row loop's q chunk x{copies}"] = copies * chunk_bytes
    return l1


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    M, K = params["M"], params["K"]
    require(K % PAIR == 0, KIND, "K", K, f"must be a multiple of {PAIR}")
    words = int_gemm.activation_words(K)
    check_operands(KIND, operands, [("x", {(M, K)}, "bf16"), ("xq", {(M, words)}, "i32")])
    herd = tuning.get("herd", largest_dividing(M, DEVICE.herd_candidates))
    require(herd <= DEVICE.columns, KIND, "herd", herd, f"a row-parallel herd spans at most {DEVICE.columns} columns")
    require(M % herd == 0, KIND, "herd", herd, f"must divide M={M}")
    chunk = tuning.get("chunk", _default_chunk(K))
    require(chunk % PAIR == 0 and K % chunk == 0, KIND, "chunk", chunk,
            f"must be a multiple of {PAIR} dividing K={K}")
    rows_per_tile, chunks, chunk_words = M // herd, K // chunk, int_gemm.activation_words(chunk)
    l1 = _l1_bytes(K, chunk, rows_per_tile)
    check_budget(KIND, "L1", l1, "K is too long to quantize a row in one tile, or chunk too large")
    defines = {"QUANT_K": K, "QUANT_CHUNK": chunk}

    b = LaunchBuilder(KIND, operands, ("x", "xq"))
    b.comment(f"quantize_rows M={M} K={K}: herd {herd}x1, {rows_per_tile} rows per tile"
              + (f" (the last peeled out of the row loop), {chunks} chunks of {chunk} per row" if chunks > 1 else ""))
    with b.launch(KIND, (1, 1), b.operands) as (_, _, launch_args):
        with b.segment(f"{KIND}_seg", launch_args) as (_, _, segment_args):
            with b.herd(f"{KIND}_herd", (herd, 1), segment_args, link_with=OBJECT) as ((tx, _), _, (x, xq)):
                x_buf = b.alloc(MemRef((K,), "bf16", L1), "x_l1")
                state = b.alloc(MemRef((STATE_FLOATS,), "f32", L1), "state_l1")
                chunk_type = MemRef((_chunk_buffer_words(chunk),), "i32", L1)
                if chunks == 1:  # a row's runs in one buffer: the row loop owns (and double-buffers) them all
                    q_buf = b.alloc(chunk_type, "q_l1")
                    with b.loop(0, rows_per_tile, 1, "r") as r:
                        row = b.affine(f"s0 * {rows_per_tile} + s1", [tx, r], "row")
                        b.dma(x_buf, WHOLE, x, rows_window(x.type, row, 1, 0, K))
                        b.call("quantize_rows_prepare", [x_buf, state], defines)
                        b.call("quantize_rows_chunk", [x_buf, state, q_buf, Value(b.const(0, "i32"), "i32")], defines)
                        b.dma(xq, rows_window(xq.type, row, 1, 0, chunk_words), q_buf, _words(chunk_words))
                    b.dealloc(x_buf, state, q_buf)
                else:
                    _peeled_rows(b, x, xq, tx, x_buf, state, chunk_type, chunk_words, rows_per_tile, chunks, defines)
    return b.finish(l1)


def _words(count: int) -> Window:
    """The first ``count`` words of a chunk buffer: the chunk's runs, without the buffer's padding."""
    return Window((0,), (count,), (1,))


def _peeled_rows(b: LaunchBuilder, x, xq, tx, x_buf, state, chunk_type, chunk_words, rows_per_tile, chunks,
                 defines) -> None:
    """The tile's rows, each in chunks: a loop over all rows but the last, then the last (the module doc says why)."""
    K = x.type.shape[1]

    def row_of(row: str, q_buf) -> None:
        b.dma(x_buf, WHOLE, x, rows_window(x.type, row, 1, 0, K))
        b.call("quantize_rows_prepare", [x_buf, state], defines)
        with b.loop(0, chunks, 1, "c") as c:
            index = b.index_to_i32(c, "chunk")
            b.call("quantize_rows_chunk", [x_buf, state, q_buf, index], defines)
            col = b.affine(f"s0 * {chunk_words}", [c], "col")
            b.dma(xq, rows_window(xq.type, row, 1, col, chunk_words), q_buf, _words(chunk_words))

    buffers = [x_buf, state]
    if rows_per_tile > 1:
        q_loop = b.alloc(chunk_type, "q_l1")
        buffers.append(q_loop)
        with b.loop(0, rows_per_tile - 1, 1, "r") as r:
            row_of(b.affine(f"s0 * {rows_per_tile} + s1", [tx, r], "row"), q_loop)
    q_last = b.alloc(chunk_type, "q_last_l1")
    row_of(b.affine(f"s0 * {rows_per_tile} + {rows_per_tile - 1}", [tx], "last_row"), q_last)
    b.dealloc(*buffers, q_last)
