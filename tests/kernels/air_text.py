"""Reading the builders' custom-form AIR text in tests: hierarchy ops with their bodies, DMAs, definitions."""
import re
from dataclasses import dataclass

_HEADER = re.compile(r"^(?P<indent> *)air\.(?P<op>launch|segment|herd) @(?P<name>\w+)(?: tile)?"
                     r"(?: \((?P<ids>[^)]*)\) in \((?P<sizes>[^)]*)\))?"
                     r"(?: args\((?P<args>[^)]*)\) : (?P<types>.*?))?"
                     r'(?: attributes \{link_with = "(?P<link>[^"]*)"\})? \{$', re.M)
_CONSTANT = re.compile(r"(%[\w$.]+) = arith\.constant (-?\d+) : index")
_DMA = re.compile(r"air\.dma_memcpy_nd \((%[\w$.]+)\[[^\]]*\] \[[^\]]*\] \[[^\]]*\], (%[\w$.]+)\[")


@dataclass(frozen=True)
class Hierarchy:
    op: str                 # launch, segment or herd
    name: str
    depth: int              # indentation, in the emitted two-space steps
    sizes: tuple[str, ...]  # SSA names of the iteration sizes
    ids: tuple[str, ...]    # block arguments: ids then sizes
    bindings: tuple[tuple[str, str], ...]  # (block argument, operand) pairs
    link_with: str | None
    body: str


def hierarchy(text: str) -> list[Hierarchy]:
    """Every air.launch/segment/herd in text order, each with the text of its region."""
    ops = []
    lines = text.splitlines()
    for number, line in enumerate(lines):
        match = _HEADER.match(line)
        if not match:
            continue
        closing = match.group("indent") + "}"
        end = next(i for i in range(number + 1, len(lines)) if lines[i] == closing)
        pairs = re.findall(r"(%[\w$.]+)=(%[\w$.]+)", match.group("args") or "")
        sized = re.findall(r"(%[\w$.]+)=(%[\w$.]+)", match.group("sizes") or "")
        ops.append(Hierarchy(match.group("op"), match.group("name"), len(match.group("indent")) // 2,
                             tuple(size for _, size in sized),
                             tuple(re.findall(r"%[\w$.]+", match.group("ids") or "")) + tuple(e for e, _ in sized),
                             tuple(pairs), match.group("link"), "\n".join(lines[number + 1:end])))
    return ops


def index_constants(text: str) -> dict[str, int]:
    return {name: int(value) for name, value in _CONSTANT.findall(text)}


def herd_headers(text: str) -> list[tuple[str, tuple[int, ...], str | None]]:
    """(name, sizes, link_with) of every air.herd, sizes resolved through the index constants."""
    constants = index_constants(text)
    return [(h.name, tuple(constants[s] for s in h.sizes), h.link_with) for h in hierarchy(text) if h.op == "herd"]


def dma_endpoints(text: str) -> list[tuple[str, str]]:
    """(dst, src) SSA names of every air.dma_memcpy_nd, in text order."""
    return _DMA.findall(text)
