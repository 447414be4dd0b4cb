"""The cost model reads our IR: scalar GEMMs are slow, vectorized kernel calls fast, bytes and overlap as emitted."""
import dataclasses

import pytest

from benchmarks import common, cost_model
from torch_npu2.kernels import catalog
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
    assert {c.kind for c in CALL_COSTS.values()} <= set(cost_model.THROUGHPUT)


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


# ---- scf.if: branches counted as the IR executes them --------------------------------------------------------
BRANCH_CONFIG = {"ATTN_TQ": 8, "ATTN_TK": 16, "ATTN_HEAD_DIM": 16}
BRANCH_WORK = 8 * 16  # attn_init_f32's elements per call: ATTN_TQ × ATTN_HEAD_DIM
BRANCH_DMA_BYTES = 64 * 2  # the bf16 window the branch fetches from DDR


def branch_launch(herd: tuple[int, int], trips: int, condition, orelse: bool = False):
    """One launch step, a ``herd`` of tiles each looping ``trips`` times; in every trip, an scf.if on
    ``condition(b, tile_x, iv, flags)`` (it returns the i1 value, or a list of them for nested ifs) fetches 64 bf16 from DDR and calls attn_init_f32 (a
    vector_elementwise kernel of BRANCH_WORK elements). With ``orelse``, the call is in the else branch."""
    b = LaunchBuilder("branchy", [MemRef((64,), "bf16"), MemRef((1,), "i32")], "xf")
    row_type = MemRef((BRANCH_CONFIG["ATTN_TQ"],), "f32", L1)
    with b.launch("branchy", (1, 1), b.operands) as (_, _, (x, flags)):
        with b.segment("branchy_seg", [x, flags]) as (_, _, (sx, sflags)):
            with b.herd("branchy_herd", herd, [sx, sflags], link_with="attention.o") as ((tx, _), _, (hx, hflags)):
                x_buf = b.alloc(MemRef((64,), "bf16", L1), "x_l1")
                flag_buf = b.alloc(MemRef((1,), "i32", L1), "flag_l1")
                b.dma(flag_buf, WHOLE, hflags, WHOLE)
                rows = [b.alloc(row_type, n) for n in ("row_max", "row_sum")]
                acc = b.alloc(MemRef((8 * 16,), "f32", L1), "acc")
                with b.loop(0, trips, 1, "i") as iv:
                    body = [lambda: b.dma(x_buf, WHOLE, hx, WHOLE),
                            lambda: b.call("attn_init_f32", [*rows, acc], BRANCH_CONFIG)]
                    conditions = condition(b, tx, iv, flag_buf)
                    conditions = [conditions] if isinstance(conditions, str) else conditions
                    for value in conditions:
                        b.emit(f"scf.if {value} {{")
                    if not orelse:
                        for emit in body:
                            emit()
                    b.emit("} else {")
                    if orelse:
                        for emit in body:
                            emit()
                    b.emit("}")
                    for _ in conditions[1:]:
                        b.emit("} else {")
                        b.emit("}")
    return b.finish()


def iv_below_3(b, tx, iv, flags):
    return b.assign("taken", f"arith.cmpi slt, {iv}, {b.const(3)} : index", "i1").ssa


def test_a_branch_taken_in_3_of_8_trips_gets_3_eighths_of_its_work_and_bytes():
    always = cost_model.launch_cost(branch_launch((1, 1), 8, lambda b, *_: b.const(1, "i1")), DEFAULT_OPTIONS)
    cost = cost_model.launch_cost(branch_launch((1, 1), 8, iv_below_3), DEFAULT_OPTIONS)
    assert always.work["vector_elementwise"] == 8 * BRANCH_WORK
    assert cost.work["vector_elementwise"] == 3 * BRANCH_WORK
    flag_bytes = 4
    assert always.ddr_bytes == 8 * BRANCH_DMA_BYTES + flag_bytes
    assert cost.ddr_bytes == 3 * BRANCH_DMA_BYTES + flag_bytes
    (condition,) = cost.conditions
    assert (condition.work_share, condition.time_share, condition.unevaluated) == (3 / 8, 3 / 8, "")
    assert "arith.cmpi slt" in condition.text
    assert cost.compute_s["vector_elementwise"] == pytest.approx(3 / 8 * always.compute_s["vector_elementwise"])
    assert cost.seconds < always.seconds


def test_the_else_branch_gets_the_other_trips():
    cost = cost_model.launch_cost(branch_launch((1, 1), 8, iv_below_3, orelse=True), DEFAULT_OPTIONS)
    assert cost.work["vector_elementwise"] == 5 * BRANCH_WORK


