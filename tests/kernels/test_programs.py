"""Programs are the single declaration: roles, index sets, validation and content keys."""
import pytest

from torch_npu2.kernels import Arg, Launch, ModelDims, Program, Role, programs_for_model
from torch_npu2.kernels.catalog import (DECODE_GROUP_SIZES, decode_layers_program, lm_head_gemv_program,
                                        o_ffn_program, rms_gemms_rope_program)
from torch_npu2.kernels.program import MAX_KERNEL_ARGS, View

SMOL = ModelDims(576, 9, 3, 64, 1536, 49152, 1e-5)


def test_rms_gemms_rope_abi_and_index_sets():
    p = rms_gemms_rope_program(576, 9, 3, 64, 1e-5, 32)
    assert [a.name for a in p.args] == ["x", "norm_w", "normed", "wq", "wk", "wv", "rope_lut", "q", "k", "v",
                                        "q_roped", "k_roped"]
    assert p.indices(Role.WEIGHT) == (1, 3, 4, 5)
    assert p.indices(Role.INPUT) == (0, 6)
    assert [a.name for a in p.outputs] == ["v", "q_roped", "k_roped"]
    assert p.arg("wq").shape == (576, 576) and p.arg("wk").shape == (192, 576)
    assert [l.kind for l in p.launches] == ["rmsnorm", "gemm", "gemm", "gemm", "rope", "rope"]


def test_prefill_and_decode_share_weight_layouts():
    """With bf16-weight GEMMs one buffer per weight serves prefill and decode, decode's [Wq; Wk] with prefill's wq
    and wk as its two row ranges; the integer GEMMs (the default for bf16 weights) take prepared copies of the
    projections instead, and share only the norms."""
    d = SMOL
    for precision in ("bf16", "bfp16", "w8x2a16"):
        progs = programs_for_model(d, [64], precision)
        for prefill, decode in [(0, 3), (2, 4)]:
            weights_p = {a.name: (a.shape, a.dtype) for a in progs[prefill].args if a.role is Role.WEIGHT}
            weights_d = {a.name: (a.shape, a.dtype) for a in progs[decode].args if a.role is Role.WEIGHT}
            if "wqk" in weights_d:
                qk, wq, wk = weights_d.pop("wqk"), weights_p.pop("wq"), weights_p.pop("wk")
                if precision != "w8x2a16":
                    assert qk == ((wq[0][0] + wk[0][0], wq[0][1]), wq[1]) == ((576 + 192, 576), "bf16")
            assert weights_p.keys() == weights_d.keys()
            shared = {n for n in weights_p if weights_p[n] == weights_d[n]}
            assert shared == (set(weights_p) if precision != "w8x2a16" else {"norm_w"})


def test_lm_head_is_one_gemv_keeping_fp32_logits():
    program = lm_head_gemv_program(576, 49152)
    assert [(l.kind, l.p) for l in program.launches] == [("gemv_f32", {"K": 576, "N": 49152})]
    assert program.arg("logits").dtype == "f32" and program.compile_options.runtime_loop_tiling_sizes == (16, 16)


def test_json_round_trip_and_stable_key():
    p = o_ffn_program(576, 576, 1536, 1e-5, 16)
    q = Program.from_json(p.to_json())
    assert q == p and q.key == p.key
    assert o_ffn_program(576, 576, 1536, 1e-5, 32).key != p.key


def test_programs_for_model_covers_buckets():
    decode = ["rms_gemv_rope", "o_gemv_ffn", "o_gemv_ffn_rms_gemv_rope", "lm_head_gemv"]
    names = [p.name for p in programs_for_model(SMOL, [16, 32], "bf16")]
    assert names == ["rms_gemms_rope", "flash_attn", "o_ffn"] * 2 + decode
    # "auto", the default: the integer GEMMs' Programs for bf16 weights, the bf16 ones beside packed decode weights
    assert [p.name for p in programs_for_model(SMOL, [16])] == ["rms_gemms_rope_w8x2", "flash_attn", "o_ffn_w8x2",
                                                               *decode]
    assert [p.name for p in programs_for_model(SMOL, [16], weights="q4_1")][:3] == ["rms_gemms_rope", "flash_attn",
                                                                                   "o_ffn"]


