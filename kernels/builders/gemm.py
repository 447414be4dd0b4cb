"""gemm(M, K, N): ``C[M, N] = A[M, K] · W[N, K]^T`` over the full 8×4 array, on gemm.cc's vector kernel.

W keeps HF's (out, in) layout: its K dimension is contiguous, so every DMA window moves whole 8-value runs of
K (bf16 cannot be transposed by DMA) and the kernel transposes each 8×8 W block in registers.

Schedule, one launch step per (herd_m·tile_m) × (herd_n·tile_n) output block, as upstream's bf16 GEMM
(mlir-air matrix_multiplication/bf16_in_bf16_out, its in-herd "drain" cast):

* a herd zeroes the f32 accumulator each tile keeps in its own L1 slab (``gemm_zero_f32``; the buffer is
  allocated at segment scope so it survives the herd being entered once per K step);
* for each ``tile_k_l2`` slice of K: DDR → memtile for the A rows and W rows of the block (L2 buffers
  [herd_m, 1, tile_m, tile_k_l2] and [herd_n, 1, tile_n, tile_k_l2], one slab per herd row or column), then
  per ``tile_k_l1`` step the memtile → L1 DMA cuts each tile's A and W windows into 8×8 blocks, in the order
  gemm.cc reads them (A [k/8][m/8][8][8], W [k/8][n/8][8][8]), and ``gemm_bf16_f32_wnk`` accumulates
  ``A · W^T``; A windows are shared along a herd row, W windows along a herd column;
* a herd rounds its slab to bf16 ``drain_n`` columns at a time (``gemm_f32_to_bf16``; the slab is
  [n/8][m/8][8][8], so a chunk of columns is a contiguous run of it) and the L1 → memtile DMA un-tiles each
  chunk into the L2 block [herd_m, herd_n, tile_m, tile_n], which the memtile writes to DDR. Rounding by chunks
  needs a bf16 buffer of one chunk (twice, ping-pong) instead of one of the whole tile: the L1 this frees is
  what lets a tile grow to 64×128 at tile_k_l1 32 (upstream rounds the whole tile, at 32×128).

The three herds share one name: they are the same physical tiles, which is what keeps the accumulator in
place between them. Staging both operands through the memtile is required for a K reduction on a 2-D herd:
unstaged broadcasts across K steps are known to go wrong upstream.

gemm_swiglu(M, K, N) is the same schedule over a W of [Wg | Wu] rows (N × 2K): each tile's W window holds its
tile_n gate rows and the same rows' up halves (the kernel built 2·tile_n wide keeps both accumulators), and the
drain rounds both and applies SiLU·up (``gemm_f32_swiglu_to_bf16``). A plain gemm may read W's rows from column
``w_col0`` of ``w_cols`` (optional params): half of such a [Wg | Wu] buffer.

Param ``precision`` (optional): "bf16" (default, exact bf16 multiplies) or "bfp16" (the kernel built with
``-DAIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16``: upstream's fast mode, operands in 8-value shared-exponent
blocks along K).

Tiles, after upstream's drain-method registry entries (kernel_registry GEMM_bf16_in_bf16_out.json: tile_m
32, tile_n 128, tile_k_l1 32, tile_k_l2 256 on an 8×4 herd) but twice as tall: the widest herd that divides M
and N into multiples of 16 (the kernel's 2×2 mmul expansion), then the largest tile_m ≤ 64 and tile_n ≤ 128
that divide the herd's share, and the largest tile_k_l2 ≤ 256 dividing K whose double-buffered slices fit the
fullest memtile beside the C block (``_l2_bytes``: AIR splits the L2 buffers of a multi-column herd over its
columns' memtiles); tile_k_l1 32 if it fits L1 beside the smallest drain chunk, then the widest drain chunk
that fits. A 64-row tile halves the launch steps and the times W is read from DDR (per 512×512 output block on
8×4: Llama-3.2-1B's gate projection at 2048 rows reads 302 MB instead of 436 MB); 32 MACs of K per kernel call
keep the accumulator loads and stores of a call to one per 16 mmuls.

Constraints: M, N multiples of 16 and K of 8; herd_m ≤ 8 and herd_n ≤ 4 divide M and N; tile_m, tile_n
multiples of 16 dividing M/herd_m, N/herd_n; tile_k_l1 a multiple of 8, tile_k_l1 | tile_k_l2 | K; drain_n a
multiple of 8 dividing tile_n; the accumulator and the double-buffered A/W windows and drain chunks fit L1; the double-buffered A/W slice pieces and
C block pieces a memtile receives fit it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..device import DEVICE
from .ir import L1, L2, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window
from .npu2 import (L1_AVAILABLE, check_budget, check_operands, divisors_descending, largest_dividing, nbytes,
                   pingpong_copies, require)

KIND = "gemm"
SWIGLU_KIND = "gemm_swiglu"
PARAMS = ("M", "K", "N")
TUNING = ("herd_m", "herd_n", "tile_m", "tile_n", "tile_k_l1", "tile_k_l2", "drain_n")
PRECISION_DEFINES = {"bf16": {}, "bfp16": {"AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16": 1}}
BLOCK = DEVICE.mmul_granule          # the kernel's operands are pre-tiled into 8×8 blocks
TILE_GRANULE = 2 * BLOCK      # tile_m and tile_n: the kernel works on 2×2 blocks of mmuls
MAX_TILE_M, MAX_TILE_N = 64, 128
MAX_TILE_K_L2 = 256
TILE_K_L1_CANDIDATES = (32, 16, 8)


def _l1_bytes(tile_m, tile_n, tile_k_l1, tile_k_l2, drain_n, w_rows=None) -> dict[str, int]:
    """``w_rows``: W rows (accumulator columns) per tile, when they are not ``tile_n`` (SwiGLU: 2 · tile_n)."""
    w_rows = w_rows or tile_n
    copies = pingpong_copies(tile_k_l2 // tile_k_l1)
    drain_copies = pingpong_copies(tile_n // drain_n)
    return {"f32 accumulator": nbytes((tile_m, w_rows), "f32"),
            f"A window x{copies} (ping-pong)": copies * nbytes((tile_m, tile_k_l1), "bf16"),
            f"W window x{copies}": copies * nbytes((w_rows, tile_k_l1), "bf16"),
            f"bf16 drain chunk x{drain_copies}": drain_copies * nbytes((tile_m, drain_n), "bf16")}


def _l2_bytes(herd_m, herd_n, tile_m, tile_n, tile_k_l2, K, w_rows=None) -> dict[str, int]:
    """What the fullest memtile holds. A segment on more than one column of tiles has its L2 buffers split by
    AIR's air-split-l2-memref into one piece per herd column (A, C) or row (W), spread over the memtiles of its
    herd_m columns; on one column everything stays in one memtile. (Measured with the real passes: M=K=N=2048 on
    8x4 at tile_k_l2 256 fills its fullest memtile with 192 KiB: one A, W and C piece, 32 + 128 + 32 KiB.)"""
    copies = pingpong_copies(K // tile_k_l2)
    memtiles = herd_m if herd_m * herd_n > DEVICE.rows else 1
    per_memtile = lambda pieces: -(-pieces // memtiles)  # noqa: E731
    a, w, c = per_memtile(herd_m), per_memtile(herd_n), per_memtile(herd_m)
    return {f"A slice x{copies} (ping-pong), {a} of {herd_m} pieces": a * copies * nbytes((tile_m, tile_k_l2), "bf16"),
            f"W slice x{copies}, {w} of {herd_n} pieces": w * copies * nbytes((w_rows or tile_n, tile_k_l2), "bf16"),
            f"C block, {c} of {herd_m} pieces": c * nbytes((herd_n, tile_m, tile_n), "bf16")}


def _granular_divisor(extent: int, cap: int) -> int | None:
    """Largest multiple of the kernel's tile granule that divides ``extent`` and is at most ``cap``."""
    return next((d for d in divisors_descending(extent, cap) if d % TILE_GRANULE == 0), None)


