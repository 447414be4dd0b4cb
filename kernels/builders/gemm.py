"""gemm(M, K, N): ``C[M, N] = A[M, K] · W[N, K]^T`` over the full 8×4 array.

W keeps HF's (out, in) layout: its K dimension is contiguous, so every DMA window is a plain row block
(bf16 cannot be transposed by DMA) and the transpose lives in the ``linalg.matmul`` indexing maps.

Schedule, one launch step per (herd_m·tile_m) × (herd_n·tile_n) output block:

* a herd zeroes an f32 accumulator that each tile keeps in its own L1 slab (allocated at segment scope so
  it survives the herd being entered once per K step);
* for each ``tile_k_l2`` slice of K: DDR → memtile for the A rows and W rows of the block, then the herd
  takes its (tile_m × tile_k_l1) and (tile_n × tile_k_l1) windows memtile → L1 (double-buffered) and
  accumulates ``A · W^T``; A windows are shared along a herd row, W windows along a herd column;
* a herd rounds its slab to bf16 and sends it to the memtile, which writes the block to DDR.

The three herds share one name: they are the same physical tiles, which is what keeps the accumulator
in place between them. Staging both operands through the memtile is required for a K reduction on a 2-D
herd: unstaged broadcasts across K steps are known to go wrong upstream.

Compute is ``linalg.matmul`` (bf16 × bf16 → f32): it verifies and lowers anywhere, but stays scalar
unless aircc vectorizes it; a tuned matmul kernel is the next step for prefill speed.

Constraints: M, K, N multiples of 8 (the matmul intrinsic's block); herd_m ≤ 8 and herd_n ≤ 4 divide M
and N; tile_m, tile_n multiples of 8 dividing M/herd_m, N/herd_n; tile_k_l1 | tile_k_l2 | K; the
accumulator, output tile and double-buffered A/W windows fit L1; double-buffered A/W slices and the C
block fit one memtile.
"""
from __future__ import annotations

from .ir import L1, L2, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window
from .npu2 import (COLUMNS, HERD_CANDIDATES, L1_AVAILABLE, L2_BYTES, MMUL_GRANULE, ROWS, check_budget,
                   check_operands, check_params, check_tuning, divisors_descending, largest_dividing, nbytes,
                   pingpong_copies, require)

KIND = "gemm"
PARAMS = ("M", "K", "N")
TUNING = ("herd_m", "herd_n", "tile_m", "tile_n", "tile_k_l1", "tile_k_l2")
MAX_TILE_M, MAX_TILE_N = 64, 64
TILE_K_L2_CANDIDATES = (128, 64, 32, 16, 8)
TILE_K_L1_CANDIDATES = (32, 16, 8)
MATMUL_TRANSPOSED_B = ("indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>, "
                       "affine_map<(d0, d1, d2) -> (d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>]")


