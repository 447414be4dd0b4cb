"""The kernel records (builders/externs.py) and the launch-kind table (builders/__init__.py) against what they
describe: the C++ signatures, the builders' calls, the emulator's launches. Each table that used to restate a
record (the interpreter's access, the timing model's costs and work arguments, the host build's ctypes types,
lint's GEMM-class kinds) is read from it, so a record is checked here once, for all of them."""
import dataclasses
import re

import pytest

from torch_npu2.emulator.launches import LAUNCH_KINDS
from torch_npu2.kernels import core_ops, host_build
from torch_npu2.kernels.builders import BUILDERS, EXTERNAL_KERNELS
from torch_npu2.kernels.builders.externs import (CALL_KINDS, LAST_OPERAND, MATMUL_OPERANDS, MEMREF_ACCESS, SCALAR_TYPES,
                                                 CallCost, KernelObject, KernelSymbol, kernel_symbol)
from torch_npu2.kernels.interpret import KERNEL_ARGUMENT_ACCESS
from torch_npu2.kernels.lint import GEMM_CLASS_KINDS

from .test_builders import EXAMPLES, build

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
MATMUL_COSTS = ("mmul_bf16", "mmul_int", "vector_mac")


def _letter(parameter: str) -> str:
    """The record letter a C parameter declaration allows: "r" for a const pointer, "wmp" for another pointer."""
    words = parameter.replace("*", " * ").split()
    if "*" in words:
        return "r" if words[0] == "const" else "wmp"
    return "f" if "float" in words else "i"


def record_problems(kernel: KernelObject) -> list[str]:
    """What is missing or wrong in ``kernel``'s record against its C++ source (every definition of each
    symbol: the AIE and the host path each have one) and its own macros."""
    text = _COMMENT.sub("", (host_build.KERNEL_DIR / kernel.source).read_text())
    macros = set(kernel.config_macros) | set(kernel.optional_macros)
    problems = []
    for entry in kernel.entries:
        definitions = re.findall(rf"\bvoid\s+{entry.name}\s*\(([^)]*)\)\s*\{{", text)
        if not definitions:
            problems.append(f"{entry.name}: not defined in {kernel.source}")
        for parameters in definitions:
            letters = [_letter(p) for p in parameters.split(",")]
            if len(letters) != len(entry.arguments) or any(a not in allowed
                                                            for a, allowed in zip(entry.arguments, letters)):
                problems.append(f"{entry.name}: arguments {entry.arguments!r}, the C++ declares ({parameters})")
        if entry.cost.kind not in CALL_KINDS:
            problems.append(f"{entry.name}: cost kind {entry.cost.kind!r} is none of CALL_KINDS")
        operands = {MATMUL_OPERANDS, LAST_OPERAND}
        if not entry.cost.work or not (set(entry.cost.work) <= macros or
                                       (len(entry.cost.work) == 1 and entry.cost.work[0] in operands)):
            problems.append(f"{entry.name}: work {entry.cost.work} is neither macros of {kernel.object} nor one of "
                            f"{sorted(operands)}")
        if entry.work_arguments and definitions:
            sample = {m: 64 for m in macros}
            integers = {p.split()[-1] for p in definitions[0].split(",") if _letter(p) == "i"}
            for bound in entry.work_arguments(sample):
                if not set(bound) <= integers:
                    problems.append(f"{entry.name}: work arguments {sorted(bound)} are not its integer "
                                    f"parameters {sorted(integers)}")
    return problems


@pytest.mark.parametrize("kernel", EXTERNAL_KERNELS, ids=lambda k: k.object)
def test_every_kernel_record_matches_its_source(kernel):
    assert record_problems(kernel) == []


def test_symbols_are_recorded_once():
    names = [e.name for k in EXTERNAL_KERNELS for e in k.entries]
    assert len(names) == len(set(names))


def _incomplete_records():
    gemv = next(k for k in EXTERNAL_KERNELS if k.object == "gemv.o")
    entry = kernel_symbol("gemv_add_bf16")
    swap = lambda **change: dataclasses.replace(  # noqa: E731
        gemv, entries=tuple(dataclasses.replace(e, **change) if e is entry else e for e in gemv.entries))
    return {
        "a scalar left out": (swap(arguments="rrp"), "gemv_add_bf16: arguments 'rrp'"),
        "a const pointer said written": (swap(arguments="wrpii"), "gemv_add_bf16: arguments 'wrpii'"),
        "no work": (swap(cost=CallCost("vector_elementwise", ())), "gemv_add_bf16: work ()"),
        "a macro of another object": (swap(cost=CallCost("vector_elementwise", ("ATTN_TQ",))), "work ('ATTN_TQ',)"),
        "an unknown cost kind": (swap(cost=CallCost("vector", ("GEMV_ROWS",))), "cost kind 'vector'"),
        "a work argument it does not take": (swap(work_arguments=lambda d: ({"k0": 0}, {"k0": 1})),
                                             "work arguments ['k0']"),
        "a symbol the source lacks": (dataclasses.replace(gemv, entries=(*gemv.entries, KernelSymbol(
            "gemv_bias_bf16", "rrw", CallCost("vector_mac", ("GEMV_ROWS", "GEMV_K"))))),
            "gemv_bias_bf16: not defined in gemv.cc"),
    }


@pytest.mark.parametrize("case", sorted(_incomplete_records()))
def test_an_incomplete_record_is_reported(case):
    record, expected = _incomplete_records()[case]
    problems = record_problems(record)
    assert any(expected in p for p in problems), problems


def test_a_record_takes_only_argument_letters():
    with pytest.raises(ValueError, match="must be letters"):
        KernelSymbol("gemv_bf16", "rrx", CallCost("vector_mac", ("GEMV_ROWS",)))


def test_the_tables_are_read_from_the_records():
    for kernel in EXTERNAL_KERNELS:
        for entry in kernel.entries:
            assert KERNEL_ARGUMENT_ACCESS[entry.name] == "".join(a for a in entry.arguments if a in MEMREF_ACCESS)
            assert core_ops.WORK_ARGUMENTS.get(entry.name) is entry.work_arguments
            assert core_ops.source_of(entry.name) == kernel.source


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_each_builder_calls_its_kernels_as_their_records_say(kind):
    """Memref where the record has an access letter, i32 / f32 where it has "i" / "f"."""
    for decl in build(kind).externs:
        expected = ["memref" if a in MEMREF_ACCESS else {"i": "i32", "f": "f32"}[a]
                    for a in kernel_symbol(decl.symbol).arguments]
        assert ["memref" if t.startswith("memref") else t for t in decl.arg_types] == expected, decl
    assert set(SCALAR_TYPES) == {"i", "f"}


def test_every_launch_kind_has_an_emulator_launch_and_gemm_class_kinds_multiply():
    assert set(BUILDERS) == set(LAUNCH_KINDS)
    for kind in GEMM_CLASS_KINDS:
        assert any(kernel_symbol(d.symbol).cost.kind in MATMUL_COSTS for d in build(kind).externs), kind
    assert set(GEMM_CLASS_KINDS) == {"gemm", "gemm_swiglu", "gemv", "gemv_f32", "gemv_add", "rms_gemv",
                                     "gemm_int", "gemm_int_swiglu"}