def test_a_branch_on_the_tile_id_charges_work_over_all_tiles_and_time_for_the_slowest():
    """Tile x of a 4×1 herd takes the branch in the x of its 4 trips where iv < x: 0+1+2+3 = 6 of 16 in all,
    3 of 4 for the slowest tile (x = 3), which the herd waits for."""
    def iv_below_tile_x(b, tx, iv, flags):
        return b.assign("taken", f"arith.cmpi slt, {iv}, {tx} : index", "i1").ssa

    cost = cost_model.launch_cost(branch_launch((4, 1), 4, iv_below_tile_x), DEFAULT_OPTIONS)
    always = cost_model.launch_cost(branch_launch((4, 1), 4, lambda b, *_: b.const(1, "i1")), DEFAULT_OPTIONS)
    assert cost.work["vector_elementwise"] == 6 * BRANCH_WORK
    (condition,) = cost.conditions
    assert (condition.work_share, condition.time_share) == (6 / 16, 3 / 4)
    assert cost.compute_s["vector_elementwise"] == pytest.approx(3 / 4 * always.compute_s["vector_elementwise"])


def test_integer_arithmetic_and_affine_maps_feed_the_condition():
    """taken = (2·iv + 1 ≤ 9) over iv in [0, 8): iv ≤ 4, 5 of 8."""
    def odd_at_most_9(b, tx, iv, flags):
        doubled = b.affine("s0 * 2", [iv], "doubled")
        odd = b.assign("odd", f"arith.addi {doubled}, {b.const(1)} : index", "index").ssa
        return b.index_at_most(odd, b.const(9), "taken")

    cost = cost_model.launch_cost(branch_launch((1, 1), 8, odd_at_most_9), DEFAULT_OPTIONS)
    assert cost.work["vector_elementwise"] == 5 * BRANCH_WORK


def loaded_flag(b, tx, iv, flags):
    flag = b.assign("flag", f"memref.load {flags.ssa}[{b.const(0)}] : {flags.type}", "i32").ssa
    return b.assign("taken", f"arith.cmpi ne, {flag}, {b.const(0, 'i32')} : i32", "i1").ssa


def shifted_iv(b, tx, iv, flags):
    shifted = b.assign("shifted", f"arith.shrui {iv}, {b.const(1)} : index", "index").ssa
    return b.assign("taken", f"arith.cmpi eq, {shifted}, {b.const(0)} : index", "i1").ssa


@pytest.mark.parametrize("condition,culprit", [(loaded_flag, "memref.load"), (shifted_iv, "arith.shrui")])
def test_a_condition_the_model_cannot_evaluate_stays_always_taken_and_is_reported(condition, culprit):
    cost = cost_model.launch_cost(branch_launch((1, 1), 8, condition), DEFAULT_OPTIONS)
    assert cost.work["vector_elementwise"] == 8 * BRANCH_WORK
    (unevaluated,) = cost.unevaluated_conditions
    assert culprit in unevaluated.unevaluated
    assert (unevaluated.work_share, unevaluated.time_share) == (1.0, 1.0)


