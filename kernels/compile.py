"""Compile pipeline: Program → stitched MLIR-AIR → aircc (with Peano-built C++ kernels) → multi-launch ELF.

Toolchain pieces and where they are looked for:

* ``aircc`` (mlir-air): PATH, ``$MLIR_AIR_INSTALL_DIR/bin``, the install tree of the ``air`` package;
* ``aiecc`` (mlir-aie), which aircc runs: PATH, ``$MLIR_AIE_INSTALL_DIR/bin``, the ``aie`` package's tree;
* Peano (``llvm-aie``): ``$PEANO_INSTALL_DIR``, else the ``llvm-aie`` distribution's install tree;
* the ``aie_api`` headers: next to ``aie-opt``, ``$MLIR_AIE_INSTALL_DIR/include``, the ``aie`` package's tree.

(The wheels and source installs both put the python package at ``<install>/python/<air|aie>``.)

Every compile runs in its own temporary directory (aircc writes into its working directory and must
never share one); on failure that directory, with the stitched ``air.mlir``, is kept and named in the
error. The artifact cache (torch_npu2/artifact_cache.py) calls :func:`compile_program` and keys entries
with :func:`toolchain_fingerprint`.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .program import Program
from .stitch import ObjectBuild, stitch

KERNELS_DIR = Path(__file__).resolve().parent
KERNEL_SOURCE_DIR = KERNELS_DIR / "aie2p"
INSTALL_HINT = ("pip install 'mlir_air[aie]' "
                "-f https://github.com/Xilinx/mlir-air/releases/expanded_assets/latest-air-wheels "
                "-f https://github.com/Xilinx/mlir-aie/releases/expanded_assets/latest-wheels-4 "
                "-f https://github.com/Xilinx/llvm-aie/releases/expanded_assets/nightly")
PEANO_FLAGS = ("-O2", "-std=c++20", "--target=aie2p-none-unknown-elf", "-DNDEBUG",
               "-Wno-parentheses", "-Wno-attributes", "-Wno-macro-redefined", "-Wno-empty-body",
               # keeps aie_api from including the Vitis-only adf.h
               "-D__AIE_API_AIE_ADF_HPP__")
PROJECT_DIR = "air_project"  # aircc's --tmpdir inside the build directory
TOOLCHAIN_DISTS = ("mlir_air", "mlir_aie", "mlir_aie_no_rtti", "llvm-aie")


class ToolchainMissing(RuntimeError):
    """aircc, aiecc, Peano or the aie_api headers cannot be found (see :func:`missing_toolchain`)."""


class CompileError(RuntimeError):
    """Peano or aircc failed; the build directory with the stitched MLIR is kept for inspection."""

    def __init__(self, program: str, stage: str, command: list[str], returncode: int, stderr: str,
                 mlir_path: Path, build_dir: Path):
        self.program, self.stage, self.command, self.returncode = program, stage, command, returncode
        self.stderr, self.mlir_path, self.build_dir = stderr, mlir_path, build_dir
        tail = stderr[-4000:]
        super().__init__(f"{stage} failed for {program} (exit {returncode}); MLIR kept at {mlir_path}\n"
                         f"command: {' '.join(command)}\n{tail}")


@dataclass(frozen=True)
class Toolchain:
    aircc: Path | None
    aiecc: Path | None
    peano: Path | None        # install dir holding bin/clang++
    aie_include: Path | None  # dir holding aie_api/aie.hpp

    @property
    def clang(self) -> Path | None:
        return self.peano / "bin" / "clang++" if self.peano else None


def _package_root(package: str) -> Path | None:
    """``<install>`` of an importable mlir-air/mlir-aie package living at ``<install>/python/<package>``."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent.parent


def _package_file(package: str, relative: str) -> Path | None:
    root = _package_root(package)
    return root / relative if root and (root / relative).exists() else None


def _dist_file(dists, relative: str) -> Path | None:
    for name in dists:
        try:
            path = Path(importlib.metadata.distribution(name).locate_file(relative))
        except importlib.metadata.PackageNotFoundError:
            continue
        if path.exists():
            return path
    return None


