"""Reading the builders' custom-form AIR text in tests: hierarchy ops with their bodies, DMAs, definitions."""
from dataclasses import dataclass

from torch_npu2.kernels.lint import regions
from torch_npu2.kernels.mlir_text import dma_copies, index_constants


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
    """Every air.launch/segment/herd in text order, each with the text of its region (the lint's parser)."""
    return [Hierarchy(r.op, r.name, r.depth, r.sizes, r.ids + r.size_args,
                      tuple((inner, outer) for inner, outer, _ in r.bindings), r.link_with, "\n".join(r.body))
            for r in regions(text)]


def herd_headers(text: str) -> list[tuple[str, tuple[int, ...], str | None]]:
    """(name, sizes, link_with) of every air.herd, sizes resolved through the index constants."""
    constants = index_constants(text)
    return [(h.name, tuple(constants[s] for s in h.sizes), h.link_with) for h in hierarchy(text) if h.op == "herd"]


def dma_endpoints(text: str) -> list[tuple[str, str]]:
    """(dst, src) SSA names of every air.dma_memcpy_nd, in text order."""
    return [(dma.dst.value, dma.src.value) for dma in dma_copies(text)]
