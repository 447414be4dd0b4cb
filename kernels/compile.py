"""Compile pipeline: Program → stitched MLIR-AIR → multi-launch ELF, with Peano-built C++ kernels.

Two drivers, chosen by what is installed (kernels/toolchain.py finds them):

* ``aircc`` from the mlir-air wheels, given the Program's :class:`CompileOptions` as flags;
* without aircc, the AIR binaries: kernels/air_pipeline.py replays aircc's npu2 flow with ``air-opt`` and
  ends with ``aiecc --generate-full-elf`` as aircc does.

Either way the Program's tiles are first checked against the core's L1 (kernels/budgets.py: buffers, the
``stack_size`` aircc is given, headroom), every DMA window is read back through the installed ``air-opt`` (when
there is one),
and every compile runs in its own temporary directory (aircc writes into its working directory and must
never share one); on failure that directory, with the stitched ``air.mlir``, is kept and named in the
error. The artifact cache (torch_npu2/artifact_cache.py) calls :func:`compile_program` and keys entries
with :func:`toolchain_fingerprint`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from . import air_pipeline
from .air_pipeline import CompileError
from .budgets import check_program_l1
from .device import DEVICE
from .program import Program
from .stitch import ObjectBuild, stitch
from .toolchain import (KERNEL_SOURCE_DIR, Toolchain, ToolchainMissing, air_version_warning, find_toolchain,
                        missing_toolchain, toolchain_fingerprint)

PEANO_FLAGS = ("-O2", "-std=c++20", f"--target={DEVICE.architecture}-none-unknown-elf", "-DNDEBUG",
               "-Wno-parentheses", "-Wno-attributes", "-Wno-macro-redefined", "-Wno-empty-body",
               # keeps aie_api from including the Vitis-only adf.h
               "-D__AIE_API_AIE_ADF_HPP__")
PROJECT_DIR = "air_project"  # aircc's --tmpdir inside the build directory


def _run(program: str, stage: str, command: list[str], cwd: Path, env: dict, build_dir: Path) -> None:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(program, stage, (result.stderr or result.stdout)[-4000:], build_dir, command=command,
                           returncode=result.returncode)


def peano_command(tc: Toolchain, build: ObjectBuild, output: Path) -> list[str]:
    return [str(tc.clang), *PEANO_FLAGS, f"-I{tc.aie_include}", f"-I{KERNEL_SOURCE_DIR}",
            *(f"-D{name}={value}" for name, value in build.defines),
            *(f"-D{old}={new}" for old, new in build.renames),
            "-c", str(KERNEL_SOURCE_DIR / build.source), "-o", str(output)]


def aircc_command(tc: Toolchain, program: Program, elf_name: str, extra_flags=()) -> list[str]:
    return [str(tc.aircc), "--device", DEVICE.name, "air.mlir", "--elf-name", elf_name, "--output-format", "elf",
            "--xclbin-instance-name", program.name, "--peano", str(tc.peano), "--no-xchesscc", "--no-xbridge",
            f"--tmpdir={PROJECT_DIR}", *program.compile_options.aircc_flags(), *extra_flags]


def aiecc_elf_command(tc: Toolchain, elf_name: str, npu_module: Path) -> list[str]:
    """The aiecc call aircc makes for ``--output-format elf`` (its options, for the C++ aiecc)."""
    return [str(tc.aiecc), "--no-aiesim", "--no-xchesscc", "--no-xbridge", "--no-compile-host",
            f"--tmpdir={PROJECT_DIR}", "--peano", str(tc.peano), "-O", "3", "--generate-full-elf",
            "--expand-load-pdis", f"--full-elf-name={elf_name}", str(npu_module)]


def compile_program(program: Program, workdir: Path, *, aircc_flags=()) -> Path:
    """Builds ``<workdir>/<program.name>.elf`` (its kernel is ``main:<program.name>``) and returns its path.

    ``aircc_flags`` are appended to the aircc command line (e.g. ``--verbose`` while bringing up a kernel; the
    aircc driver only), except ``--stack-size``: the stack is ``CompileOptions.stack_size``, which the L1 check
    counts. A Program with a tile that does not fit L1 raises ``budgets.L1BudgetError`` before any tool runs. The
    stitched MLIR is also left next to the ELF for inspection.
    """
    if any(flag.startswith("--stack-size") for flag in aircc_flags):
        raise ValueError(f"{program.name}: the stack size is CompileOptions.stack_size (the L1 budget counts it), "
                         f"not an extra aircc flag")
    missing = missing_toolchain()
    if missing:
        raise ToolchainMissing(f"cannot compile {program.name} for the NPU; missing:\n  " + "\n  ".join(missing))
    check_program_l1(program)
    tc = find_toolchain()
    warning = air_version_warning(tc)
    if warning:
        warnings.warn(f"compiling {program.name}: {warning}", stacklevel=2)
    workdir = Path(workdir)
    stitched = stitch(program)
    build_dir = Path(tempfile.mkdtemp(prefix=f"torch_npu2-{program.name}-"))
    project = build_dir / PROJECT_DIR
    project.mkdir()
    (build_dir / "air.mlir").write_text(stitched.text)
    env = dict(os.environ, PEANO_INSTALL_DIR=str(tc.peano))
    env["PATH"] = os.pathsep.join([str(p.parent) for p in (tc.aiecc, tc.aircc) if p] + [env.get("PATH", "")])
    for build in stitched.objects:
        if not (KERNEL_SOURCE_DIR / build.source).exists():
            raise CompileError(program.name, "peano", f"kernel source {KERNEL_SOURCE_DIR / build.source} not found "
                               f"(needed for {build.object})", build_dir)
        _run(program.name, "peano", peano_command(tc, build, project / build.object), build_dir, env, build_dir)
        # aiecc resolves link_with against its working directory in some versions and --tmpdir in others.
        shutil.copy2(project / build.object, build_dir / build.object)
    elf_name = f"{program.name}.elf"
    if tc.aircc is not None:
        if tc.air_opt is not None:
            air_pipeline.check_windows(program.name, stitched, build_dir, tc)
        command = aircc_command(tc, program, elf_name, aircc_flags)
        _run(program.name, "aircc", command, build_dir, env, build_dir)
    else:
        command = aiecc_elf_command(tc, elf_name, air_pipeline.prepare(program, build_dir, tc))
        _run(program.name, "aiecc", command, build_dir, env, build_dir)
    produced = next((p for p in (build_dir / elf_name, project / elf_name) if p.exists()), None)
    if produced is None:
        raise CompileError(program.name, Path(command[0]).name, f"exited 0 but wrote no {elf_name}", build_dir,
                           command=command, returncode=0)
    workdir.mkdir(parents=True, exist_ok=True)
    elf = workdir / elf_name
    shutil.copy2(produced, elf)
    (workdir / f"{program.name}.mlir").write_text(stitched.text)
    shutil.rmtree(build_dir, ignore_errors=True)
    return elf


__all__ = ["CompileError", "ToolchainMissing", "compile_program", "missing_toolchain", "toolchain_fingerprint",
           "find_toolchain", "peano_command", "aircc_command", "aiecc_elf_command"]
