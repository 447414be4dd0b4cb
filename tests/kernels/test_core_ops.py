"""What a kernel call executes, counted by running its AIE path against the counting stand-in of the AIE API: the
counts follow the kernels' loops (checked against counts derived by hand from the sources), cover every call our
Programs make, and the aie::mmul expansion is what aie_api's AIE2P headers emit."""
import math
import os
import re
from pathlib import Path

import pytest

from benchmarks import cost_model
from torch_npu2.kernels import core_ops
from torch_npu2.kernels.builders import build_launch
from torch_npu2.kernels.builders.externs import LAST_OPERAND, MATMUL_OPERANDS, call_cost
from torch_npu2.kernels.mlir_text import parse_memref_type

AIE_API_INCLUDE = Path(os.environ.get("TORCH_NPU2_AIE_API_INCLUDE", Path(__file__).resolve().parents[3] / "shared" /
                                      "toolchains" / "aie-headers" / "aie_api" / "include"))


def counts(symbol, defines, **integers):
    (ops, _) = core_ops.call_ops(symbol, defines, integers)
    return ops


def test_the_entry_points_are_read_from_the_definitions():
    params = core_ops.entry_points("attention.cc")["attn_qk_tile_bf16"]
    assert [(p.name, p.kind) for p in params] == [("q", "bf16 *"), ("kv", "bf16 *"), ("scores", "float *"),
                                                  ("q_start", "int"), ("k_start", "int")]
    assert [p.kind for p in core_ops.entry_points("gemv.cc")["rmsnorm_bf16"]] == ["bf16 *", "bf16 *", "float"]


@pytest.mark.parametrize("rows,depth", [(16, 2048), (2, 8192)])
def test_gemv_counts_follow_its_loops(rows, depth):
    """gemv.cc's row_dot, per row: a zeroed 32-lane accumulator (two registers), K/32 steps of two 512-bit loads
    and one 32-lane mac, the sum moved to a vector (two registers) and reduced over 32 lanes (5 shifts, 5 adds, a
    move to a scalar); then gemv_bf16 rounds it to bf16 (a software float op)."""
    ops = counts("gemv_bf16", {"GEMV_ROWS": rows, "GEMV_K": depth})
    steps = depth // 32
    assert ops.counts == {"load": 2 * steps * rows, "store": 0, "mac": steps * rows, "vector": 10 * rows,
                          "move": 5 * rows, "nonlinear": 0, "scalar_float": rows}
    assert ops.mmul == ()


