"""gemm_int(M, K, N, tile_n): ``C[M, N]`` from quantized activation rows and a prepared two-term weight, the integer
GEMM of matmul precision "w8x2a16" (kernels/int_gemm.py: its numerics and both operands' layouts), on gemm_int8.cc.

Operands: ``a`` (M, int_gemm.activation_words(K)) int32, each row its K/32 runs of 32 int16 q, the row's fp32 scale
and two zeros (quantize_rows' output); ``w`` the prepared weight (int_gemm.prepared_weight_shape(N, K)) int32, one
window per (column tile of ``tile_n``, call of 32 K), tile-major; ``c`` (M, N) bf16. ``tile_n`` is the weights'
(int_gemm.weight_tile_n): the builder cannot choose it, the weights were cut by it.

Schedule: gemm.py's, one launch step per (herd_m·tile_m) × (herd_n·tile_n) output block, with the operands' scales
riding inside their windows (a compute tile has two input DMA channels and this AIR refuses a third stream):

* a herd zeroes the two int32 accumulators (hi and lo term) each tile keeps in L1 at segment scope
  (``gemm_int_zero_i32``), beside two more segment-scope buffers the K loop fills: the tile's row scales
  (tile_m fp32) and column scales (T fp32; T = tile_n, or 2·tile_n for SwiGLU);
* for each ``tile_k_l2`` slice of K: DDR → memtile for the block's activation rows (their runs of the slice, one
  contiguous run of words per row) and for each herd column's weight windows of the slice (tile-major: one
  contiguous run of ``tile_k_l2 / 32`` windows per column tile); then per call of 32 K the memtile → L1 DMA cuts a
  tile's A window as gemm_int8.cc reads it, ``[9 kb][tile_m m][2 words]`` (a 3-D pattern over the rows' runs: 8 data
  blocks of 4 K, then the scale block), and moves its W window whole (``[9 kb][T/8 nb][2 t][4 k][8 n]`` int8, already
  in the kernel's order); ``gemm_int_w8x2`` accumulates both terms and copies the windows' scales (every call of a
  tile rewrites the same values);
* a herd rescales the accumulators ``drain_n`` columns at a time (``gemm_int_drain_bf16``, or
  ``gemm_int_swiglu_drain_bf16`` over a gate chunk and its up chunk) and the L1 → memtile DMA un-tiles each chunk into
  the C block, which the memtile writes to DDR (gemm.py's drain).

gemm_int_swiglu(M, K, N, tile_n) is the same over a [gate | up] pair prepared with halves 2 (each window: tile_n gate
columns, then the same up columns): T = 2·tile_n accumulator columns, c = silu_mul(bf16(gate), bf16(up)).

Tiles: the herd as gemm.py's (herd_m the widest of 8, 4, 2, 1 dividing M/16; herd_n the widest of 4, 2, 1 dividing
the column tiles), tile_m the largest multiple of 16 up to 64 dividing M/herd_m, tile_k_l2 the largest multiple of
32 up to 256 dividing K whose double-buffered slices fit the fullest memtile, drain_n the widest multiple of 8
dividing tile_n that fits L1. At tile_m 64 and T 64 a tile holds 32 KiB of accumulators, two 4.5 KiB A windows
and two 4.5 KiB W windows (ping-pong), 512 B of scales and an 8 KiB bf16 drain chunk: 59,904 B of the 61,440.

Checked here with the real AIR (tests/kernels/test_air_pipeline.py, test_air_opt.py): every window as meant, the
lowering to NPU instructions, each tile's L1 as this plan counts it; the IR run by the interpreter against the
emulator bit for bit (test_interpret.py). Not checked: a Peano build of gemm_int8.cc and a run on the NPU.

Constraints: M and N multiples of 16, K of 32; tile_n a multiple of 16 dividing N (and the weight's shape its);
herd_m ≤ 8 and herd_n ≤ 4 dividing M and the column tiles; everything above fitting L1 and the memtile.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import int_gemm
from ..device import DEVICE
from .ir import L1, L2, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window
from .npu2 import (L1_AVAILABLE, check_budget, check_operands, divisors_descending, largest_dividing, nbytes,
                   pingpong_copies, require)

KIND = "gemm_int"
SWIGLU_KIND = "gemm_int_swiglu"
PARAMS = ("M", "K", "N", "tile_n")
TUNING = ("herd_m", "herd_n", "tile_m", "tile_k_l2", "drain_n")
BLOCK = int_gemm.BLOCK
TILE_GRANULE = int_gemm.TILE_GRANULE   # tile_m: the kernel's two row blocks per accumulator pass
CALL_K = int_gemm.CALL_K               # K per kernel call: the windows' depth
RUN_WORDS = int_gemm.CALL_COLS // 2    # words of one row's run of 32 K (q and scale)
BLOCK_WORDS = int_gemm.SCALE_K // 2    # words of one row of one 4-K block
A_BLOCKS = CALL_K // int_gemm.SCALE_K + 1  # K blocks of an A window: 8 data blocks and the scale block
MAX_TILE_M = 64
MAX_TILE_K_L2 = 256
OBJECT = "gemm_int8.o"


def _l1_bytes(tile_m, T, calls_l2, drain_n, tile_n) -> dict[str, int]:
    copies = pingpong_copies(calls_l2)  # the K loop's trips: one call each
    drain_copies = pingpong_copies(tile_n // drain_n)  # the drain loop's trips: chunks of the (gate's) tile_n
    return {"int32 accumulators (hi, lo)": 2 * nbytes((tile_m, T), "i32"),
            f"A window x{copies} (ping-pong)": copies * nbytes((A_BLOCKS, tile_m, BLOCK_WORDS), "i32"),
            f"W window x{copies}": copies * int_gemm.window_bytes(T),
            "row scales": nbytes((tile_m,), "f32"), "column scales": nbytes((T,), "f32"),
            f"bf16 drain chunk x{drain_copies}": drain_copies * nbytes((tile_m, drain_n), "bf16")}


def _l2_bytes(herd_m, herd_n, tile_m, tile_n, T, calls_l2, K) -> dict[str, int]:
    """What the fullest memtile holds (gemm.py's _l2_bytes: AIR splits a multi-column segment's L2 buffers into one
    piece per herd column (A, C) or row (W) over the memtiles of its herd_m columns)."""
    copies = pingpong_copies(K // CALL_K // calls_l2)
    memtiles = herd_m if herd_m * herd_n > DEVICE.rows else 1
    per_memtile = lambda pieces: -(-pieces // memtiles)  # noqa: E731
    a, w, c = per_memtile(herd_m), per_memtile(herd_n), per_memtile(herd_m)
    return {f"A slice x{copies} (ping-pong), {a} of {herd_m} pieces":
            a * copies * nbytes((tile_m, calls_l2 * RUN_WORDS), "i32"),
            f"W slice x{copies}, {w} of {herd_n} pieces": w * copies * calls_l2 * int_gemm.window_bytes(T),
            f"C block, {c} of {herd_m} pieces": c * nbytes((herd_n, tile_m, tile_n), "bf16")}


@dataclass(frozen=True)
class IntGemmPlan:
    """A gemm_int launch's shape and schedule, checked: what ``_emit`` writes out."""

    kind: str
    M: int
    K: int
    N: int
    halves: int          # 2: a [gate | up] pair
    herd_m: int
    herd_n: int
    tile_m: int
    tile_n: int
    tile_k_l2: int
    drain_n: int
    l1: dict

    @property
    def T(self) -> int:
        """Accumulator columns and weight columns per tile."""
        return self.halves * self.tile_n

    @property
    def calls_l2(self) -> int:
        return self.tile_k_l2 // CALL_K

    @property
    def window_words(self) -> int:
        return int_gemm.window_bytes(self.T) // 4

    @property
    def defines(self) -> dict:
        return {"GEMM_TILE_M": self.tile_m, "GEMM_TILE_N": self.T, "GEMM_DRAIN_N": self.drain_n}


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    return _emit(_plan(KIND, params, operands, tuning), operands)


