"""The timing model reads our IR: scalar GEMMs are slow, kernel calls cost what they execute, bytes and overlap as
emitted, branches as the IR takes them, and every prediction is a range from a fast to a slow end."""
import dataclasses

import pytest

from torch_npu2.kernels import catalog, core_ops, timing
from torch_npu2.kernels.builders import build_launch
from torch_npu2.kernels.builders.ir import L1, WHOLE, ExternDecl, LaunchBuilder, MemRef, Window
from torch_npu2.kernels.builders.npu2 import l1_elements
from torch_npu2.kernels.device import DEVICE
from torch_npu2.kernels.program import CompileOptions

M, K, N = 256, 512, 256
HERD_M, HERD_N, TILE_K = 4, 4, 64
DEFAULT_OPTIONS = CompileOptions()
FAST, SLOW = timing.FAST, timing.SLOW
# C += A·Wᵀ as a linalg.matmul over W's (N, K) rows: the scalar form the gemm builder emitted before gemm.cc
MATMUL_TRANSPOSED_B = ("indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>, "
                       "affine_map<(d0, d1, d2) -> (d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>]")
BFP16 = core_ops.BFP16_DEFINE


def tile_gemm(kernel: bool, defines=()):
    """A hand-made GEMM launch, one launch step, on a HERD_M×HERD_N herd: each tile streams its A and W windows
    DDR → L1 over K and accumulates with ``linalg.matmul`` (the scalar form) or a call of the vectorized GEMM kernel
    (``gemm_bf16_f32_wnk``, declared here by hand with its tile sizes and ``defines``)."""
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
    ir = b.finish({name: value.type.nbytes for name, value in
                   (("A window", a_buf), ("W window", w_buf), ("f32 accumulator", acc), ("C tile", c_buf))})
    if not kernel:
        return ir
    config = (("GEMM_TILE_M", tile_m), ("GEMM_TILE_K", TILE_K), ("GEMM_TILE_N", tile_n), *defines)
    decl = ExternDecl("gemm_bf16_f32_wnk", (str(a_type), str(w_type), str(acc_type)), "gemm.o", config)
    return dataclasses.replace(ir, externs=(decl,))


def test_core_cycles_co_issue_at_the_fast_end_and_serialize_at_the_slow_end():
    """Fast: the busiest of the load units (two), the store unit, the vector unit and the move slot, or the
    scalar float work; slow: every instruction alone, a scalar float operation at its slow cost."""
    n = {"load": 10, "store": 3, "mac": 4, "vector": 5, "move": 7, "nonlinear": 1, "scalar_float": 2}
    assert timing.core_cycles(n, FAST) == max(10 / 2, 3, 4 + 5 + 1, 7, 2 * FAST.scalar_float_cycles)
    assert timing.core_cycles(n, SLOW) == 10 + 3 + 4 + 5 + 7 + 1 + 2 * SLOW.scalar_float_cycles
    assert timing.core_cycles({**n, "move": 40}, FAST) == 40


def test_a_kernel_call_costs_the_instructions_it_executes():
    """The vectorized GEMM call's cycles at each end are its counted instructions (core_ops) through core_cycles:
    operands shared and cheapest arguments at the fast end, as written at the slow end."""
    ir = tile_gemm(kernel=True)
    defines = dict(ir.externs[0].defines)
    cheapest, dearest = core_ops.call_ops("gemm_bf16_f32_wnk", defines, {})
    cost = {end.name: timing.launch_cost(ir, DEFAULT_OPTIONS, end) for end in timing.ENDS}
    calls = K // TILE_K
    for end, ops in ((FAST, cheapest), (SLOW, dearest)):
        cycles = timing.core_cycles(core_ops.instructions(ops, end.share_operands), end)
        assert cost[end.name].compute_s["mmul_bf16"] == pytest.approx(calls * cycles / DEVICE.clock_hz)


def test_scalar_gemm_is_predicted_much_slower_than_the_vectorized_kernel():
    for end in timing.ENDS:
        scalar = timing.launch_cost(tile_gemm(kernel=False), DEFAULT_OPTIONS, end)
        vectorized = timing.launch_cost(tile_gemm(kernel=True), DEFAULT_OPTIONS, end)
        assert scalar.work["scalar_mac"] == pytest.approx(M * K * N)
        assert vectorized.work["mmul_bf16"] == pytest.approx(M * K * N)
        assert "scalar_mac" not in vectorized.work
        assert scalar.seconds > 100 * vectorized.seconds