def _env_dir(variable: str, relative: str) -> Path | None:
    root = os.environ.get(variable)
    if root and (Path(root) / relative).exists():
        return Path(root) / relative
    return None


def _which(*names: str) -> Path | None:
    found = next((shutil.which(n) for n in names if shutil.which(n)), None)
    return Path(found) if found else None


def _find_peano() -> Path | None:
    explicit = os.environ.get("PEANO_INSTALL_DIR")
    if explicit:
        return Path(explicit) if (Path(explicit) / "bin" / "clang++").exists() else None
    tree = _dist_file(("llvm-aie", "llvm_aie"), "llvm-aie")
    return tree if tree and (tree / "bin" / "clang++").exists() else None


def _find_aie_include() -> Path | None:
    candidates = []
    aie_opt = _which("aie-opt")
    if aie_opt:
        candidates.append(aie_opt.resolve().parent.parent / "include")
    if os.environ.get("MLIR_AIE_INSTALL_DIR"):
        candidates.append(Path(os.environ["MLIR_AIE_INSTALL_DIR"]) / "include")
    packaged = _package_file("aie", "include")
    if packaged:
        candidates.append(packaged)
    return next((c for c in candidates if (c / "aie_api" / "aie.hpp").exists()), None)


def find_toolchain() -> Toolchain:
    return Toolchain(
        aircc=_which("aircc") or _env_dir("MLIR_AIR_INSTALL_DIR", "bin/aircc") or _package_file("air", "bin/aircc"),
        aiecc=(_which("aiecc", "aiecc.py") or _env_dir("MLIR_AIE_INSTALL_DIR", "bin/aiecc")
               or _package_file("aie", "bin/aiecc")),
        peano=_find_peano(),
        aie_include=_find_aie_include(),
    )


def missing_toolchain() -> list[str]:
    """Each missing piece of the NPU compile toolchain with how to get it; empty when all are present."""
    tc = find_toolchain()
    missing = []
    if tc.aircc is None:
        missing.append(f"aircc (mlir-air): not on PATH, not in $MLIR_AIR_INSTALL_DIR/bin, no air python package; "
                       f"install the wheels: {INSTALL_HINT}")
    if tc.aiecc is None:
        missing.append(f"aiecc (mlir-aie, run by aircc): not on PATH, not in $MLIR_AIE_INSTALL_DIR/bin, no aie "
                       f"python package; the [aie] extra of mlir_air brings it: {INSTALL_HINT}")
    if tc.peano is None:
        where = (f"$PEANO_INSTALL_DIR={os.environ['PEANO_INSTALL_DIR']} has no bin/clang++"
                 if os.environ.get("PEANO_INSTALL_DIR") else "PEANO_INSTALL_DIR is unset and no llvm-aie package")
        missing.append(f"Peano (llvm-aie): {where}; the [aie] extra of mlir_air brings it, or set "
                       f"PEANO_INSTALL_DIR (upstream pins an LLVM 21 nightly: 22 nightlies gave NaNs on NPU2)")
    if tc.aie_include is None:
        missing.append("aie_api headers: no include dir with aie_api/aie.hpp next to aie-opt, in "
                       f"$MLIR_AIE_INSTALL_DIR/include or in the aie package's install; {INSTALL_HINT}")
    return missing


def _stat(path: Path | None) -> str:
    if path is None or not path.exists():
        return "missing"
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _sources_digest() -> str:
    """Our own inputs to every ELF: builders, stitcher, this pipeline and the C++ kernels."""
    files = sorted([*KERNELS_DIR.glob("builders/*.py"), KERNELS_DIR / "stitch.py", KERNELS_DIR / "compile.py",
                    *KERNEL_SOURCE_DIR.glob("*.cc"), *KERNEL_SOURCE_DIR.glob("*.h")])
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.parent.name}/{path.name}".encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def toolchain_fingerprint() -> str:
    """Dist versions, the binaries' size:mtime and a digest of our kernel sources: a change means recompile."""
    parts = []
    for dist in TOOLCHAIN_DISTS:
        try:
            parts.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist}=absent")
    tc = find_toolchain()
    parts += [f"aircc={_stat(tc.aircc)}", f"aiecc={_stat(tc.aiecc)}", f"clang++={_stat(tc.clang)}",
              f"kernels={_sources_digest()}"]
    return ";".join(parts)


