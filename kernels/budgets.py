"""Each compute tile's data memory (L1), checked when a Program is built: the tile's buffers, the core's stack
and a stated headroom must fit its 64 KiB.

What the NPU2 toolchain does with a tile's L1 (mlir-aie c668d2cb, the AIE tools built here): the core's stack
starts at address 0 (``stack_size`` of ``aie.core``, 0x400 unless set; aircc sets it from ``--stack-size``);
``aie-assign-buffer-addresses`` places the tile's buffers in its four 16 KiB banks, or in one run above the
stack when a buffer is larger than a bank; the linker gives the kernels' static data what is left above the
highest buffer. It does not always refuse what does not fit: with a stack larger than a bank it leaves buffers
over the stack and reports success (measured here: aiecc with a 61,440 B stack exits 0). So this module refuses,
with the Program, the tile, each buffer, the stack and the limit, a tile whose used bytes plus ``L1_HEADROOM``
exceed the device's L1 (``DEVICE.l1_bytes``), whose buffers overlap the stack or each other, or, placed, whose
buffers aiecc put off the boundary a vector load needs (``TileL1.misaligned``: the core would read from below the
buffer, a wrong answer rather than a failed build). The builders keep every L1 buffer whole runs of
``DEVICE.vector_align_bytes`` (builders/ir.py, ``LaunchBuilder.alloc``) above a stack of whole runs
(``CompileOptions``), so the placed check is the proof that aiecc kept them there.

Two counts of the same thing:

* ``program_l1``: per launch, one herd tile's buffers as its builder planned them (``LaunchIR.l1_buffers``,
  AIR's ping-pong copies counted, so an upper bound where a Program omits ping-pong) above the Program's
  ``CompileOptions.stack_size``. It needs no compiler: the emulator's and the NPU2 target's builds check it
  (``check_program_l1``), and the lint reports it.
* ``lowered_l1``: per compute tile of a lowered segment device, the buffers at the addresses aiecc assigned
  (its ``--dump-intermediates`` module) and the stack its core carries: what ``air_pipeline.lower_to_npu_insts``
  checks. tests/kernels/test_air_pipeline.py holds the first count to the second for every Program.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .builders import build_launch
from .builders.ir import ELEMENT_BYTES
from .mlir_text import index_constants
from .builders.npu2 import L1_AVAILABLE, L1_HEADROOM, STACK_BYTES, BudgetExceeded
from .device import DEVICE
from .program import Program

AIE_CORE_DEFAULT_STACK = 0x400  # aie.core's stack_size when the attribute is absent (mlir-aie AIEOps.td)
# aie-assign-buffer-addresses packs a bank's buffers end to end without aligning them (mlir-aie's basic_alloc_simple
# test: a 32-byte buffer at 3072, the next at 3104), so a buffer whose size is not a multiple of this shifts every
# buffer after it off the boundary the widest vector load needs.
VECTOR_LOAD_ALIGN = DEVICE.vector_align_bytes


@dataclass(frozen=True)
class TileL1:
    """One compute tile's data memory: its buffers (name, bytes) and stack, and ``used``, the bytes from address
    0 to the end of the highest of them (planned: the stack then every buffer in one run)."""

    program: str
    launch: int
    kind: str
    tile: str
    buffers: tuple[tuple[str, int], ...]
    stack: int
    used: int
    overlaps: tuple[str, ...] = ()  # buffers placed over the stack or over each other
    misaligned: tuple[str, ...] = ()  # buffers aiecc placed off a VECTOR_LOAD_ALIGN boundary (at address)

    @property
    def buffer_bytes(self) -> int:
        return sum(size for _, size in self.buffers)

    @property
    def total(self) -> int:
        return self.used + L1_HEADROOM

    @property
    def fits(self) -> bool:
        return self.total <= DEVICE.l1_bytes and not self.overlaps and not self.misaligned

    @property
    def only_misaligned(self) -> bool:
        """Within L1 with nothing overlapping, but a buffer off the boundary: padding fixes it, not fewer bytes."""
        return bool(self.misaligned) and self.total <= DEVICE.l1_bytes and not self.overlaps

    def __str__(self) -> str:
        items = ", ".join(f"{name} {size:,} B" for name, size in self.buffers)
        placed = f"; used up to {self.used:,} B" if self.used != self.stack + self.buffer_bytes else ""
        overlaps = f"; overlapping: {', '.join(self.overlaps)}" if self.overlaps else ""
        misaligned = (f"; off a {VECTOR_LOAD_ALIGN}-byte boundary, where a vector load from its start reads from below "
                      f"it: {', '.join(self.misaligned)}" if self.misaligned else "")
        return (f"{self.program}, launch {self.launch} ({self.kind}), {self.tile}: buffers {self.buffer_bytes:,} B "
                f"({items}) + stack {self.stack:,} B{placed} + headroom {L1_HEADROOM:,} B = {self.total:,} B of "
                f"{DEVICE.l1_bytes:,} B{overlaps}{misaligned}")


class L1BudgetError(ValueError):
    """A Program whose compute tile does not fit its L1, or has a buffer placed where a vector load cannot read it;
    ``tile`` is that tile's :class:`TileL1`."""

    def __init__(self, tile: TileL1, cause: str = ""):
        self.tile = tile
        if tile.only_misaligned:
            super().__init__(f"{tile.program} places a core's L1 buffer off a vector load's boundary: {tile}; pad "
                             f"the buffers before it to whole {VECTOR_LOAD_ALIGN}-byte runs")
            return
        super().__init__(f"{tile.program} does not fit a core's L1: {tile}"
                         + (f" ({cause})" if cause else "")
                         + "; lower the launch's tiles or the Program's CompileOptions.stack_size")