def test_gemm_counts_follow_its_loops_bfp16():
    """gemm_bf16_f32_wnk in BFP16: per 2×2 group of 8×8 output blocks, four accumulators loaded (64 floats each) and
    stored, and per K step two A blocks and two transposed W blocks (a 1024-bit load, and two shuffles for W) for
    four aie::mmul<8, 8, 8> calls; an A block and a W block each serve two calls."""
    tile_m, tile_k, tile_n = 64, 32, 128
    defines = {"GEMM_TILE_M": tile_m, "GEMM_TILE_K": tile_k, "GEMM_TILE_N": tile_n, core_ops.BFP16_DEFINE: 1}
    groups, steps = (tile_n // 16) * (tile_m // 16), tile_k // 8
    ops = counts("gemm_bf16_f32_wnk", defines)
    assert ops.counts == {"load": groups * (4 * 4 + steps * (2 * 2 + 2 * 2)), "store": groups * 4 * 4, "mac": 0,
                          "vector": groups * steps * 2 * 2, "move": groups * 2 * 4 * 4, "nonlinear": 0,
                          "scalar_float": 0}
    (use,) = ops.mmul
    assert (use.precision, use.shape) == ("bfp16", (8, 8, 8))
    assert (use.calls, use.a_operands, use.b_operands) == (4 * groups * steps, 2 * groups * steps, 2 * groups * steps)
    assert use.macs == tile_m * tile_k * tile_n


def test_gemm_counts_follow_its_loops_exact_bf16():
    """gemm_bf16_f32_wnk in exact bf16 (bf16_blocks.h): per 2×2 group of 8×8 output blocks, four accumulators
    loaded, moved in, moved out and stored (4 each); per K step two A and two W blocks loaded (2 each) and transposed
    (2 shuffles each); then per value of K each W block's row of it repeated (an extract and a broadcast), each A
    block's column of it spread along its rows (those and a transpose), and four 64-lane multiply-accumulates (2 ×
    32 lanes). No aie::mmul: every product issued once."""
    tile_m, tile_k, tile_n = 64, 32, 128
    ops = counts("gemm_bf16_f32_wnk", {"GEMM_TILE_M": tile_m, "GEMM_TILE_K": tile_k, "GEMM_TILE_N": tile_n})
    groups, steps = (tile_n // 16) * (tile_m // 16), tile_k // 8
    per_k = {"mac": 4 * 2, "vector": 2 * 2, "move": 2 * 2 + 2 * 2}
    assert ops.counts == {"load": groups * (4 * 4 + steps * 8), "store": groups * 4 * 4,
                          "mac": groups * steps * 8 * per_k["mac"],
                          "vector": groups * steps * (8 + 8 * per_k["vector"]),
                          "move": groups * (2 * 4 * 4 + steps * 8 * per_k["move"]), "nonlinear": 0,
                          "scalar_float": 0}
    assert ops.mmul == ()
    assert ops.counts["mac"] * 32 == tile_m * tile_k * tile_n


def test_attention_scores_count_whole_block_loads_2x2_blocking_and_the_mask():
    """attn_qk_tile_bf16 in passes of 2×2 score blocks: per pass and 8 of head_dim, two Q and two K blocks loaded
    whole (2 loads of 512 bits each) and transposed (2 shuffles each); then per value of head_dim each K block's
    row of it repeated down the block (an extract and a 128-bit broadcast) and each Q block's column of it spread
    along its rows (those two and a transpose), shared by the two products that take it, and four 64-lane
    multiply-accumulates (2 × 32 lanes each). Per pass four accumulators zeroed (4 each), the mask value broadcast
    once, and per block the fp32 scores moved out (4) and stored (4). No aie::mmul, no gathers and no scaling (the
    softmax scales). On the diagonal, per block on or above it, four 16-lane parts: the lane table loaded, the bound
    broadcast, a compare and a select."""
    tq, tk, dim = 32, 64, 64
    defines = {"ATTN_TQ": tq, "ATTN_TK": tk, "ATTN_HEAD_DIM": dim}
    passes = (tq // 16) * (tk // 16)
    steps = passes * dim // 8
    cheapest, dearest = core_ops.call_ops("attn_qk_tile_bf16", defines, {})
    per_value = {"mac": 4 * 2, "vector": 2 * 2, "move": 2 * 2 + 2 * 2}
    assert cheapest.counts == {"load": 8 * steps, "store": 16 * passes, "mac": 8 * per_value["mac"] * steps,
                               "vector": (8 + 8 * per_value["vector"]) * steps,
                               "move": 8 * per_value["move"] * steps + (16 + 17) * passes, "nonlinear": 0,
                               "scalar_float": 0}
    assert cheapest.mmul == ()
    on_or_above = sum(1 for qb in range(tq // 8) for kb in range(tk // 8) if kb >= qb)
    extra = {kind: dearest.counts[kind] - cheapest.counts[kind] for kind in core_ops.KINDS}
    assert extra == {"load": 4 * on_or_above, "store": 0, "mac": 0, "vector": 8 * on_or_above,
                     "move": 4 * on_or_above, "nonlinear": 0, "scalar_float": 0}
    # BFP16 keeps aie::mmul<8, 8, 8>: one per block pair and 8 of head_dim, the Q blocks as loaded
    bfp16, _ = core_ops.call_ops("attn_qk_tile_bf16", {**defines, core_ops.BFP16_DEFINE: 1}, {})
    (use,) = bfp16.mmul
    assert (use.precision, use.shape, use.calls, use.a_operands, use.b_operands) == ("bfp16", (8, 8, 8), 4 * steps,
                                                                                      2 * steps, 2 * steps)


def test_attention_pv_counts_operands_made_once_per_block_pair():
    """attn_pv_accumulate_bf16 per pass of two query row blocks: two rows of rescale factors made into blocks (a
    load, a move into the accumulator, a rounding, 8 inserts, a transpose); per two dim blocks the four accumulator
    blocks loaded (4 each), moved in (4) and rescaled by mul_by_bf16 (two roundings and a subtraction, 2 lanes ops
    each, and two 64-lane products); per key block two V blocks loaded as they are and two P blocks loaded and
    transposed, then per key each V block's row repeated down it (an extract and a broadcast), each P block's column
    spread along its rows (those and a transpose) and four 64-lane multiply-accumulates; finally each block moved
    out (4) and stored (4)."""
    tq, tk, dim = 32, 64, 64
    ops, same = core_ops.call_ops("attn_pv_accumulate_bf16", {"ATTN_TQ": tq, "ATTN_TK": tk, "ATTN_HEAD_DIM": dim}, {})
    assert ops == same and ops.mmul == ()
    passes, calls, key_blocks = tq // 16, (tq // 16) * (dim // 16), tk // 8
    per_key = {"mac": 8, "vector": 4, "move": 8}
    per_key_block = {"load": 8, "vector": 4 + 8 * per_key["vector"], "move": 8 * per_key["move"],
                     "mac": 8 * per_key["mac"]}
    per_call = {"load": 16 + key_blocks * per_key_block["load"], "store": 16,
                "vector": 24 + key_blocks * per_key_block["vector"],
                "move": 16 + 16 + key_blocks * per_key_block["move"], "mac": 16 + key_blocks * per_key_block["mac"]}
    row_scales = {"load": 1, "move": 9, "vector": 3}
    assert ops.counts == {kind: calls * per_call.get(kind, 0) + 2 * passes * row_scales.get(kind, 0)
                          for kind in core_ops.KINDS}
    assert ops.counts["mac"] - 16 * calls == tq * tk * dim // 32  # every product once, 32 lanes an instruction


@pytest.mark.parametrize("tk", [32, 64])
def test_the_online_softmax_works_on_8_rows_at_once(tk):
    """attn_online_softmax_bf16 per 8 rows: no scalar float work; one 8-lane exp2 for the rescale factors and per
    8×8 block of scores a 64-lane exp2 (4 of 16 lanes); the scale in each exponent's argument (a 64-lane bf16
    multiply and two multiply-adds: 6 ops of 32 lanes per block) and in the rescale factors' (3), the row sum's
    rescale (2); per block 16 vector ops (the bf16 max, the shift, the split of the argument, the transpose and the
    sum), and 25 per 8 rows (the folds of the max and the sums, the row state)."""
    tq = 32
    ops = counts("attn_online_softmax_bf16", {"ATTN_TQ": tq, "ATTN_TK": tk, "ATTN_HEAD_DIM": 64})
    groups, blocks = tq // 8, tk // 8
    assert ops.counts["scalar_float"] == 0
    assert ops.counts["nonlinear"] == groups * (4 * blocks + 1)
    assert ops.counts["mac"] == groups * (6 * blocks + 5)
    assert ops.counts["vector"] == groups * (16 * blocks + 25)


SMOLLM2_DIMS = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152, eps=1e-5)


def models_calls():
    """Every kernel call of Llama-3.2-1B's and SmolLM2-135M's Programs at 16 and 2048 tokens, in every matmul
    precision, and in decode: (its extern declaration, the launch's IR text), one per symbol and build."""
    from torch_npu2.kernels import catalog

    found = {}
    for dims in (cost_model.llama_1b_dims(), catalog.ModelDims(**SMOLLM2_DIMS)):
        for precision in catalog.MATMUL_PRECISIONS:
            decode_attention = catalog.decode_attn_program(dims.heads, dims.kv_heads, dims.head_dim, 2048)
            for program in [*catalog.programs_for_model(dims, (16, 2048), precision), decode_attention]:
                for launch in program.launches:
                    ir = build_launch(program, launch)
                    for decl in ir.externs:
                        found.setdefault((decl.symbol, decl.defines), (decl, ir.text))
    return list(found.values())


def integer_operands(decl, text: str) -> dict:
    """The call's integer parameters in ``text`` (a launch's IR): name → the SSA operand, and the constants."""
    constants = {name: int(value) for name, value in re.findall(r"(%\w+) = arith\.constant (-?\d+) : i32", text)}
    operands = re.search(rf"func\.call @{decl.symbol}\(([^)]*)\)", text).group(1).split(", ")
    params = core_ops.entry_points(core_ops.source_of(decl.symbol))[decl.symbol]
    return {p.name: o for p, o in zip(params, operands) if p.kind == "int"}, constants


def test_every_call_our_programs_make_is_counted_and_its_multiplies_are_its_work():
    """Each call's mmul uses multiply exactly the MACs the call's work says (CallCost), at both argument bounds,
    its integer arguments the constants our IR passes; a call that multiplies elementwise instead (exact bf16
    attention) issues at least one 32-lane multiply per 32 of them (the stand-in's lanes per instruction)."""
    for decl, text in models_calls():
        cost = call_cost(decl.symbol)
        shapes = [parse_memref_type(t).shape for t in decl.arg_types if t.startswith("memref")]
        operands, constants = integer_operands(decl, text)
        known = {name: constants[o] for name, o in operands.items() if o in constants}
        for ops in core_ops.call_ops(decl.symbol, dict(decl.defines), known):
            assert sum(ops.counts.values()) > 0, decl
            if cost.kind not in ("mmul_bf16", "mmul_int"):
                assert ops.mmul == (), decl
                continue
            if cost.work == (MATMUL_OPERANDS,):
                work = math.sqrt(math.prod(math.prod(s) for s in shapes[:3]))
            else:
                assert cost.work != (LAST_OPERAND,)
                work = cost.factor * math.prod(dict(decl.defines)[m] for m in cost.work)
            if ops.mmul:
                assert sum(use.macs for use in ops.mmul) == work, decl
            else:
                assert cost.kind == "mmul_bf16" and ops.counts["mac"] * 32 >= work, decl


def test_integer_arguments_left_out_of_the_work_bounds_do_not_change_what_a_call_executes():
    """An integer argument that is neither a constant of the call in our IR nor bounded by WORK_ARGUMENTS is counted
    at 0: that must not matter (the row offsets of the decode GEMVs)."""
    checked = 0
    for decl, text in models_calls():
        operands, constants = integer_operands(decl, text)
        known = {name: constants[o] for name, o in operands.items() if o in constants}
        bounded = core_ops.WORK_ARGUMENTS.get(decl.symbol, lambda _: ({}, {}))(dict(decl.defines))[1]
        for name in operands.keys() - known.keys() - bounded.keys():
            at_zero = core_ops.call_ops(decl.symbol, dict(decl.defines), known)
            elsewhere = core_ops.call_ops(decl.symbol, dict(decl.defines), {**known, name: 64})
            assert at_zero == elsewhere, (decl.symbol, name)
            checked += 1
    assert checked >= 3  # gemv_add_bf16's two row offsets and gemv_rows_bf16's one


def test_the_work_arguments_bound_the_work():
    for symbol, defines in (("attn_qk_tile_bf16", {"ATTN_TQ": 32, "ATTN_TK": 64, "ATTN_HEAD_DIM": 64}),
                            ("gemv_partial_f32", {"GEMV_ROWS": 8, "GEMV_K": 2048})):
        cheapest, dearest = core_ops.call_ops(symbol, defines, {})
        assert sum(cheapest.counts.values()) < sum(dearest.counts.values()), symbol
        assert all(cheapest.counts[k] <= dearest.counts[k] for k in core_ops.KINDS), symbol


def test_an_mmul_without_instruction_counts_is_refused():
    unknown = core_ops.CoreOps(dict.fromkeys(core_ops.KINDS, 0), (core_ops.MmulUse("bfp16", (4, 8, 8), 1, 1, 1),))
    with pytest.raises(KeyError, match=r"bfp16 aie::mmul of shape \(4, 8, 8\)"):
        core_ops.instructions(unknown, share_operands=True)


def test_shared_operands_are_prepared_once_at_the_fast_end_only():
    emitted = core_ops.MMUL_INSTRUCTIONS[("bfp16", (8, 8, 8))]
    ops = core_ops.CoreOps(dict.fromkeys(core_ops.KINDS, 0), (core_ops.MmulUse("bfp16", (8, 8, 8), 4, 2, 1),))
    shared, written = core_ops.instructions(ops, True), core_ops.instructions(ops, False)
    assert shared["vector"] == 2 * emitted.per_a["vector"] + 1 * emitted.per_b["vector"]
    assert written["vector"] == 4 * (emitted.per_a["vector"] + emitted.per_b["vector"])
    assert shared["mac"] == 4 * emitted.per_call["mac"] + emitted.per_b["mac"]
    assert written["mac"] == 4 * (emitted.per_call["mac"] + emitted.per_b["mac"])


# ---- the mmul expansion against aie_api's headers ----------------------------------------------------------------
def aie_api_header(relative: str) -> str:
    path = AIE_API_INCLUDE / "aie_api" / relative
    if not path.exists():
        pytest.skip(f"aie_api's headers are not at {AIE_API_INCLUDE} (the shared workspace's toolchains/aie-headers; "
                    f"or set TORCH_NPU2_AIE_API_INCLUDE to an aie_api include directory)")
    return path.read_text()


def body(text: str, opening: str) -> str:
    """The brace-balanced body that follows the first ``opening`` in ``text``."""
    start = text.index("{", text.index(opening))
    depth = 0
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end + 1]
    raise ValueError(f"unbalanced body after {opening}")


def test_bfp16_mmul_is_charged_what_aie_apis_emulation_emits():
    """detail/aie2p/mmul_bf16_bf16.hpp under AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16: an 8×8×8 multiply is one
    mac_8x8_8x8T_conf; A becomes a 64-lane accumulator (two 32-lane upshifts, aie2p/accum.hpp) and bfp16; B is
    transposed (two shuffles on AIE2P, aie2/transpose.hpp), multiplied by ones and converted to bfp16."""
    mmul = aie_api_header("detail/aie2p/mmul_bf16_bf16.hpp")
    start = mmul.index("#if AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16")
    bfp16 = mmul[start:mmul.index("#else", start)]
    mac = body(bfp16[bfp16.index("struct mmul_bf16_bf16<8, 8, 8"):], "void mac(")
    emitted = core_ops.MMUL_INSTRUCTIONS[("bfp16", (8, 8, 8))]
    assert mac.count("::mac_8x8_8x8T_conf(") == emitted.per_call["mac"] == 1
    assert mac.count("::mul_elem_64(") == emitted.per_b["mac"] == 1
    assert mac.count("::to_v64bfp16ebs8(") == 2
    assert "accum<accfloat, 64> acc_a(a);" in mac and mac.count("transpose<TypeB, 64>::run(b, 8, 8)") == 1
    accum = aie_api_header("detail/aie2p/accum.hpp")
    ups = body(accum, "static constexpr auto get_ups()")
    assert "return ::ups_to_v32accfloat(v);" in ups  # 64 lanes: two of them
    transpose = aie_api_header("detail/aie2/transpose.hpp")
    aie2p = transpose[transpose.index("#else", transpose.index("struct transpose_bits_impl<16, T, 64>")):]
    assert body(aie2p, "static vector_type run(").count("::shuffle(") == 2
    assert emitted.per_a["vector"] == 2 + 1 and emitted.per_b["vector"] == 2 + 1
