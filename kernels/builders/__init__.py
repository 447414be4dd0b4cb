"""Launch-kind builders: each turns one Program launch into MLIR-AIR text (ir.py describes the form).

``BUILDERS`` maps a launch kind to ``build(params, operand_types, tuning=None) -> LaunchIR``; operand
types are the launch's reads then writes, as the Program's argument shapes and dtypes.
"""
from __future__ import annotations

from ..program import Launch, Program
from . import add, attention, gemm, gemv, gemv_fused, rmsnorm, rope, silu_mul, stack
from .externs import EXTERNAL_KERNELS, KERNEL_OBJECTS, KernelObject
from .ir import LaunchIR, MemRef
from .npu2 import LaunchConstraintError

BUILDERS = {
    "rmsnorm": rmsnorm.build,
    "gemm": gemm.build,
    "gemv": gemv.build,
    "gemv_f32": gemv.build_f32,
    "gemv_add": gemv_fused.build_add,
    "rms_gemv": gemv_fused.build_rms_gemv,
    "swiglu_gemv_add": gemv_fused.build_swiglu_add,
    "rope": rope.build,
    "silu_mul": silu_mul.build,
    "add": add.build,
    "attention": attention.build,
    "stack": stack.build,
}


def operand_types(program: Program, launch: Launch) -> list[MemRef]:
    return [MemRef(tuple(program.arg(n).shape), program.arg(n).dtype) for n in launch.reads + launch.writes]


def build_launch(program: Program, launch: Launch, tuning: dict | None = None) -> LaunchIR:
    try:
        builder = BUILDERS[launch.kind]
    except KeyError:
        raise ValueError(f"Program {program.name}: no MLIR builder for launch kind {launch.kind!r}; "
                         f"known: {', '.join(BUILDERS)}") from None
    return builder(launch.p, operand_types(program, launch), tuning)


__all__ = ["BUILDERS", "EXTERNAL_KERNELS", "KERNEL_OBJECTS", "KernelObject", "LaunchConstraintError", "LaunchIR",
           "MemRef", "build_launch", "operand_types"]
