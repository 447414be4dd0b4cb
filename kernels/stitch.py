"""Stitching: a Program's launches become one module with one ``func.func @<program.name>``, the ELF's ABI.

The function's arguments are exactly the Program's arguments, in order, typed from shape and dtype and
named after them. Each launch's builder output is spliced in with:

* its operands (``%operand<i>``: the launch's reads then writes) remapped to those function arguments;
* every other SSA value prefixed ``l<launch index>_``, and so are its hierarchy symbols (the
  ``@name`` of each ``air.launch``/``air.segment``/``air.herd``), so nothing collides across launches;
* its external kernel declarations merged module-wide. A kernel's tile sizes are compile-time macros, so
  each distinct ``-D`` configuration of one kernel object is its own build; and one C symbol can have only
  one declaration, so every configuration after the first is a variant: its symbols get a ``_v<n>``
  suffix, its herds link ``<object stem>_v<n>.o``, and the compile pipeline builds that object from the
  same source with the configuration plus ``-D<symbol>=<symbol>_v<n>`` (``StitchedModule.objects``).
  Launches with the same configuration (the K and V projections, say) share one build.
"""
from __future__ import annotations

import itertools

import re
from dataclasses import dataclass

from .builders import KERNEL_OBJECTS, build_launch
from .builders.ir import OPERAND_PREFIX, Dma, MemRef, extern_declaration
from .program import Program

LAUNCH_PREFIX = "l{index}_"
_ARG_NAME = re.compile(r"[A-Za-z_]\w*")
_RESERVED_ARG_NAME = re.compile(r"l\d+_")
# link_with strings are renamed; any other string literal is skipped; %values and @symbols renamed.
_TOKEN = re.compile(r'\blink_with = "([^"]*)"|"(?:[^"\\]|\\.)*"|([%@])([A-Za-z_][\w$.]*)')


@dataclass(frozen=True)
class ObjectBuild:
    """One kernel object the module links: file name, C++ source, ``-D`` configuration and symbol renames."""

    object: str
    source: str
    defines: tuple[tuple[str, int], ...]
    renames: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class StitchedModule:
    program_name: str
    objects: tuple[ObjectBuild, ...]
    dmas: tuple[Dma, ...]  # every launch's DMAs, in text order
    # the text split at the launches: everything before the first launch's body, each body, everything after
    prologue: str
    launch_texts: tuple[str, ...]
    epilogue: str

    @property
    def text(self) -> str:
        return self.prologue + "".join(self.launch_texts) + self.epilogue

    def launch_module(self, index: int) -> str:
        """The module with launch ``index`` only: the same declarations and function signature (air-opt places a
        launch alone in it, kernels/air_pipeline.py)."""
        return self.prologue + self.launch_texts[index] + self.epilogue


class _KernelVariants:
    """One build per (kernel object, -D configuration), numbered in order of first use; a second build of the same
    configuration when launches call one of its symbols with different memref types (a declaration has one)."""

    def __init__(self):
        # (object, defines, copy) → symbol: arg types
        self._builds: dict[tuple[str, tuple, int], dict[str, tuple[str, ...]]] = {}

    def _number(self, key: tuple[str, tuple, int]) -> int:
        return [k for k in self._builds if k[0] == key[0]].index(key)

    def _build_for(self, obj: str, decls) -> tuple[str, tuple, int]:
        if len({decl.defines for decl in decls}) > 1:
            raise ValueError(f"a launch links two configurations of {obj}")
        defines = decls[0].defines
        for copy in itertools.count():
            declared = self._builds.setdefault((obj, defines, copy), {})
            if all(declared.get(decl.symbol, decl.arg_types) == decl.arg_types for decl in decls):
                for decl in decls:
                    declared[decl.symbol] = decl.arg_types
                return obj, defines, copy

    def assign(self, externs) -> tuple[dict[str, str], dict[str, str]]:
        """Returns (symbol renames, object renames) for one launch's external calls."""
        symbols, objects = {}, {}
        by_object: dict[str, list] = {}
        for decl in externs:
            by_object.setdefault(decl.object, []).append(decl)
        for obj, decls in by_object.items():
            suffix = _suffix(self._number(self._build_for(obj, decls)))
            objects[obj] = _variant_object(obj, suffix)
            for decl in decls:
                symbols[decl.symbol] = decl.symbol + suffix
        return symbols, objects

    def declarations(self) -> list[str]:
        return [extern_declaration(symbol + suffix, types, _variant_object(key[0], suffix))
                for key, declared in self._builds.items()
                for suffix in [_suffix(self._number(key))]
                for symbol, types in declared.items()]

    def object_builds(self) -> tuple[ObjectBuild, ...]:
        builds = []
        for key in self._builds:
            obj, defines, _ = key
            kernel = KERNEL_OBJECTS[obj]
            suffix = _suffix(self._number(key))
            renames = tuple((s, s + suffix) for s in kernel.symbols) if suffix else ()
            builds.append(ObjectBuild(_variant_object(obj, suffix), kernel.source, defines, renames))
        return tuple(builds)