def test_bfp16_emulation_is_faster_than_exact_bf16_whichever_way_it_is_chosen():
    """BFP16 by the call's build flag or by the launch's precision parameter: the same cost; exact bf16, emulated
    by aie_api on AIE2P, is slower at both ends."""
    for end in timing.ENDS:
        exact = timing.launch_cost(tile_gemm(kernel=True), DEFAULT_OPTIONS, end)
        by_define = timing.launch_cost(tile_gemm(kernel=True, defines=[(BFP16, 1)]), DEFAULT_OPTIONS, end)
        by_param = timing.launch_cost(tile_gemm(kernel=True), DEFAULT_OPTIONS, end, precision="bfp16")
        assert by_define.work["mmul_bfp16"] == by_param.work["mmul_bfp16"] == pytest.approx(M * K * N)
        assert by_define.seconds == pytest.approx(by_param.seconds)
        assert by_define.seconds < exact.seconds


def test_ddr_bytes_count_each_distinct_window_once():
    """A windows move with the tile row only and W windows with the tile column only, so each is one broadcast
    read along the other herd dimension: every A and W element leaves DDR once, every C element returns once."""
    cost = timing.launch_cost(tile_gemm(kernel=False), DEFAULT_OPTIONS, FAST)
    assert cost.ddr_bytes == 2 * (M * K + N * K + M * N)
    assert cost.tile_dma_bytes == 2 * (M * K * HERD_N + N * K * HERD_M + M * N)
    assert cost.iterations == 1
    assert cost.tiles == HERD_M * HERD_N


def test_double_buffering_overlaps_dma_with_compute():
    vectorized = tile_gemm(kernel=True)
    for end in timing.ENDS:
        overlapped = timing.launch_cost(vectorized, DEFAULT_OPTIONS, end)
        serial = timing.launch_cost(vectorized, CompileOptions(omit_pingpong="all"), end)
        assert serial.seconds > overlapped.seconds


def test_unknown_ops_and_symbols_are_refused():
    ir = tile_gemm(kernel=False)
    with pytest.raises(ValueError, match="no cost for 'linalg.batch_matmul'"):
        timing.launch_cost(dataclasses.replace(ir, text=ir.text.replace("linalg.matmul", "linalg.batch_matmul")),
                           DEFAULT_OPTIONS, FAST)
    call = tile_gemm(kernel=True)
    renamed = dataclasses.replace(call, text=call.text.replace("@gemm_bf16_f32_wnk", "@mystery_kernel"),
                                  externs=tuple(dataclasses.replace(d, symbol="mystery_kernel") for d in call.externs))
    with pytest.raises(KeyError, match="mystery_kernel"):
        timing.launch_cost(renamed, DEFAULT_OPTIONS, FAST)


@pytest.mark.parametrize("work, nbytes", [(64 * 1024, 256), (64, 64 * 1024)], ids=["compute-bound", "dma-bound"])
def test_a_double_buffered_loop_is_a_pipeline(work, nbytes):
    """Fill, then each trip's compute beside the next trip's copy, then the last compute: never slower than the
    same trips in sequence, even when the copies dominate."""
    trips, cycles = 8, (work / 32, work / 8)
    body = [timing.Transfer(nbytes, 1, 2, 1, frozenset({"buf"})), timing.Compute("vector_mac", work, cycles)]
    loop = timing.Region("for", (trips,), body, buffers={"buf": 2})
    for end, end_cycles in zip(timing.ENDS, cycles):
        def evaluate(omitted):
            evaluator = timing._Evaluator(omitted, timing.LaunchCost("k", 0.0, 1), end)
            return evaluator.loop(loop, copies=1, tiles=1, ddr_rate=end.ddr_bytes_per_s)

        compute = end_cycles / DEVICE.clock_hz
        dma = nbytes / DEVICE.tile_channel_bytes_per_s
        assert evaluate(frozenset()) == pytest.approx(dma + (trips - 1) * max(compute, dma) + compute)
        assert evaluate(frozenset({2})) == pytest.approx(trips * (compute + dma))  # L1 left single-buffered
        assert evaluate(frozenset()) < evaluate(frozenset({2}))


