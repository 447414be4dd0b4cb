"""gemv(K, N): ``y[N] = W[N, K] · x[K]`` through the external ``gemv_bf16``; gemv_f32 for the LM head.

W is HF's (out, in) layout, so each output row is a contiguous K-vector: no transpose anywhere. gemv's y
is bf16; gemv_f32's y keeps the accumulator's precision (the LM head's logits), through ``gemv_bf16_f32``.

Schedule (per launch step, ``herd * tile_n`` output rows):

* DDR → memtile: the W panel of those rows; AIR gives each tile's ``tile_n`` rows a memtile buffer of
  their own (air-split-l2-memref), so the panel spans up to 8 memtiles.
* DDR → L1: x, once per tile per step. It is identical for every tile, so AIR broadcasts it.
* Each tile walks its rows ``rows_per_call`` at a time (W rows L2 → L1, double-buffered, one kernel
  call, its outputs copied into the tile's ``tile_n`` results), then sends those back through the
  memtile. The kernel's row count and K are compile-time (GEMV_ROWS, GEMV_K), so the call writes a
  buffer of exactly ``rows_per_call`` outputs.

Fewer, larger launch steps compile faster and need fewer shim buffer descriptors, so each tile takes the
most rows a memtile holds.

Constraints: K a multiple of 32; herd divides N; tile_n divides N/herd and is whole 4-byte words of y;
rows_per_call divides tile_n; x, double-buffered W rows and y fit L1; one tile's W rows and results fit
one memtile.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import L1, L2, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window
from .npu2 import (COLUMNS, HERD_CANDIDATES, L1_AVAILABLE, L2_BYTES, check_budget, check_operands, check_params,
                   check_tuning, divisors_descending, largest_dividing, nbytes, pingpong_copies, require)

KIND = "gemv"
F32_KIND = "gemv_f32"
PARAMS = ("K", "N")
TUNING = ("herd", "tile_n", "rows_per_call")
OBJECT = "gemv.o"
GEMV_ROLES = ("x", "w", "y")
SYMBOL_FOR_OUTPUT = {"bf16": "gemv_bf16", "f32": "gemv_bf16_f32"}
ROWS_PER_CALL_CANDIDATES = (16, 8, 4, 2, 1)
DMA_GRANULE_BYTES = 4  # DMAs move whole 4-byte words
GEMV_K_GRANULE = 32
MAX_TILE_N = 1024


@dataclass(frozen=True)
class GemvPlan:
    herd: int
    tile_n: int
    rows_per_call: int

    @property
    def panel_rows(self) -> int:
        return self.herd * self.tile_n


def _l1_bytes(K: int, tile_n: int, rows_per_call: int, out_dtype: str) -> dict[str, int]:
    copies = pingpong_copies(tile_n // rows_per_call)
    return {"x": nbytes((K,), "bf16"), f"W rows x{copies} (ping-pong)": copies * nbytes((rows_per_call, K), "bf16"),
            f"y per call x{copies}": copies * nbytes((rows_per_call,), out_dtype), "y": nbytes((tile_n,), out_dtype)}


def _l2_bytes(K: int, tile_n: int, out_dtype: str) -> dict[str, int]:
    """One memtile's share of a step's panel: AIR's air-split-l2-memref gives the rows each tile reads (and
    the results it writes) a memtile buffer of their own."""
    return {"W rows of one tile": nbytes((tile_n, K), "bf16"), "y of one tile": nbytes((tile_n,), out_dtype)}


def plan_gemv(kind: str, K: int, N: int, out_dtype: str, tuning: dict) -> GemvPlan:
    """Widest herd dividing N, then the longest tile that fits a memtile (fewest launch steps), then the
    most rows per call that fit L1."""
    require(K % GEMV_K_GRANULE == 0, kind, "K", K,
            f"must be a multiple of {GEMV_K_GRANULE} (gemv.cc's 32-lane bf16 multiplier)")
    herd = tuning.get("herd", largest_dividing(N, HERD_CANDIDATES))
    require(herd <= COLUMNS, kind, "herd", herd, f"the herd spans at most {COLUMNS} columns")
    require(N % herd == 0, kind, "herd", herd, f"must divide N={N}")
    per_tile = N // herd

    def whole_words(rows: int) -> bool:
        return nbytes((rows,), out_dtype) % DMA_GRANULE_BYTES == 0

    if "tile_n" in tuning:
        tile_n = tuning["tile_n"]
        require(per_tile % tile_n == 0 and whole_words(tile_n), kind, "tile_n", tile_n,
                f"must divide N/herd={per_tile} and span whole {DMA_GRANULE_BYTES}-byte words of y")
        tiles = [tile_n]
    else:
        tiles = [t for t in divisors_descending(per_tile, MAX_TILE_N) if whole_words(t)]
        require(bool(tiles), kind, "N", N, f"N/herd={per_tile} has no tile of whole {DMA_GRANULE_BYTES}-byte words")
    calls = [tuning["rows_per_call"]] if "rows_per_call" in tuning else list(ROWS_PER_CALL_CANDIDATES)
    candidates = [(tile_n, rows) for tile_n in tiles for rows in calls if tile_n % rows == 0]
    require(bool(candidates), kind, "rows_per_call", calls[0], f"must divide tile_n (candidates {tiles})")

    def fits(tile_n: int, rows: int) -> bool:
        return (sum(_l1_bytes(K, tile_n, rows, out_dtype).values()) <= L1_AVAILABLE
                and sum(_l2_bytes(K, tile_n, out_dtype).values()) <= L2_BYTES)

    tile_n, rows_per_call = next((c for c in candidates if fits(*c)), candidates[-1])
    check_budget(kind, "L1", _l1_bytes(K, tile_n, rows_per_call, out_dtype), "K is too long for one tile")
    check_budget(kind, "L2", _l2_bytes(K, tile_n, out_dtype), "lower tile_n")
    return GemvPlan(herd, tile_n, rows_per_call)


def _build(kind: str, out_dtype: str, params: dict, operands, tuning: dict | None) -> LaunchIR:
    tuning = dict(tuning or {})
    check_params(kind, params, PARAMS)
    check_tuning(kind, tuning, TUNING)
    K, N = params["K"], params["N"]
    check_operands(kind, operands, [("x", {(K,)}, "bf16"), ("W", {(N, K)}, "bf16"), ("y", {(N,)}, out_dtype)])
    plan = plan_gemv(kind, K, N, out_dtype, tuning)
    b = LaunchBuilder(kind, operands, GEMV_ROLES)
    _emit(b, kind, K, N, plan, out_dtype)
    return b.finish()


def build(params: dict, operands, tuning: dict | None = None) -> LaunchIR:
    return _build(KIND, "bf16", params, operands, tuning)


def build_f32(params: dict, operands, tuning: dict | None = None) -> LaunchIR:
    return _build(F32_KIND, "f32", params, operands, tuning)


def _emit(b: LaunchBuilder, name: str, K: int, rows: int, plan: GemvPlan, out_dtype: str) -> None:
    panel = plan.panel_rows
    b.comment(f"{name} K={K} N={rows}: herd {plan.herd}x1, {plan.tile_n} rows per tile per step, {rows // panel} "
              f"launch steps, {plan.rows_per_call} rows per call")
    with b.launch(name, (rows // panel, 1), b.operands) as ((step, _), _, (x, w, y)):
        with b.segment(f"{name}_seg", [Value(step, "index"), x, w, y]) as (_, _, (seg_step, sx, sw, sy)):
            row0 = b.affine(f"s0 * {panel}", [seg_step.ssa], "row0")
            w_panel = b.alloc(MemRef((panel, K), "bf16", L2), "w_l2")
            y_panel = b.alloc(MemRef((panel,), out_dtype, L2), "y_l2")
            b.dma(w_panel, WHOLE, sw, Window((row0, 0), (panel, K), (K, 1)))
            with b.herd(f"{name}_herd", (plan.herd, 1), [sx, w_panel, y_panel], link_with=OBJECT) as (
                    (tx, _), _, (hx, hw, hy)):
                x_buf = b.alloc(MemRef((K,), "bf16", L1), "x_l1")
                w_buf = b.alloc(MemRef((plan.rows_per_call, K), "bf16", L1), "w_l1")
                y_call = b.alloc(MemRef((plan.rows_per_call,), out_dtype, L1), "y_call_l1")
                y_buf = b.alloc(MemRef((plan.tile_n,), out_dtype, L1), "y_l1")
                b.broadcast_dma(x_buf, WHOLE, hx, Window((0,), (K,), (1,)))
                config = {"GEMV_ROWS": plan.rows_per_call, "GEMV_K": K}
                with b.loop(0, plan.tile_n, plan.rows_per_call, "r") as r:
                    w_row = b.affine(f"s0 * {plan.tile_n} + s1", [tx, r], "w_row")
                    b.dma(w_buf, WHOLE, hw, Window((w_row, 0), (plan.rows_per_call, K), (K, 1)))
                    b.call(SYMBOL_FOR_OUTPUT[out_dtype], [w_buf, x_buf, y_call], config)
                    # A few scalars: cheaper than a DMA per call, and no sub-word transfers.
                    with b.loop(0, plan.rows_per_call, 1, "i") as i:
                        value = b.assign("y_value", f"memref.load {y_call.ssa}[{i}] : {y_call.type}", out_dtype)
                        index = b.affine("s0 + s1", [r, i], "y_index")
                        b.emit(f"memref.store {value.ssa}, {y_buf.ssa}[{index}] : {y_buf.type}")
                y_col = b.affine(f"s0 * {plan.tile_n}", [tx], "y_col")
                b.dma(hy, Window((y_col,), (plan.tile_n,), (1,)), y_buf, WHOLE)
                b.dealloc(x_buf, w_buf, y_call, y_buf)
            b.dma(sy, Window((row0,), (panel,), (1,)), y_panel, WHOLE)
            b.dealloc(w_panel, y_panel)
