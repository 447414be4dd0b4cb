"""Reading printed MLIR: the builders' custom-form AIR and air-opt's print of it.

One grammar for what the interpreter, the lint, the lowering pipeline's window read-back, the budgets and the
timing model all read: memref types, index constants, ``air.dma_memcpy_nd`` operands, top-level splitting, and
the op tree (one op per line, regions opened by a trailing ``{``) the interpreter walks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

SSA = r"%[\w$.-]+"
SSA_VALUE = re.compile(SSA)
# memref<…> whose layout may hold one level of <…> (strided<[…], offset: …>)
_MEMREF = re.compile(r"memref<([^<>]*(?:<[^<>]*>[^<>]*)*)>")
_CONSTANT = re.compile(rf"({SSA}) = arith\.constant (-?\d+) : (index|i32)\b")
_DMA_SIDE = rf"({SSA})\[([^\]]*)\] \[([^\]]*)\] \[([^\]]*)\]"
_DMA = re.compile(rf"air\.dma_memcpy_nd (?:async (?:\[[^\]]*\] )?)?\({_DMA_SIDE}, {_DMA_SIDE}\)(?: \{{[^}}]*\}})?"
                  rf"(?: : \((.*)\))?$")
_OP_LINE = re.compile(rf"^((?:{SSA}(?:, )?)+) = ([\w.]+)(.*)$|^([\w.]+)(.*)$")
_ALIAS = re.compile(r"^(#\w+) = (affine_map<.*>)$")


class MlirTextError(ValueError):
    """Text this reader does not understand."""


@dataclass(frozen=True)
class MemRefType:
    shape: tuple[int, ...]
    dtype: str
    space: int  # AIR memory space: 0 DDR (L3, when the type names none), 1 memtile (L2), 2 compute tile (L1)


def _memref(body: str) -> MemRefType:
    parts = split_top(body)
    dims = parts[0].split("x")
    space = 0
    for part in parts[1:]:
        if part.endswith(": i32"):
            space = int(part.split(":")[0])
    try:
        return MemRefType(tuple(int(d) for d in dims[:-1]), dims[-1], space)
    except ValueError:
        raise MlirTextError(f"not a static memref type: memref<{body}>") from None


def memref_types(text: str) -> list[MemRefType]:
    """Every memref type in ``text``, in order."""
    return [_memref(body) for body in _MEMREF.findall(text)]


def parse_memref_type(text: str) -> MemRefType:
    """The first memref type in ``text``."""
    match = _MEMREF.search(text)
    if not match:
        raise MlirTextError(f"not a memref type: {text}")
    return _memref(match.group(1))


def split_top(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside brackets, each part stripped; empty text gives no parts."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def constant(line: str) -> tuple[str, int] | None:
    """(name, value) when ``line`` defines an index or i32 ``arith.constant``."""
    match = _CONSTANT.search(line)
    return (match.group(1), int(match.group(2))) if match else None


def index_constants(text: str, distinct: bool = False) -> dict[str, int]:
    """Every ``arith.constant … : index`` of ``text`` by name. ``distinct``: refuse a name bound to two values
    (air-opt's print of several functions may reuse names; a read that resolves by name must not guess)."""
    found: dict[str, int] = {}
    for name, value, kind in _CONSTANT.findall(text):
        if kind != "index":
            continue
        if distinct and found.setdefault(name, int(value)) != int(value):
            raise MlirTextError(f"{name} names two different index constants")
        found[name] = int(value)
    return found


@dataclass(frozen=True)
class DmaSide:
    value: str                 # the memref's SSA name
    offsets: tuple[str, ...]   # SSA names; empty: the whole buffer
    sizes: tuple[str, ...]
    strides: tuple[str, ...]


@dataclass(frozen=True)
class DmaCopy:
    dst: DmaSide
    src: DmaSide
    types: tuple[MemRefType, ...]  # (dst, src) when the op prints its types, else empty
    text: str


def parse_dma(line: str) -> DmaCopy | None:
    """The operands of an ``air.dma_memcpy_nd`` line (custom form, with or without an async token), or None."""
    match = _DMA.search(line.strip())
    if not match:
        return None
    dst, src = (DmaSide(match.group(first), *(tuple(split_top(match.group(first + k))) for k in (1, 2, 3)))
                for first in (1, 5))
    return DmaCopy(dst, src, tuple(memref_types(match.group(9) or "")), match.group(0))


def dma_copies(text: str) -> list[DmaCopy]:
    """Every ``air.dma_memcpy_nd`` of ``text``, in text order."""
    return [dma for line in text.splitlines() if "air.dma_memcpy_nd" in line and (dma := parse_dma(line))]


@dataclass
class Op:
    """One op line of the printed module and the regions it opens."""

    line_number: int
    text: str
    results: tuple[str, ...]
    name: str
    body: str  # the text after the op name
    regions: list[list["Op"]] = field(default_factory=list)

    def where(self) -> str:
        return f"line {self.line_number}: {self.text.strip()[:200]}"


def parse_op(line: str, line_number: int = 0) -> Op:
    """One stripped op line (its regions, if it opens any, are left empty)."""
    match = _OP_LINE.match(line)
    if not match:
        raise MlirTextError(f"line {line_number}: cannot read {line!r}")
    if match.group(1):
        results = tuple(r.strip() for r in match.group(1).split(","))
        return Op(line_number, line, results, match.group(2), match.group(3))
    return Op(line_number, line, (), match.group(4), match.group(5))


def parse_module(text: str) -> tuple[dict[str, str], list[Op]]:
    """(affine map aliases, top-level ops) of a printed module."""
    aliases, roots = {}, []
    stack: list[list[Op]] = [roots]
    open_ops: list[Op] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("//"):
            continue
        alias = _ALIAS.match(line)
        if alias:
            aliases[alias.group(1)] = alias.group(2)
            continue
        if line == "}":
            stack.pop()
            open_ops.pop()
            continue
        if line == "} else {":
            stack.pop()
            open_ops[-1].regions.append([])
            stack.append(open_ops[-1].regions[-1])
            continue
        op = parse_op(line, number)
        stack[-1].append(op)
        if line.endswith("{"):
            op.regions.append([])
            stack.append(op.regions[-1])
            open_ops.append(op)
    if len(stack) != 1:
        raise MlirTextError("unbalanced regions in the module text")
    return aliases, roots
