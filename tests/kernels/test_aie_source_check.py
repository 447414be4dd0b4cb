"""The AIE-path source check (kernels/aie_source_check.py): every -D variant of every kernel that the builders build
for SmolLM2-135M and Llama-3.2-1B, in every matmul precision, type-checks in its __AIENGINE__ path; sources kept in
tests/kernels/aie_source/ prove that the check rejects what it must and show what it cannot see."""
import re
from functools import lru_cache
from pathlib import Path

import pytest

from torch_npu2.kernels import MATMUL_PRECISIONS, ModelDims, aie_source_check, programs_for_model
from torch_npu2.kernels.builders import EXTERNAL_KERNELS
from torch_npu2.kernels.catalog import decode_attn_program

SOURCES = Path(__file__).resolve().parent / "aie_source"
SMOLLM2 = ModelDims(576, 9, 3, 64, 1536, 49152, 1e-5)
LLAMA32_1B = ModelDims(2048, 32, 8, 64, 8192, 128256, 1e-5)
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
BFP16_SWITCH = "AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16"


@lru_cache(maxsize=None)
def builder_variants() -> tuple[aie_source_check.KernelVariant, ...]:
    return tuple(aie_source_check.kernel_variants(
        [program for dims in (SMOLLM2, LLAMA32_1B) for precision in MATMUL_PRECISIONS
         for program in programs_for_model(dims, PREFILL_BUCKETS, precision)]
        + [program for dims in (SMOLLM2, LLAMA32_1B) for weights in ("q4_0", "q4_1", "q8_0")
           for program in programs_for_model(dims, (), weights=weights)]
        # decode attention: its group size and head_dim are the model's, its tile the same at every capacity
        + [decode_attn_program(dims.heads, dims.kv_heads, dims.head_dim, 2048) for dims in (SMOLLM2, LLAMA32_1B)]))


def test_the_variants_are_what_the_builders_build():
    variants = builder_variants()
    assert {v.source for v in variants} == {k.source for k in EXTERNAL_KERNELS}
    for kernel in EXTERNAL_KERNELS:  # each variant sets every tile-size macro of its kernel
        assert all({name for name, _ in v.defines} >= set(kernel.config_macros)
                   for v in variants if v.source == kernel.source), kernel.source
    gemm_switches = {dict(v.defines).get(BFP16_SWITCH) for v in variants if v.source == "gemm.cc"}
    assert gemm_switches == {None, 1}  # exact bf16 and BFP16 builds of the GEMM are both checked
    gemv_formats = {dict(v.defines).get("GEMV_QUANT") for v in variants if v.source == "gemv.cc"}
    assert gemv_formats == {None, 40, 41, 80}  # bf16 and every packed format of the decode GEMVs
    assert len(variants) == len(set(variants))


@pytest.mark.parametrize("source", sorted({k.source for k in EXTERNAL_KERNELS}))
def test_every_variant_type_checks(aie_source_checker, source):
    variants = [v for v in builder_variants() if v.source == source]
    rejected = [r for r in aie_source_checker.check_variants(variants) if not r.accepted]
    assert not rejected, "\n\n".join(f"{r.variant}:\n{r.errors}" for r in rejected)


def test_a_bf16_times_float_mul_is_rejected(aie_source_checker):
    source = SOURCES / "bf16_times_float_mul.cc"
    errors = aie_source_checker.check(source)
    mul_line = next(n for n, line in enumerate(source.read_text().splitlines(), 1) if "aie::mul(" in line)
    assert f"bf16_times_float_mul.cc:{mul_line}:" in errors and "no matching function for call to 'mul'" in errors
    assert "is_valid_mul_op_v<typename aie::vector<__bf16, 16>::value_type, " \
           "typename aie::vector<float, 16>::value_type>' evaluated to false" in errors
    assert aie_source_checker.check(source, (("SCALE_IN_BF16", 1),)) == ""


def test_an_intrinsic_declared_from_the_def_rejects_a_wrong_vector(aie_source_checker):
    source = SOURCES / "intrinsic_width.cc"
    assert aie_source_checker.check(source, (("ACC_LANES", 16),)) == ""
    errors = aie_source_checker.check(source, (("ACC_LANES", 32),))
    assert "intrinsic_width.cc:7:48: error: no viable conversion from 'const aie::accum<accfloat, 32>' " \
           "(aka 'const aie::accum<char32_t, 32>') to 'v16accfloat'" in errors, errors


def test_a_permissive_intrinsic_takes_any_arguments(aie_source_checker):
    """A limit of the check, stated in the README: this call is wrong and is accepted."""
    assert aie_source_checker.check(SOURCES / "permissive_intrinsic.cc") == ""


def test_aie_api_is_parsed_with_the_macros_it_reads(aie_source_checker):
    """The precompiled aie_api is keyed by the -D macros it reads, and a source that #defines one gets aie_api parsed
    after its own #define."""
    source = SOURCES / "bfp16_switch.cc"
    assert aie_source_checker.check(source, ((BFP16_SWITCH, 1),)) == ""
    assert "aie_api was parsed without AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16" in aie_source_checker.check(source)
    assert aie_source_checker.check(SOURCES / "bfp16_switch_in_source.cc") == ""


def test_builtin_declarations_carry_the_def_types(aie_source_checker):
    headers = aie_source_checker.headers
    text = aie_source_check.builtin_declarations(headers)
    definitions = re.findall(r"^BUILTIN\((\w+)", (headers / "llvm-aie/basic/BuiltinsAIE2P.def").read_text(), re.M)
    assert len(definitions) > 200 and all(f" {name}(" in text for name in definitions)
    # "V32gV32yV32yV32gi": v32accfloat(v32bfloat16, v32bfloat16, v32accfloat, int)
    assert ("v32accfloat __builtin_aie2p_I512_I512_ACC1024_bf_mac_conf(v32bfloat16, v32bfloat16, v32accfloat, int);"
            in text)
    assert "void __builtin_aie2p_set_ctrl_reg(const unsigned int, unsigned int);" in text  # "vUiCUi"
    assert "v16bfloat16 to_v16bfloat16(v16accfloat);" in text
    assert "v16accfloat ups_to_v16accfloat(v8float);" in text


def test_missing_headers_and_compiler_say_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setenv(aie_source_check.HEADERS_VARIABLE, str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    missing = aie_source_check.missing_tools()
    assert len(missing) == 2
    assert "clang++-22 is not on PATH" in missing[0] and "apt-get install clang-22" in missing[0]
    assert f"{aie_source_check.HEADERS_VARIABLE}={tmp_path} has no aie_api/include/aie_api/aie.hpp" in missing[1]
    with pytest.raises(FileNotFoundError, match="has no aie_api"):
        aie_source_check.AieSourceChecker()