STAGED_TRIPS, STAGED_ELEMENTS = 8, 4096
STAGED_CONFIG = {"ATTN_TQ": 8, "ATTN_TK": 16, "ATTN_HEAD_DIM": 16}


def segment_loop_herd(herd_loop: bool):
    """One launch step: a segment loop of STAGED_TRIPS trips, each moving STAGED_ELEMENTS bf16 DDR → memtile, then
    entering a herd that copies them memtile → L1 and calls attn_init_f32 (decode attention's shape of schedule).
    With ``herd_loop`` the herd's copy and call sit in a loop of one trip of its own (the GEMVs' shape)."""
    n = STAGED_ELEMENTS
    b = LaunchBuilder("staged", [MemRef((STAGED_TRIPS * n,), "bf16")], "x")
    rows_type = MemRef((l1_elements(STAGED_CONFIG["ATTN_TQ"], "f32"),), "f32", L1)
    with b.launch("staged", (1, 1), b.operands) as (_, _, (x,)):
        with b.segment("staged_seg", [x]) as (_, _, (sx,)):
            x_l2 = b.alloc(MemRef((n,), "bf16", 1), "x_l2")
            with b.loop(0, STAGED_TRIPS, 1, "trip") as trip:
                start = b.affine(f"s0 * {n}", [trip], "start")
                b.dma(x_l2, WHOLE, sx, Window((start,), (n,), (1,)))
                with b.herd("staged_herd", (1, 1), [x_l2], link_with="attention.o") as (_, _, (hx,)):
                    x_l1 = b.alloc(MemRef((n,), "bf16", L1), "x_l1")
                    rows = [b.alloc(rows_type, name) for name in ("row_max", "row_sum")]
                    acc = b.alloc(MemRef((8 * 16,), "f32", L1), "acc")

                    def body():
                        b.dma(x_l1, WHOLE, hx, WHOLE)
                        b.call("attn_init_f32", [*rows, acc], STAGED_CONFIG)
                    if herd_loop:
                        with b.loop(0, 1, 1, "once"):
                            body()
                    else:
                        body()
            b.dealloc(x_l2)
    return b.finish({"x": n * 2, "acc": 8 * 16 * 4, "rows": 2 * rows_type.nbytes})


def test_a_loopless_herd_in_a_segment_loop_double_buffers_its_l1_copies_as_a_stage():
    """AIR gives a herd with no loop of its own a copy of the segment loop around it and ping-pongs its L1 buffers
    over it (air-isolate-async-dma-loop-nests; tests/benchmarks/test_cost_model_pingpong.py checks both shapes against
    the real passes): its memtile → L1 copies become a stage of the loop's pipeline. A herd with a loop of its own
    stays inside the segment loop, its copies in sequence with its compute, as when L1 ping-pong is omitted."""
    loopless, looped = segment_loop_herd(False), segment_loop_herd(True)
    l2_pingpong = timing.PingPongBuffer("segment", STAGED_TRIPS, 1)
    assert timing.pingpong_buffers(loopless, DEFAULT_OPTIONS) == {l2_pingpong,
                                                                  timing.PingPongBuffer("herd", STAGED_TRIPS, L1)}
    assert timing.pingpong_buffers(looped, DEFAULT_OPTIONS) == {l2_pingpong}
    no_l1 = dataclasses.replace(DEFAULT_OPTIONS, omit_pingpong="L1")
    assert timing.pingpong_buffers(loopless, no_l1) == {l2_pingpong}
    for end in timing.ENDS:
        staged = timing.launch_cost(loopless, DEFAULT_OPTIONS, end)
        sequential = timing.launch_cost(loopless, no_l1, end)
        assert timing.launch_cost(looped, DEFAULT_OPTIONS, end).seconds == pytest.approx(sequential.seconds)
        # per trip: the DDR copy d2, the memtile → L1 copy d1, the compute c (d2 < d1: DDR is faster than a tile
        # channel). In sequence: d2 + (T − 1) max(c + d1, d2) + c + d1; staged: d2 + d1 + (T − 1) max(c, d1, d2) + c
        d1 = STAGED_ELEMENTS * 2 / DEVICE.tile_channel_bytes_per_s
        c = sum(staged.compute_s.values()) / STAGED_TRIPS
        assert sequential.seconds - staged.seconds == pytest.approx((STAGED_TRIPS - 1) * min(c, d1))
        assert staged.ddr_bytes == sequential.ddr_bytes == STAGED_TRIPS * STAGED_ELEMENTS * 2


