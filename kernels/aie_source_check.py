"""The AIE path of every C++ kernel, type-checked here: ``clang++-22 -fsyntax-only`` against the real aie_api headers.

Only Peano compiles the ``__AIENGINE__`` path of ``aie2p/*.cc``, and Peano is not here. An ordinary clang can still
parse that path as Peano's front end would, given the real aie_api headers (AMD, MIT), the llvm-aie headers that
could be copied (Apache-2.0 WITH LLVM-exception) and a stand-in for the intrinsic headers that could not
(``aie2p_check/``). It then checks everything aie_api decides itself: its overload sets and ``requires``
constraints (``is_valid_mul_op`` is what rejects a bf16 × float ``aie::mul``), its static_asserts on lane counts,
types and mmul shapes, the accumulator/vector conversions, and the kernels' own C++ in the variant at hand.

Every variant: the sources and ``-D`` configurations are the compile pipeline's own (``stitch(program).objects``
over the Programs given), checked with the language standard and macros of ``compile.PEANO_FLAGS``.

What it cannot see: the argument types of the intrinsics ``aie2p_check/aie2p_permissive.h`` declares permissively
(the MAC/MUL families, shuffles, extract/insert/set, address generation, locks: about 540 names); accfloat being a
float type (it is an integer stand-in here); anything after the front end: Peano-only diagnostics, code generation,
register pressure and spills, program-memory size, stack use, timing. A clean result is necessary, not sufficient,
for a Peano build.

The headers are read from ``$TORCH_NPU2_AIE_HEADERS`` when set, else from the shared workspace beside the checkout
(``../shared/toolchains/aie-headers``), as the AIR tools are.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .compile import PEANO_FLAGS
from .program import Program
from .stitch import stitch
from .toolchain import KERNEL_SOURCE_DIR, KERNELS_DIR

HEADERS_VARIABLE = "TORCH_NPU2_AIE_HEADERS"
SHARED_HEADERS = KERNELS_DIR.parent.parent / "shared" / "toolchains" / "aie-headers"
HEADERS_HINT = (f"set {HEADERS_VARIABLE} to a folder holding aie_api/include (github:Xilinx/aie_api) and "
                "llvm-aie/include + llvm-aie/basic/BuiltinsAIE2P.def (github:Xilinx/llvm-aie), as "
                "../shared/toolchains/aie-headers beside the checkout does")
CLANG = "clang++-22"
SHIM_DIR = KERNELS_DIR / "aie2p_check"
_REQUIRED_HEADERS = ("aie_api/include/aie_api/aie.hpp", "llvm-aie/include/aiebase_typedefs.h",
                     "llvm-aie/include/aie2p/aie2p_enums.h", "llvm-aie/basic/BuiltinsAIE2P.def")
# What Peano defines for an AIE2P target (its triple is not one an x86 clang has).
TARGET_FLAGS = ("-D__AIENGINE__", "-D__AIE_ARCH__=21", "-D__AIEARCH__=21")
# Attributes and pragmas only Peano knows, and aie_api's template spellings an x86 clang warns about.
QUIET_FLAGS = ("-Wno-unknown-attributes", "-Wno-ignored-attributes", "-Wno-macro-redefined",
               "-Wno-missing-template-arg-list-after-template-kw", "-Wno-align-mismatch")
LANGUAGE_FLAGS = tuple(flag for flag in PEANO_FLAGS if flag.startswith(("-std=", "-D")))

# Intrinsics whose Peano wrapper calls one builtin with the builtin's own signature (llvm-aie
# clang/lib/Headers/aie2p/: aie2p_srs.h, aie2p_ups.h, aie2p_nlf.h, aie2p_nlf_vector.h), declared with the types
# BuiltinsAIE2P.def gives those builtins: one overload per builtin. The overloads Peano composes from them are in
# aie2p_prelude.h. Every other intrinsic aie_api calls is permissive (aie2p_permissive.h).
PRECISE_INTRINSICS = {
    "to_v16bfloat16": ("__builtin_aie2p_v16accfloat_to_v16bf16",),
    "to_v32bfloat16": ("__builtin_aie2p_v32accfloat_to_v32bf16",),
    "ups_to_v16accfloat": ("__builtin_aie2p_v16bf16_to_v16accfloat", "__builtin_aie2p_v8float_to_v16accfloat"),
    "ups_to_v32accfloat": ("__builtin_aie2p_v32bf16_to_v32accfloat", "__builtin_aie2p_v16float_to_v32accfloat"),
    "exp2": ("__builtin_aie2p_exp2",),
    "tanh": ("__builtin_aie2p_tanh",),
    "invsqrt": ("__builtin_aie2p_invsqrt",),
    "inv": ("__builtin_aie2p_inv",),
    "_sqrtf": ("__builtin_aie2p_sqrtf",),
}


def find_headers() -> tuple[Path | None, str | None]:
    """The folder holding aie_api/ and llvm-aie/, or why there is none."""
    explicit = os.environ.get(HEADERS_VARIABLE)
    root = Path(explicit) if explicit else SHARED_HEADERS
    absent = [relative for relative in _REQUIRED_HEADERS if not (root / relative).is_file()]
    if absent:
        where = f"{HEADERS_VARIABLE}={explicit}" if explicit else f"{root} ({HEADERS_VARIABLE} unset)"
        return None, f"{where} has no {', '.join(absent)}"
    return root, None


def missing_tools() -> list[str]:
    """What the check lacks here, each with how to get it; empty when it can run."""
    missing = []
    if shutil.which(CLANG) is None:
        missing.append(f"{CLANG} is not on PATH (Debian: apt-get install clang-22; `make test` installs it)")
    _, problem = find_headers()
    if problem:
        missing.append(f"the aie_api and llvm-aie headers: {problem}; {HEADERS_HINT}")
    return missing


@dataclass(frozen=True, order=True)
class KernelVariant:
    source: str                           # a file name in the kernel folder
    defines: tuple[tuple[str, int], ...]  # the -D configuration its object is built with

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(f"-D{name}={value}" for name, value in self.defines)

    def __str__(self) -> str:
        return " ".join((self.source, *self.flags))


def kernel_variants(programs: Iterable[Program]) -> list[KernelVariant]:
    """Every (source, -D configuration) Peano builds for these Programs: the stitcher's object builds, less their
    symbol renames (``-D<symbol>=<symbol>_v<n>`` renames an extern "C" function and changes no type)."""
    return sorted({KernelVariant(build.source, build.defines)
                   for program in programs for build in stitch(program).objects})


@dataclass(frozen=True)
class VariantResult:
    variant: KernelVariant
    errors: str  # the compiler's diagnostics when it rejects the variant, else empty

    @property
    def accepted(self) -> bool:
        return not self.errors


# ---- the declarations written from BuiltinsAIE2P.def -------------------------------------------------------------
_BUILTIN = re.compile(r'^BUILTIN\((\w+),\s*"([^"]*)"', re.M)
# clang's builtin type letters (clang/include/clang/Basic/Builtins.def), plus llvm-aie's accumulator letters
_ELEMENTS = {"v": "void", "b": "bool", "c": "char", "s": "short", "i": "int", "f": "float", "d": "double",
             "y": "__bf16", "n": "__acc32", "e": "__acc48", "m": "__acc64", "g": "__accfloat"}
_ELEMENT_BYTES = {"char": 1, "short": 2, "int": 4, "float": 4, "double": 8, "__bf16": 2, "__acc32": 4, "__acc48": 8,
                  "__acc64": 8, "__accfloat": 4, "long long": 8}
# llvm-aie's own names for vectors of these (aiebase_typedefs.h: v16accfloat, v32bfloat16, ...)
_VECTOR_NAMES = {"__bf16": "bfloat16", "__accfloat": "accfloat", "float": "float", "__acc32": "acc32",
                 "__acc64": "acc64"}
_TYPE = re.compile(r"(?P<vector>V(?P<lanes>\d+))?(?P<modifiers>[USWLZI]*)(?P<element>[a-z])(?P<suffixes>[*&CD]*)")


def _spell_types(signature: str, named_vectors: set[str], typedefs: dict[str, str]) -> list[str]:
    """A builtin's type string as C types, result first; vectors by llvm-aie's names where it has one."""
    types = []
    for match in _TYPE.finditer(signature):
        element = "long long" if "W" in match["modifiers"] else _ELEMENTS[match["element"]]
        if match["vector"]:
            lanes = int(match["lanes"])
            name = f"v{lanes}{_VECTOR_NAMES.get(element, '')}"
            if name not in named_vectors or "U" in match["modifiers"]:
                name = f"__aie_check_v{lanes}_{element.replace(' ', '_')}"
                typedefs[name] = (f"typedef {element} {name} "
                                  f"__attribute__((__vector_size__({lanes * _ELEMENT_BYTES[element]})));")
            element = name
        elif "U" in match["modifiers"]:
            element = "unsigned " + element
        for suffix in match["suffixes"]:
            element = {"*": f"{element} *", "&": f"{element} &", "C": f"const {element}",
                       "D": f"volatile {element}"}[suffix]
        types.append(element)
    return types


def builtin_declarations(headers: Path) -> str:
    """Every ``__builtin_aie2p_*`` of BuiltinsAIE2P.def, and the PRECISE_INTRINSICS, as C++ declarations."""
    named_vectors = set(re.findall(r"\b(v\d+[a-z]\w*)\b",
                                   (headers / "llvm-aie/include/aiebase_typedefs.h").read_text()))
    typedefs: dict[str, str] = {}
    signatures = {name: _spell_types(types, named_vectors, typedefs)
                  for name, types in _BUILTIN.findall((headers / "llvm-aie/basic/BuiltinsAIE2P.def").read_text())}

    def declaration(name: str, builtin: str) -> str:
        if builtin not in signatures:
            raise ValueError(f"PRECISE_INTRINSICS: {name} names {builtin}, which BuiltinsAIE2P.def does not define")
        result, *arguments = signatures[builtin]
        return f"{result} {name}({', '.join(a for a in arguments if a != 'void')});"

    lines = ["// written by kernels/aie_source_check.py from llvm-aie's BuiltinsAIE2P.def", "#pragma once",
             *sorted(typedefs.values()),
             *(declaration(name, name) for name in signatures),
             *(declaration(name, builtin) for name, builtins in PRECISE_INTRINSICS.items() for builtin in builtins)]
    return "\n".join(lines) + "\n"


# ---- the check ---------------------------------------------------------------------------------------------------
class AieSourceChecker:
    """Runs the check; one per session (use as a context manager): it writes the declarations from the .def and a
    precompiled header of aie_api (per set of -D macros that aie_api or the stand-in reads) into a private folder."""

    def __init__(self, headers: Path | None = None):
        if headers is None:
            headers, problem = find_headers()
            if problem:
                raise FileNotFoundError(f"{problem}; {HEADERS_HINT}")
        self.headers = headers
        self._workdir = tempfile.TemporaryDirectory(prefix="torch_npu2-aie-check-")
        self.work = Path(self._workdir.name)
        (self.work / "aie2p_builtins.h").write_text(builtin_declarations(headers))
        self._precompiled: dict[tuple, tuple[Path, str]] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> AieSourceChecker:
        return self

    def __exit__(self, *exc) -> None:
        self._workdir.cleanup()

    @property
    def _flags(self) -> list[str]:
        return [*LANGUAGE_FLAGS, *TARGET_FLAGS, *QUIET_FLAGS, "-I", str(self.work), "-I", str(SHIM_DIR),
                "-I", str(self.headers / "llvm-aie/include"), "-I", str(self.headers / "aie_api/include")]

    @cached_property
    def _header_identifiers(self) -> frozenset[str]:
        """Every identifier in the headers a precompiled header holds: the macros that can change it."""
        files = [*(self.headers / "aie_api/include").rglob("*.hpp"), *(self.headers / "llvm-aie/include").rglob("*.h"),
                 *SHIM_DIR.rglob("*.h")]
        return frozenset(word for path in files for word in re.findall(r"\w+", path.read_text(errors="replace")))

    def _precompiled_header(self, defines: tuple[tuple[str, int], ...]) -> tuple[Path, str]:
        """aie_api parsed once behind the stand-in, with those of ``defines`` it reads (a GEMV_K does not change it, an
        AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16 does); and the compiler's diagnostics if that fails."""
        key = tuple((name, value) for name, value in defines if name in self._header_identifiers)
        with self._lock:
            if key not in self._precompiled:
                index = len(self._precompiled)
                source, output = self.work / f"aie_api_{index}.h", self.work / f"aie_api_{index}.pch"
                source.write_text('#include "aie2p_prelude.h"\n#include <aie_api/aie.hpp>\n')
                result = subprocess.run([CLANG, *self._flags, *(f"-D{name}={value}" for name, value in key),
                                         "-x", "c++-header", str(source), "-o", str(output)],
                                        capture_output=True, text=True)
                self._precompiled[key] = (output, "" if result.returncode == 0 else
                                          f"aie_api with {' '.join(f'-D{n}={v}' for n, v in key) or 'no -D macros'} "
                                          f"does not parse:\n{result.stderr}")
            return self._precompiled[key]

    def check(self, source: Path, defines: tuple[tuple[str, int], ...] = (),
              include_dirs: Iterable[Path] = ()) -> str:
        """The compiler's diagnostics for ``source`` compiled with ``defines`` (empty when it is accepted)."""
        own_macros = set()
        for path in (source, *(header for folder in include_dirs for header in folder.glob("*.h"))):
            own_macros |= set(re.findall(r"^\s*#\s*define\s+(\w+)", path.read_text(), re.M))
        if own_macros & self._header_identifiers:  # a macro the source defines could change aie_api: parse it anew
            prelude = ["-include", "aie2p_prelude.h"]
        else:
            precompiled, errors = self._precompiled_header(defines)
            if errors:
                return errors
            prelude = ["-include-pch", str(precompiled)]
        command = [CLANG, "-fsyntax-only", *self._flags, *prelude, *(f"-I{folder}" for folder in include_dirs),
                   *(f"-D{name}={value}" for name, value in defines), str(source)]
        result = subprocess.run(command, capture_output=True, text=True)
        return "" if result.returncode == 0 else (result.stderr or f"{CLANG} exited {result.returncode}")

    def check_variants(self, variants: Iterable[KernelVariant],
                       kernel_dir: Path = KERNEL_SOURCE_DIR) -> list[VariantResult]:
        """Each variant's source in ``kernel_dir`` checked with its -D configuration (two at a time)."""
        def one(variant: KernelVariant) -> VariantResult:
            source = kernel_dir / variant.source
            if not source.is_file():
                return VariantResult(variant, f"{source}: no such file")
            return VariantResult(variant, self.check(source, variant.defines, (kernel_dir,)))

        with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
            return list(pool.map(one, variants))
