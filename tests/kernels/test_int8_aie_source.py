"""The integer GEMMs' AIE path (kernels/aie2p/gemm_int8.cc, quantize_rows.cc) type-checks against the real aie_api
headers in every -D variant the builders make for SmolLM2-135M's and Llama-3.2-1B's "w8x2a16" Programs, and the check
rejects what the kernels must not do: an int16 x int8 mmul shape aie_api lacks on AIE2P, int8 activations fed to the
int16 x int8 mmul, and a tile the kernel's own static_asserts refuse."""
from pathlib import Path

import pytest

from torch_npu2.kernels import ModelDims, aie_source_check, programs_for_model
from torch_npu2.kernels.toolchain import KERNEL_SOURCE_DIR

SOURCES = Path(__file__).resolve().parent / "aie_source"
MODELS = (ModelDims(576, 9, 3, 64, 1536, 49152, 1e-5), ModelDims(2048, 32, 8, 64, 8192, 128256, 1e-5))
BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
INTEGER_SOURCES = ("gemm_int8.cc", "quantize_rows.cc")


def integer_variants():
    return [v for v in aie_source_check.kernel_variants(
        p for dims in MODELS for p in programs_for_model(dims, BUCKETS, "w8x2a16") if p.name.endswith("_w8x2"))
        if v.source in INTEGER_SOURCES]


def test_the_builders_make_both_kernels_in_the_models_tiles():
    variants = integer_variants()
    defines = {(v.source, v.defines) for v in variants}
    assert {v.source for v in variants} == set(INTEGER_SOURCES)
    # the GEMMs' 64-row tiles of 64 accumulator columns (Llama's tile_n 64, its gate/up pairs of 32), SmolLM2's 48
    assert ("gemm_int8.cc", (("GEMM_DRAIN_N", 64), ("GEMM_TILE_M", 64), ("GEMM_TILE_N", 64))) in defines
    assert ("gemm_int8.cc", (("GEMM_DRAIN_N", 32), ("GEMM_TILE_M", 64), ("GEMM_TILE_N", 64))) in defines
    assert ("gemm_int8.cc", (("GEMM_DRAIN_N", 48), ("GEMM_TILE_M", 64), ("GEMM_TILE_N", 48))) in defines
    # rows of 576 in one chunk, of 8192 in four
    assert ("quantize_rows.cc", (("QUANT_CHUNK", 576), ("QUANT_K", 576))) in defines
    assert ("quantize_rows.cc", (("QUANT_CHUNK", 2048), ("QUANT_K", 8192))) in defines


def test_every_variant_type_checks(aie_source_checker):
    rejected = [r for r in aie_source_checker.check_variants(integer_variants()) if not r.accepted]
    assert not rejected, "\n\n".join(f"{r.variant}:\n{r.errors}" for r in rejected)


def test_an_int16_mmul_shape_aie_api_lacks_is_rejected(aie_source_checker):
    source = SOURCES / "int16_int8_mmul_8x8x8.cc"
    assert aie_source_checker.check(source, (("MMUL_K", 4),)) == ""
    errors = aie_source_checker.check(source)
    assert "error:" in errors and "mmul_16_8<8, 8, 8" in errors, errors


def test_int8_activations_into_the_int16_mmul_are_rejected(aie_source_checker):
    source = SOURCES / "int8_activations_w8x2.cc"
    assert aie_source_checker.check(source, (("ACTIVATION", "int16_t"),)) == ""
    errors = aie_source_checker.check(source)
    assert "int8_activations_w8x2.cc:15:10: error: no matching member function for call to 'mac'" in errors, errors


@pytest.mark.parametrize("source, defines, message", [
    ("gemm_int8.cc", dict(GEMM_TILE_M=24, GEMM_TILE_N=64, GEMM_DRAIN_N=32), "GEMM_TILE_M must be a positive multiple"),
    ("gemm_int8.cc", dict(GEMM_TILE_M=64, GEMM_TILE_N=64, GEMM_DRAIN_N=12), "GEMM_DRAIN_N must be a positive multiple"),
    ("quantize_rows.cc", dict(QUANT_K=576, QUANT_CHUNK=96), "QUANT_CHUNK must be a positive multiple of 64"),
])
def test_a_tile_the_kernel_refuses_is_rejected(aie_source_checker, source, defines, message):
    errors = aie_source_checker.check(Path(KERNEL_SOURCE_DIR) / source, tuple(sorted(defines.items())))
    assert "error: static assertion failed" in errors and message in errors, errors
