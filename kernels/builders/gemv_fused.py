"""The fused decode-FFN launches, after upstream's 3-launch o_gemv_ffn (mlir-air
``llms/shared/builders/o_gemv_ffn_multi.py``): no projection or norm result crosses DDR on its own; only
the post-attention residual and the SwiGLU activation cross between launches.

* gemv_add(K, N): ``y[N] = bf16(W[N, K] · x[K]) + residual[N]`` (upstream's ``matvec_2tile_add``). Up to
  K=2048 a call takes ``rows_per_call`` whole rows (``gemv_partial_f32`` then ``gemv_add_bf16``); a longer
  K (Llama-3.2-1B's 8192-long down projection) is split: one loop over K chunks of ``k_chunk``, each call
  adding a chunk of all the tile's rows to fp32 partial sums in L1, then the rounding and the residual add.
* rms_gemv(K, N, eps): ``y = W · (rmsnorm(x) * norm_w)``; each tile normalizes the whole x itself
  (``rmsnorm_bf16``: about K MACs, once per panel, since the herd is entered per panel: next to the panel's
  tile_n rows of K MACs each), then walks its rows (``gemv_rows_bf16``). Keeping the normalized x in a
  segment-scope L1 slab across the panels' herds (as the GEMMs keep their accumulators) did not get through this
  AIR: placement failed on some Programs ("operand does not dominate this use"), aiecc on others, and where both
  passed aiecc placed more L1 than the plan.
  Optional param ``gate_up``: W is [w_gate | w_up] (N/2 × 2K, the two weights side by side in each row), read as
  N rows of K, so that each tile's rows interleave gate and up (g0, u0, g1, u1, ...): both projections in one
  launch. With ``swiglu`` as well, each tile applies SiLU·up to its pairs (``swiglu_bf16``, in place) before its
  rows leave, and y is the N/2 products: the activation, made once per pair by the tile that projected it.

o_gemv_ffn is gemv_add → rms_gemv (gate, up and SwiGLU) → gemv_add (down): upstream's three launches, SwiGLU in the
middle one as upstream's ``matvec_swiglu_rms`` makes it (ours made it in the down launch before, where every tile
made the whole activation once per panel).
Every launch keeps the unfused chain's rounding points (projection to bf16, then the add; gate and up to bf16,
then SiLU and the product), so the fused Program computes what the 8-launch one did.

Departures from upstream, each for a limit of this AIR (0e3df89d) or of our weights:

* No cascade. Upstream reduces a 4-tile K-split over ``npu_cascade`` channels and hands the residual add to
  a second tile over one. This AIR lowers cascade channels (a 4-tile reduction over one reaches NPU
  instructions here), but it predates upstream's fixes for them: placement of cascade chains across 3+ herds
  (#1583), air-collapse-herd with cascades (#1554), and re-arming cascade locks when a single-trip launch is
  dispatched again (#1694; before it the second dispatch hangs). The launches that would carry it (gemv_add and
  the plain gemvs) are single-trip and run once per token, so K-split partial sums stay in
  the tile's own L1.
* Gate and up in one stream. A compute tile has two S2MM channels, which this AIR cannot share between
  streams from different sources, so gate rows, up rows and the vector cannot arrive separately (two herds in
  one segment, or a panel filled from two buffers, were refused). The weights are one buffer instead,
  [w_gate | w_up] (F × 2H, the two side by side in each row: kernels/catalog.py), read as 2F rows of H, so a
  tile's panel holds gate and up rows alternately and its y interleaves them, pairs its ``swiglu`` calls
  join.
* Each tile gets exactly two streams: its weight rows, and one packed vector (x with the panel's residual
  rows; x with the norm weight) that the segment gathers in a
  memtile from its DDR pieces and broadcasts to the herd. DDR → array streams are one per tile (AIR gives
  each tile's share of a panel its own memtile buffer, fed by its own shim channel) plus one per
  vector piece, at most 16 (two MM2S per shim tile).

The memtile holds a panel as ``[herd][tile_n][row]`` (as gemv.py's), each tile reading its rows with its index
leading: staged as ``[panel rows][row]`` while a tile read its rows a call at a time, this AIR's air-split-l2-memref
gave each tile's DDR transfer the whole panel's rows (README, "Shim BDs inside their arguments").

Schedule, as in gemv.py: each tile owns a contiguous run of rows per launch step (one step unless tuned) and
walks it ``tile_n`` rows at a time; the segment loops over these panels, and each trip moves the packed
vector (with the panel's residual rows) and the panel's weight rows DDR → memtile, enters the herd, and
moves the panel's results memtile → DDR, so AIR's ping-pong transform streams the next panel in while the
herd works. Every write of the packed vector sits inside that loop, so both of its ping-pong copies are
whole; x is read again per panel (a few KiB next to the panel's weights). Offsets inside herds derive from
tile ids and the herd's own loop indices only (no launch-id or panel-index runtime parameters).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..device import DEVICE
from .gemv import (BF16_ROWS, GEMV_K_GRANULE, OBJECT, ROWS_PER_CALL_CANDIDATES, GemvPlan, WeightRows, describe,
                   double_buffered, panel_candidates, panel_loop, panel_windows, split_rows, weight_rows, whole_l1_calls,
                   whole_words)
from .ir import L1, L2, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window
from .npu2 import (L1_AVAILABLE, check_budget, check_operands, divisors_descending, l1_elements, nbytes, pingpong_copies,
                   require)

ADD_KIND = "gemv_add"
RMS_KIND = "rms_gemv"
PARAMS = ("K", "N")
TUNING = ("herd", "steps", "tile_n", "rows_per_call", "k_chunk")
RMS_PARAMS = ("K", "N", "eps")
RMS_TUNING = ("herd", "steps", "tile_n", "rows_per_call")
# A split chunk's row is one dimension of a memtile BD, which aie.dma_bd holds to the device's limit in elements of
# its memref: bf16 elements for bf16 rows, 4-byte words for packed rows.
MAX_SPLIT_K_CHUNK = DEVICE.bd_dim_max_elements
MAX_CHUNK_WORDS = DEVICE.bd_dim_max_elements
MAX_WHOLE_K = 2048  # up to here a row is one chunk (a contiguous window: no per-dimension limit applies)
SHIM_MM2S_CHANNELS = DEVICE.shim_channels_per_direction * DEVICE.columns  # DDR → array streams
# Panels per launch step. The packed vector is read from DDR again every panel; AIR folds those reads into a
# shim BD with a stride-0 wrap, which aiecc rejects ("Stride 1 must be a positive integer") at 64 panels
# (measured on rms_gemv K=576, N=2048; 32 panels lower).
MAX_PANELS = 32
# rms_gemv's SwiGLU panels: whole gate/up pairs, and swiglu_bf16 takes 16 pairs per vector step (gemv.cc).
SWIGLU_PANEL_GRANULE = 32
# DDR → array streams of each kind: (per tile of the widest herd, shared vector pieces).
STREAMS = {ADD_KIND: (1, 2), RMS_KIND: (1, 2)}


@dataclass(frozen=True)
class FusedGemvPlan(GemvPlan):
    k_chunk: int        # K elements per call (K itself unless the K loop is split)

    @property
    def panel_rows(self) -> int:
        return self.herd * self.tile_n


def _k_chunk(kind: str, K: int, tuning: dict, weights: WeightRows) -> int:
    k_chunk = tuning["k_chunk"]
    granule = weights.chunk_granule(K)
    require(K % k_chunk == 0 and k_chunk % granule == 0, kind, "k_chunk", k_chunk,
            f"must divide K={K} and be a multiple of {granule}" + (" (whole groups of packed rows)"
                                                                   if weights.packed else ""))
    require(_chunk_fits(K, k_chunk, weights), kind, "k_chunk", k_chunk,
            f"a split chunk spans at most {MAX_SPLIT_K_CHUNK} elements (one DMA dimension)" if not weights.packed
            else f"a split chunk's row is one DMA dimension of at most {MAX_CHUNK_WORDS} words")
    return k_chunk


def _chunk_fits(K: int, k_chunk: int, weights: WeightRows) -> bool:
    """Whether a chunk of k_chunk elements of a row of K is one BD dimension (whole groups, when packed)."""
    if not weights.packed:
        return k_chunk <= MAX_SPLIT_K_CHUNK
    return k_chunk % weights.chunk_granule(K) == 0 and weights.nbytes(1, k_chunk) <= 4 * MAX_CHUNK_WORDS


def _vector_elements(kind: str, K: int, panel: int) -> int:
    """The packed vector each tile gets: x, then the panel's residual rows; or x, then the norm weight."""
    return {ADD_KIND: K + panel, RMS_KIND: 2 * K}[kind]


