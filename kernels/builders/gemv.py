"""gemv(K, N): ``y[N] = W[N, K] · x[K]`` through the external ``gemv_bf16``; gemv_f32 for the LM head.

W is HF's (out, in) layout, so each output row is a contiguous K-vector: no transpose anywhere. gemv's y
is bf16; gemv_f32's y keeps the accumulator's precision (the LM head's logits), through ``gemv_bf16_f32``.

A launch step covers ``herd * rows_per_tile`` consecutive rows in panels of ``herd * tile_n`` consecutive
rows, ``tile_n`` per tile. (Dealing each tile one contiguous run instead would make a panel's DDR window
stride ``rows_per_tile`` rows between tiles, beyond a shim BD's 2^20-word stride before AIR splits it.)

Schedule, per launch step (few of them: one unless tuned otherwise):

* x DDR → memtile, once;
* the segment loops over the panels (``scf.for``); each trip moves the panel's rows DDR → memtile (AIR's
  air-split-l2-memref gives each tile's ``tile_n`` rows a memtile buffer and a shim channel of their own),
  enters the herd, and moves the panel's results memtile → DDR. The DMAs and the herd share the loop, so
  AIR's ping-pong transform double-buffers the memtile buffers: the next panel streams in from DDR while
  the herd works on this one;
* the herd: x memtile → L1 (identical for every tile, so AIR broadcasts it), then the tile's ``tile_n`` rows
  ``rows_per_call`` at a time (W rows memtile → L1, double-buffered, one kernel call, its outputs copied
  into the tile's ``tile_n`` results), then those results back to the memtile. The kernel's row count and K
  are compile-time (GEMV_ROWS, GEMV_K), so a call writes a buffer of exactly ``rows_per_call`` outputs.

Panels are as large as a memtile holds twice (ping and pong), but at least ``MIN_PANELS`` per tile when the
rows allow, so that streaming has a steady state to overlap. x goes through the memtile rather than straight
from DDR into every herd entry: re-read from DDR per panel, AIR folds the reads into a shim BD with a
stride-0 wrap that aiecc rejects from 64 panels on ("Stride 1 must be a positive integer"), and at 334
panels (Llama-3.2-1B's LM head in one step) air-opt-shim-dma-bds grew past 16 GB before it was stopped.
Staged, the LM head's 334 panels lower in about 2 s.

Packed weights (launch param ``weights``, a kernels/quant.py format such as "q4_1"): W is its packed rows as
(N, row_bytes / 4) 32-bit words (``i32``), moved row for row exactly as bf16 rows are, and the calls are gemv.cc's
``gemv_q_*`` built with its GEMV_QUANT, which dequantize each block in the panel loop; everything else is the
same schedule.

Constraints: K a multiple of 32; herd divides N; steps divides N/herd; tile_n divides N/(herd·steps) and is
whole 4-byte words of y; rows_per_call divides tile_n; x, double-buffered W rows and y fit L1; one tile's
W rows and results, times the ping-pong copies, fit one memtile.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

from ..device import DEVICE
from ..quant import BLOCK, GEMV_QUANT, transposed, weight_format
from .ir import L1, L1_BUFFER_GRANULE, L2, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window
from .npu2 import (L1_AVAILABLE, check_budget, check_operands, divisors_descending, l1_elements, largest_dividing,
                   nbytes, pingpong_copies, require)

KIND = "gemv"
F32_KIND = "gemv_f32"
PARAMS = ("K", "N")
TUNING = ("herd", "steps", "tile_n", "rows_per_call")
OBJECT = "gemv.o"
GEMV_ROLES = ("x", "w", "y")
SYMBOL_FOR_OUTPUT = {"bf16": "gemv_bf16", "f32": "gemv_bf16_f32"}
ROWS_PER_CALL_CANDIDATES = (16, 8, 4, 2, 1)
DMA_GRANULE_BYTES = 4  # DMAs move whole 4-byte words
GEMV_K_GRANULE = 32
MAX_TILE_N = 1024
MIN_PANELS = 16  # panels per tile before a larger panel is preferred: the first panel's DMA is not overlapped
PINGPONG_TRIPS = 4  # the fewest trips of a loop AIR's ping-pong transform double-buffers (kernels/timing.py)
PACKED_MIN_ROWS = 4


PACKED_DTYPE = "i32"  # a packed weight's rows, in 32-bit words
PACKED_SYMBOLS = {"gemv_bf16": "gemv_q_bf16", "gemv_bf16_f32": "gemv_q_bf16_f32",
                  "gemv_partial_f32": "gemv_q_partial_f32", "gemv_rows_bf16": "gemv_q_rows_bf16"}


@dataclass(frozen=True)
class WeightRows:
    """How a launch's W rows are stored: bf16 elements, or the bytes of packed block-quantized rows."""
    name: str  # "bf16" or a kernels/quant.py format

    @property
    def packed(self) -> bool:
        return self.name != "bf16"

    @property
    def dtype(self) -> str:
        return PACKED_DTYPE if self.packed else "bf16"

    def row(self, k: int) -> int:
        """W memref elements of a row (or a chunk of whole groups of one) of k weights."""
        return weight_format(self.name).row_bytes(k) // 4 if self.packed else k

    def nbytes(self, rows: int, k: int) -> int:
        return nbytes((rows, self.row(k)), self.dtype)

    def l1_row_granule(self, k: int) -> int:
        """The fewest rows of k weights that fill an L1 buffer of whole vector-alignment runs (builders/ir.py): 1
        for bf16 rows (k a multiple of 32), up to 4 for packed ones (whole runs of their format's alignment)."""
        return L1_BUFFER_GRANULE // math.gcd(self.nbytes(1, k), L1_BUFFER_GRANULE)

    def whole_l1(self, rows: int, k: int) -> bool:
        return rows % self.l1_row_granule(k) == 0

    def chunk_granule(self, K: int) -> int:
        """What a chunk of a row of K elements is a multiple of: whole groups of a packed row (kernels/quant.py),
        else the GEMV's 32 elements."""
        return weight_format(self.name).group_blocks(K) * BLOCK if self.packed else GEMV_K_GRANULE

    def symbol(self, bf16_symbol: str) -> str:
        return PACKED_SYMBOLS[bf16_symbol] if self.packed else bf16_symbol

    def config(self, rows: int, k: int) -> dict[str, int]:
        config = {"GEMV_ROWS": rows, "GEMV_K": k}
        if self.packed:
            config["GEMV_QUANT"] = GEMV_QUANT[self.name]
        return config

    def prepare_x(self, b: LaunchBuilder, x: Value, length: int, config: dict[str, int]) -> None:
        """Puts the ``length`` elements of x in L1 (the whole buffer, or the head of a longer vector) in the order
        the packed calls built with ``config`` read them (gemv.cc's gemv_q_prepare_x: transposed per group of 32
        blocks), once per tile entry; bf16 rows and element-order groups read x as it is."""
        if self.packed and transposed(config["GEMV_K"]):
            b.call("gemv_q_prepare_x", [x, Value(b.const(length, "i32"), "i32")], config)


