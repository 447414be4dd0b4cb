"""The cost model reads our IR: scalar GEMMs are slow, vectorized kernel calls fast, bytes and overlap as emitted."""
import dataclasses

import pytest

from benchmarks import cost_model
from torch_npu2.kernels.builders import EXTERNAL_KERNELS, build_launch
from torch_npu2.kernels.builders.externs import CALL_COSTS
from torch_npu2.kernels.builders.ir import L1, WHOLE, ExternDecl, LaunchBuilder, MemRef, Window
from torch_npu2.kernels.program import CompileOptions

M, K, N = 256, 512, 256
HERD_M, HERD_N, TILE_K = 4, 4, 64
DEFAULT_OPTIONS = CompileOptions()
# C += A·Wᵀ as a linalg.matmul over W's (N, K) rows: the scalar form the gemm builder emitted before gemm.cc
MATMUL_TRANSPOSED_B = ("indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>, "
                       "affine_map<(d0, d1, d2) -> (d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>]")


def tile_gemm(kernel: bool, defines=()):
    """A hand-made GEMM launch, one launch step, on a HERD_M×HERD_N herd: each tile streams its A and W windows
    DDR → L1 over K and accumulates with ``linalg.matmul`` (the scalar form) or a call of the vectorized GEMM kernel
    (``gemm_bf16_f32_wnk``, declared here by hand so that this test does not depend on when gemm.o lands)."""
    tile_m, tile_n = M // HERD_M, N // HERD_N
    b = LaunchBuilder("gemm", [MemRef((M, K), "bf16"), MemRef((N, K), "bf16"), MemRef((M, N), "bf16")], "awc")
    a_type, w_type = MemRef((tile_m, TILE_K), "bf16", L1), MemRef((tile_n, TILE_K), "bf16", L1)
    acc_type = MemRef((tile_m, tile_n), "f32", L1)
    with b.launch("gemm", (1, 1), b.operands) as (_, _, (a, w, c)):
        with b.segment("gemm_seg", [a, w, c]) as (_, _, (sa, sw, sc)):
            with b.herd("gemm_herd", (HERD_M, HERD_N), [sa, sw, sc]) as ((tx, ty), _, (ha, hw, hc)):
                a_buf, w_buf, acc = b.alloc(a_type, "a_l1"), b.alloc(w_type, "w_l1"), b.alloc(acc_type, "acc")
                c_buf = b.alloc(MemRef((tile_m, tile_n), "bf16", L1), "c_l1")
                row = b.affine(f"s0 * {tile_m}", [tx], "row")
                col = b.affine(f"s0 * {tile_n}", [ty], "col")
                with b.loop(0, K, TILE_K, "k") as k:
                    b.dma(a_buf, WHOLE, ha, Window((row, k), (tile_m, TILE_K), (K, 1)))
                    b.dma(w_buf, WHOLE, hw, Window((col, k), (tile_n, TILE_K), (K, 1)))
                    types = f"{a_type}, {w_type}, {acc_type}"
                    if kernel:
                        b.emit(f"func.call @gemm_bf16_f32_wnk({a_buf.ssa}, {w_buf.ssa}, {acc.ssa}) : ({types}) -> ()")
                    else:
                        b.emit(f"linalg.matmul {MATMUL_TRANSPOSED_B} ins({a_buf.ssa}, {w_buf.ssa} : {a_type}, "
                               f"{w_type}) outs({acc.ssa} : {acc_type})")
                b.dma(hc, Window((row, col), (tile_m, tile_n), (N, 1)), c_buf, WHOLE)
    ir = b.finish()
    if not kernel:
        return ir
    decl = ExternDecl("gemm_bf16_f32_wnk", (str(a_type), str(w_type), str(acc_type)), "gemm.o", tuple(defines))
    return dataclasses.replace(ir, externs=(decl,))


def test_every_external_kernel_symbol_has_a_known_throughput_class():
    for kernel in EXTERNAL_KERNELS:
        for symbol in kernel.symbols:
            assert symbol in CALL_COSTS, f"{symbol} ({kernel.object}) has no CallCost in externs.py"
    assert {c.throughput for c in CALL_COSTS.values()} <= set(cost_model.THROUGHPUT)


def test_scalar_gemm_is_predicted_much_slower_than_the_vectorized_kernel():
    scalar = cost_model.launch_cost(tile_gemm(kernel=False), DEFAULT_OPTIONS)
    vectorized = cost_model.launch_cost(tile_gemm(kernel=True), DEFAULT_OPTIONS)
    assert scalar.work["scalar_mac"] == pytest.approx(M * K * N)
    assert vectorized.work["mmul_bf16"] == pytest.approx(M * K * N)
    assert "scalar_mac" not in vectorized.work
    assert scalar.seconds > 100 * vectorized.seconds


