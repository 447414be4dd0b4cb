"""dequant_rows(K, N): packed block-quantized rows (kernels/quant.py) to the bf16 weight ``out[N, K]`` on the cores,
through gemv.cc's ``gemv_q_dequant_bf16``: each weight GGUF's fp32 value rounded once to bf16.

What the prefill GEMMs read when a model keeps its projections packed: the dequantization runs where the weights
already are, instead of on the host, and writes the bf16 rows the GEMMs then stream from DDR (each layer's bf16 rows
written to DDR once per prefill and read back by its GEMMs; the GEMMs do not read packed rows themselves).

Param ``weights``: the packed format ("q4_0", "q4_1", "q8_0"). W is its rows as (N, row_bytes / 4) 32-bit words.

Schedule, gemv's (builders/gemv.py: herd, launch steps, panels of ``herd * tile_n`` consecutive rows, ``tile_n``
per tile): per panel, its packed rows DDR → memtile; in the herd, each tile's rows ``rows_per_call`` at a time
memtile → L1, one kernel call, the bf16 rows L1 → memtile; then the panel's bf16 rows memtile → DDR. The DMAs
and the herd share the panel loop, so AIR double-buffers the memtile buffers.

Constraints: K a multiple of 32 (whole blocks); herd divides N; steps divides N/herd; rows_per_call divides
tile_n, which divides a tile's rows; the double-buffered packed and bf16 rows of a call fit L1, a tile's packed
and bf16 rows of a panel, times the ping-pong copies, one memtile; at most a shim BD's wraps of panels.
"""
from __future__ import annotations

from ..device import DEVICE
from .gemv import (GEMV_K_GRANULE, OBJECT, PINGPONG_TRIPS, ROWS_PER_CALL_CANDIDATES, GemvPlan, WeightRows, describe,
                   panel_candidates, panel_loop, panel_windows, split_rows, weight_rows, whole_l1_calls)
from .ir import L1, L2, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window
from .npu2 import L1_AVAILABLE, check_budget, check_operands, nbytes, pingpong_copies, require

KIND = "dequant_rows"
PARAMS = ("K", "N")
TUNING = ("herd", "steps", "tile_n", "rows_per_call")
SYMBOL = "gemv_q_dequant_bf16"