def build_swiglu(params: dict, operands, tuning: dict) -> LaunchIR:
    """gemm_int_swiglu(M, K, N, tile_n): both projections of a [gate | up] pair and SiLU·up in one launch."""
    return _emit(_plan(SWIGLU_KIND, params, operands, tuning), operands)


def _plan(kind: str, params: dict, operands, tuning: dict) -> IntGemmPlan:
    M, K, N, tile_n = params["M"], params["K"], params["N"], params["tile_n"]
    halves = 2 if kind == SWIGLU_KIND else 1
    for name, extent, granule in (("M", M, TILE_GRANULE), ("K", K, CALL_K), ("N", N, TILE_GRANULE),
                                  ("tile_n", tile_n, TILE_GRANULE)):
        require(extent % granule == 0, kind, name, extent, f"must be a multiple of {granule}")
    require(N % tile_n == 0, kind, "tile_n", tile_n, f"must divide N={N}")
    T = halves * tile_n
    calls = K // CALL_K
    check_operands(kind, operands, [
        ("A", {(M, int_gemm.activation_words(K))}, "i32"),
        ("W", {(N // tile_n * calls, int_gemm.window_bytes(T) // 4)}, "i32"),
        ("C", {(M, N)}, "bf16")])
    tiles_n = N // tile_n
    herd_m = tuning.get("herd_m", largest_dividing(M // TILE_GRANULE, DEVICE.herd_candidates))
    herd_n = tuning.get("herd_n", largest_dividing(tiles_n, (DEVICE.rows, 2, 1)))
    require(herd_m <= DEVICE.columns, kind, "herd_m", herd_m, f"the herd spans at most {DEVICE.columns} columns")
    require(herd_n <= DEVICE.rows, kind, "herd_n", herd_n, f"the herd spans at most {DEVICE.rows} rows")
    require(M % herd_m == 0, kind, "herd_m", herd_m, f"must divide M={M}")
    require(tiles_n % herd_n == 0, kind, "herd_n", herd_n, f"must divide the {tiles_n} column tiles of {tile_n}")
    tile_m = tuning.get("tile_m", next((d for d in divisors_descending(M // herd_m, MAX_TILE_M)
                                        if d % TILE_GRANULE == 0), None))
    require(tile_m is not None and (M // herd_m) % tile_m == 0 and tile_m % TILE_GRANULE == 0, kind, "tile_m",
            tile_m, f"must divide M/herd_m={M // herd_m} and be a multiple of {TILE_GRANULE}")
    # the deepest K slice up to 256 whose double-buffered pieces fit the fullest memtile, preferring an even count of
    # calls (AIR double-buffers the windows of a loop of at least 4 even trips)
    candidates = sorted((d for d in divisors_descending(K, MAX_TILE_K_L2) if d % CALL_K == 0),
                        key=lambda d: (not (d // CALL_K >= 4 and d // CALL_K % 2 == 0), -d))
    fits_l2 = lambda t: sum(_l2_bytes(herd_m, herd_n, tile_m, tile_n, T, t // CALL_K, K).values()) \
        <= DEVICE.l2_bytes  # noqa: E731
    tile_k_l2 = tuning.get("tile_k_l2") or next((t for t in candidates if fits_l2(t)), candidates[-1])
    require(K % tile_k_l2 == 0 and tile_k_l2 % CALL_K == 0, kind, "tile_k_l2", tile_k_l2,
            f"must divide K={K} and be a multiple of {CALL_K}")
    check_budget(kind, "L2", _l2_bytes(herd_m, herd_n, tile_m, tile_n, T, tile_k_l2 // CALL_K, K),
                 "lower tile_k_l2 or the block size")
    chunk_candidates = [d for d in divisors_descending(tile_n) if d % BLOCK == 0]
    drain_n = tuning.get("drain_n") or next(
        (d for d in chunk_candidates
         if sum(_l1_bytes(tile_m, T, tile_k_l2 // CALL_K, d, tile_n).values()) <= L1_AVAILABLE), chunk_candidates[-1])
    require(tile_n % drain_n == 0 and drain_n % BLOCK == 0, kind, "drain_n", drain_n,
            f"must divide tile_n={tile_n} and be a multiple of {BLOCK}")
    l1 = _l1_bytes(tile_m, T, tile_k_l2 // CALL_K, drain_n, tile_n)
    check_budget(kind, "L1", l1, "lower tile_m or drain_n")
    return IntGemmPlan(kind, M, K, N, halves, herd_m, herd_n, tile_m, tile_n, tile_k_l2, drain_n, l1)


def _emit(plan: IntGemmPlan, operands) -> LaunchIR:
    kind, swiglu, defines = plan.kind, plan.halves == 2, plan.defines
    M, K, N, T, halves = plan.M, plan.K, plan.N, plan.T, plan.halves
    herd_m, herd_n, tile_m, tile_n, drain_n = plan.herd_m, plan.herd_n, plan.tile_m, plan.tile_n, plan.drain_n
    calls, calls_l2, window_words = K // CALL_K, plan.calls_l2, plan.window_words
    a_words, slice_words = calls * RUN_WORDS, plan.calls_l2 * RUN_WORDS
    block_m, block_n = herd_m * tile_m, herd_n * tile_n
    chunks, chunk_blocks = tile_n // drain_n, drain_n // BLOCK
    b = LaunchBuilder(kind, operands, ("a", "w", "c"))
    b.comment(f"{kind} M={M} K={K} N={N}: herd {herd_m}x{herd_n}, tiles m{tile_m} n{tile_n} ({T} accumulator columns) "
              f"k{CALL_K} (a call) k{plan.tile_k_l2} (L2), drained by n{drain_n}, {M // block_m}x{N // block_n} launch "
              f"steps, int16 x two int8 terms")
    herd_name, herd_sizes = f"{kind}_herd", (herd_m, herd_n)
    with b.launch(kind, (M // block_m, N // block_n), b.operands) as ((bm, bn), _, (a, w, c)):
        seg_operands = [Value(bm, "index"), Value(bn, "index"), a, w, c]
        with b.segment(f"{kind}_seg", seg_operands) as (_, _, (sbm, sbn, sa, sw, sc)):
            row0 = b.affine(f"s0 * {block_m}", [sbm.ssa], "row0")
            col0 = b.affine(f"s0 * {block_n}", [sbn.ssa], "col0")
            tile0 = b.affine(f"s0 * {herd_n}", [sbn.ssa], "tile0")  # the block's first column tile
            a_l2 = b.alloc(MemRef((herd_m, 1, tile_m, slice_words), "i32", L2), "a_l2")
            w_l2 = b.alloc(MemRef((herd_n, calls_l2, window_words), "i32", L2), "w_l2")
            c_l2 = b.alloc(MemRef((herd_m, herd_n, tile_m, tile_n), "bf16", L2), "c_l2")
            # per tile: [T/8 nb][2 t][tile_m/8 mb][8][8], its nb split into drain chunks (SwiGLU: the gate's, then
            # the up's); the column scales split alike
            acc = b.alloc(MemRef((herd_m, herd_n, halves * chunks, chunk_blocks * 2 * tile_m * BLOCK), "i32", L1),
                          "acc_l1")
            rows = b.alloc(MemRef((herd_m, herd_n, tile_m), "f32", L1), "row_scale_l1")
            cols = b.alloc(MemRef((herd_m, herd_n, halves * chunks, drain_n), "f32", L1), "col_scale_l1")
            with b.herd(herd_name, herd_sizes, [acc], link_with=OBJECT) as ((tx, ty), _, (h_acc,)):
                b.call("gemm_int_zero_i32", [b.slab(h_acc, [tx, ty])], defines)
            with b.loop(0, calls, calls_l2, "k2") as call0:
                k_words = b.affine(f"s0 * {RUN_WORDS}", [call0], "k_words")
                # each row's runs of the slice: one contiguous run of words per row, in the memtile buffer's rank
                # (gemm.py says why)
                b.dma(a_l2, WHOLE, sa, Window((0, 0, row0, k_words), (herd_m, 1, tile_m, slice_words),
                                              (tile_m * a_words, tile_m * a_words, a_words, 1)))
                # each herd row's column tile: its windows of the slice, one contiguous run
                b.dma(w_l2, WHOLE, sw, Window((tile0, call0, 0), (herd_n, calls_l2, window_words),
                                              (calls * window_words, window_words, 1)))
                with b.herd(herd_name, herd_sizes, [a_l2, w_l2, acc, rows, cols], link_with=OBJECT) as \
                        ((tx, ty), _, (ha, hw, h_acc, h_rows, h_cols)):
                    a_buf = b.alloc(MemRef((A_BLOCKS, tile_m, BLOCK_WORDS), "i32", L1), "a_l1")
                    w_buf = b.alloc(MemRef((window_words,), "i32", L1), "w_l1")
                    slabs = [b.slab(h_acc, [tx, ty]), b.slab(h_rows, [tx, ty]), b.slab(h_cols, [tx, ty])]
                    with b.loop(0, calls_l2, 1, "k1") as k1:
                        run0 = b.affine(f"s0 * {RUN_WORDS}", [k1], "run0")
                        # [9 kb][tile_m m][2 words] of the tile's rows' run: kb strides 2 words, m a row of the slice
                        b.dma(a_buf, WHOLE, ha, Window((tx, 0, 0, run0), (1, A_BLOCKS, tile_m, BLOCK_WORDS),
                                                       (tile_m * slice_words, BLOCK_WORDS, slice_words, 1)))
                        b.dma(w_buf, WHOLE, hw, Window((ty, k1, 0), (1, 1, window_words),
                                                       (calls_l2 * window_words, window_words, 1)))
                        b.call("gemm_int_w8x2", [a_buf, w_buf, *slabs], defines)
                    b.dealloc(a_buf, w_buf)
            with b.herd(herd_name, herd_sizes, [acc, rows, cols, c_l2], link_with=OBJECT) as \
                    ((tx, ty), _, (h_acc, h_rows, h_cols, hc)):
                c_buf = b.alloc(MemRef((chunk_blocks, tile_m // BLOCK, BLOCK, BLOCK), "bf16", L1), "c_l1")
                row_scales = b.slab(h_rows, [tx, ty])
                with b.loop(0, chunks, 1, "chunk") as chunk:
                    n0 = b.affine(f"s0 * {drain_n}", [chunk], "n0")
                    if swiglu:
                        up_chunk = b.affine(f"s0 + {chunks}", [chunk], "up_chunk")
                        b.call("gemm_int_swiglu_drain_bf16",
                               [b.slab(h_acc, [tx, ty, chunk]), b.slab(h_acc, [tx, ty, up_chunk]), row_scales,
                                b.slab(h_cols, [tx, ty, chunk]), b.slab(h_cols, [tx, ty, up_chunk]), c_buf], defines)
                    else:
                        b.call("gemm_int_drain_bf16", [b.slab(h_acc, [tx, ty, chunk]), row_scales,
                                                       b.slab(h_cols, [tx, ty, chunk]), c_buf], defines)
                    # [n/8][m/8][8][8] read back in (m, n) order, as gemm.py's drain
                    b.dma(hc, Window((tx, ty, 0, n0), (1, 1, tile_m, drain_n),
                                     (herd_n * tile_m * tile_n, tile_m * tile_n, tile_n, 1)),
                          c_buf, Window((0, 0, 0, 0), (tile_m // BLOCK, BLOCK, chunk_blocks, BLOCK),
                                        (BLOCK * BLOCK, BLOCK, tile_m * BLOCK, 1)))
                b.dealloc(c_buf)
            b.dma(sc, Window((0, 0, row0, col0), (herd_m, herd_n, tile_m, tile_n), (tile_m * N, tile_n, N, 1)),
                  c_l2, WHOLE)
            b.dealloc(a_l2, w_l2, c_l2, acc, rows, cols)
    return b.finish(plan.l1)