def _fitting_k_tile(extent: int, candidates, fits) -> int:
    """Largest candidate dividing ``extent`` that fits, else the smallest dividing one (its budget check then
    reports what does not fit)."""
    dividing = [t for t in candidates if extent % t == 0]
    return next((t for t in dividing if fits(t)), dividing[-1] if dividing else candidates[-1])


def _blocked_window(herd_index: str, rows: int, k_offset: str, tile_k_l1: int, tile_k_l2: int) -> Window:
    """A herd tile's (rows × tile_k_l1) window of an L2 slice [herd, 1, rows, tile_k_l2], read in the kernel's
    [k/8][rows/8][8][8] block order."""
    return Window((herd_index, 0, 0, 0, k_offset),
                  (1, tile_k_l1 // BLOCK, rows // BLOCK, BLOCK, BLOCK),
                  (rows * tile_k_l2, BLOCK, BLOCK * tile_k_l2, tile_k_l2, 1))


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    return _build(KIND, params, operands, tuning)


def build_swiglu(params: dict, operands, tuning: dict) -> LaunchIR:
    """gemm_swiglu(M, K, N): SwiGLU's gate and up projections and their product in one launch,
    ``C = silu(bf16(A · Wgᵀ)) * bf16(A · Wuᵀ)`` with W = [Wg | Wu] (N × 2K: gate and up side by side in each row).
    Each tile takes its tile_n gate rows and the same up rows through its one W stream (one DMA: the up half is K
    further along each row, a stride a shim BD can take, where [Wg; Wu] would need N·K), keeps both accumulators
    (the kernel's tile is 2·tile_n wide: gate blocks, then up blocks) and drains with
    ``gemm_f32_swiglu_to_bf16``, silu_mul's rounding points over the two bf16 projections."""
    return _build(SWIGLU_KIND, params, operands, tuning)


@dataclass(frozen=True)
class GemmPlan:
    """A gemm launch's shape and schedule, checked: what ``_emit`` writes out."""

    kind: str
    M: int
    K: int
    N: int
    precision: str
    w_cols: int          # W's row length (2·K for [Wg | Wu])
    w_col0: int          # the column W's K values start at
    halves: int          # W rows per output column (2: gate and up)
    herd_m: int
    herd_n: int
    tile_m: int
    tile_n: int
    tile_k_l1: int
    tile_k_l2: int
    drain_n: int
    l1: dict             # a tile's L1 buffers, for the budget check

    @property
    def w_rows(self) -> int:
        """W rows and accumulator columns per tile."""
        return self.halves * self.tile_n

    @property
    def defines(self) -> dict:
        return {"GEMM_TILE_M": self.tile_m, "GEMM_TILE_K": self.tile_k_l1, "GEMM_TILE_N": self.w_rows,
                "GEMM_DRAIN_N": self.drain_n, **PRECISION_DEFINES[self.precision]}


def _build(kind: str, params: dict, operands, tuning: dict) -> LaunchIR:
    return _emit(_plan(kind, params, operands, tuning), operands)


def _plan(kind: str, params: dict, operands, tuning: dict) -> GemmPlan:
    """Check the params and operands, and choose the herd and tiles (the module's docstring says how)."""
    swiglu = kind == SWIGLU_KIND
    M, K, N = params["M"], params["K"], params["N"]
    precision = params.get("precision", "bf16")
    require(precision in PRECISION_DEFINES, kind, "precision", precision,
            f"must be one of {', '.join(PRECISION_DEFINES)}")
    # W's rows may be longer than the K a plain gemm multiplies ([w_gate | w_up] read half by half): w_cols long,
    # from column w_col0
    w_cols = 2 * K if swiglu else params.get("w_cols", K)
    w_col0 = 0 if swiglu else params.get("w_col0", 0)
    require(0 <= w_col0 <= w_cols - K, kind, "w_col0", w_col0, f"must leave K={K} columns of w_cols={w_cols}")
    check_operands(kind, operands, [("A", {(M, K)}, "bf16"), ("W", {(N, w_cols)}, "bf16"), ("C", {(M, N)}, "bf16")])
    for name, extent, granule in (("M", M, TILE_GRANULE), ("K", K, BLOCK), ("N", N, TILE_GRANULE)):
        require(extent % granule == 0, kind, name, extent, f"must be a multiple of {granule}")
    halves = 2 if swiglu else 1  # W rows per output column

    herd_m = tuning.get("herd_m", largest_dividing(M // TILE_GRANULE, DEVICE.herd_candidates))
    herd_n = tuning.get("herd_n", largest_dividing(N // TILE_GRANULE, (DEVICE.rows, 2, 1)))
    require(herd_m <= DEVICE.columns, kind, "herd_m", herd_m, f"the herd spans at most {DEVICE.columns} columns")
    require(herd_n <= DEVICE.rows, kind, "herd_n", herd_n, f"the herd spans at most {DEVICE.rows} rows")
    require(M % herd_m == 0, kind, "herd_m", herd_m, f"must divide M={M}")
    require(N % herd_n == 0, kind, "herd_n", herd_n, f"must divide N={N}")
    tile_m = tuning.get("tile_m", _granular_divisor(M // herd_m, MAX_TILE_M))
    tile_n = tuning.get("tile_n", _granular_divisor(N // herd_n, MAX_TILE_N // halves))
    require(tile_m is not None and (M // herd_m) % tile_m == 0 and tile_m % TILE_GRANULE == 0, kind, "tile_m",
            tile_m, f"must divide M/herd_m={M // herd_m} and be a multiple of {TILE_GRANULE}")
    require(tile_n is not None and (N // herd_n) % tile_n == 0 and tile_n % TILE_GRANULE == 0, kind, "tile_n",
            tile_n, f"must divide N/herd_n={N // herd_n} and be a multiple of {TILE_GRANULE}")
    w_rows = halves * tile_n  # W rows and accumulator columns per tile
    # The deepest K slice up to upstream's 256 that fits, preferring whole tile_k_l1 steps of 32.
    k_l2_candidates = sorted((d for d in divisors_descending(K, MAX_TILE_K_L2) if d % BLOCK == 0),
                             key=lambda d: (d % TILE_K_L1_CANDIDATES[0] != 0, -d))
    tile_k_l2 = tuning.get("tile_k_l2") or _fitting_k_tile(
        K, k_l2_candidates,
        lambda t: sum(_l2_bytes(herd_m, herd_n, tile_m, tile_n, t, K, w_rows).values()) <= DEVICE.l2_bytes)
    require(K % tile_k_l2 == 0, kind, "tile_k_l2", tile_k_l2, f"must divide K={K}")
    check_budget(kind, "L2", _l2_bytes(herd_m, herd_n, tile_m, tile_n, tile_k_l2, K, w_rows),
                 "lower tile_k_l2 or the block size")
    # K depth per call first (it sets the kernel's efficiency), beside the smallest drain chunk; then the widest
    # drain chunk that fits.
    tile_k_l1 = tuning.get("tile_k_l1") or _fitting_k_tile(
        tile_k_l2, TILE_K_L1_CANDIDATES,
        lambda t: sum(_l1_bytes(tile_m, tile_n, t, tile_k_l2, tuning.get("drain_n", BLOCK), w_rows).values())
        <= L1_AVAILABLE)
    require(tile_k_l2 % tile_k_l1 == 0 and tile_k_l1 % BLOCK == 0, kind, "tile_k_l1", tile_k_l1,
            f"must divide tile_k_l2={tile_k_l2} and be a multiple of {BLOCK}")
    drain_n = tuning.get("drain_n") or _fitting_k_tile(
        tile_n, [d for d in divisors_descending(tile_n) if d % BLOCK == 0],
        lambda d: sum(_l1_bytes(tile_m, tile_n, tile_k_l1, tile_k_l2, d, w_rows).values()) <= L1_AVAILABLE)
    require(tile_n % drain_n == 0 and drain_n % BLOCK == 0, kind, "drain_n", drain_n,
            f"must divide tile_n={tile_n} and be a multiple of {BLOCK}")
    l1 = _l1_bytes(tile_m, tile_n, tile_k_l1, tile_k_l2, drain_n, w_rows)
    check_budget(kind, "L1", l1, "lower tile_m, tile_n, tile_k_l1 or drain_n")
    return GemmPlan(kind, M, K, N, precision, w_cols, w_col0, halves, herd_m, herd_n, tile_m, tile_n, tile_k_l1,
                    tile_k_l2, drain_n, l1)


def _emit(plan: GemmPlan, operands) -> LaunchIR:
    """The launch of ``plan``: its schedule as the module's docstring describes it."""
    kind, swiglu, defines = plan.kind, plan.kind == SWIGLU_KIND, plan.defines
    M, K, N, precision, halves = plan.M, plan.K, plan.N, plan.precision, plan.halves
    w_cols, w_col0 = plan.w_cols, plan.w_col0
    herd_m, herd_n, tile_m, tile_n = plan.herd_m, plan.herd_n, plan.tile_m, plan.tile_n
    tile_k_l1, tile_k_l2, drain_n, w_rows = plan.tile_k_l1, plan.tile_k_l2, plan.drain_n, plan.w_rows
    block_m, block_n = herd_m * tile_m, herd_n * tile_n
    b = LaunchBuilder(kind, operands, ("a", "w", "c"))
    b.comment(f"{kind} M={M} K={K} N={N}: herd {herd_m}x{herd_n}, tiles m{tile_m} n{tile_n} "
              f"k{tile_k_l1} (L1) k{tile_k_l2} (L2), drained by n{drain_n}, {M // block_m}x{N // block_n} launch steps, "
              f"{precision} multiplies")
    herd_name, herd_sizes, kernel = "gemm_herd", (herd_m, herd_n), "gemm.o"
    blocks_m, drain_blocks, chunks = tile_m // BLOCK, drain_n // BLOCK, tile_n // drain_n
    with b.launch(kind, (M // block_m, N // block_n), b.operands) as ((bm, bn), _, (a, w, c)):
        seg_operands = [Value(bm, "index"), Value(bn, "index"), a, w, c]
        with b.segment(f"{kind}_seg", seg_operands) as (_, _, (sbm, sbn, sa, sw, sc)):
            row0 = b.affine(f"s0 * {block_m}", [sbm.ssa], "row0")
            col0 = b.affine(f"s0 * {block_n}", [sbn.ssa], "col0")
            a_l2 = b.alloc(MemRef((herd_m, 1, tile_m, tile_k_l2), "bf16", L2), "a_l2")
            w_l2 = b.alloc(MemRef((herd_n, halves, tile_n, tile_k_l2), "bf16", L2), "w_l2")
            c_l2 = b.alloc(MemRef((herd_m, herd_n, tile_m, tile_n), "bf16", L2), "c_l2")
            # Each tile's slab [n/8][m/8][8][8], its n/8 split into drain chunks: a chunk is the slab of [tx, ty, chunk]
            # (SwiGLU: the gate's chunks, then the up's).
            acc = b.alloc(MemRef((herd_m, herd_n, halves * chunks, drain_blocks, blocks_m, BLOCK, BLOCK), "f32", L1),
                          "acc_l1")
            with b.herd(herd_name, herd_sizes, [acc], link_with=kernel) as ((tx, ty), _, (h_acc,)):
                b.call("gemm_zero_f32", [b.slab(h_acc, [tx, ty])], defines)
            with b.loop(0, K, tile_k_l2, "k2") as k2:
                # The L2 slices hold the block's rows in order, read from DDR in their own rank [herd, 1, tile, k]:
                # this AIR's air-split-l2-memref, splitting them by herd row or column, gives each piece the whole
                # block when the DDR window is 2-D (README, "Shim BDs inside their arguments").
                b.dma(a_l2, WHOLE, sa, Window((0, 0, row0, k2), (herd_m, 1, tile_m, tile_k_l2),
                                              (tile_m * K, tile_m * K, K, 1)))
                if swiglu:  # each herd column's slab: its gate rows, then the same rows' up half, K further along
                    b.dma(w_l2, WHOLE, sw, Window((0, 0, col0, k2), (herd_n, 2, tile_n, tile_k_l2),
                                                  (tile_n * 2 * K, K, 2 * K, 1)))
                else:
                    k0 = b.affine(f"s0 + {w_col0}", [k2], "w_k0") if w_col0 else k2
                    b.dma(w_l2, WHOLE, sw, Window((0, 0, col0, k0), (herd_n, 1, tile_n, tile_k_l2),
                                                  (tile_n * w_cols, tile_n * w_cols, w_cols, 1)))
                with b.herd(herd_name, herd_sizes, [a_l2, w_l2, acc], link_with=kernel) as \
                        ((tx, ty), _, (ha, hw, h_acc)):
                    a_buf = b.alloc(MemRef((tile_k_l1 // BLOCK, blocks_m, BLOCK, BLOCK), "bf16", L1), "a_l1")
                    w_buf = b.alloc(MemRef((tile_k_l1 // BLOCK, w_rows // BLOCK, BLOCK, BLOCK), "bf16", L1), "w_l1")
                    slab = b.slab(h_acc, [tx, ty])
                    with b.loop(0, tile_k_l2, tile_k_l1, "k1") as k1:
                        b.dma(a_buf, WHOLE, ha, _blocked_window(tx, tile_m, k1, tile_k_l1, tile_k_l2))
                        b.dma(w_buf, WHOLE, hw, _blocked_window(ty, w_rows, k1, tile_k_l1, tile_k_l2))
                        b.call("gemm_bf16_f32_wnk", [a_buf, w_buf, slab], defines)
                    b.dealloc(a_buf, w_buf)
            with b.herd(herd_name, herd_sizes, [acc, c_l2], link_with=kernel) as ((tx, ty), _, (h_acc, hc)):
                c_buf = b.alloc(MemRef((drain_blocks, blocks_m, BLOCK, BLOCK), "bf16", L1), "c_l1")
                with b.loop(0, chunks, 1, "chunk") as chunk:
                    n0 = b.affine(f"s0 * {drain_n}", [chunk], "n0")
                    if swiglu:
                        up_chunk = b.affine(f"s0 + {chunks}", [chunk], "up_chunk")
                        b.call("gemm_f32_swiglu_to_bf16", [b.slab(h_acc, [tx, ty, chunk]),
                                                            b.slab(h_acc, [tx, ty, up_chunk]), c_buf], defines)
                    else:
                        b.call("gemm_f32_to_bf16", [b.slab(h_acc, [tx, ty, chunk]), c_buf], defines)
                    # [n/8][m/8][8][8] read back in (m, n) order: m/8 blocks, 8 rows, n/8 blocks, 8 columns.
                    b.dma(hc, Window((tx, ty, 0, n0), (1, 1, tile_m, drain_n),
                                     (herd_n * tile_m * tile_n, tile_m * tile_n, tile_n, 1)),
                          c_buf, Window((0, 0, 0, 0), (blocks_m, BLOCK, drain_blocks, BLOCK),
                                        (BLOCK * BLOCK, BLOCK, tile_m * BLOCK, 1)))
                b.dealloc(c_buf)
            b.dma(sc, Window((0, 0, row0, col0), (herd_m, herd_n, tile_m, tile_n), (tile_m * N, tile_n, N, 1)),
                  c_l2, WHOLE)
            b.dealloc(a_l2, w_l2, c_l2, acc)
    return b.finish(plan.l1)
