"""Programs are the single declaration: roles, index sets, validation and content keys."""
import pytest

from torch_npu2.kernels import Arg, Launch, ModelDims, Program, Role, programs_for_model
from torch_npu2.kernels.catalog import (DECODE_GROUP_SIZES, decode_layers_program, layer_arenas,
                                        lm_head_gemv_program, o_ffn_program, rms_gemms_rope_program, weight_arg)
from torch_npu2.kernels.device import DEVICE
from torch_npu2.kernels.program import DTYPE_BYTES, MAX_KERNEL_ARGS, View

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
     "view 't'.s arena 'o' must be a 1-D scratch or weight argument"),
    ((View("s", "arena", 0, (4,), "f32"), View("t", "arena", 8, (4,), "bf16")), _THROUGH_VIEWS,
     "view 's'.s arena 'arena' must be a 1-D scratch or weight argument of its dtype f32"),
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


_WEIGHT_ARENA_ARGS = (Arg("a", (4,), "bf16", Role.INPUT), Arg("weights", (16,), "bf16", Role.WEIGHT),
                      Arg("o", (4,), "bf16", Role.OUTPUT))
_WEIGHT_VIEWS = (View("w1", "weights", 0, (4,), "bf16"), View("w2", "weights", 8, (2, 2), "bf16"))


def test_a_weight_arena_holds_weights_launches_only_read():
    """A weight arena's views are weights: read by launches, never required to be written, and the arena may hold
    parts no view names (elements 4 to 8 here, 12 to 16)."""
    program = Program("weights", _WEIGHT_ARENA_ARGS, (Launch("add", (), ("a", "w1"), ("o",)),), views=_WEIGHT_VIEWS)
    assert program.arg("w2") == Arg("w2", (2, 2), "bf16", Role.WEIGHT)
    assert [a.name for a in program.host_args] == ["a", "weights"]
    with pytest.raises(ValueError, match="writes weight 'w2'"):
        Program("weights", _WEIGHT_ARENA_ARGS, (Launch("add", (), ("a", "w1"), ("w2",)),), views=_WEIGHT_VIEWS)
    flat = (_WEIGHT_ARENA_ARGS[0], Arg("weights", (4, 4), "bf16", Role.WEIGHT), _WEIGHT_ARENA_ARGS[2])
    with pytest.raises(ValueError, match="must be a 1-D scratch or weight argument"):
        Program("weights", flat, (Launch("add", (), ("a", "w1"), ("o",)),), views=_WEIGHT_VIEWS)


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


@pytest.mark.parametrize("weights", ["bf16", "q4_0", "q4_1", "q8_0"])
def test_a_layers_arenas_hold_each_weight_once_where_a_dma_can_start(weights):
    """layer_arenas: every part of a decoder layer in one of its two arenas, at a whole shim DMA word and a whole row
    of its own (so a DMA window moves along its rows), the parts in order and apart, each arena just long enough."""
    arenas = layer_arenas(2048, 2048, 512, 8192, weights)
    parts = {v.name: v for v in arenas.parts}
    assert list(parts) == ["wqk", "wv", "wo", "w_gate_up", "w_down", "input_norm", "post_attention_norm"]
    assert parts["wqk"].shape == weight_arg("wqk", 2560, 2048, weights).shape
    assert parts["w_gate_up"].shape == weight_arg("w_gate_up", 8192, 2048, weights, 2).shape
    assert arenas.norms == Arg("norms", (4096,), "bf16", Role.WEIGHT)
    for arena in (arenas.weights, arenas.norms):
        views = [v for v in arenas.parts if v.arena == arena.name]
        assert {v.dtype for v in views} == {arena.dtype}
        ends = [0] + [v.offset + Arg(v.name, v.shape, v.dtype, Role.WEIGHT).numel for v in views]
        assert all(end <= v.offset for end, v in zip(ends, views)) and ends[-1] == arena.numel
        assert all(v.offset % v.shape[-1] == 0 and v.offset * DTYPE_BYTES[v.dtype] % DEVICE.dma_word_bytes == 0
                   for v in views)