def _l1_bytes(kind: str, K: int, herd: int, tile_n: int, rows: int, k_chunk: int,
              weights: WeightRows = BF16_ROWS) -> dict[str, int]:
    trips = K // k_chunk if K > k_chunk else tile_n // rows  # the loop that refills the W buffer
    copies = pingpong_copies(trips)
    partial = nbytes((l1_elements(rows, "f32"),), "f32")
    buffers = {"packed vector": nbytes((l1_elements(_vector_elements(kind, K, herd * tile_n), "bf16"),), "bf16"),
               f"W chunk x{copies} (ping-pong)": copies * weights.nbytes(rows, k_chunk),
               "y": nbytes((l1_elements(tile_n, "bf16"),), "bf16")}
    if kind == RMS_KIND:
        buffers["normed x"] = nbytes((K,), "bf16")
    elif K > k_chunk:  # summed over the K loop's trips: one copy (a carried sum is never split)
        buffers["f32 partial sums"] = partial
    elif l1_elements(rows, "f32") == rows:  # refilled in every trip of the row loop, so copied like the W chunk
        buffers[f"f32 partial sums x{copies}"] = copies * partial
    else:  # padded, its tail zeroed before the row loop: AIR's ping-pong transform leaves a buffer used there single
        buffers["f32 partial sums"] = partial
    return buffers