def test_prefill_programs_are_one_buckets_trio():
    from torch_npu2.kernels.catalog import prefill_programs

    trio = prefill_programs(SMOL, 32, "bfp16")
    assert [p.name for p in trio] == ["rms_gemms_rope", "flash_attn", "o_ffn"]
    assert [p.key for p in trio] == [p.key for p in programs_for_model(SMOL, [32], "bfp16")[:3]]


@pytest.mark.parametrize("launches,message", [
    ((Launch("add", (), ("a", "s"), ("o",)),), "reads 's' before any launch writes it"),
    ((Launch("add", (), ("a",), ("a",)),), "writes input 'a'"),
    ((Launch("add", (), ("a", "zz"), ("o",)),), "unknown argument 'zz'"),
    ((Launch("add", (), ("a",), ("s",)),), "output 'o' is never written"),
])
def test_invalid_programs_are_rejected(launches, message):
    args = (Arg("a", (4,), "bf16", Role.INPUT), Arg("s", (4,), "bf16", Role.SCRATCH), Arg("o", (4,), "bf16", Role.OUTPUT))
    with pytest.raises(ValueError, match=message):
        Program("bad", args, launches)


_ARENA_ARGS = (Arg("a", (4,), "bf16", Role.INPUT), Arg("arena", (16,), "bf16", Role.SCRATCH),
               Arg("o", (4,), "bf16", Role.OUTPUT))
_THROUGH_VIEWS = (Launch("add", (), ("a", "a"), ("s",)), Launch("add", (), ("s", "a"), ("t",)),
                  Launch("add", (), ("t", "s"), ("o",)))


def test_views_are_buffers_in_their_arena():
    views = (View("s", "arena", 0, (4,), "bf16"), View("t", "arena", 8, (2, 2), "bf16"))
    program = Program("arena", _ARENA_ARGS, _THROUGH_VIEWS, views=views)
    assert [a.name for a in program.args] == ["a", "arena", "o"]  # one ELF argument for both
    assert program.arg("t") == Arg("t", (2, 2), "bf16", Role.SCRATCH) and program.view("t") == views[1]
    assert [a.name for a in program.buffers] == ["a", "o", "s", "t"]
    again = Program.from_json(program.to_json())
    assert again == program and again.key == program.key
    moved = Program("arena", _ARENA_ARGS, _THROUGH_VIEWS, views=(views[0], View("t", "arena", 4, (2, 2), "bf16")))
    assert moved.key != program.key


@pytest.mark.parametrize("views,launches,message", [
    ((View("s", "arena", 0, (4,), "bf16"), View("t", "arena", 2, (4,), "bf16")), _THROUGH_VIEWS,
     "views 's' and 't' overlap in 'arena'"),
    ((View("s", "arena", 0, (4,), "bf16"), View("t", "arena", 13, (2,), "bf16")), _THROUGH_VIEWS,
     "view 't' .* must start at a multiple of 4 bytes"),
    ((View("s", "arena", 0, (4,), "bf16"), View("t", "arena", 14, (4,), "bf16")), _THROUGH_VIEWS,
     r"view 't' \(4 elements at 14\) .* inside 'arena' \(16 elements\)"),
    ((View("s", "arena", 0, (4,), "bf16"), View("t", "nowhere", 0, (4,), "bf16")), _THROUGH_VIEWS,
     "view 't' is in 'nowhere', which is no argument"),
    ((View("s", "arena", 0, (4,), "bf16"), View("t", "o", 0, (4,), "bf16")), _THROUGH_VIEWS,
     "view 't'.s arena 'o' must be a 1-D scratch argument"),
    ((View("s", "arena", 0, (4,), "f32"), View("t", "arena", 8, (4,), "bf16")), _THROUGH_VIEWS,
     "view 's'.s arena 'arena' must be a 1-D scratch argument of its dtype f32"),
    ((View("s", "arena", 0, (4,), "bf16"), View("t", "arena", 8, (4,), "bf16")),
     (*_THROUGH_VIEWS, Launch("add", (), ("arena", "a"), ("o",))), "unknown argument 'arena'"),
    ((View("s", "arena", 0, (4,), "bf16"), View("a", "arena", 8, (4,), "bf16")), _THROUGH_VIEWS,
     "duplicate argument or view names"),
    ((View("s", "arena", 0, (4,), "bf16"), View("t", "arena", 8, (4,), "bf16"), View("u", "arena", 12, (4,), "bf16")),
     _THROUGH_VIEWS, "scratch 'u' is never written"),
])
def test_invalid_views_are_rejected(views, launches, message):
    with pytest.raises(ValueError, match=message):
        Program("bad", _ARENA_ARGS, launches, views=views)