def _suffix(variant_number: int) -> str:
    return "" if variant_number == 0 else f"_v{variant_number + 1}"


def _variant_object(obj: str, suffix: str) -> str:
    stem = obj[:-2] if obj.endswith(".o") else obj
    return f"{stem}{suffix}.o"


def _check_arg_names(program: Program) -> None:
    for arg in program.args:
        if not _ARG_NAME.fullmatch(arg.name) or _RESERVED_ARG_NAME.match(arg.name):
            raise ValueError(f"Program {program.name}: argument name {arg.name!r} cannot be an SSA name here "
                             f"(needs [A-Za-z_][A-Za-z0-9_]* and no 'l<digits>_' prefix, which launches use)")


def _rename(text: str, prefix: str, operand_args: list[str], symbols: dict[str, str], objects: dict[str, str]) -> str:
    """Operands → function arguments, external kernel symbols → their variant, every other value and
    symbol (the hierarchy's ``@names``) → prefixed."""
    def replace(match: re.Match) -> str:
        linked, sigil, name = match.groups()
        if linked is not None:
            return f'link_with = "{objects[linked]}"'
        if sigil is None:
            return match.group(0)
        if sigil == "@":
            return "@" + symbols.get(name, prefix + name)
        if name.startswith(OPERAND_PREFIX) and name[len(OPERAND_PREFIX):].isdigit():
            return "%" + operand_args[int(name[len(OPERAND_PREFIX):])]
        return f"%{prefix}{name}"

    return _TOKEN.sub(replace, text)


def _describe(index: int, launch) -> str:
    params = ", ".join(f"{k}={v}" for k, v in launch.params)
    return (f"launch {index}: {launch.kind}({params}) reads {', '.join(launch.reads)}; "
            f"writes {', '.join(launch.writes)}")


def stitch(program: Program, tuning: dict[int, dict] | None = None) -> StitchedModule:
    """The Program as one MLIR module; ``tuning`` maps a launch index to its builder's tuning overrides."""
    _check_arg_names(program)
    tuning = tuning or {}
    unknown = sorted(set(tuning) - set(range(len(program.launches))))
    if unknown:
        raise ValueError(f"Program {program.name}: tuning for launch index(es) {unknown}, but it has launches "
                         f"0..{len(program.launches) - 1}")
    variants = _KernelVariants()
    bodies, dmas = [], []
    for index, launch in enumerate(program.launches):
        ir = build_launch(program, launch, tuning.get(index))
        dmas += ir.dmas
        symbols, objects = variants.assign(ir.externs)
        prefix = LAUNCH_PREFIX.format(index=index)
        operands = [view.arena if (view := program.view(n)) else n for n in launch.reads + launch.writes]
        text = _rename(ir.text, prefix, operands, symbols, objects)
        bodies.append((_describe(index, launch), text))

    arg_types = [MemRef(tuple(a.shape), a.dtype) for a in program.args]
    lines = [f"// torch_npu2 program {program.name}: func.func arguments in ELF order (run.set_arg index)"]
    lines += [f"//   arg {i}: {a.name} ({a.role.value}) {t}" for i, (a, t) in enumerate(zip(program.args, arg_types))]
    lines.append("module {")
    lines += ["  " + d for d in variants.declarations()]
    signature = ", ".join(f"%{a.name}: {t}" for a, t in zip(program.args, arg_types))
    lines.append(f"  func.func @{program.name}({signature}) {{")
    launch_texts = tuple("\n".join([f"    // {description}", *("    " + line for line in text.splitlines())]) + "\n"
                         for description, text in bodies)
    prologue, epilogue = "\n".join(lines) + "\n", "\n".join(["    return", "  }", "}", ""])
    return StitchedModule(program.name, variants.object_builds(), tuple(dmas), prologue, launch_texts, epilogue)


def emit_mlir(program: Program) -> str:
    return stitch(program).text


def npu2_build_problem(program: Program) -> str | None:
    """Why ``program`` cannot be built for NPU2 (the builder constraint it breaks), or None when it can."""
    try:
        stitch(program)
    except ValueError as exc:  # LaunchConstraintError and unknown launch kinds or argument names
        return str(exc)
    return None