def _run(program: str, stage: str, command: list[str], cwd: Path, env: dict, mlir_path: Path,
         build_dir: Path) -> None:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(program, stage, command, result.returncode, result.stderr or result.stdout, mlir_path,
                           build_dir)


def peano_command(tc: Toolchain, build: ObjectBuild, output: Path) -> list[str]:
    return [str(tc.clang), *PEANO_FLAGS, f"-I{tc.aie_include}", f"-I{KERNEL_SOURCE_DIR}",
            *(f"-D{name}={value}" for name, value in build.defines),
            *(f"-D{old}={new}" for old, new in build.renames),
            "-c", str(KERNEL_SOURCE_DIR / build.source), "-o", str(output)]


def aircc_command(tc: Toolchain, program: Program, elf_name: str, extra_flags=()) -> list[str]:
    return [str(tc.aircc), "--device", "npu2", "air.mlir", "--elf-name", elf_name, "--output-format", "elf",
            "--xclbin-instance-name", program.name, "--peano", str(tc.peano), "--no-xchesscc", "--no-xbridge",
            f"--tmpdir={PROJECT_DIR}", *extra_flags]


def compile_program(program: Program, workdir: Path, *, aircc_flags=()) -> Path:
    """Builds ``<workdir>/<program.name>.elf`` (its kernel is ``main:<program.name>``) and returns its path.

    ``aircc_flags`` are appended to the aircc command line (e.g. ``--stack-size 2048`` while bringing up a
    kernel). The stitched MLIR is also left next to the ELF for inspection.
    """
    missing = missing_toolchain()
    if missing:
        raise ToolchainMissing(f"cannot compile {program.name} for the NPU; missing:\n  " + "\n  ".join(missing))
    tc = find_toolchain()
    workdir = Path(workdir)
    stitched = stitch(program)
    build_dir = Path(tempfile.mkdtemp(prefix=f"torch_npu2-{program.name}-"))
    project = build_dir / PROJECT_DIR
    project.mkdir()
    mlir_path = build_dir / "air.mlir"
    mlir_path.write_text(stitched.text)
    env = dict(os.environ, PEANO_INSTALL_DIR=str(tc.peano))
    env["PATH"] = os.pathsep.join([str(tc.aiecc.parent), str(tc.aircc.parent), env.get("PATH", "")])
    for build in stitched.objects:
        if not (KERNEL_SOURCE_DIR / build.source).exists():
            raise CompileError(program.name, "peano", [], 1, f"kernel source {KERNEL_SOURCE_DIR / build.source} "
                               f"not found (needed for {build.object})", mlir_path, build_dir)
        _run(program.name, "peano", peano_command(tc, build, project / build.object), build_dir, env, mlir_path,
             build_dir)
        # aiecc resolves link_with against its working directory in some versions and --tmpdir in others.
        shutil.copy2(project / build.object, build_dir / build.object)
    elf_name = f"{program.name}.elf"
    _run(program.name, "aircc", aircc_command(tc, program, elf_name, aircc_flags), build_dir, env, mlir_path,
         build_dir)
    produced = next((p for p in (build_dir / elf_name, project / elf_name) if p.exists()), None)
    if produced is None:
        raise CompileError(program.name, "aircc", aircc_command(tc, program, elf_name, aircc_flags), 0,
                           f"aircc exited 0 but wrote no {elf_name}", mlir_path, build_dir)
    workdir.mkdir(parents=True, exist_ok=True)
    elf = workdir / elf_name
    shutil.copy2(produced, elf)
    (workdir / f"{program.name}.mlir").write_text(stitched.text)
    shutil.rmtree(build_dir, ignore_errors=True)
    return elf
