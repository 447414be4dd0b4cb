"""Every stitched Program module (SmolLM2-135M and Llama-3.2-1B dims, every prefill bucket, decode, LM head)
and every builder's standalone module parses and verifies with a stock mlir-opt.

AIR is not registered in mlir-opt, so AIR ops are generic-form unregistered ops; everything inside them
(func, memref, arith, scf, affine, linalg, vector, math) is fully verified. One adaptation is needed: MLIR
treats an unregistered op with one region as a possible symbol table, so a ``func.call`` nested in an
``air.herd`` could not resolve its callee. The copy handed to mlir-opt gives each AIR hierarchy op an
extra empty region (two regions cannot be a symbol table); nothing else changes.

The AIR ops themselves are then checked structurally on mlir-opt's own generic re-print: operand segment
sizes against operand counts, block arguments against sizes and operands, DMA static arrays against ranks.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from torch_npu2.kernels import ModelDims, programs_for_model
from torch_npu2.kernels.builders import build_launch
from torch_npu2.kernels.stitch import stitch

MLIR_OPT = shutil.which("mlir-opt-22") or ("/usr/bin/mlir-opt-22" if Path("/usr/bin/mlir-opt-22").exists() else None)
pytestmark = pytest.mark.skipif(MLIR_OPT is None,
                                reason="mlir-opt-22 not found (Debian/Ubuntu: apt install mlir-22-tools)")

SMOL = ModelDims(576, 9, 3, 64, 1536, 49152, 1e-5)
LLAMA = ModelDims(2048, 32, 8, 64, 8192, 128256, 1e-5)
BUCKETS = [16, 32, 64, 128, 256, 512, 1024, 2048]
SPLIT = "// -----"
_TERMINATOR_THEN_CLOSE = re.compile(r'("air\.(?:launch|segment|herd)_terminator"\(\) : \(\) -> \(\)\n\s*)\}\)')


def for_mlir_opt(module: str) -> str:
    """The module with each AIR hierarchy op given a second, empty region (see the module docstring)."""
    adapted, count = _TERMINATOR_THEN_CLOSE.subn(r"\1}, {})", module)
    assert count == module.count('_terminator"()'), "every AIR region must close right after its terminator"
    return adapted


def run_mlir_opt(modules: dict[str, str], *extra: str) -> str:
    """Verifies all modules in one mlir-opt run; fails naming the modules mlir-opt rejected."""
    names = list(modules)
    text = f"\n{SPLIT}\n".join(for_mlir_opt(modules[n]) for n in names)
    result = subprocess.run([MLIR_OPT, "--allow-unregistered-dialect", "--split-input-file", *extra, "-"],
                            input=text, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        starts, line = [], 1
        for name in names:
            starts.append((line, name))
            line += modules[name].count("\n") + 2
        failing = sorted({next(n for s, n in reversed(starts) if s <= int(m)) for m in
                          re.findall(r"^<stdin>:(\d+):\d+: error", result.stderr, flags=re.M)})
        pytest.fail(f"mlir-opt rejected {failing or 'the input'}:\n{result.stderr[:6000]}")
    return result.stdout


def segment_sizes(props: str) -> list[int]:
    return [int(x) for x in re.search(r"operandSegmentSizes = array<i32: ([\d, ]+)>", props).group(1).split(", ")]


def model_programs():
    return {f"{model}/{p.name}/{dict(p.params).get('rows', dict(p.params).get('seq', ''))}": p
            for model, dims in (("smol", SMOL), ("llama", LLAMA)) for p in programs_for_model(dims, BUCKETS)}


def test_every_stitched_program_verifies():
    programs = model_programs()
    assert len(programs) == 2 * (3 * len(BUCKETS) + 3)
    run_mlir_opt({name: stitch(p).text for name, p in programs.items()})


def test_every_builder_module_verifies_standalone():
    modules = {}
    for name, program in model_programs().items():
        for index, launch in enumerate(program.launches):
            modules[f"{name}/launch{index}:{launch.kind}"] = build_launch(program, launch).standalone_module()
    run_mlir_opt(modules)


def test_air_ops_are_structurally_consistent_after_mlir_opt_round_trip():
    programs = model_programs()
    sample = {n: stitch(programs[n]).text for n in ("smol/o_ffn/64", "llama/flash_attn/2048",
                                                    "llama/rms_gemms_rope/2048", "llama/lm_head_gemv/")}
    printed = run_mlir_opt(sample, "--mlir-print-op-generic")
    hierarchy_ops = re.findall(r'"air\.(launch|segment|herd)"\(([^)]*)\) <\{([^}]*)\}> \(\{\n\s*\^bb0\(([^)]*)\)',
                               printed)
    assert len(hierarchy_ops) > 20
    for op, operands, props, block_args in hierarchy_ops:
        segments = segment_sizes(props)
        n_operands = len(operands.split(", ")) if operands else 0
        assert segments[0] == 0 and sum(segments) == n_operands, (op, segments, operands)
        assert len(re.findall(r"%[\w$.]+:", block_args)) == 2 * segments[1] + segments[2], (op, block_args)
        assert "sym_name" in props
    dmas = re.findall(r'"air\.dma_memcpy_nd"\(([^)]*)\) <\{([^}]*)\}> : \(([^)]*)\) -> \(\)', printed)
    assert len(dmas) > 20
    for operands, props, types in dmas:
        segments = segment_sizes(props)
        assert len(segments) == 9 and segments[1] == segments[5] == 1
        assert sum(segments) == len(operands.split(", "))
        for side, dynamic in (("dst", segments[2]), ("src", segments[6])):
            arrays = {k: re.search(rf"static_{side}_{k} = array<i64(?:: ([-\d, ]+))?>", props).group(1) or ""
                      for k in ("offsets", "sizes", "strides")}
            offsets = arrays["offsets"].split(", ") if arrays["offsets"] else []
            assert len(offsets) == len(arrays["sizes"].split(", ") if arrays["sizes"] else []) == \
                len(arrays["strides"].split(", ") if arrays["strides"] else []), (side, props)
            assert offsets.count("-9223372036854775808") == dynamic, (side, props)


def test_mlir_opt_rejects_a_broken_module():
    """The verification above has teeth: a DMA whose declared operand type disagrees with its value fails."""
    program = next(iter(model_programs().values()))
    broken = stitch(program).text.replace("memref<16x576xbf16>) -> ()", "memref<16x577xbf16>) -> ()", 1)
    assert broken != stitch(program).text
    result = subprocess.run([MLIR_OPT, "--allow-unregistered-dialect", "-"], input=for_mlir_opt(broken),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "error" in result.stderr