def _l1_bytes(tile_m, tile_n, tile_k_l1, tile_k_l2) -> dict[str, int]:
    copies = pingpong_copies(tile_k_l2 // tile_k_l1)
    return {"f32 accumulator": nbytes((tile_m, tile_n), "f32"),
            f"A window x{copies} (ping-pong)": copies * nbytes((tile_m, tile_k_l1), "bf16"),
            f"W window x{copies}": copies * nbytes((tile_n, tile_k_l1), "bf16"),
            "bf16 output tile": nbytes((tile_m, tile_n), "bf16")}


def _l2_bytes(block_m, block_n, tile_k_l2, K) -> dict[str, int]:
    copies = pingpong_copies(K // tile_k_l2)
    return {f"A slice x{copies} (ping-pong)": copies * nbytes((block_m, tile_k_l2), "bf16"),
            f"W slice x{copies}": copies * nbytes((block_n, tile_k_l2), "bf16"),
            "C block": nbytes((block_m, block_n), "bf16")}


def _granular_divisor(extent: int, cap: int) -> int | None:
    """Largest multiple of the matmul granule that divides ``extent`` and is at most ``cap``."""
    return next((d for d in divisors_descending(extent, cap) if d % MMUL_GRANULE == 0), None)


def _fitting_k_tile(extent: int, candidates, fits) -> int:
    """Largest candidate dividing ``extent`` that fits, else the smallest dividing one (its budget check then
    reports what does not fit)."""
    dividing = [t for t in candidates if extent % t == 0]
    return next((t for t in dividing if fits(t)), dividing[-1] if dividing else candidates[-1])


def build(params: dict, operands, tuning: dict | None = None) -> LaunchIR:
    tuning = dict(tuning or {})
    check_params(KIND, params, PARAMS)
    check_tuning(KIND, tuning, TUNING)
    M, K, N = params["M"], params["K"], params["N"]
    check_operands(KIND, operands, [("A", {(M, K)}, "bf16"), ("W", {(N, K)}, "bf16"), ("C", {(M, N)}, "bf16")])
    for name, extent in (("M", M), ("K", K), ("N", N)):
        require(extent % MMUL_GRANULE == 0, KIND, name, extent, f"must be a multiple of {MMUL_GRANULE}")

    herd_m = tuning.get("herd_m", largest_dividing(M // MMUL_GRANULE, HERD_CANDIDATES))
    herd_n = tuning.get("herd_n", largest_dividing(N // MMUL_GRANULE, (ROWS, 2, 1)))
    require(herd_m <= COLUMNS, KIND, "herd_m", herd_m, f"the herd spans at most {COLUMNS} columns")
    require(herd_n <= ROWS, KIND, "herd_n", herd_n, f"the herd spans at most {ROWS} rows")
    require(M % herd_m == 0, KIND, "herd_m", herd_m, f"must divide M={M}")
    require(N % herd_n == 0, KIND, "herd_n", herd_n, f"must divide N={N}")
    tile_m = tuning.get("tile_m", _granular_divisor(M // herd_m, MAX_TILE_M))
    tile_n = tuning.get("tile_n", _granular_divisor(N // herd_n, MAX_TILE_N))
    require(tile_m is not None and (M // herd_m) % tile_m == 0, KIND, "tile_m", tile_m,
            f"must divide M/herd_m={M // herd_m} and be a multiple of {MMUL_GRANULE}")
    require(tile_n is not None and (N // herd_n) % tile_n == 0, KIND, "tile_n", tile_n,
            f"must divide N/herd_n={N // herd_n} and be a multiple of {MMUL_GRANULE}")
    block_m, block_n = herd_m * tile_m, herd_n * tile_n
    tile_k_l2 = tuning.get("tile_k_l2") or _fitting_k_tile(
        K, TILE_K_L2_CANDIDATES, lambda t: sum(_l2_bytes(block_m, block_n, t, K).values()) <= L2_BYTES)
    require(K % tile_k_l2 == 0, KIND, "tile_k_l2", tile_k_l2, f"must divide K={K}")
    check_budget(KIND, "L2", _l2_bytes(block_m, block_n, tile_k_l2, K), "lower tile_k_l2 or the block size")
    tile_k_l1 = tuning.get("tile_k_l1") or _fitting_k_tile(
        tile_k_l2, TILE_K_L1_CANDIDATES,
        lambda t: sum(_l1_bytes(tile_m, tile_n, t, tile_k_l2).values()) <= L1_AVAILABLE)
    require(tile_k_l2 % tile_k_l1 == 0, KIND, "tile_k_l1", tile_k_l1, f"must divide tile_k_l2={tile_k_l2}")
    check_budget(KIND, "L1", _l1_bytes(tile_m, tile_n, tile_k_l1, tile_k_l2), "lower tile_m, tile_n or tile_k_l1")

    b = LaunchBuilder(KIND, operands, ("a", "w", "c"))
    b.comment(f"gemm M={M} K={K} N={N}: herd {herd_m}x{herd_n}, tiles m{tile_m} n{tile_n} "
              f"k{tile_k_l1} (L1) k{tile_k_l2} (L2), {M // block_m}x{N // block_n} launch steps")
    herd_name, herd_sizes = "gemm_herd", (herd_m, herd_n)
    with b.launch("gemm", (M // block_m, N // block_n), b.operands) as ((bm, bn), _, (a, w, c)):
        seg_operands = [Value(bm, "index"), Value(bn, "index"), a, w, c]
        with b.segment("gemm_seg", seg_operands) as (_, _, (sbm, sbn, sa, sw, sc)):
            row0 = b.affine(f"s0 * {block_m}", [sbm.ssa], "row0")
            col0 = b.affine(f"s0 * {block_n}", [sbn.ssa], "col0")
            a_l2 = b.alloc(MemRef((block_m, tile_k_l2), "bf16", L2), "a_l2")
            w_l2 = b.alloc(MemRef((block_n, tile_k_l2), "bf16", L2), "w_l2")
            c_l2 = b.alloc(MemRef((block_m, block_n), "bf16", L2), "c_l2")
            acc = b.alloc(MemRef((herd_m, herd_n, tile_m, tile_n), "f32", L1), "acc_l1")
            with b.herd(herd_name, herd_sizes, [acc]) as ((tx, ty), _, (h_acc,)):
                slab = b.slab(h_acc, [tx, ty])
                b.emit(f"linalg.fill ins({b.const(0.0, 'f32')} : f32) outs({slab.ssa} : {slab.type})")
            with b.loop(0, K, tile_k_l2, "k2") as k2:
                b.dma(a_l2, WHOLE, sa, Window((row0, k2), (block_m, tile_k_l2), (K, 1)))
                b.dma(w_l2, WHOLE, sw, Window((col0, k2), (block_n, tile_k_l2), (K, 1)))
                with b.herd(herd_name, herd_sizes, [a_l2, w_l2, acc]) as ((tx, ty), _, (ha, hw, h_acc)):
                    a_buf = b.alloc(MemRef((tile_m, tile_k_l1), "bf16", L1), "a_l1")
                    w_buf = b.alloc(MemRef((tile_n, tile_k_l1), "bf16", L1), "w_l1")
                    slab = b.slab(h_acc, [tx, ty])
                    a_row = b.affine(f"s0 * {tile_m}", [tx], "a_row")
                    w_row = b.affine(f"s0 * {tile_n}", [ty], "w_row")
                    with b.loop(0, tile_k_l2, tile_k_l1, "k1") as k1:
                        b.dma(a_buf, WHOLE, ha, Window((a_row, k1), (tile_m, tile_k_l1), (tile_k_l2, 1)))
                        b.dma(w_buf, WHOLE, hw, Window((w_row, k1), (tile_n, tile_k_l1), (tile_k_l2, 1)))
                        b.emit(f"linalg.matmul {MATMUL_TRANSPOSED_B} ins({a_buf.ssa}, {w_buf.ssa} : {a_buf.type}, "
                               f"{w_buf.type}) outs({slab.ssa} : {slab.type})")
                    b.dealloc(a_buf, w_buf)
            with b.herd(herd_name, herd_sizes, [acc, c_l2]) as ((tx, ty), _, (h_acc, hc)):
                slab = b.slab(h_acc, [tx, ty])
                c_buf = b.alloc(MemRef((tile_m, tile_n), "bf16", L1), "c_l1")
                _emit_round_to_bf16(b, slab, c_buf)
                c_row = b.affine(f"s0 * {tile_m}", [tx], "c_row")
                c_col = b.affine(f"s0 * {tile_n}", [ty], "c_col")
                b.dma(hc, Window((c_row, c_col), (tile_m, tile_n), (block_n, 1)), c_buf, WHOLE)
                b.dealloc(c_buf)
            b.dma(sc, Window((row0, col0), (block_m, block_n), (N, 1)), c_l2, WHOLE)
            b.dealloc(a_l2, w_l2, c_l2, acc)
    return b.finish()


def _emit_round_to_bf16(b: LaunchBuilder, source: Value, target: Value) -> None:
    in_arg, out_arg, rounded = b.fresh("in"), b.fresh("out"), b.fresh("rounded")
    identity = "affine_map<(d0, d1) -> (d0, d1)>"
    b.emit(f'linalg.generic {{indexing_maps = [{identity}, {identity}], iterator_types = ["parallel", "parallel"]}} '
           f"ins({source.ssa} : {source.type}) outs({target.ssa} : {target.type}) {{")
    b.emit(f"^bb0({in_arg}: f32, {out_arg}: bf16):")
    b.emit(f"  {rounded} = arith.truncf {in_arg} : f32 to bf16")
    b.emit(f"  linalg.yield {rounded} : bf16")
    b.emit("}")