def _l1_bytes(K: int, tile_n: int, rows_per_call: int, weights: WeightRows) -> dict[str, int]:
    copies = pingpong_copies(tile_n // rows_per_call)
    return {f"packed rows x{copies} (ping-pong)": copies * weights.nbytes(rows_per_call, K),
            f"bf16 rows x{copies}": copies * nbytes((rows_per_call, K), "bf16")}


def _l2_bytes(K: int, tile_n: int, panels: int, weights: WeightRows) -> dict[str, int]:
    """The fullest memtile: one tile's packed rows and bf16 rows of a panel (AIR's air-split-l2-memref gives each
    tile's its own memtile buffer), times the ping-pong copies of the panel loop."""
    copies = pingpong_copies(panels)
    return {f"packed rows of one tile x{copies} (ping-pong)": copies * weights.nbytes(tile_n, K),
            f"bf16 rows of one tile x{copies}": copies * nbytes((tile_n, K), "bf16")}


def plan(K: int, N: int, weights: WeightRows, tuning: dict) -> GemvPlan:
    """The widest herd dividing N and one launch step (unless tuned), then the most rows per call and, for it, the
    first panel in gemv's order (``panel_candidates``) that fit L1 and a memtile, calls double-buffered first."""
    herd, steps, rows_per_tile = split_rows(KIND, N, tuning, granule=weights.l1_row_granule(K))
    calls = [tuning["rows_per_call"]] if "rows_per_call" in tuning else list(ROWS_PER_CALL_CANDIDATES)
    tiles = panel_candidates(KIND, rows_per_tile, None, tuning)  # an output row is K values: any height will do
    candidates = [(t, r) for r in calls for t in tiles if t % r == 0]
    require(bool(candidates), KIND, "rows_per_call", calls[0], f"must divide tile_n (candidates {tiles})")
    candidates = whole_l1_calls(KIND, candidates, weights, lambda _: K)
    # calls that AIR double-buffers first (an even trip count of at least PINGPONG_TRIPS: no odd trip left over with
    # buffers of its own): a tile then reads the next rows and writes the last ones while it works. Unlike the packed
    # GEMVs (gemv.double_buffered), a call shares no work among its rows, so any count of rows per call will do.
    overlapped = [c for c in candidates if c[0] // c[1] >= PINGPONG_TRIPS and (c[0] // c[1]) % 2 == 0]
    candidates = overlapped + [c for c in candidates if c not in overlapped]

    def fits(tile_n: int, rows: int) -> bool:
        return (sum(_l1_bytes(K, tile_n, rows, weights).values()) <= L1_AVAILABLE
                and sum(_l2_bytes(K, tile_n, rows_per_tile // tile_n, weights).values()) <= DEVICE.l2_bytes)

    tile_n, rows_per_call = next((c for c in candidates if fits(*c)), candidates[-1])
    check_budget(KIND, "L1", _l1_bytes(K, tile_n, rows_per_call, weights), "K is too long for one tile")
    check_budget(KIND, "L2", _l2_bytes(K, tile_n, rows_per_tile // tile_n, weights), "lower tile_n")
    require(rows_per_tile // tile_n <= DEVICE.shim_wrap_max, KIND, "N", N,
            f"a tile walks its {rows_per_tile} rows per step in {rows_per_tile // tile_n} panels of {tile_n}, more "
            f"than a shim BD's {DEVICE.shim_wrap_max} wraps: raise steps")
    return GemvPlan(herd, steps, rows_per_tile, tile_n, rows_per_call)


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    K, N = params["K"], params["N"]
    weights = weight_rows(KIND, params)
    require(weights.packed, KIND, "weights", weights.name, "must be a packed format (bf16 rows need no dequantizing)")
    require(K % GEMV_K_GRANULE == 0, KIND, "K", K, f"must be a multiple of {GEMV_K_GRANULE} (whole blocks)")
    R = weights.row(K)
    check_operands(KIND, operands, [("W", {(N, R)}, weights.dtype), ("out", {(N, K)}, "bf16")])
    p = plan(K, N, weights, tuning)
    config = weights.config(p.rows_per_call, K)
    b = LaunchBuilder(KIND, operands, ("w", "out"))
    b.comment(f"{KIND} K={K} N={N} weights={weights.name}: {describe(p)}, {p.rows_per_call} rows per call")
    with b.launch(KIND, (p.steps, 1), b.operands) as ((step, _), _, (w, out)):
        with b.segment(f"{KIND}_seg", [Value(step, "index"), w, out]) as (_, _, (seg_step, sw, sout)):
            w_panel = b.alloc(MemRef((p.herd, p.tile_n, R), weights.dtype, L2), "w_l2")
            out_panel = b.alloc(MemRef((p.herd, p.tile_n, K), "bf16", L2), "out_l2")
            with panel_loop(b, p, seg_step) as (panel_row0, _):
                b.dma(w_panel, WHOLE, sw, panel_windows(p, R, panel_row0)[0])
                with b.herd(f"{KIND}_herd", (p.herd, 1), [w_panel, out_panel], link_with=OBJECT) as (
                        (tx, _), _, (hw, hout)):
                    w_buf = b.alloc(MemRef((p.rows_per_call, R), weights.dtype, L1), "w_l1")
                    out_buf = b.alloc(MemRef((p.rows_per_call, K), "bf16", L1), "out_l1")
                    with b.loop(0, p.tile_n, p.rows_per_call, "r") as r:
                        b.dma(w_buf, WHOLE, hw, Window((tx, r, 0), (1, p.rows_per_call, R), (p.tile_n * R, R, 1)))
                        b.call(SYMBOL, [w_buf, out_buf], config)
                        b.dma(hout, Window((tx, r, 0), (1, p.rows_per_call, K), (p.tile_n * K, K, 1)), out_buf, WHOLE)
                    b.dealloc(w_buf, out_buf)
                b.dma(sout, panel_windows(p, K, panel_row0)[0], out_panel, WHOLE)
            b.dealloc(w_panel, out_panel)
    return b.finish(_l1_bytes(K, p.tile_n, p.rows_per_call, weights))
