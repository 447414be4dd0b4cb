"""Where the NPU compile toolchain is, which version it is, and what is missing.

Two ways to build an ELF, both needing Peano (``llvm-aie``) and the ``aie_api`` headers for the C++ kernels:

* the ``aircc`` driver from the mlir-air wheels (``pip install 'mlir_air[aie]'``), which runs ``aiecc``;
* the AIR binaries alone (``air-opt`` and the C++ ``aiecc``), through which kernels/air_pipeline.py
  replays aircc's npu2 flow. Those binaries also lower every Program to NPU instructions without Peano.

Where each piece is looked for:

* ``air-opt`` and ``aiecc``: ``$TORCH_NPU2_AIR_TOOLS`` (a directory holding ``bin/``, or the ``bin``
  directory itself; when set, nothing else is searched), PATH, ``$MLIR_AIR_INSTALL_DIR/bin`` /
  ``$MLIR_AIE_INSTALL_DIR/bin``, the install trees of the ``air``/``aie`` python packages;
* ``aircc``: PATH, ``$MLIR_AIR_INSTALL_DIR/bin``, the ``air`` package's install tree;
* Peano: ``$PEANO_INSTALL_DIR``, else the ``llvm-aie`` distribution's install tree;
* the ``aie_api`` headers: next to ``aie-opt``, ``$MLIR_AIE_INSTALL_DIR/include``, the ``aie`` package's tree.

(The wheels and source installs both put the python package at ``<install>/python/<air|aie>``.)

The builders' IR was verified against one AIR: :data:`VERIFIED_AIR`, the binaries of
``../shared/toolchains/air-mlir22``. Any other AIR is reported as such (``torch-npu2 info``, compile
warnings); the compile path also reads every DMA window back through the AIR in use before lowering,
so an AIR that parses the IR differently fails loudly instead of miscompiling.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .device import DEVICE

KERNELS_DIR = Path(__file__).resolve().parent
KERNEL_SOURCE_DIR = KERNELS_DIR / DEVICE.architecture
AIR_TOOLS_VARIABLE = "TORCH_NPU2_AIR_TOOLS"
INSTALL_HINT = ("pip install 'mlir_air[aie]' "
                "-f https://github.com/Xilinx/mlir-air/releases/expanded_assets/latest-air-wheels "
                "-f https://github.com/Xilinx/mlir-aie/releases/expanded_assets/latest-wheels-4 "
                "-f https://github.com/Xilinx/llvm-aie/releases/expanded_assets/nightly")
AIR_TOOLS_HINT = (f"set {AIR_TOOLS_VARIABLE} to a directory holding bin/air-opt and bin/aiecc: the "
                  "air-mlir22 archive unpacked (`make air-tools` in a checkout beside ../shared unpacks it into "
                  "<checkout>/.air-tools), "
                  "one built from source by ../shared/toolchains/air-mlir22/build.sh (about 25 minutes on 2 "
                  f"cores), or the mlir_air[aie] wheels ({INSTALL_HINT})")
TOOLCHAIN_DISTS = ("mlir_air", "mlir_aie", "mlir_aie_no_rtti", "llvm-aie")
# The AIR the builders' IR was verified against, and the sha256 of the archive that holds it.
VERIFIED_AIR = "mlir-air 0e3df89d + mlir-aie c668d2cb (LLVM 22.1.8)"
VERIFIED_ARCHIVE_SHA256 = "c5785294fa06ce1d59e4af21a4cf3160f9ecbd0dc71cf6d05d8c760cecb19ba6"
# Written next to bin/ by `make air-tools`: the sha256 of the archive the tools were unpacked from.
ARCHIVE_MARKER = "torch_npu2-archive.sha256"


class ToolchainMissing(RuntimeError):
    """A piece of the NPU compile toolchain cannot be found (the message says which and how to get it)."""


@dataclass(frozen=True)
class Toolchain:
    aircc: Path | None
    aiecc: Path | None
    air_opt: Path | None
    peano: Path | None        # install dir holding bin/clang++
    aie_include: Path | None  # dir holding aie_api/aie.hpp
    air_tools_problem: str | None = None  # why $TORCH_NPU2_AIR_TOOLS, when set, is unusable

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


def _explicit_air_tools() -> tuple[Path | None, str | None]:
    """The bin directory named by $TORCH_NPU2_AIR_TOOLS, or why it is not one."""
    root = os.environ.get(AIR_TOOLS_VARIABLE)
    if not root:
        return None, None
    for candidate in (Path(root) / "bin", Path(root)):
        if (candidate / "air-opt").exists() and (candidate / "aiecc").exists():
            return candidate, None
    return None, f"{AIR_TOOLS_VARIABLE}={root} holds neither bin/air-opt + bin/aiecc nor air-opt + aiecc"


def find_toolchain() -> Toolchain:
    explicit, problem = _explicit_air_tools()
    if os.environ.get(AIR_TOOLS_VARIABLE):
        air_opt = explicit / "air-opt" if explicit else None
        aiecc = explicit / "aiecc" if explicit else None
    else:
        air_opt = (_which("air-opt") or _env_dir("MLIR_AIR_INSTALL_DIR", "bin/air-opt")
                   or _package_file("air", "bin/air-opt"))
        aiecc = (_which("aiecc") or _env_dir("MLIR_AIE_INSTALL_DIR", "bin/aiecc")
                 or _package_file("aie", "bin/aiecc"))
    return Toolchain(
        aircc=_which("aircc") or _env_dir("MLIR_AIR_INSTALL_DIR", "bin/aircc") or _package_file("air", "bin/aircc"),
        aiecc=aiecc or _which("aiecc.py"),
        air_opt=air_opt,
        peano=_find_peano(),
        aie_include=_find_aie_include(),
        air_tools_problem=problem,
    )


def _missing_air_tools(tc: Toolchain) -> list[str]:
    if tc.air_tools_problem:
        return [f"AIR tools: {tc.air_tools_problem}"]
    missing = [name for name, path in (("air-opt", tc.air_opt), ("aiecc", tc.aiecc)) if path is None]
    if missing:
        return [f"AIR tools ({' and '.join(missing)}): not found; {AIR_TOOLS_HINT}"]
    problem = air_tools_run_problem(tc.air_opt)
    return [f"AIR tools: {problem}"] if problem else []


def missing_lowering_tools() -> list[str]:
    """What lowering a Program to NPU instructions (no Peano needed) lacks; empty when nothing."""
    return _missing_air_tools(find_toolchain())


def missing_toolchain() -> list[str]:
    """Each missing piece of the ELF toolchain with how to get it; empty when an ELF can be built."""
    tc = find_toolchain()
    missing = []
    if tc.aircc is None:
        air_tools = _missing_air_tools(tc)
        if air_tools:
            missing.append(f"aircc (mlir-air wheels) or the AIR tools: no aircc on PATH, in "
                           f"$MLIR_AIR_INSTALL_DIR/bin or the air python package; {air_tools[0]}")
    elif tc.aiecc is None:
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


@functools.lru_cache(maxsize=None)
def _version_output(air_opt: Path, stamp: str) -> tuple[int, str]:
    try:
        result = subprocess.run([str(air_opt), "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        return 1, str(exc)
    return result.returncode, (result.stdout + result.stderr).strip()


def air_tools_run_problem(air_opt: Path) -> str | None:
    """Why ``air-opt`` cannot run here (e.g. the LLVM 22 shared libraries it links are missing), or None."""
    code, output = _version_output(air_opt, _stat(air_opt))
    if code == 0:
        return None
    hint = " (Debian/Ubuntu: apt-get install mlir-22-tools)" if "shared librar" in output else ""
    return f"{air_opt} --version failed{hint}: {output.splitlines()[-1] if output else f'exit {code}'}"


def air_version(tc: Toolchain | None = None) -> str:
    """Which AIR the toolchain holds: the verified archive, a wheel version, or an unknown build."""
    tc = tc or find_toolchain()
    if tc.air_opt is None:
        try:
            return f"mlir_air {importlib.metadata.version('mlir_air')} (aircc only)" if tc.aircc else "absent"
        except importlib.metadata.PackageNotFoundError:
            return "absent" if tc.aircc is None else f"aircc at {tc.aircc}, version unknown"
    marker = tc.air_opt.resolve().parent.parent / ARCHIVE_MARKER
    if marker.exists() and marker.read_text().split()[:1] == [VERIFIED_ARCHIVE_SHA256]:
        return VERIFIED_AIR
    if tc.air_opt == _package_file("air", "bin/air-opt"):
        try:
            return f"mlir_air {importlib.metadata.version('mlir_air')}"
        except importlib.metadata.PackageNotFoundError:
            pass
    code, output = _version_output(tc.air_opt, _stat(tc.air_opt))
    first = output.splitlines()[0].strip() if code == 0 and output else "air-opt --version failed"
    return f"an unknown build at {tc.air_opt} ({first})"


def air_version_warning(tc: Toolchain | None = None) -> str | None:
    """A sentence for the user when the AIR in use is not the one the IR was verified against."""
    tc = tc or find_toolchain()
    version = air_version(tc)
    if version in (VERIFIED_AIR, "absent"):
        return None
    checked = ("every DMA window is read back through its air-opt before lowering, but pass behaviour may differ"
               if tc.air_opt else "pass behaviour and IR parsing may differ")
    return f"the AIR in use is {version}, not the {VERIFIED_AIR} the builders' IR was verified against; {checked}"


def _stat(path: Path | None) -> str:
    if path is None or not path.exists():
        return "missing"
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _sources_digest() -> str:
    """Our own inputs to every ELF: builders, stitcher, the pipelines and the C++ kernels."""
    files = sorted([*KERNELS_DIR.glob("builders/*.py"), KERNELS_DIR / "stitch.py", KERNELS_DIR / "compile.py",
                    KERNELS_DIR / "air_pipeline.py", *KERNEL_SOURCE_DIR.glob("*.cc"), *KERNEL_SOURCE_DIR.glob("*.h")])
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.parent.name}/{path.name}".encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def toolchain_fingerprint() -> str:
    """Dist versions, the AIR version, the binaries' size:mtime and a digest of our kernel sources: a change
    in any of them means recompile."""
    parts = []
    for dist in TOOLCHAIN_DISTS:
        try:
            parts.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist}=absent")
    tc = find_toolchain()
    parts += [f"air={air_version(tc)}", f"aircc={_stat(tc.aircc)}", f"air-opt={_stat(tc.air_opt)}",
              f"aiecc={_stat(tc.aiecc)}", f"clang++={_stat(tc.clang)}", f"kernels={_sources_digest()}"]
    return ";".join(parts)
