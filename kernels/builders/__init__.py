"""Launch-kind builders: each turns one Program launch into MLIR-AIR text (ir.py describes the form).

``BUILDERS`` maps a launch kind to a :class:`KindBuilder`, called as ``(params, operand_types, tuning=None)
-> LaunchIR``; operand types are the launch's reads then writes, as the Program's argument shapes and
dtypes. It checks the launch's params and tuning against the kind's names before the build function runs,
so a build function starts from present, positive params and a known tuning dict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..program import Launch, Program
from . import (add, attention, bias_add, decode_attention, dequant, gemm, gemm_int, gemv, gemv_fused, quantize_rows,
               rmsnorm, rope, silu_mul, stack)
from .externs import EXTERNAL_KERNELS, KERNEL_OBJECTS, KernelObject
from .ir import LaunchIR, MemRef
from .npu2 import LaunchConstraintError, check_params, check_tuning


@dataclass(frozen=True)
class KindBuilder:
    kind: str
    build: Callable[[dict, list, dict], LaunchIR]  # (params, operand types, tuning), both already checked
    params: tuple[str, ...]                        # required launch params
    tuning: tuple[str, ...]                        # tuning keys the build function understands
    gemm_class: bool = False  # its herds multiply matrices: lint reports loop-lowered (scalar) compute in them

    def __call__(self, params: dict, operands, tuning: dict | None = None) -> LaunchIR:
        tuning = dict(tuning or {})
        check_params(self.kind, params, self.params)
        check_tuning(self.kind, tuning, self.tuning)
        return self.build(params, operands, tuning)


def _module_builder(kind: str, module, build=None, gemm_class: bool = False) -> KindBuilder:
    """The builder of a module that holds one kind's ``build``, ``PARAMS`` and ``TUNING``."""
    return KindBuilder(kind, build or module.build, module.PARAMS, module.TUNING, gemm_class)


BUILDERS = {builder.kind: builder for builder in (
    _module_builder("rmsnorm", rmsnorm),
    _module_builder("gemm", gemm, gemm_class=True),
    _module_builder("gemm_swiglu", gemm, gemm.build_swiglu, gemm_class=True),
    _module_builder("gemv", gemv, gemm_class=True),
    _module_builder("gemv_f32", gemv, gemv.build_f32, gemm_class=True),
    _module_builder("gemv_add", gemv_fused, gemv_fused.build_add, gemm_class=True),
    KindBuilder("rms_gemv", gemv_fused.build_rms_gemv, gemv_fused.RMS_PARAMS, gemv_fused.RMS_TUNING, gemm_class=True),
    _module_builder("rope", rope),
    KindBuilder("rope_qk", rope.build_qk, rope.QK_PARAMS, rope.QK_TUNING),
    _module_builder("silu_mul", silu_mul),
    _module_builder("add", add),
    _module_builder("bias_add", bias_add),
    _module_builder("attention", attention),
    _module_builder("stack", stack),
    _module_builder("decode_attention", decode_attention),
    _module_builder("quantize_rows", quantize_rows),
    _module_builder("gemm_int", gemm_int, gemm_class=True),
    _module_builder("gemm_int_swiglu", gemm_int, gemm_int.build_swiglu, gemm_class=True),
    _module_builder("dequant_rows", dequant),
)}


def operand_types(program: Program, launch: Launch) -> list[MemRef]:
    """The launch's operands (reads then writes) as L3 memrefs; a view's carries its place in its arena."""
    types = []
    for name in launch.reads + launch.writes:
        arg, view = program.arg(name), program.view(name)
        arena = None if view is None else (program.arg(view.arena).numel, view.offset)
        types.append(MemRef(tuple(arg.shape), arg.dtype, arena=arena))
    return types


def build_launch(program: Program, launch: Launch, tuning: dict | None = None) -> LaunchIR:
    try:
        builder = BUILDERS[launch.kind]
    except KeyError:
        raise ValueError(f"Program {program.name}: no MLIR builder for launch kind {launch.kind!r}; "
                         f"known: {', '.join(BUILDERS)}") from None
    return builder(launch.p, operand_types(program, launch), tuning)


__all__ = ["BUILDERS", "EXTERNAL_KERNELS", "KERNEL_OBJECTS", "KindBuilder", "KernelObject", "LaunchConstraintError",
           "LaunchIR", "MemRef", "build_launch", "operand_types"]