@pytest.mark.parametrize("inputs", [MAX_KERNEL_ARGS - 1, MAX_KERNEL_ARGS])
def test_a_program_binds_at_most_the_drivers_argument_buffers(inputs):
    """A run binds at most MAX_KERNEL_ARGS buffers: one more argument is refused when the Program is declared, so the
    emulator never runs what the driver would reject."""
    args = tuple(Arg(f"a{i}", (4,), "bf16", Role.INPUT) for i in range(inputs)) + (Arg("o", (4,), "bf16", Role.OUTPUT),)
    launches = (Launch("add", (), ("a0", "a1"), ("o",)),)
    if inputs < MAX_KERNEL_ARGS:
        assert len(Program("wide", args, launches).args) == MAX_KERNEL_ARGS
    else:
        with pytest.raises(ValueError, match=rf"Program wide: {MAX_KERNEL_ARGS + 1} arguments, more than the "
                                             rf"{MAX_KERNEL_ARGS} buffers one run may bind"):
            Program("wide", args, launches)


def test_decode_groups_fit_the_argument_limit_up_to_four_layers():
    for weights in ("bf16", "q4_1"):
        sizes = [len(decode_layers_program(n, 2048, 2048, 8192, 1e-5, 32, 8, 64, 2048, 1e-5, weights).args)
                 for n in DECODE_GROUP_SIZES]
        # 11 per layer, and the group's x, q, length, LUT row, out, next_q_roped and one scratch arena
        assert sizes == [29, 40, 51] and max(sizes) <= MAX_KERNEL_ARGS
        # a group that starts with its first layer's Q/K/V: three weights and two K/V rows more, q a scratch view
        leading = [len(decode_layers_program(n, 2048, 2048, 8192, 1e-5, 32, 8, 64, 2048, 1e-5, weights,
                                             first_qkv=True).args) for n in DECODE_GROUP_SIZES]
        assert leading == [33, 44, 55] and max(leading) <= MAX_KERNEL_ARGS
        group = decode_layers_program(4, 2048, 2048, 8192, 1e-5, 32, 8, 64, 2048, 1e-5, weights, first_qkv=True)
        assert [(v.name, v.offset) for v in group.views] == [
            ("q", 0), ("attn", 2048), ("res1", 4096), ("act", 6144), ("hidden_mid", 14336), ("next_qk", 16384),
            ("q_mid", 18944)] and group.arg("scratch_bf16").shape == (18944 + 2048,)
    with pytest.raises(ValueError, match="a decode group chains 2, 3, 4 layers, got 5"):
        decode_layers_program(5, 2048, 2048, 8192, 1e-5, 32, 8, 64, 2048, 1e-5)


def test_model_dims_validation():
    with pytest.raises(ValueError, match=r"heads \(9\) must be a multiple of kv_heads \(2\)"):
        ModelDims(576, 9, 2, 64, 1536, 49152, 1e-5)
    with pytest.raises(ValueError, match="ModelDims.vocab must be a positive int"):
        ModelDims(576, 9, 3, 64, 1536, 0, 1e-5)
