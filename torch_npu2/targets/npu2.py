"""The NPU2 target: the Ryzen AI NPU through ``pyxrt``, running ELFs that aircc (or the AIR tools) and Peano
build from a Program (kernels/compile.py), keyed by the installed toolchain's fingerprint."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

from ..kernels.program import Program
from ..kernels.toolchain import toolchain_fingerprint
from . import Target


@dataclass
class Probe:
    """What this machine offers for the NPU2 target."""

    pyxrt: object | None = None
    device_ok: bool = False
    problems: list[str] = field(default_factory=list)


def probe() -> Probe:
    found = Probe()
    try:
        found.pyxrt = importlib.import_module("pyxrt")
    except ImportError as exc:
        found.problems.append(
            f"pyxrt: cannot be imported ({exc}); install XRT with the amdxdna driver and "
            "`source /opt/xilinx/xrt/setup.sh`")
        return found
    try:
        found.pyxrt.device(0)
        found.device_ok = True
    except Exception as exc:  # pyxrt raises its own RuntimeError subclasses, undocumented
        found.problems.append(f"device: no NPU device answers at index 0 ({exc}); `xrt-smi examine` should list it")
    return found


def open_driver():
    found = probe()
    if found.problems:
        raise RuntimeError("npu2: pyxrt cannot open the NPU:\n  " + "\n  ".join(found.problems))
    return found.pyxrt


def build_elf(program: Program, directory: Path) -> Path:
    # Imported here: the compile pipeline stitches MLIR, which only this target's builds need.
    from ..kernels.compile import compile_program

    return compile_program(program, directory)


TARGET = Target(name="npu2", description="NPU2 through pyxrt (device 0)", problems=lambda: probe().problems,
                open_driver=open_driver, build_artifact=build_elf, toolchain=toolchain_fingerprint)