def test_decode_groups_over_weight_arenas_fit_eight_layers():
    """With each layer's weights in two arenas a layer binds six arguments: eight layers fit one run (a 16-layer
    model's token in two), in every weight format, each weight a view of its layer's arenas."""
    for weights in ("bf16", "q4_1"):
        head = (128256, 1e-5, weights)
        sizes = {(n, qkv, ends): len(decode_layers_program(
                     n, 2048, 2048, 8192, 1e-5, 32, 8, 64, 2048, 1e-5, weights, ends is not None, ends, qkv).args)
                 for n in DECODE_GROUP_SIZES for qkv in (False, True) for ends in (None, head)}
        # per layer its caches, its arenas and the K/V rows it writes; a group not ending the model takes the arenas
        # of the layer after it too
        assert sizes[(8, True, None)] == 58 and sizes[(8, False, head)] == 56
        assert all(sizes[(n + 1, qkv, ends)] - sizes[(n, qkv, ends)] == 6 for n, qkv, ends in sizes if n < 8)
        assert max(sizes.values()) <= MAX_KERNEL_ARGS
        group = decode_layers_program(2, 2048, 2048, 8192, 1e-5, 32, 8, 64, 2048, 1e-5, weights, first_qkv=True)
        arenas = layer_arenas(2048, 2048, 512, 8192, weights)
        placed = {v.name: (v.arena, v.offset) for v in group.views if not v.arena.startswith("scratch")}
        assert placed == {
            "first_norm_w": ("norms_0", arenas.part("input_norm").offset),
            "first_wqk": ("weights_0", 0), "first_wv": ("weights_0", arenas.part("wv").offset),
            **{f"{name}_{j}": (f"{arenas.part(part).arena}_{j + (name.startswith('next_'))}", arenas.part(part).offset)
               for j in range(2) for name, part in (("wo", "wo"), ("norm_w", "post_attention_norm"),
                                                    ("w_gate_up", "w_gate_up"), ("w_down", "w_down"),
                                                    ("next_norm_w", "input_norm"), ("next_wqk", "wqk"),
                                                    ("next_wv", "wv"))}}
        assert [a.name for a in group.host_args] == [
            "x", "length", "next_rope_lut", "k_cache_0", "v_cache_0", "weights_0", "norms_0", "k_cache_1", "v_cache_1",
            "weights_1", "norms_1", "weights_2", "norms_2"]
        # the device-only scratches every layer reuses: views of one scratch argument, q among them in a _qkv group
        assert [(v.name, v.offset) for v in group.views if v.arena == "scratch_bf16"] == [
            ("q", 0), ("attn", 2048), ("res1", 4096), ("act", 6144), ("hidden_mid", 14336), ("next_qk", 16384),
            ("q_mid", 18944)] and group.arg("scratch_bf16").shape == (18944 + 2048,)
    with pytest.raises(ValueError, match="a decode group chains 2, 3, 4, 5, 6, 7, 8 layers, got 9"):
        decode_layers_program(9, 2048, 2048, 8192, 1e-5, 32, 8, 64, 2048, 1e-5)


def test_model_dims_validation():
    with pytest.raises(ValueError, match=r"heads \(9\) must be a multiple of kv_heads \(2\)"):
        ModelDims(576, 9, 2, 64, 1536, 49152, 1e-5)
    with pytest.raises(ValueError, match="ModelDims.vocab must be a positive int"):
        ModelDims(576, 9, 3, 64, 1536, 0, 1e-5)


def test_the_integer_default_needs_rows_quantize_rows_can_take():
    """quantize_rows packs a row's 32-value runs in pairs, so a down projection of 2080 in features (65 runs) once
    passed the integer GEMMs' check and made "auto" pick an o_ffn that cannot be built."""
    from torch_npu2.kernels.catalog import default_matmul_precision, integer_gemm_misfit

    odd = ModelDims(576, 9, 3, 64, 2080, 49152, 1e-5)
    assert "multiples of 64" in integer_gemm_misfit(odd) and "down_proj is 576 × 2080" in integer_gemm_misfit(odd)
    assert default_matmul_precision(odd) != "w8x2a16"
    from torch_npu2.kernels.builders import build_launch

    o_ffn = next(p for p in programs_for_model(odd, (16,)) if p.name.startswith("o_ffn"))  # "auto"
    assert all(build_launch(o_ffn, launch).text for launch in o_ffn.launches)
    assert integer_gemm_misfit(ModelDims(576, 9, 3, 64, 1536, 49152, 1e-5)) is None

