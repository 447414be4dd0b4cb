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


# Llama-3.2-1B's rms_gemv_rope over Q4_1 weights: its V projection (launch 1) moves each tile's 16-row panels of the
# 512 x 320-word weight in one shim BD of 20,480 words; the first starts at element 0.
PACKED_V_FIRST_BD = r"(aie\.dma_bd\(%arg\d+ : memref<512x320xi32>, )0, 20480"


def shift_first_packed_v_bd(monkeypatch, offset: int) -> None:
    """Makes the AIR pipeline's npu stage start the packed V projection's first weight BD at ``offset`` instead:
    a stand-in for a pass that misplaces a DMA (what this AIR's L2 split did before the DDR windows took the memtile
    buffers' rank)."""
    import re

    from torch_npu2.kernels import air_pipeline

    real = air_pipeline._air_opt

    def shifted(tc, name, stage, source, output, *rest):
        real(tc, name, stage, source, output, *rest)
        if stage == "npu":
            text, count = re.subn(PACKED_V_FIRST_BD, rf"\g<1>{offset}, 20480", output.read_text(), count=1)
            assert count == 1, "the packed V projection's first BD is not where the test expects it"
            output.write_text(text)

    monkeypatch.setattr(air_pipeline, "_air_opt", shifted)
