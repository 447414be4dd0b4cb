"""Every stitched Program module parses in the real air-opt, and every DMA window survives the round trip.

SmolLM2-135M and Llama-3.2-1B dims, every prefill bucket, decode and the LM head: air-opt (mlir-air
0e3df89d) parses and verifies each module (AIR, func, memref, arith, scf, affine, linalg, vector, math),
and the windows read back from its own print equal what the builders meant. The checks are proven by
feeding them what the real compiler must reject or drop.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torch_npu2.kernels import ModelDims, programs_for_model
from torch_npu2.kernels.air_pipeline import DYNAMIC, read_back_windows, window_mismatches
from torch_npu2.kernels.catalog import decode_attn_program, rms_gemv_rope_program
from torch_npu2.kernels.stitch import stitch

SMOL = ModelDims(576, 9, 3, 64, 1536, 49152, 1e-5)
LLAMA = ModelDims(2048, 32, 8, 64, 8192, 128256, 1e-5)
BUCKETS = [16, 32, 64, 128, 256, 512, 1024, 2048]
PROGRAMS = {f"{model}-{p.name}-{dict(p.params).get('rows', dict(p.params).get('seq'))}": p
            for model, dims in (("smol", SMOL), ("llama", LLAMA)) for p in programs_for_model(dims, BUCKETS)}
# the integer-GEMM prefill Programs ("w8x2a16"): their A windows cut the activation rows' runs in 3-D patterns
W8X2 = {f"{model}-{p.name}-{dict(p.params)['rows']}": p for model, dims in (("smol", SMOL), ("llama", LLAMA))
        for p in programs_for_model(dims, BUCKETS, "w8x2a16") if p.name.endswith("_w8x2")}
DECODE_ATTENTION = {f"{model}-decode_attn-{capacity}": decode_attn_program(dims.heads, dims.kv_heads, dims.head_dim,
                                                                           capacity)
                    for model, dims in (("smol", SMOL), ("llama", LLAMA)) for capacity in (256, 2048)}


def air_opt(tools, text: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(tools.air_opt), *flags, "-"], input=text, capture_output=True, text=True, timeout=300)


def test_every_model_program_is_covered():
    assert len(PROGRAMS) == 2 * (3 * len(BUCKETS) + 4)


@pytest.mark.parametrize("name", [*PROGRAMS, *W8X2, *DECODE_ATTENTION])
def test_module_parses_and_every_window_survives(air_tools, name):
    stitched = stitch({**PROGRAMS, **W8X2, **DECODE_ATTENTION}[name])
    result = air_opt(air_tools, stitched.text)
    assert result.returncode == 0, result.stderr[-3000:]
    assert window_mismatches(stitched.dmas, result.stdout) == []
    assert any(dma.src.sizes or dma.dst.sizes for dma in stitched.dmas)
    # a window the builder meant is never printed empty
    meant = sum(bool(w.sizes) for dma in stitched.dmas for w in (dma.dst, dma.src))
    printed = sum(bool(side[1]) for dma in read_back_windows(result.stdout) for side in dma)
    assert printed == meant


def test_air_opt_rejects_a_type_mismatch(air_tools):
    text = stitch(rms_gemv_rope_program(576, 9, 3, 64, 1e-5)).text
    broken = text.replace("(memref<1152xbf16, 1 : i32>, memref<576xbf16>)",
                          "(memref<1152xbf16, 1 : i32>, memref<577xbf16>)", 1)
    assert broken != text
    result = air_opt(air_tools, broken)
    assert result.returncode != 0 and "error" in result.stderr


GENERIC_DMA = ('"air.dma_memcpy_nd"(%dst, %src) <{operandSegmentSizes = array<i32: 0, 1, 0, 0, 0, 1, 0, 0, 0>, '
               "static_dst_offsets = array<i64>, static_dst_sizes = array<i64>, static_dst_strides = array<i64>, "
               "static_src_offsets = array<i64: 2, 0>, static_src_sizes = array<i64: 4, 8>, "
               "static_src_strides = array<i64: 8, 1>}> : (memref<4x8xbf16, 2 : i32>, memref<16x8xbf16>) -> ()")


def test_window_check_catches_the_post_1762_form_that_this_air_drops(air_tools):
    """The trap the toolchain README describes: generic form with static_* properties parses, windows vanish."""
    from torch_npu2.kernels.builders.ir import Dma, Window

    module = ("module {\n  func.func @f(%dst: memref<4x8xbf16, 2 : i32>, %src: memref<16x8xbf16>) {\n    "
              f"{GENERIC_DMA}\n    return\n  }}\n}}\n")
    result = air_opt(air_tools, module)
    assert result.returncode == 0
    meant = (Dma(Window(), Window((2, 0), (4, 8), (8, 1))),)
    assert window_mismatches(meant, result.stdout) == [
        "DMA 0 src: meant offsets/sizes/strides ((2, 0), (4, 8), (8, 1)), air-opt printed ((), (), ())"]


def test_window_check_catches_a_shifted_offset_and_a_swapped_stride(air_tools):
    stitched = stitch(rms_gemv_rope_program(576, 9, 3, 64, 1e-5))
    good = air_opt(air_tools, stitched.text).stdout
    # the W panel copy of the first projection, tile-major: %arg[%c0, %panel_row, %c0] [%c8, %cR, %c576]
    # [%cS, %c576, %c1]
    match = re.search(r"(air\.dma_memcpy_nd \(%\w+\[\] \[\] \[\], %\w+\[%\w+, %\w+, )(%c0\w*)(\] "
                      r"\[%c\d+\w*, %c\d+\w*, %c576\w*\] \[%c\d+\w*, (%c576\w*), (%c1\w*)\]\))", good)
    assert match, "expected a three-dimensional panel copy"
    constants = dict(re.findall(r"(%c\w+) = arith\.constant (\d+) : index", good))
    one = next(name for name, value in constants.items() if value == "1")
    shifted = good.replace(match.group(0), match.group(1) + one + match.group(3), 1)
    assert any("DMA" in p and "src" in p for p in window_mismatches(stitched.dmas, shifted))
    swapped = good.replace(match.group(0), match.group(0).replace(f"{match.group(4)}, {match.group(5)}]",
                                                                 f"{match.group(5)}, {match.group(4)}]"), 1)
    assert any("src" in p for p in window_mismatches(stitched.dmas, swapped))
    assert window_mismatches(stitched.dmas, good) == []


def test_read_back_marks_loop_dependent_offsets_dynamic(air_tools):
    stitched = stitch(rms_gemv_rope_program(576, 9, 3, 64, 1e-5))
    windows = read_back_windows(air_opt(air_tools, stitched.text).stdout)
    assert any(DYNAMIC in side[0] for dma in windows for side in dma)
    assert len(windows) == len(stitched.dmas)


@pytest.mark.parametrize("ci,outcome,code", [("true", "1 error", 1), ("", "1 skipped", 0)])
def test_missing_air_tools_skip_with_how_to_get_them_and_fail_in_ci(ci, outcome, code):
    env = dict(os.environ, TORCH_NPU2_AIR_TOOLS="/nonexistent", CI=ci)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider",
                             f"{__file__}::test_air_opt_rejects_a_type_mismatch"], env=env, capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert outcome in result.stdout and result.returncode == code, result.stdout[-2000:]
    assert "the real AIR compiler is not available: AIR tools: TORCH_NPU2_AIR_TOOLS=/nonexistent holds neither" \
        in result.stdout