def test_bfp16_emulation_is_faster_than_exact_bf16_whichever_way_it_is_chosen():
    exact = cost_model.launch_cost(tile_gemm(kernel=True), DEFAULT_OPTIONS)
    by_define = cost_model.launch_cost(tile_gemm(kernel=True, defines=[("GEMM_BFP16", 1)]), DEFAULT_OPTIONS)
    by_param = cost_model.launch_cost(tile_gemm(kernel=True), DEFAULT_OPTIONS, precision="bfp16")
    off = cost_model.launch_cost(tile_gemm(kernel=True, defines=[("GEMM_BFP16", 0)]), DEFAULT_OPTIONS)
    assert by_define.work["mmul_bfp16"] == by_param.work["mmul_bfp16"] == pytest.approx(M * K * N)
    assert by_define.seconds == pytest.approx(by_param.seconds)
    assert by_define.seconds < exact.seconds
    assert off.seconds == pytest.approx(exact.seconds)


def test_ddr_bytes_count_each_distinct_window_once():
    """A windows move with the tile row only and W windows with the tile column only, so each is one broadcast
    read along the other herd dimension: every A and W element leaves DDR once, every C element returns once."""
    cost = cost_model.launch_cost(tile_gemm(kernel=False), DEFAULT_OPTIONS)
    assert cost.ddr_bytes == 2 * (M * K + N * K + M * N)
    assert cost.tile_dma_bytes == 2 * (M * K * HERD_N + N * K * HERD_M + M * N)
    assert cost.iterations == 1


def test_double_buffering_overlaps_dma_with_compute():
    vectorized = tile_gemm(kernel=True)
    overlapped = cost_model.launch_cost(vectorized, DEFAULT_OPTIONS)
    serial = cost_model.launch_cost(vectorized, CompileOptions(omit_pingpong="all"))
    assert serial.seconds > overlapped.seconds


def test_unknown_ops_and_symbols_are_refused():
    ir = tile_gemm(kernel=False)
    with pytest.raises(ValueError, match="no cost for 'linalg.batch_matmul'"):
        cost_model.launch_cost(dataclasses.replace(ir, text=ir.text.replace("linalg.matmul", "linalg.batch_matmul")),
                               DEFAULT_OPTIONS)
    call = tile_gemm(kernel=True)
    renamed = dataclasses.replace(call, text=call.text.replace("@gemm_bf16_f32_wnk", "@mystery_kernel"),
                                  externs=tuple(dataclasses.replace(d, symbol="mystery_kernel") for d in call.externs))
    with pytest.raises(KeyError, match="mystery_kernel"):
        cost_model.launch_cost(renamed, DEFAULT_OPTIONS)


def test_the_builders_gemm_is_costed_by_what_it_emits():
    """Llama-3.2-1B's o_ffn at 2048: while the gemm builder emits linalg.matmul, scalar MACs dominate and the
    Program is predicted over 100× slower than upstream; once it calls a kernel, no scalar MAC is left."""
    dims = cost_model.llama_1b_dims()
    program = cost_model.program("o_ffn", dims, 2048)
    gemm_text = build_launch(program, next(l for l in program.launches if l.kind == "gemm")).text
    cost = cost_model.program_cost(program)
    compute = cost.compute_s()
    if "linalg.matmul" in gemm_text:
        matmuls = sum(l.p["M"] * l.p["K"] * l.p["N"] for l in program.launches if l.kind == "gemm")
        assert sum(l.work.get("scalar_mac", 0.0) for l in cost.launches) == pytest.approx(matmuls)
        assert max(compute, key=compute.get) == "scalar_mac"
        assert cost.seconds > 100 * cost_model.PUBLISHED_MS[("o_ffn", 2048)] / 1e3
    else:
        assert "scalar_mac" not in compute
    for name in ("rms_gemv_rope", "o_gemv_ffn", "lm_head_gemv"):  # the GEMVs call gemv.o
        assert "scalar_mac" not in cost_model.program_cost(cost_model.program(name, dims)).compute_s()


def test_bucketed_prefill_is_predicted_faster_for_short_prompts():
    prefill = cost_model.predictions(prompts=(32, 2048))["prefill"]
    assert prefill[0]["buckets"] == [32] and prefill[1]["buckets"] == [2048]
    assert prefill[0]["predicted_ms"] < prefill[1]["predicted_ms"]
