"""The integer GEMM's AIE path (kernels/aie2p/gemm_int8.cc, quantize_rows.cc) type-checks against the real aie_api
headers in both activation widths (and, at int16, with two weight terms: "w8x2a16") at Llama-3.2-1B's and SmolLM2's
sizes, and the check rejects the int16 x int8 mmul shape aie_api does not have on AIE2P and two weight terms over
int8 activations."""
from pathlib import Path

import pytest

from torch_npu2.emulator.int8 import activation_qmax
from torch_npu2.kernels.toolchain import KERNEL_SOURCE_DIR

SOURCES = Path(__file__).resolve().parent / "aie_source"
GEMM_VARIANTS = [dict(GEMM_ACT_BITS=bits, GEMM_TILE_M=64, GEMM_TILE_K=32, GEMM_TILE_N=n, GEMM_DRAIN_N=32)
                 for bits in (8, 16) for n in (64, 128)]
GEMM_VARIANTS += [dict(GEMM_ACT_BITS=16, GEMM_WEIGHT_TERMS=2, GEMM_TILE_M=64, GEMM_TILE_K=32, GEMM_TILE_N=n,
                       GEMM_DRAIN_N=32) for n in (64, 128)]  # w8x2a16
QUANT_VARIANTS = [dict(QUANT_ACT_BITS=bits, QUANT_K=k, QUANT_QMAX=activation_qmax(precision, k), QUANT_ROWS=rows)
                  for bits, precision in ((8, "int8"), (16, "w8a16")) for k, rows in ((576, 4), (2048, 2), (8192, 1))]


@pytest.mark.parametrize("source, defines", [("gemm_int8.cc", d) for d in GEMM_VARIANTS]
                         + [("quantize_rows.cc", d) for d in QUANT_VARIANTS])
def test_variant_type_checks(aie_source_checker, source, defines):
    errors = aie_source_checker.check(Path(KERNEL_SOURCE_DIR) / source, tuple(sorted(defines.items())))
    assert errors == "", errors


def test_an_int16_mmul_shape_aie_api_lacks_is_rejected(aie_source_checker):
    source = SOURCES / "int16_int8_mmul_8x8x8.cc"
    assert aie_source_checker.check(source, (("MMUL_K", 4),)) == ""
    errors = aie_source_checker.check(source)
    assert "error:" in errors and "mmul_16_8<8, 8, 8" in errors, errors


def test_two_weight_terms_over_int8_activations_are_refused(aie_source_checker):
    defines = dict(GEMM_ACT_BITS=8, GEMM_WEIGHT_TERMS=2, GEMM_TILE_M=64, GEMM_TILE_K=32, GEMM_TILE_N=64,
                   GEMM_DRAIN_N=32)
    errors = aie_source_checker.check(Path(KERNEL_SOURCE_DIR) / "gemm_int8.cc", tuple(sorted(defines.items())))
    assert "error:" in errors and "GEMM_WEIGHT_TERMS must be 1, or 2 with 16-bit activations" in errors, errors