@pytest.mark.parametrize("seq", [256, 512])
def test_flash_attn_is_charged_for_the_causally_needed_kv_blocks(seq):
    """Counted by hand from the builder's tile sizes: a query tile of tile_q rows starting at q0 needs the key
    blocks of tile_kv positions starting at or before its last row, (q0 + tile_q - 1) // tile_kv + 1 of them;
    each needed block costs the two tile matmuls (tile_q × tile_kv × head_dim MACs each) and one softmax
    update (tile_q × tile_kv elements). The other blocks are streamed but skipped."""
    heads, kv_heads, head_dim = 8, 2, 64
    program = catalog.flash_attn_program(heads, kv_heads, head_dim, seq)
    launch = next(l for l in program.launches if l.kind == "attention")
    ir = build_launch(program, launch)
    config = dict(next(d for d in ir.externs if d.symbol == "attn_qk_tile_bf16").defines)
    tile_q, tile_kv = config["ATTN_TQ"], config["ATTN_TK"]
    needed = heads * sum((q0 + tile_q - 1) // tile_kv + 1 for q0 in range(0, seq, tile_q))
    every = heads * (seq // tile_q) * (seq // tile_kv)
    assert needed < every
    cost = cost_model.launch_cost(ir, program.compile_options)
    assert cost.work["mmul_bf16"] == pytest.approx(needed * 2 * tile_q * tile_kv * head_dim)
    assert cost.work["vector_transcendental"] == pytest.approx(needed * tile_q * tile_kv)
    assert not cost.unevaluated_conditions


def test_a_nested_branch_counts_the_trips_where_both_conditions_hold():
    """Outer: iv < 6; inner: iv >= 2; both hold for iv in [2, 6): 4 of 8."""
    def nested(b, tx, iv, flags):
        return [b.assign("outer", f"arith.cmpi slt, {iv}, {b.const(6)} : index", "i1").ssa,
                b.assign("inner", f"arith.cmpi sge, {iv}, {b.const(2)} : index", "i1").ssa]

    cost = cost_model.launch_cost(branch_launch((1, 1), 8, nested), DEFAULT_OPTIONS)
    assert cost.work["vector_elementwise"] == 4 * BRANCH_WORK
    assert [c.work_share for c in cost.conditions] == [6 / 8, 4 / 6]


def test_decode_adds_the_host_time_the_host_section_measured(tmp_path):
    assert cost_model.host_measurement(tmp_path) is None
    npu_only = cost_model.predictions(prompts=(32,))["decode"]
    assert "NPU only: no host measurement" in cost_model.decode_line(npu_only)
    contexts = [{"context_tokens": 32, "token_ms": 7.0, "host_attention_ms": 2.0, "host_overhead_ms": 5.0},
                {"context_tokens": 512, "token_ms": 9.0, "host_attention_ms": 4.0, "host_overhead_ms": 5.0}]
    common.write_result("host_overhead", {"contexts": contexts}, tmp_path, "quick", 0.0)
    host = cost_model.host_measurement(tmp_path)
    assert (host["token_ms"], host["context_tokens"], host["mode"]) == (7.0, 32, "quick")
    decode = cost_model.predictions(prompts=(32,), host=host)["decode"]
    assert decode["npu_ms_per_token"] == npu_only["npu_ms_per_token"]
    assert decode["total_ms_per_token"] == pytest.approx(npu_only["npu_ms_per_token"] + 7.0)
    line = cost_model.decode_line(decode)
    assert f"predicted NPU {npu_only['npu_ms_per_token']:.1f} ms + measured host 7.00 ms" in line
    assert "quick mode, context 32" in line


@pytest.mark.parametrize("work, nbytes", [(64 * 1024, 256), (64, 64 * 1024)], ids=["compute-bound", "dma-bound"])
def test_a_double_buffered_loop_is_a_pipeline(work, nbytes):
    """Fill, then each trip's compute beside the next trip's copy, then the last compute: never slower than the
    same trips in sequence, even when the copies dominate."""
    trips = 8
    body = [cost_model.Transfer(nbytes, 1, 2, 1, frozenset({"buf"})), cost_model.Compute("vector_mac", work)]
    loop = cost_model.Region("for", (trips,), body, buffers={"buf": 2})
    evaluate = lambda omitted: cost_model._Evaluator(omitted, cost_model.LaunchCost("k", 0.0, 1)).loop(
        loop, copies=1, tiles=1, ddr_rate=cost_model.DDR_BYTES_PER_S)
    compute = work / (cost_model.THROUGHPUT["vector_mac"].per_cycle * cost_model.CLOCK_HZ)
    dma = nbytes / cost_model.TILE_CHANNEL_BYTES_PER_S
    assert evaluate(frozenset()) == pytest.approx(dma + (trips - 1) * max(compute, dma) + compute)
    assert evaluate(frozenset({2})) == pytest.approx(trips * (compute + dma))  # L1 left single-buffered
    assert evaluate(frozenset()) < evaluate(frozenset({2}))


def test_prefill_is_predicted_for_every_matmul_precision():
    (row,) = cost_model.predictions(prompts=(128,))["prefill"]
    # the BFP16-emulated mmul runs at twice the rate; "bfp16_gate_up" has only the gate/up GEMM at it
    assert row["predicted_ms_bfp16"] < row["predicted_ms_bfp16_gate_up"] < row["predicted_ms"]
    rows = {(r["program"], r["seq"]): r for r in cost_model.per_program(cost_model.llama_1b_dims())}
    o_ffn, qkv = rows[("o_ffn", 2048)], rows[("rms_gemms_rope", 2048)]
    assert o_ffn["predicted_ms_bfp16"] < o_ffn["predicted_ms_bfp16_gate_up"] < o_ffn["predicted_ms"]
    assert qkv["predicted_ms_bfp16_gate_up"] == qkv["predicted_ms"]  # no gate/up GEMM in it
    for key in ("predicted_ms_bfp16", "predicted_ms_bfp16_gate_up"):
        assert rows[("flash_attn", 2048)][key] is None  # no GEMM precision to choose


def test_a_decode_token_pays_one_dispatch_per_layer_plus_the_first_layers_and_the_lm_heads():
    """The chained Program is its two parts' launches in one dispatch, and a decode token follows NpuDecoderLayer:
    rms_gemv_rope, then L−1 chained Programs, o_gemv_ffn, the LM head: L+2 dispatches."""
    dims = cost_model.llama_1b_dims()
    cost = {name: cost_model.program_cost(cost_model.program(name, dims))
            for name in ("rms_gemv_rope", "o_gemv_ffn", "o_gemv_ffn_rms_gemv_rope", "lm_head_gemv")}
    chained, parts = cost["o_gemv_ffn_rms_gemv_rope"], (cost["o_gemv_ffn"], cost["rms_gemv_rope"])
    assert [l.kind for l in chained.launches] == [l.kind for p in parts for l in p.launches]
    assert chained.seconds == pytest.approx(sum(p.seconds for p in parts) - cost_model.DISPATCH_S)
    for layers in (1, 16):
        expected_s = sum(c.seconds for c in cost.values()) + (layers - 2) * chained.seconds
        assert cost_model.decode_ms(dims, layers) == pytest.approx(expected_s * 1e3)
    unchained = 16 * (cost["rms_gemv_rope"].seconds + cost["o_gemv_ffn"].seconds) + cost["lm_head_gemv"].seconds
    assert unchained * 1e3 - cost_model.decode_ms(dims, 16) == pytest.approx(15 * cost_model.DISPATCH_S * 1e3)
