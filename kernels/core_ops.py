"""What one call of an AIE2P kernel executes on the core, counted from the kernel's own AIE path.

Each kernel's ``__AIENGINE__`` path is compiled by the host compiler against ``aie_count/aie_api/aie.hpp``, a
stand-in for the AIE API whose types hold no data and count the core instructions each operation issues (its
header says how), with ``float`` bound to a counting scalar (scalar float arithmetic is software-emulated on the
core). One entry point runs once, with the integer arguments the call gets: its loops, helpers and branches run as
the source writes them, so the counts follow the source and cannot drift from it.

``aie::mmul`` calls come back as uses (precision, shape, calls, distinct A and B operands); ``MMUL_INSTRUCTIONS``
expands them into what aie_api emits for one call (github:Xilinx/aie_api at dc3ab77, the headers
``../shared/toolchains/aie-headers/aie_api`` holds; tests/kernels/test_core_ops.py counts them in those headers).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from . import host_build
from .builders.externs import EXTERNAL_KERNELS, KERNEL_SYMBOLS, object_for_symbol

STAND_IN_DIR = Path(__file__).resolve().parent / "aie_count"
KINDS = ("load", "store", "mac", "vector", "move", "nonlinear", "scalar_float")
# Scalar arguments the counting run passes for pointers and floats: no vector touches memory, and the few scalar
# reads and writes of a kernel stay within this many elements.
SCRATCH_ELEMENTS = 1 << 16
# raw memory behind every other pointer: int8 operands, int32 accumulators, a call's packed weight rows (whose
# scales the kernel reads as scalars)
RAW_SCRATCH_BYTES = 1 << 20
BFP16_DEFINE = "AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16"


@dataclass(frozen=True)
class MmulUse:
    precision: str                  # "bf16" (exact), "bfp16" (emulated through BFP16), "int8", "int16x8" (A × B)
    shape: tuple[int, int, int]     # M, K, N of the aie::mmul aie_api runs
    calls: int
    a_operands: int                 # distinct A values among the calls
    b_operands: int

    @property
    def macs(self) -> int:
        return self.calls * self.shape[0] * self.shape[1] * self.shape[2]


@dataclass(frozen=True)
class CoreOps:
    """The instructions of one call, by kind (the stand-in's header defines the kinds), and its mmul uses."""
    counts: Mapping[str, int]
    mmul: tuple[MmulUse, ...] = ()


@dataclass(frozen=True)
class MmulInstructions:
    """What aie_api emits for one ``aie::mmul`` mac/mul on AIE2P: for the multiply itself, and for preparing an A
    and a B operand (the part a compiler may share between calls that take the same operand)."""
    per_call: Mapping[str, int]
    per_a: Mapping[str, int]
    per_b: Mapping[str, int]
    source: str


MMUL_INSTRUCTIONS = {
    ("bfp16", (8, 8, 8)): MmulInstructions(
        {"mac": 1}, {"vector": 3}, {"vector": 3, "mac": 1},
        "aie_api detail/aie2p/mmul_bf16_bf16.hpp, mmul_bf16_bf16<8, 8, 8> under "
        "AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16: one mac_8x8_8x8T_conf; A becomes an accumulator (two "
        "ups_to_v32accfloat) and then bfp16 (to_v64bfp16ebs8); B is transposed (two shuffles on AIE2P, "
        "detail/aie2/transpose.hpp), multiplied by ones (mul_elem_64) and converted (to_v64bfp16ebs8)"),
    ("int8", (8, 8, 8)): MmulInstructions(
        {"mac": 1}, {}, {},
        "aie_api detail/aie2p/mmul_8_8.hpp, mmul_8_8<8, 8, 8> at 32 bits: one mac_8x8_8x8_conf; A and B are one "
        "512-bit register each as loaded"),
    ("int16x8", (8, 4, 8)): MmulInstructions(
        {"mac": 1}, {}, {},
        "aie_api detail/aie2p/mmul_16_8.hpp, mmul_16_8<8, 4, 8> at 32 bits: one mac_8x4_4x8_conf; A is one 512-bit "
        "register, B (256 bits) grown to 512 (a register name)"),
}


def instructions(ops: CoreOps, share_operands: bool) -> dict[str, int]:
    """Every instruction of a call by kind, its mmul uses expanded; ``share_operands``: an operand's preparation
    counted once per distinct operand (calls on the same A or B share it), else once per call, as written."""
    total = dict(ops.counts)
    for use in ops.mmul:
        try:
            emitted = MMUL_INSTRUCTIONS[(use.precision, use.shape)]
        except KeyError:
            raise KeyError(f"no instruction count for a {use.precision} aie::mmul of shape {use.shape}: add it to "
                           f"core_ops.MMUL_INSTRUCTIONS from aie_api's AIE2P headers") from None
        a_times = use.a_operands if share_operands else use.calls
        b_times = use.b_operands if share_operands else use.calls
        for part, times in ((emitted.per_call, use.calls), (emitted.per_a, a_times), (emitted.per_b, b_times)):
            for kind, n in part.items():
                total[kind] += n * times
    return total


# ---- the entry points and their integer arguments --------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    name: str
    kind: str                       # "bf16 *", "float *", "int *" (any other pointer), "int" or "float"


_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def source_of(symbol: str) -> str:
    return object_for_symbol(symbol).source


@lru_cache(maxsize=None)
def entry_points(source: str) -> dict[str, tuple[Param, ...]]:
    """Each symbol of ``aie2p/<source>`` with its C parameters, from its definition (the symbols builders/externs.py
    lists for it, or, for a kernel no builder calls yet, every extern "C" function it defines)."""
    text = _COMMENT.sub("", (host_build.KERNEL_DIR / source).read_text())
    symbols = next((k.symbols for k in EXTERNAL_KERNELS if k.source == source), None) or \
        tuple(re.findall(r'extern "C" void (\w+)\(', text))
    found = {}
    for symbol in symbols:
        m = re.search(rf"\bvoid {symbol}\(([^)]*)\)\s*\{{", text)
        if m is None:
            raise ValueError(f"{source}: no definition of {symbol}")
        params = []
        for declaration in m.group(1).split(","):
            words = declaration.replace("*", " * ").split()
            base = "bf16" if {"bf16_t", "bfloat16"} & set(words) else "float" if "float" in words else "int"
            # any other pointer (int8_t *, int32_t *, a typedef'd element) is raw memory
            params.append(Param(words[-1], f"{base} *" if "*" in words else base))
        found[symbol] = tuple(params)
    return found


# Integer arguments that change what a call executes: their values in the cheapest and in the dearest call the
# builders make (each kernel symbol's record in builders/externs.py). A prediction charges the cheapest to its
# fast end, the dearest to its slow end.
WORK_ARGUMENTS = {name: entry.work_arguments for name, entry in KERNEL_SYMBOLS.items() if entry.work_arguments}


def _driver(source: str) -> str:
    lines = ['#include "aie_api/aie.hpp"', "#include <cstdlib>", "#include <cstring>",
             "#define float counted_float", f'#include "{source}"', "#undef float",
             f"static bfloat16 bf16_memory[{SCRATCH_ELEMENTS}];",
             f"static counted_float f32_memory[{SCRATCH_ELEMENTS}];",
             f"alignas(64) static unsigned char raw_memory[{RAW_SCRATCH_BYTES}];",
             "struct raw_pointer { template <typename T> operator T *() const { return reinterpret_cast<T *>(raw_memory); } };",
             "int main(int argc, char **argv) {", "  if (argc < 2) return 2;"]
    for symbol, params in entry_points(source).items():
        args, integers = [], 0
        for p in params:
            if p.kind == "int":
                args.append(f"argc > {2 + integers} ? std::atoi(argv[{2 + integers}]) : 0")
                integers += 1
            else:
                args.append({"bf16 *": "bf16_memory", "float *": "f32_memory", "float": "counted_float(1.0)",
                             "int *": "raw_pointer{}"}[p.kind])
        lines.append(f'  if (!std::strcmp(argv[1], "{symbol}")) {{ {symbol}({", ".join(args)}); '
                      "aie_count::report(); return 0; }")
    return "\n".join([*lines, "  return 2;", "}", ""])


def _counter(source: str, defines: tuple[tuple[str, int], ...]) -> Path:
    """The counting executable of ``aie2p/<source>`` built with ``defines`` (cached)."""
    driver = _driver(source)
    stand_in = STAND_IN_DIR / "aie_api" / "aie.hpp"
    path = host_build.cache_dir() / f"count-{Path(source).stem}-{hashlib.sha256(driver.encode()).hexdigest()[:16]}.cc"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(driver)
        os.replace(partial, path)
    arguments = ["-std=c++20", "-O0", "-D__AIENGINE__", "-I", str(STAND_IN_DIR), "-I", str(host_build.KERNEL_DIR),
                 *host_build.define_flags(dict(defines)), str(path)]
    inputs = [driver.encode(), stand_in.read_bytes(), host_build.sources_digest(host_build.KERNEL_DIR / source)]
    return host_build.cached_compile(f"count-{Path(source).stem}.bin", arguments, inputs)


@lru_cache(maxsize=None)
def count_call(symbol: str, defines: tuple[tuple[str, int], ...], integers: tuple[int, ...],
               source: str | None = None) -> CoreOps:
    """Run ``symbol``'s AIE path once, built with ``defines``, with these integer arguments in order (``source``:
    its file, for a kernel builders/externs.py does not list)."""
    source = source or source_of(symbol)
    result = subprocess.run([str(_counter(source, defines)), symbol, *map(str, integers)], capture_output=True,
                            text=True, check=True)
    data = json.loads(result.stdout)
    uses = tuple(MmulUse(u["precision"], tuple(u["shape"]), u["calls"], u["a_operands"], u["b_operands"])
                 for u in data["mmul"])
    return CoreOps({kind: data[kind] for kind in KINDS}, uses)


def call_ops(symbol: str, defines: Mapping[str, int], known: Mapping[str, int]) -> tuple[CoreOps, CoreOps]:
    """(cheapest, dearest) of one call: integer arguments from ``known`` (by parameter name), else the bounds of
    ``WORK_ARGUMENTS``, else 0 (an argument that does not change the work)."""
    frozen = tuple(sorted(defines.items()))
    bounds = WORK_ARGUMENTS.get(symbol, lambda _: ({}, {}))(dict(defines))
    names = [p.name for p in entry_points(source_of(symbol))[symbol] if p.kind == "int"]
    return tuple(count_call(symbol, frozen, tuple(known.get(n, bound.get(n, 0)) for n in names)) for bound in bounds)
