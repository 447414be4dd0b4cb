"""Programs are the single declaration: roles, index sets, validation and content keys."""
import pytest

from torch_npu2.kernels import Arg, Launch, ModelDims, Program, Role, programs_for_model
from torch_npu2.kernels.catalog import lm_head_gemv_program, o_ffn_program, rms_gemms_rope_program

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
    """With bf16-weight GEMMs one buffer per weight serves prefill and decode; the integer GEMMs (the default for
    bf16 weights) take prepared copies of the projections instead, and share only the norms."""
    d = SMOL
    for precision in ("bf16", "bfp16", "w8x2a16"):
        progs = programs_for_model(d, [64], precision)
        for prefill, decode in [(0, 3), (2, 4)]:
            weights_p = {a.name: (a.shape, a.dtype) for a in progs[prefill].args if a.role is Role.WEIGHT}
            weights_d = {a.name: (a.shape, a.dtype) for a in progs[decode].args if a.role is Role.WEIGHT}
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


def test_model_dims_validation():
    with pytest.raises(ValueError, match=r"heads \(9\) must be a multiple of kv_heads \(2\)"):
        ModelDims(576, 9, 2, 64, 1536, 49152, 1e-5)
    with pytest.raises(ValueError, match="ModelDims.vocab must be a positive int"):
        ModelDims(576, 9, 3, 64, 1536, 0, 1e-5)