def _tiles_per_memtile(herd: int) -> int:
    """aircc's air-collapse-herd{max-col-size=4} folds a herd of up to 4 tiles into one column, whose memtile
    then holds every tile's share of the panel; a wider herd keeps one column, so one memtile, per tile."""
    return herd if herd <= DEVICE.rows else 1


def _l2_bytes(kind: str, K: int, herd: int, tile_n: int, panels: int, weights: WeightRows = BF16_ROWS,
              per_value: int = 1) -> dict[str, int]:
    """The fullest memtile: the W rows and y (a value per ``per_value`` rows) of the tiles in its column, and maybe
    the packed vector, each copied by the ping-pong transform of the panel loop."""
    tiles, copies = _tiles_per_memtile(herd), pingpong_copies(panels)
    return {f"W rows of {tiles} tile(s) x{copies} (ping-pong)": copies * tiles * weights.nbytes(tile_n, K),
            f"y of {tiles} tile(s) x{copies}": copies * tiles * nbytes((tile_n // per_value,), "bf16"),
            f"packed vector x{copies}": copies * nbytes((_vector_elements(kind, K, tile_n * herd),), "bf16")}


def _candidates(kind: str, K: int, rows_per_tile: int, split: bool, tuning: dict,
                weights: WeightRows) -> list[tuple[int, int, int]]:
    """(tile_n, rows_per_call, k_chunk) to try for a tile's rows of one step, best first."""
    tiles = panel_candidates(kind, rows_per_tile, "bf16", tuning)
    if split:
        # One loop over K chunks, each call covering the tile's rows: AIR 0e3df89d's ping-pong transform
        # cannot double-buffer a DMA in a loop nested in another (fixed upstream in mlir-air #1626).
        if "rows_per_call" in tuning:
            rows = tuning["rows_per_call"]
            require(rows in tiles and tuning.get("tile_n", rows) == rows, kind, "rows_per_call", rows,
                    f"with K in chunks a call covers the tile's rows: must equal tile_n (candidates {tiles})")
            tiles = [rows]
        chunks = [_k_chunk(kind, K, tuning, weights)] if "k_chunk" in tuning else [
            c for c in divisors_descending(K) if c % GEMV_K_GRANULE == 0 and _chunk_fits(K, c, weights)]
        require(bool(chunks), kind, "K", K, "no K chunk of whole groups fits one DMA dimension")
        return whole_l1_calls(kind, [(tile_n, tile_n, k_chunk) for tile_n in tiles for k_chunk in chunks], weights,
                              lambda c: c[2])
    calls = [tuning["rows_per_call"]] if "rows_per_call" in tuning else list(ROWS_PER_CALL_CANDIDATES)
    candidates = [(tile_n, rows, K) for tile_n in tiles for rows in calls if tile_n % rows == 0]
    require(bool(candidates), kind, "rows_per_call", calls[0], f"must divide tile_n (candidates {tiles})")
    candidates = whole_l1_calls(kind, candidates, weights, lambda _: K)
    if weights.packed:  # as gemv.py's plan_gemv: double-buffered calls first
        preferred = [c for c in candidates if double_buffered(rows_per_tile, c[0], c[1])]
        candidates = preferred + [c for c in candidates if c not in preferred]
    return candidates


def plan(kind: str, K: int, N: int, tuning: dict, weights: WeightRows = BF16_ROWS, panel_granule: int = 1,
         per_value: int = 1) -> FusedGemvPlan:
    """Widest herd dividing N that the shim channels can feed; the fewest launch steps whose rows a tile walks
    in at most ``MAX_PANELS`` panels that fit; then the panel (gemv.py's :func:`~.gemv.panel_candidates`, a
    multiple of ``panel_granule`` rows) and the most rows per call that fit L1 and a memtile (K in chunks when a
    row is longer than ``MAX_WHOLE_K``; rms_gemv keeps K whole, its calls take the whole normed x). ``per_value``:
    W rows per value of y."""
    require(K % GEMV_K_GRANULE == 0, kind, "K", K, f"must be a multiple of {GEMV_K_GRANULE} (gemv.cc's multiplier)")
    per_tile_streams, shared_streams = STREAMS[kind]
    fed = [h for h in DEVICE.herd_candidates if per_tile_streams * h + shared_streams <= SHIM_MM2S_CHANNELS]
    herd, steps, rows_per_tile = split_rows(kind, N, tuning, fed,
                                            math.lcm(panel_granule, weights.l1_row_granule(K)))
    require(per_tile_streams * herd + shared_streams <= SHIM_MM2S_CHANNELS, kind, "herd", herd,
            f"{per_tile_streams} weight stream(s) per tile plus {shared_streams} vector pieces need more than "
            f"the {SHIM_MM2S_CHANNELS} shim MM2S channels")
    split = kind != RMS_KIND and (K > MAX_WHOLE_K or tuning.get("k_chunk", K) != K)

    def fits(rows_per_tile: int, tile_n: int, rows: int, k_chunk: int) -> bool:
        return (sum(_l1_bytes(kind, K, herd, tile_n, rows, k_chunk, weights).values()) <= L1_AVAILABLE
                and sum(_l2_bytes(kind, K, herd, tile_n, rows_per_tile // tile_n, weights, per_value).values())
                <= DEVICE.l2_bytes and tile_n % panel_granule == 0)

    step_choices = [steps] if "steps" in tuning else [
        s for s in reversed(divisors_descending(N // herd)) if whole_words(N // (herd * s), "bf16")
        and ("tile_n" not in tuning or (N // (herd * s)) % tuning["tile_n"] == 0)]
    for choice in step_choices:
        tile_rows = N // (herd * choice)
        good = [c for c in _candidates(kind, K, tile_rows, split, tuning, weights)
                if fits(tile_rows, *c) and tile_rows // c[0] <= MAX_PANELS]
        if good:
            steps, rows_per_tile, (tile_n, rows_per_call, k_chunk) = choice, tile_rows, good[0]
            break
    else:  # nothing fits: the first candidate that does, else the last, for the checks below to name
        candidates = _candidates(kind, K, rows_per_tile, split, tuning, weights)
        tile_n, rows_per_call, k_chunk = next((c for c in candidates if fits(rows_per_tile, *c)), candidates[-1])
    check_budget(kind, "L1", _l1_bytes(kind, K, herd, tile_n, rows_per_call, k_chunk, weights),
                 "K is too long for one tile" + ("" if kind == RMS_KIND else ", or lower k_chunk"))
    check_budget(kind, "L2", _l2_bytes(kind, K, herd, tile_n, rows_per_tile // tile_n, weights, per_value),
                 "lower tile_n")
    require(tile_n % panel_granule == 0, kind, "tile_n", tile_n, f"must be a multiple of {panel_granule}"
            + (" (whole gate/up pairs, 16 per swiglu_bf16 step)" if per_value == 2 else ""))
    require(rows_per_tile // tile_n <= MAX_PANELS, kind, "steps", steps,
            f"a tile walks its {rows_per_tile} rows per step in {rows_per_tile // tile_n} panels of {tile_n}, more "
            f"than {MAX_PANELS}: raise steps or tile_n")
    return FusedGemvPlan(herd, steps, rows_per_tile, tile_n, rows_per_call, k_chunk)


def build_add(params: dict, operands, tuning: dict) -> LaunchIR:
    kind = ADD_KIND
    K, N = params["K"], params["N"]
    weights = weight_rows(kind, params)
    R = weights.row(K)
    check_operands(kind, operands, [("x", {(K,)}, "bf16"), ("W", {(N, R)}, weights.dtype),
                                    ("residual", {(N,)}, "bf16"), ("y", {(N,)}, "bf16")])
    p = plan(kind, K, N, tuning, weights)
    panel = p.panel_rows
    b = LaunchBuilder(kind, operands, ("x", "w", "residual", "y"))
    b.comment(f"{kind} K={K} N={N} weights={weights.name}: {describe(p)}, {p.rows_per_call} rows per call, K in "
              f"chunks of {p.k_chunk}")
    with b.launch(kind, (p.steps, 1), b.operands) as ((step, _), _, launch_args):
        with b.segment(f"{kind}_seg", [Value(step, "index"), *launch_args]) as (_, _, (seg_step, sx, sw, sr, sy)):
            vector = b.alloc(MemRef((K + panel,), "bf16", L2), "vector_l2")
            w_panel = b.alloc(MemRef((p.herd, p.tile_n, R), weights.dtype, L2), "w_l2")
            y_panel = b.alloc(MemRef((panel,), "bf16", L2), "y_l2")
            with panel_loop(b, p, seg_step) as (panel_row0, _):
                w_window, rows_window = panel_windows(p, R, panel_row0)
                b.dma(vector, Window((0,), (K,), (1,)), sx, WHOLE)
                b.dma(vector, Window((K,), (panel,), (1,)), sr, rows_window)
                b.dma(w_panel, WHOLE, sw, w_window)
                with b.herd(f"{kind}_herd", (p.herd, 1), [vector, w_panel, y_panel], link_with=OBJECT) as (
                        (tx, _), _, (hv, hw, hy)):
                    _emit_add_tile(b, p, K, weights, tx, hv, hw, hy)
                b.dma(sy, rows_window, y_panel, WHOLE)
            b.dealloc(vector, w_panel, y_panel)
    return b.finish(_l1_bytes(kind, K, p.herd, p.tile_n, p.rows_per_call, p.k_chunk, weights))


def _emit_add_tile(b: LaunchBuilder, p: FusedGemvPlan, K: int, weights: WeightRows, tx, hv, hw, hy) -> None:
    R, chunk = weights.row(K), weights.row(p.k_chunk)
    vector = b.alloc(MemRef((l1_elements(K + p.panel_rows, "bf16"),), "bf16", L1), "vector_l1")
    w_buf = b.alloc(MemRef((p.rows_per_call, chunk), weights.dtype, L1), "w_l1")
    partial = b.alloc(MemRef((l1_elements(p.rows_per_call, "f32"),), "f32", L1), "partial_l1")
    y_buf = b.alloc(MemRef((l1_elements(p.tile_n, "bf16"),), "bf16", L1), "y_l1")
    b.broadcast_dma(vector, Window((0,), (K + p.panel_rows,), (1,)), hv, Window((0,), (K + p.panel_rows,), (1,)))
    b.zero_tail(vector, K + p.panel_rows)
    b.zero_tail(partial, p.rows_per_call)
    config = weights.config(p.rows_per_call, p.k_chunk)
    partial_f32 = weights.symbol("gemv_partial_f32")
    weights.prepare_x(b, vector, K, config)
    first_row = b.affine(f"s0 * {p.tile_n}", [tx], "tile_row0")
    if p.k_chunk == K:  # a row group per call: partial sums of the whole rows, then the add
        with b.loop(0, p.tile_n, p.rows_per_call, "r") as r:
            w_row = b.affine(f"s0 * {p.tile_n} + s1", [tx, r], "w_row")
            b.dma(w_buf, WHOLE, hw, Window((tx, r, 0), (1, p.rows_per_call, R), (p.tile_n * R, R, 1)))
            b.call(partial_f32, [w_buf, vector, partial, Value(b.const(0, "i32"), "i32")], config)
            residual_row = b.affine(f"s0 + {K}", [w_row], "residual_row")
            b.call("gemv_add_bf16", [partial, vector, y_buf, b.index_to_i32(residual_row, "residual_row0"),
                                     b.index_to_i32(r, "row0")], config)
    else:  # a K chunk of all the tile's rows per call, then the add
        if not weights.packed:
            with b.loop(0, K, p.k_chunk, "k0") as k0:
                b.dma(w_buf, WHOLE, hw, Window((tx, 0, k0), (1, p.tile_n, p.k_chunk), (p.tile_n * R, R, 1)))
                b.call(partial_f32, [w_buf, vector, partial, b.index_to_i32(k0, "k0_i32")], config)
        else:  # packed rows: chunk c is words c·chunk of each row, elements c·k_chunk of x
            with b.loop(0, K // p.k_chunk, 1, "chunk") as c:
                column = b.affine(f"s0 * {chunk}", [c], "chunk_word0")
                b.dma(w_buf, WHOLE, hw, Window((tx, 0, column), (1, p.tile_n, chunk), (p.tile_n * R, R, 1)))
                k0 = b.affine(f"s0 * {p.k_chunk}", [c], "k0")
                b.call(partial_f32, [w_buf, vector, partial, b.index_to_i32(k0, "k0_i32")], config)
        residual_row = b.affine(f"s0 + {K}", [first_row], "residual_row")
        b.call("gemv_add_bf16", [partial, vector, y_buf, b.index_to_i32(residual_row, "residual_row0"),
                                 Value(b.const(0, "i32"), "i32")], config)
    b.dma(hy, Window((first_row,), (p.tile_n,), (1,)), y_buf, Window((0,), (p.tile_n,), (1,)))
    b.dealloc(vector, w_buf, partial, y_buf)


def build_rms_gemv(params: dict, operands, tuning: dict) -> LaunchIR:
    kind = RMS_KIND
    K, N, eps = params["K"], params["N"], float(params["eps"])
    weights = weight_rows(kind, params)
    R = weights.row(K)
    # gate_up: W is [w_gate | w_up] (N/2 × 2K; packed: each row a packed gate row then a packed up row), read as
    # N rows of K, so a tile's rows interleave gate and up; swiglu: y is SiLU(gate)·up of each pair
    gate_up, swiglu = bool(params.get("gate_up")), bool(params.get("swiglu"))
    require(gate_up or not swiglu, kind, "swiglu", params.get("swiglu"), "needs gate_up (SiLU·up joins gate/up pairs)")
    w_shape = (N // 2, 2 * R) if gate_up else (N, R)
    require(not gate_up or N % 2 == 0, kind, "N", N, "must be even for a [w_gate | w_up] weight")
    per_value = 2 if swiglu else 1  # W rows per value of y
    check_operands(kind, operands, [("x", {(K,)}, "bf16"), ("norm_w", {(K,)}, "bf16"),
                                    ("W", {w_shape}, weights.dtype), ("y", {(N // per_value,)}, "bf16")])
    p = plan(kind, K, N, tuning, weights, SWIGLU_PANEL_GRANULE if swiglu else 1, per_value)
    panel = p.panel_rows
    b = LaunchBuilder(kind, operands, ("x", "norm_w", "w", "y"))
    b.comment(f"{kind} K={K} N={N} eps={eps} weights={weights.name}{', SwiGLU' if swiglu else ''}: {describe(p)}, "
              f"{p.rows_per_call} rows per call")
    with b.launch(kind, (p.steps, 1), b.operands) as ((step, _), _, (x, norm_w, w, y)):
        with b.segment(f"{kind}_seg", [Value(step, "index"), x, norm_w, w, y]) as (_, _, (seg_step, sx, snw, sw, sy)):
            vector = b.alloc(MemRef((2 * K,), "bf16", L2), "vector_l2")
            w_panel = b.alloc(MemRef((p.herd, p.tile_n, R), weights.dtype, L2), "w_l2")
            y_panel = b.alloc(MemRef((panel // per_value,), "bf16", L2), "y_l2")
            # x and the norm weight are loaded once; each panel streams only its weight rows
            b.dma(vector, Window((0,), (K,), (1,)), sx, WHOLE)
            b.dma(vector, Window((K,), (K,), (1,)), snw, WHOLE)
            with panel_loop(b, p, seg_step, per_value) as (panel_row0, value0):
                w_window, _ = panel_windows(p, R, panel_row0)
                values = p.tile_n // per_value
                y_window = Window((0, value0), (p.herd, values), (values, 1))
                b.dma(w_panel, WHOLE, sw, w_window)
                with b.herd(f"{kind}_herd", (p.herd, 1), [vector, w_panel, y_panel], link_with=OBJECT) as (
                        (tx, _), _, (hv, hw, hy)):
                    _emit_rms_tile(b, p, K, eps, weights, swiglu, tx, hv, hw, hy)
                b.dma(sy, y_window, y_panel, WHOLE)
            b.dealloc(vector, w_panel, y_panel)
    return b.finish(_l1_bytes(kind, K, p.herd, p.tile_n, p.rows_per_call, p.k_chunk, weights))


def _emit_rms_tile(b: LaunchBuilder, p: FusedGemvPlan, K: int, eps: float, weights: WeightRows, swiglu: bool,
                   tx, hv, hw, hy) -> None:
    R = weights.row(K)
    vector = b.alloc(MemRef((2 * K,), "bf16", L1), "vector_l1")
    normed = b.alloc(MemRef((K,), "bf16", L1), "normed_l1")
    w_buf = b.alloc(MemRef((p.rows_per_call, R), weights.dtype, L1), "w_l1")
    y_buf = b.alloc(MemRef((l1_elements(p.tile_n, "bf16"),), "bf16", L1), "y_l1")
    b.broadcast_dma(vector, WHOLE, hv, Window((0,), (2 * K,), (1,)))
    config = weights.config(p.rows_per_call, K)
    b.call("rmsnorm_bf16", [vector, normed, Value(b.const(eps, "f32"), "f32")], config)
    weights.prepare_x(b, normed, K, config)
    if swiglu:  # swiglu_bf16 reads y whole
        b.zero_tail(y_buf, p.tile_n)
    with b.loop(0, p.tile_n, p.rows_per_call, "r") as r:
        b.dma(w_buf, WHOLE, hw, Window((tx, r, 0), (1, p.rows_per_call, R), (p.tile_n * R, R, 1)))
        b.call(weights.symbol("gemv_rows_bf16"), [w_buf, normed, y_buf, b.index_to_i32(r, "row0")], config)
    values = p.tile_n // 2 if swiglu else p.tile_n
    if swiglu:  # the panel's gate/up pairs (whole: tile_n is even and so is every tile's first row), in place
        b.call("swiglu_bf16", [y_buf, Value(b.const(values, "i32"), "i32")], config)
    b.dma(hy, Window((b.affine(f"s0 * {values}", [tx], "tile_value0"),), (values,), (1,)), y_buf,
          Window((0,), (values,), (1,)))
    b.dealloc(vector, normed, w_buf, y_buf)