# ---- scf.if: branches counted as the IR executes them --------------------------------------------------------
BRANCH_CONFIG = {"ATTN_TQ": 8, "ATTN_TK": 16, "ATTN_HEAD_DIM": 16}
BRANCH_WORK = 8 * 16  # attn_init_f32's elements per call: ATTN_TQ × ATTN_HEAD_DIM
BRANCH_DMA_BYTES = 64 * 2  # the bf16 window the branch fetches from DDR


def branch_launch(herd: tuple[int, int], trips: int, condition, orelse: bool = False):
    """One launch step, a ``herd`` of tiles each looping ``trips`` times; in every trip, an scf.if on
    ``condition(b, tile_x, iv, flags)`` (it returns the i1 value, or a list of them for nested ifs) fetches 64 bf16
    from DDR and calls attn_init_f32 (BRANCH_WORK elements). With ``orelse``, the call is in the else branch."""
    b = LaunchBuilder("branchy", [MemRef((64,), "bf16"), MemRef((1,), "i32")], "xf")
    row_type = MemRef((l1_elements(BRANCH_CONFIG["ATTN_TQ"], "f32"),), "f32", L1)
    with b.launch("branchy", (1, 1), b.operands) as (_, _, (x, flags)):
        with b.segment("branchy_seg", [x, flags]) as (_, _, (sx, sflags)):
            with b.herd("branchy_herd", herd, [sx, sflags], link_with="attention.o") as ((tx, _), _, (hx, hflags)):
                x_buf = b.alloc(MemRef((64,), "bf16", L1), "x_l1")
                flag_buf = b.alloc(MemRef((l1_elements(1, "i32"),), "i32", L1), "flag_l1")
                b.dma(flag_buf, Window((0,), (1,), (1,)), hflags, WHOLE)
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
    return b.finish({"x": x_buf.type.nbytes, "flag": flag_buf.type.nbytes, "acc": acc.type.nbytes,
                     **{f"row {i}": r.type.nbytes for i, r in enumerate(rows)}})


def iv_below_3(b, tx, iv, flags):
    return b.assign("taken", f"arith.cmpi slt, {iv}, {b.const(3)} : index", "i1").ssa


def test_a_branch_taken_in_3_of_8_trips_gets_3_eighths_of_its_work_and_bytes():
    always = timing.launch_cost(branch_launch((1, 1), 8, lambda b, *_: b.const(1, "i1")), DEFAULT_OPTIONS, FAST)
    cost = timing.launch_cost(branch_launch((1, 1), 8, iv_below_3), DEFAULT_OPTIONS, FAST)
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
    cost = timing.launch_cost(branch_launch((1, 1), 8, iv_below_3, orelse=True), DEFAULT_OPTIONS, FAST)
    assert cost.work["vector_elementwise"] == 5 * BRANCH_WORK


def test_a_branch_on_the_tile_id_charges_work_over_all_tiles_and_time_for_the_slowest():
    """Tile x of a 4×1 herd takes the branch in the x of its 4 trips where iv < x: 0+1+2+3 = 6 of 16 in all,
    3 of 4 for the slowest tile (x = 3), which the herd waits for."""
    def iv_below_tile_x(b, tx, iv, flags):
        return b.assign("taken", f"arith.cmpi slt, {iv}, {tx} : index", "i1").ssa

    cost = timing.launch_cost(branch_launch((4, 1), 4, iv_below_tile_x), DEFAULT_OPTIONS, FAST)
    always = timing.launch_cost(branch_launch((4, 1), 4, lambda b, *_: b.const(1, "i1")), DEFAULT_OPTIONS, FAST)
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

    cost = timing.launch_cost(branch_launch((1, 1), 8, odd_at_most_9), DEFAULT_OPTIONS, FAST)
    assert cost.work["vector_elementwise"] == 5 * BRANCH_WORK