def worst_tile(tiles) -> TileL1:
    """The tile with the most bytes used, a tile that does not fit first."""
    return max(tiles, key=lambda t: (not t.fits, t.total))


def check_fits(tiles) -> tuple[TileL1, ...]:
    """``tiles``, or an :class:`L1BudgetError` naming the worst tile when one does not fit."""
    tiles = tuple(tiles)
    if not all(t.fits for t in tiles):
        raise L1BudgetError(worst_tile(tiles))
    return tiles


_HERD = re.compile(r"air\.herd @(\w+) tile \([^)]*\) in \(([^)]*)\)")


def _herd_tile(text: str) -> str:
    """'each tile of herd @<name> (<columns>x<rows>)' for a launch's text (its herds share one name)."""
    herd = _HERD.search(text)
    constants = index_constants(text)
    sizes = "x".join(str(constants[size.split("=")[1].strip()]) for size in herd.group(2).split(","))
    return f"each tile of herd @{herd.group(1)} ({sizes})"


def program_l1(program: Program) -> tuple[TileL1, ...]:
    """One tile per launch as its builder plans it, under the Program's stack. A launch whose builder finds no
    plan within its L1 budget raises :class:`L1BudgetError`; any other builder refusal (a shape NPU2 cannot
    build) propagates as the builder's LaunchConstraintError."""
    stack = program.compile_options.stack_size
    tiles = []
    for index, launch in enumerate(program.launches):
        try:
            ir = build_launch(program, launch)
        except BudgetExceeded as exc:
            if exc.level != "L1":
                raise
            buffers = tuple(exc.buffers.items())
            planned = TileL1(program.name, index, launch.kind, "each tile of its herd", buffers, stack,
                             stack + sum(exc.buffers.values()))
            raise L1BudgetError(planned, f"its builder plans a tile within {L1_AVAILABLE:,} B: L1 less the "
                                         f"{STACK_BYTES:,} B default stack and the headroom") from exc
        tiles.append(TileL1(program.name, index, launch.kind, _herd_tile(ir.text), ir.l1_buffers, stack,
                            stack + sum(size for _, size in ir.l1_buffers)))
    return tuple(tiles)


def check_program_l1(program: Program) -> tuple[TileL1, ...]:
    """:func:`program_l1`, refusing a Program with a tile that does not fit."""
    return check_fits(program_l1(program))


# ---- the lowered count: what aiecc placed -----------------------------------------------------------------------
_CORE = re.compile(r"^    %\w+ = aie\.core\(%tile_(\d+)_(\d+)\) \{$")
_CORE_END = re.compile(r"^    \}(?: \{(.*)\})?$")
_STACK_SIZE = re.compile(r"\bstack_size = (\d+) : i32")
_BUFFER = re.compile(r"aie\.buffer\(%tile_(\d+)_(\d+)\) \{([^}]*)\} : memref<([\dx]*?)x?([a-z]+\d+)(?:, [^>]*)?>")
_ADDRESS = re.compile(r"\baddress = (\d+) : i32")
_SYM_NAME = re.compile(r'\bsym_name = "([^"]+)"')


def core_stacks(device: str) -> dict[tuple[int, int], int]:
    """The stack of every core of an ``aie.device`` body, by (column, row)."""
    stacks, core = {}, None
    for line in device.splitlines():
        opened = _CORE.match(line)
        if opened:
            core = (int(opened.group(1)), int(opened.group(2)))
            continue
        closed = _CORE_END.match(line) if core else None
        if closed:
            found = _STACK_SIZE.search(closed.group(1) or "")
            stacks[core] = int(found.group(1)) if found else AIE_CORE_DEFAULT_STACK
            core = None
    return stacks


def _overlaps(stack: int, placed: list[tuple[str, int, int]]) -> tuple[str, ...]:
    """Buffers (name, address, bytes) that start inside the stack or inside the buffer below them."""
    found, end, below = [], stack, "the stack"
    for name, address, size in sorted(placed, key=lambda b: b[1]):
        if address < end:
            found.append(f"{name} at {address} under {below} (ends at {end})")
        if address + size > end:
            end, below = address + size, name
    return tuple(found)


def lowered_l1(program: str, launch: int, kind: str, device_name: str, device: str) -> tuple[TileL1, ...]:
    """Every compute tile of one segment device whose buffers carry the addresses aiecc assigned."""
    stacks = core_stacks(device)
    placed: dict[tuple[int, int], list[tuple[str, int, int]]] = {tile: [] for tile in stacks}
    for column, row, attributes, shape, dtype in _BUFFER.findall(device):
        tile = (int(column), int(row))
        if tile not in placed:
            continue  # a memtile's buffer
        size = ELEMENT_BYTES[dtype]
        for extent in filter(None, shape.split("x")):
            size *= int(extent)
        address = _ADDRESS.search(attributes)
        if address is None:
            raise ValueError(f"{program}: buffer {attributes} of tile {tile} in @{device_name} has no address; "
                             f"pass a module after aie-assign-buffer-addresses")
        placed[tile].append((_SYM_NAME.search(attributes).group(1), int(address.group(1)), size))
    return tuple(
        TileL1(program, launch, kind, f"tile ({column}, {row}) of device @{device_name}",
               tuple((name, size) for name, _, size in sorted(buffers, key=lambda b: b[1])), stacks[(column, row)],
               max([stacks[(column, row)], *(address + size for _, address, size in buffers)]),
               _overlaps(stacks[(column, row)], buffers),
               tuple(f"{name} at {address}" for name, address, _ in sorted(buffers, key=lambda b: b[1])
                     if address % VECTOR_LOAD_ALIGN))
        for (column, row), buffers in sorted(placed.items()))
