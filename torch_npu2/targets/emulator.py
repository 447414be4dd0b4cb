"""The emulated NPU2 target: ``EmulatedXrt`` (torch_npu2/emulator) runs the Program itself, so its artifact
is the Program as JSON; nothing on this machine can stop it from running. It refuses, as the NPU2 build does,
a Program whose NPU2 build has a compute tile that does not fit its L1 (kernels/budgets.py); one the NPU2
builders cannot emit at all (a head_dim of 16, say) still runs here.

``TORCH_NPU2_EMULATOR_COHERENCY=fast|strict`` picks the driver's coherency mode (default ``fast``).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..emulator import EmulatedXrt, write_artifact
from ..kernels.program import Program
from . import Target

# Bumped when the artifact format, the emulator's numerics or what it refuses change, so cached artifacts are
# rebuilt.
TOOLCHAIN = "torch_npu2-emulator-2"
COHERENCY_VARIABLE = "TORCH_NPU2_EMULATOR_COHERENCY"


def open_driver() -> EmulatedXrt:
    return EmulatedXrt(coherency=os.environ.get(COHERENCY_VARIABLE, "fast"))


def inspection_mlir(program: Program) -> tuple[str | None, str | None]:
    """``(mlir, None)``: the module the NPU2 target would compile, or ``(None, why)`` when it cannot be emitted.

    Best effort: the emulator never needs the MLIR, so no failure of the emitter may stop a run."""
    try:
        from ..kernels.stitch import emit_mlir

        return emit_mlir(program), None
    except Exception as exc:  # any emitter failure, expected (an unsupported shape) or not, is only reported
        return None, f"{type(exc).__name__}: {exc}"


def refuse_unfit(program: Program) -> None:
    """``budgets.L1BudgetError`` when ``program`` builds for NPU2 with a tile over its L1 (the NPU2 build refuses it
    too); nothing when it fits or when the builders cannot emit it at all."""
    from ..kernels.budgets import L1BudgetError, check_program_l1

    try:
        check_program_l1(program)
    except L1BudgetError:
        raise
    except ValueError:
        pass  # not an NPU2 shape (a builder constraint, npu2_build_problem): the emulator runs it, README "Backends"


def build_program_json(program: Program, directory: Path) -> Path:
    """The emulator's artifact: the Program, plus the NPU2 MLIR for inspection (or why there is none); a Program
    that does not fit a core's L1 is refused (:func:`refuse_unfit`)."""
    refuse_unfit(program)
    path = Path(directory) / f"{program.name}.json"
    mlir, problem = inspection_mlir(program)
    write_artifact(program, path, mlir=mlir, mlir_problem=problem)
    return path


TARGET = Target(name="emulator", description="emulated NPU2", problems=lambda: [], open_driver=open_driver,
                build_artifact=build_program_json, toolchain=lambda: TOOLCHAIN)