def loaded_flag(b, tx, iv, flags):
    flag = b.assign("flag", f"memref.load {flags.ssa}[{b.const(0)}] : {flags.type}", "i32").ssa
    return b.assign("taken", f"arith.cmpi ne, {flag}, {b.const(0, 'i32')} : i32", "i1").ssa


def shifted_iv(b, tx, iv, flags):
    shifted = b.assign("shifted", f"arith.shrui {iv}, {b.const(1)} : index", "index").ssa
    return b.assign("taken", f"arith.cmpi eq, {shifted}, {b.const(0)} : index", "i1").ssa


@pytest.mark.parametrize("condition,culprit", [(loaded_flag, "memref.load"), (shifted_iv, "arith.shrui")])
def test_a_condition_the_model_cannot_evaluate_stays_always_taken_and_is_reported(condition, culprit):
    cost = timing.launch_cost(branch_launch((1, 1), 8, condition), DEFAULT_OPTIONS, FAST)
    assert cost.work["vector_elementwise"] == 8 * BRANCH_WORK
    (unevaluated,) = cost.unevaluated_conditions
    assert culprit in unevaluated.unevaluated
    assert (unevaluated.work_share, unevaluated.time_share) == (1.0, 1.0)


def test_a_nested_branch_counts_the_trips_where_both_conditions_hold():
    """Outer: iv < 6; inner: iv >= 2; both hold for iv in [2, 6): 4 of 8."""
    def nested(b, tx, iv, flags):
        return [b.assign("outer", f"arith.cmpi slt, {iv}, {b.const(6)} : index", "i1").ssa,
                b.assign("inner", f"arith.cmpi sge, {iv}, {b.const(2)} : index", "i1").ssa]

    cost = timing.launch_cost(branch_launch((1, 1), 8, nested), DEFAULT_OPTIONS, FAST)
    assert cost.work["vector_elementwise"] == 4 * BRANCH_WORK
    assert [c.work_share for c in cost.conditions] == [6 / 8, 4 / 6]


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
    cost = timing.launch_cost(ir, program.compile_options, FAST)
    assert cost.work["mmul_bf16"] == pytest.approx(needed * 2 * tile_q * tile_kv * head_dim)
    assert cost.work["vector_transcendental"] == pytest.approx(needed * tile_q * tile_kv)
    assert not cost.unevaluated_conditions


@pytest.mark.parametrize("name,seq", [("rms_gemms_rope", 2048), ("flash_attn", 2048), ("o_ffn", 2048),
                                      ("rms_gemv_rope", None), ("o_gemv_ffn", None), ("lm_head_gemv", None)])
def test_the_fast_end_is_never_slower_than_the_slow_end(name, seq):
    """Every assumption of the fast end is the faster one, launch by launch and class by class."""
    from benchmarks import cost_model

    fast, slow = cost_model.program_range(cost_model.program(name, cost_model.llama_1b_dims(), seq))
    assert fast.seconds < slow.seconds
    for f, s in zip(fast.launches, slow.launches):
        assert f.seconds <= s.seconds and f.ddr_bytes == s.ddr_bytes
        assert all(f.compute_s[k] <= s.compute_s[k] for k in f.compute_s)


@pytest.mark.parametrize("end", timing.ENDS, ids=lambda end: end.name)
def test_a_run_pays_one_dispatch_and_enters_each_further_launchs_device(end):
    """Every launch is an aie.device of its own: a run of n launches pays its dispatch, its launches and n − 1
    configures (the first comes with the dispatch), whatever the launches cost."""
    program = catalog.rms_gemv_rope_program(256, 4, 2, 64, 1e-5)
    cost = timing.program_cost(program, end)
    assert len(cost.launches) == 3
    assert cost.seconds == pytest.approx(end.dispatch_s + 2 * end.configure_s + sum(l.seconds for l in cost.launches))
    first = cost.launches[0]
    assert timing.run_seconds([first], end) == pytest.approx(end.dispatch_s + first.seconds)
    assert timing.CONFIGURE_S == (timing.FAST.configure_s, timing.SLOW.configure_s)
