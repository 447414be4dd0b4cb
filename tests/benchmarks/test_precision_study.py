"""The precision benchmark's integer studies: Programs built inside a study carry its GEMM precision to every prefill
GEMM launch (which the emulator then computes with kernels/int_gemm.py), and nothing outside it changes."""
import pytest

from benchmarks import precision
from torch_npu2.kernels import catalog


def gemm_precisions(program):
    return {launch.p["precision"] for launch in program.launches if launch.kind in ("gemm", "gemm_swiglu")}


def test_a_study_sets_every_prefill_gemm_and_only_inside():
    build = lambda: (catalog.rms_gemms_rope_program(576, 9, 3, 64, 1e-5, 64),  # noqa: E731
                     catalog.o_ffn_program(576, 576, 1536, 1e-5, 64), catalog.o_ffn_program(576, 576, 1536, 1e-5, 16))
    for study in ("int8", "w8a16"):
        with precision._studied(study):
            assert [gemm_precisions(p) for p in build()] == [{study}] * 3
    with precision._studied("w8a16_v_bf16"):  # q, k, v in order: only V exact
        qkv = build()[0]
        assert [l.p["precision"] for l in qkv.launches if l.kind == "gemm"] == ["w8a16", "w8a16", "bf16"]
        assert [gemm_precisions(p) for p in build()[1:]] == [{"w8a16"}] * 2
    assert [gemm_precisions(p) for p in build()] == [{catalog.DEFAULT_BF16_WEIGHT_PRECISION}] * 3
    assert "int8" not in catalog.MATMUL_PRECISIONS  # not a user's choice until its builder exists
    assert "w8x2a16" in catalog.MATMUL_PRECISIONS and "w8x2a16" not in precision.STUDIES  # its own Programs


def test_a_studied_model_runs_the_studys_gemms_where_auto_would_run_the_integer_programs():
    """A study's row patches its model at the bf16-weight Programs the study rewrites: for a model the integer GEMMs
    take, "auto" runs the w8x2a16 Programs, which no study reaches, so the row would measure the default instead."""
    from unittest import mock

    import torch

    from benchmarks import common
    from tests.patch_llama.tiny import tiny_llama
    from torch_npu2.emulator import launches

    model = tiny_llama(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    dims = catalog.ModelDims(128, 2, 1, 64, 256, 300, model.config.rms_norm_eps)
    assert catalog.default_matmul_precision(dims) == catalog.INTEGER_PRECISION
    computed = []

    def recording(kind):
        def run(p, *tensors):
            computed.append((kind, p.get("precision")))
            return launch(p, *tensors)
        launch = launches.LAUNCH_KINDS[kind]
        return run

    matmuls = ("gemm", "gemm_swiglu", "gemm_int", "gemm_int_swiglu")
    with common.emulated_runtime(compute=True), \
            mock.patch.dict(launches.LAUNCH_KINDS, {kind: recording(kind) for kind in matmuls}), \
            precision._studied("w8a16"):
        with pytest.warns(UserWarning, match="cannot be compiled for NPU2"):  # a study has no kernels
            precision._patch(model, (16,), None)
        with torch.no_grad():
            model(torch.arange(10).reshape(1, -1))
    # per layer Q, K, V, O, gate and up (two launches below gemm_swiglu's rows, or one), down
    assert len(computed) >= 2 * 6, computed
    assert {kind for kind, _ in computed} <= {"gemm", "gemm_swiglu"} and {p for _, p in computed} == {"w8a16"}


def test_per_call_cycles_rank_the_precisions():
    """At both ends of the timing model, for the same MACs a call (64 x 32 x 128 bf16; 64 x 64 x 32 with two int8
    terms), the integer call is cheaper than a BFP16 one, which is cheaper than exact bf16 (elementwise products)."""
    cycles = precision.gemm_call_cycles()
    assert set(cycles) == {"bf16", "bfp16", "w8x2a16"}
    for end in (0, 1):
        assert cycles["w8x2a16"][end] < cycles["bfp16"][end] < cycles["bf16"][end]
    assert cycles["w8x2a16"] == [1028, 3868]


def test_an_attention_study_changes_the_emulators_products_and_only_inside():
    """Inside an attention study the emulator's attention launch multiplies as the study does (near the exact
    products, not equal to them); outside it is exact again, bit for bit the launch before the study."""
    import torch

    from torch_npu2.emulator import launches

    g = torch.Generator().manual_seed(3)
    seq, heads, kv_heads, hd = 24, 4, 2, 16
    p = dict(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=hd, causal=True)
    q = torch.randn(seq, heads * hd, generator=g).bfloat16()
    kv = torch.randn(2, seq, kv_heads * hd, generator=g).bfloat16()
    exact = launches.LAUNCH_KINDS["attention"](p, q, kv)
    for study in precision.ATTENTION_STUDIES:
        with precision._studied_attention(study):
            studied = launches.LAUNCH_KINDS["attention"](p, q, kv)
        cosine = torch.nn.functional.cosine_similarity(studied.float().flatten(), exact.float().flatten(), dim=0)
        assert not torch.equal(studied, exact) and cosine > 0.999, (study, float(cosine))
        assert torch.equal(launches.LAUNCH_KINDS["attention"](p, q, kv), exact)


def test_the_integer_products_are_the_integer_gemms():
    """The w8x2a16 study's products are kernels/int_gemm.py's, before the bf16 rounding of its GEMM output."""
    import torch

    from torch_npu2.kernels import int_gemm

    g = torch.Generator().manual_seed(4)
    rows, columns = torch.randn(40, 64, generator=g).bfloat16(), torch.randn(24, 64, generator=g).bfloat16()
    products = precision._integer_products(rows.float(), columns.float())
    assert torch.equal(products.bfloat16(), int_gemm.integer_gemm(rows, columns, "w8x2a16"))