BF16_ROWS = WeightRows("bf16")


def weight_rows(kind: str, params: dict) -> WeightRows:
    name = params.get("weights", "bf16")
    require(name == "bf16" or name in GEMV_QUANT, kind, "weights", name,
            f"must be 'bf16' or a packed format ({', '.join(GEMV_QUANT)})")
    return WeightRows(name)


@dataclass(frozen=True)
class GemvPlan:
    herd: int
    steps: int          # launch steps
    rows_per_tile: int  # a tile's contiguous rows in one launch step
    tile_n: int         # rows of one panel, per tile
    rows_per_call: int

    @property
    def panels(self) -> int:
        return self.rows_per_tile // self.tile_n


def _l1_bytes(K: int, tile_n: int, rows_per_call: int, out_dtype: str,
              weights: WeightRows = BF16_ROWS) -> dict[str, int]:
    copies = pingpong_copies(tile_n // rows_per_call)
    return {"x": nbytes((K,), "bf16"), f"W rows x{copies} (ping-pong)": copies * weights.nbytes(rows_per_call, K),
            f"y per call x{copies}": copies * nbytes((l1_elements(rows_per_call, out_dtype),), out_dtype),
            "y": nbytes((l1_elements(tile_n, out_dtype),), out_dtype)}


def _l2_bytes(K: int, tile_n: int, panels: int, out_dtype: str,
              weights: WeightRows = BF16_ROWS) -> dict[str, int]:
    """The fullest memtile: AIR's air-split-l2-memref gives the rows each tile reads (and the results it writes) a
    memtile buffer of their own, the ping-pong transform copies them for the panel loop, and x sits in one."""
    copies = pingpong_copies(panels)
    return {f"W rows of one tile x{copies} (ping-pong)": copies * weights.nbytes(tile_n, K),
            f"y of one tile x{copies}": copies * nbytes((tile_n,), out_dtype), "x": nbytes((K,), "bf16")}


def whole_words(rows: int, dtype: str) -> bool:
    return nbytes((rows,), dtype) % DMA_GRANULE_BYTES == 0


def panel_candidates(kind: str, rows_per_tile: int, dtype: str | None, tuning: dict) -> list[int]:
    """Panel heights to try, best first: the tuned one, or the divisors of a tile's rows in whole words of y (a
    value of ``dtype`` per row; None: each row's output is whole words whatever the height), those leaving at least
    MIN_PANELS panels first (largest first), then the rest (smallest first)."""
    def whole(t: int) -> bool:
        return dtype is None or whole_words(t, dtype)

    if "tile_n" in tuning:
        tile_n = tuning["tile_n"]
        require(rows_per_tile % tile_n == 0 and whole(tile_n), kind, "tile_n", tile_n,
                f"must divide the {rows_per_tile} rows a tile owns per step" + (
                    "" if dtype is None else f" and span whole {DMA_GRANULE_BYTES}-byte words of y"))
        return [tile_n]
    tiles = [t for t in divisors_descending(rows_per_tile, MAX_TILE_N) if whole(t)]
    require(bool(tiles), kind, "N", rows_per_tile, f"a tile's {rows_per_tile} rows have no panel of whole "
            f"{DMA_GRANULE_BYTES}-byte words")
    streaming = [t for t in tiles if rows_per_tile // t >= MIN_PANELS]
    return streaming + sorted(t for t in tiles if t not in streaming)


def whole_l1_calls(kind: str, candidates: list, weights: WeightRows, k_of) -> list:
    """The (tile_n, rows_per_call, ...) candidates whose call's W buffer (rows_per_call rows of ``k_of(candidate)``
    weights) is whole vector-alignment runs: a packed row is whole runs of its format's alignment only (16 bytes in
    Q4), so a call of 1 or 2 such rows would leave the buffers after it off the boundary."""
    whole = [c for c in candidates if weights.whole_l1(c[1], k_of(c))]
    require(bool(whole), kind, "rows_per_call", candidates[0][1],
            f"no call of {weights.name} rows whose W buffer is whole {L1_BUFFER_GRANULE}-byte runs among (tile_n, "
            f"rows_per_call) {sorted({c[:2] for c in candidates})}")
    return whole


def double_buffered(rows_per_tile: int, tile_n: int, rows_per_call: int) -> bool:
    """A plan packed calls prefer (they do enough work per row for the schedule to matter): its calls AIR
    double-buffers (an even count of at least PINGPONG_TRIPS per panel: the ping-pong transform unrolls two trips
    away, and of an odd count it runs the last trip alone, on a third copy of the buffers), its panels in ping-pong
    pairs, and calls of at least PACKED_MIN_ROWS rows (a call's own work, x's per-block sums, is shared by its
    rows)."""
    calls = tile_n // rows_per_call
    return (calls >= PINGPONG_TRIPS and calls % 2 == 0 and (rows_per_tile // tile_n) % 2 == 0
            and rows_per_call >= PACKED_MIN_ROWS)


def split_rows(kind: str, N: int, tuning: dict, herd_candidates=DEVICE.herd_candidates,
               granule: int = 1) -> tuple[int, int, int]:
    """(herd, steps, rows_per_tile): the widest herd dividing N (into whole ``granule`` rows per tile when any
    does), one launch step unless tuned."""
    whole = largest_dividing(N // granule, herd_candidates) if N % granule == 0 else None
    herd = tuning.get("herd", whole or largest_dividing(N, herd_candidates))
    require(herd is not None and herd <= DEVICE.columns, kind, "herd", herd,
            f"the herd spans at most {DEVICE.columns} columns")
    require(N % herd == 0, kind, "herd", herd, f"must divide N={N}")
    steps = tuning.get("steps", 1)
    require((N // herd) % steps == 0, kind, "steps", steps, f"must divide N/herd={N // herd}")
    return herd, steps, N // (herd * steps)


def plan_gemv(kind: str, K: int, N: int, out_dtype: str, tuning: dict, weights: WeightRows = BF16_ROWS) -> GemvPlan:
    """Widest herd dividing N, one launch step, then the panel (see :func:`panel_candidates`) and the most rows
    per call that fit L1 and a memtile."""
    require(K % GEMV_K_GRANULE == 0, kind, "K", K,
            f"must be a multiple of {GEMV_K_GRANULE} (gemv.cc's 32-lane bf16 multiplier)")
    herd, steps, rows_per_tile = split_rows(kind, N, tuning, granule=weights.l1_row_granule(K))
    tiles = panel_candidates(kind, rows_per_tile, out_dtype, tuning)
    calls = [tuning["rows_per_call"]] if "rows_per_call" in tuning else list(ROWS_PER_CALL_CANDIDATES)
    candidates = [(tile_n, rows) for tile_n in tiles for rows in calls if tile_n % rows == 0]
    require(bool(candidates), kind, "rows_per_call", calls[0], f"must divide tile_n (candidates {tiles})")
    candidates = whole_l1_calls(kind, candidates, weights, lambda _: K)
    if weights.packed:
        preferred = [c for c in candidates if double_buffered(rows_per_tile, *c)]
        candidates = preferred + [c for c in candidates if c not in preferred]

    def fits(tile_n: int, rows: int) -> bool:
        return (sum(_l1_bytes(K, tile_n, rows, out_dtype, weights).values()) <= L1_AVAILABLE
                and sum(_l2_bytes(K, tile_n, rows_per_tile // tile_n, out_dtype, weights).values()) <= DEVICE.l2_bytes)

    tile_n, rows_per_call = next((c for c in candidates if fits(*c)), candidates[-1])
    check_budget(kind, "L1", _l1_bytes(K, tile_n, rows_per_call, out_dtype, weights), "K is too long for one tile")
    check_budget(kind, "L2", _l2_bytes(K, tile_n, rows_per_tile // tile_n, out_dtype, weights), "lower tile_n")
    # AIR folds the panel loop into a shim BD's wraps: at K=896, 1021 panels of 16 lower in 1 s, 1031 ran past 2 minutes
    # and 1187 (Qwen2's 151936-row LM head) past 8 in air-opt-shim-dma-bds before they were stopped
    require(rows_per_tile // tile_n <= DEVICE.shim_wrap_max, kind, "N", N,
            f"a tile walks its {rows_per_tile} rows per step in {rows_per_tile // tile_n} panels of {tile_n}, more "
            f"than a shim BD's {DEVICE.shim_wrap_max} wraps: pad N (an LM head: catalog.lm_head_rows) or raise steps")
    return GemvPlan(herd, steps, rows_per_tile, tile_n, rows_per_call)


def _build(kind: str, out_dtype: str, params: dict, operands, tuning: dict) -> LaunchIR:
    K, N = params["K"], params["N"]
    weights = weight_rows(kind, params)
    check_operands(kind, operands, [("x", {(K,)}, "bf16"), ("W", {(N, weights.row(K))}, weights.dtype),
                                    ("y", {(N,)}, out_dtype)])
    plan = plan_gemv(kind, K, N, out_dtype, tuning, weights)
    b = LaunchBuilder(kind, operands, GEMV_ROLES)
    _emit(b, kind, K, N, plan, out_dtype, weights)
    return b.finish(_l1_bytes(K, plan.tile_n, plan.rows_per_call, out_dtype, weights))


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    return _build(KIND, "bf16", params, operands, tuning)


def build_f32(params: dict, operands, tuning: dict) -> LaunchIR:
    return _build(F32_KIND, "f32", params, operands, tuning)


def describe(plan: GemvPlan) -> str:
    return (f"herd {plan.herd}x1, {plan.steps} launch step(s), {plan.rows_per_tile} rows per tile per step in "
            f"{plan.panels} panels of {plan.tile_n}")


def panel_windows(plan, K: int, panel_row0: str) -> tuple[Window, Window]:
    """(W, y) windows of one panel in DDR (``K``: W's row length in its memref's elements):
    ``herd * tile_n`` consecutive rows, ``tile_n`` per tile, with the
    tile as the leading dimension: air-split-l2-memref (0e3df89d) splits these per tile, where a flat window
    of the same rows made it emit an affine map that fails to verify."""
    n = plan.tile_n
    return (Window((0, panel_row0, 0), (plan.herd, n, K), (n * K, K, 1)),
            Window((0, panel_row0), (plan.herd, n), (n, 1)))


@contextmanager
def panel_loop(b: LaunchBuilder, plan, step: Value, rows_per_value: int = 1):
    """Inside a segment: loops over the step's panels; yields (the panel's first DDR row, its first output value),
    one and the same unless the launch writes one value per ``rows_per_value`` rows.

    One affine.apply of the step and the panel each: air-split-l2-memref (0e3df89d) composes a chain of two into a
    map that uses two symbols but declares one, which fails to verify."""
    def start(per: int, name: str) -> str:
        return b.affine(f"s0 * {plan.herd * plan.rows_per_tile // per} + s1 * {plan.herd * plan.tile_n // per}",
                        [step.ssa, panel], name)

    with b.loop(0, plan.panels, 1, "panel") as panel:
        row0 = start(1, "panel_row0")
        yield row0, row0 if rows_per_value == 1 else start(rows_per_value, "panel_value0")


def _emit(b: LaunchBuilder, name: str, K: int, rows: int, plan: GemvPlan, out_dtype: str, weights: WeightRows) -> None:
    b.comment(f"{name} K={K} N={rows} weights={weights.name}: {describe(plan)}, {plan.rows_per_call} rows per call")
    R = weights.row(K)
    with b.launch(name, (plan.steps, 1), b.operands) as ((step, _), _, (x, w, y)):
        with b.segment(f"{name}_seg", [Value(step, "index"), x, w, y]) as (_, _, (seg_step, sx, sw, sy)):
            x_l2 = b.alloc(MemRef((K,), "bf16", L2), "x_l2")
            w_panel = b.alloc(MemRef((plan.herd, plan.tile_n, R), weights.dtype, L2), "w_l2")
            y_panel = b.alloc(MemRef((plan.herd, plan.tile_n), out_dtype, L2), "y_l2")
            b.dma(x_l2, WHOLE, sx, WHOLE)
            with panel_loop(b, plan, seg_step) as (panel_row0, _):
                w_window, y_window = panel_windows(plan, R, panel_row0)
                b.dma(w_panel, WHOLE, sw, w_window)
                with b.herd(f"{name}_herd", (plan.herd, 1), [x_l2, w_panel, y_panel], link_with=OBJECT) as (
                        (tx, _), _, (hx, hw, hy)):
                    _emit_tile(b, K, plan, out_dtype, weights, tx, hx, hw, hy)
                b.dma(sy, y_window, y_panel, WHOLE)
            b.dealloc(x_l2, w_panel, y_panel)


def _emit_tile(b: LaunchBuilder, K: int, plan: GemvPlan, out_dtype: str, weights: WeightRows, tx, hx, hw, hy) -> None:
    R = weights.row(K)
    x_buf = b.alloc(MemRef((K,), "bf16", L1), "x_l1")
    w_buf = b.alloc(MemRef((plan.rows_per_call, R), weights.dtype, L1), "w_l1")
    y_call = b.alloc(MemRef((l1_elements(plan.rows_per_call, out_dtype),), out_dtype, L1), "y_call_l1")
    y_buf = b.alloc(MemRef((l1_elements(plan.tile_n, out_dtype),), out_dtype, L1), "y_l1")
    b.broadcast_dma(x_buf, WHOLE, hx, Window((0,), (K,), (1,)))
    config = weights.config(plan.rows_per_call, K)
    weights.prepare_x(b, x_buf, K, config)
    with b.loop(0, plan.tile_n, plan.rows_per_call, "r") as r:
        b.dma(w_buf, WHOLE, hw, Window((tx, r, 0), (1, plan.rows_per_call, R), (plan.tile_n * R, R, 1)))
        b.call(weights.symbol(SYMBOL_FOR_OUTPUT[out_dtype]), [w_buf, x_buf, y_call], config)
        # A few scalars: cheaper than a DMA per call, and no sub-word transfers.
        with b.loop(0, plan.rows_per_call, 1, "i") as i:
            value = b.assign("y_value", f"memref.load {y_call.ssa}[{i}] : {y_call.type}", out_dtype)
            index = b.affine("s0 + s1", [r, i], "y_index")
            b.emit(f"memref.store {value.ssa}, {y_buf.ssa}[{index}] : {y_buf.type}")
    b.dma(hy, Window((tx, 0), (1, plan.tile_n), (plan.tile_n, 1)), y_buf, Window((0,), (plan.tile_n,), (1,)))
    b.dealloc(x_buf, w_buf, y_call, y_buf)
