"""A lint for IR that aircc lowers slowly or riskily: rules with stable ids, each finding naming the Program,
the launch and what to do.

Static rules read each launch's builder output (custom-form MLIR-AIR text, as ``builders/ir.py`` emits it)
and the Program's compile options; they need no compiler:

* ``gemm-scalar-compute``: loop-lowered compute (``linalg.matmul``, ``linalg.generic``, scalar float
  arithmetic …) inside a herd of a GEMM-class launch. aircc's ``convert-linalg-to-loops`` turns it into
  scalar code (≈ 0.02–0.1 MAC/cycle against ≈ 47 for a vectorized kernel); the work must be a
  ``func.call`` into an AIE2P kernel.
* ``launch-id-in-core``: a scalar herd operand derived from ``air.launch`` ids (through segment
  arguments, ``affine.apply``, ``arith``) that core code uses beyond DMA offsets. aircc turns it into a
  host-written runtime parameter per launch step (``__air_herd_rtp_*``): a stale-value risk on silicon.
* ``dma-wrap``: a DMA access pattern the BD hardware cannot express, after AIR's canonicalization (unit
  dimensions dropped, contiguous dimensions merged).
* ``shim-bd-budget``: the shim BDs one batch of launch steps needs, after aircc tiles the launch nest by
  ``runtime_loop_tiling_sizes`` (``air-opt-shim-dma-bds``: each launch dimension tiled by its largest
  factor ≤ the tiling size, the outer loops unrolled, the inner tile folded into each shim BD).
* ``l1-budget``: a compute tile whose buffers, stack and headroom exceed its L1 (kernels/budgets.py, the
  check every build makes); :func:`worst_l1_tile` is each Program's fullest tile, which the CLI prints.

Rules on the lowered module (``lint_lowered``, from the npu-stage module of ``air_pipeline``: what
placement actually did) check the same risks exactly, plus the DMA channel budgets that only placement
decides: ``shim-channels``, ``memtile-channels``; ``shim-bd-bounds``, a runtime-sequence BD that walks past the
argument it moves (it checks the argument's bounds, not the memtile buffer the BD fills); and ``dma-wrap``,
``shim-bd-budget``, ``launch-id-in-core``, ``l1-budget`` on the real BDs, live BD IDs, runtime parameters and buffer
addresses.

NPU2 numbers, from mlir-aie's AIE2 target model and verifiers (``AIETargetModel.h``/``.cpp``,
``AIEDialect.cpp`` ``DMABDOp::verify``, ``AIEXDialect.cpp`` ``verifyStridesWraps``):
16 BDs per shim tile and per compute tile, 48 per memtile; 2 MM2S + 2 S2MM channels per shim tile
(8 shim columns: 16 of each in the array), 6 + 6 per memtile. A tile or memtile ``aie.dma_bd`` takes at most
3 (tile) or 4 (memtile) dimensions, each of size ≤ 512 elements (the verifier tests ``size >= 513`` while its
message says "Size may not exceed 1023"; the aie-opt built here rejects 513) and stride < 2^19 elements. A
shim BD of the runtime sequence takes 3 dimensions plus an iteration: the innermost size in 32-bit words and
the next size ≤ 1023, the iteration ≤ 64, strides ≤ 2^20 words.
"""
from __future__ import annotations

import math
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .budgets import L1BudgetError, TileL1, program_l1, worst_tile
from .builders import BUILDERS, build_launch
from .builders.ir import ELEMENT_BYTES, L1, L2, L3
from .device import DEVICE
from .mlir_text import SSA_VALUE, index_constants, parse_dma, parse_memref_type, split_top
from .program import Program

RULES = {
    "gemm-scalar-compute": "loop-lowered compute inside a herd of a GEMM-class launch (goes scalar)",
    "launch-id-in-core": "a launch-id-derived scalar reaches core code (a host-written runtime parameter)",
    "dma-wrap": "a DMA dimension, stride or dimension count beyond what a BD can express",
    "shim-bd-budget": "more shim BDs live at once than a shim tile has",
    "shim-channels": "more shim DMA channels than a shim tile ({0}+{0}) or the array ({1}+{1}) has".format(
        DEVICE.shim_channels_per_direction, DEVICE.shim_channels_per_direction * DEVICE.columns),
    "memtile-channels": f"more DMA channels than a memtile ({DEVICE.memtile_channels_per_direction} MM2S + "
                        f"{DEVICE.memtile_channels_per_direction} S2MM) has",
    "l1-budget": f"a compute tile's buffers, stack and headroom over its {DEVICE.l1_bytes // 1024} KiB of data memory "
                 f"(lowered: or a buffer aiecc placed over the stack or off a {DEVICE.vector_align_bytes}-byte boundary)",
    "shim-bd-bounds": "a shim BD reaches past the argument it moves, or moves another length than its dimensions walk",
}

GEMM_CLASS_KINDS = tuple(kind for kind, builder in BUILDERS.items() if builder.gemm_class)
BD_DIMS = {L1: DEVICE.tile_bd_dims, L2: DEVICE.memtile_bd_dims}
SPACE_NAMES = {L3: "L3 (shim)", L2: "L2 (memtile)", L1: "L1 (compute tile)"}

# Compute that convert-linalg-to-loops lowers to scalar loops. linalg.fill and linalg.copy are left out: they
# zero or move a tile once per output block, not per MAC.
_LOOP_COMPUTE = re.compile(r"\b(linalg\.(?!fill\b|copy\b|yield\b)\w+|arith\.(?:mulf|addf|subf|divf)|math\.fma)\b")
_HEADER = re.compile(r"^(?P<indent> *)air\.(?P<op>launch|segment|herd) @(?P<name>\w+)(?: tile)?"
                     r"(?: \((?P<ids>[^)]*)\) in \((?P<sizes>[^)]*)\))?"
                     r"(?: args\((?P<args>[^)]*)\) : (?P<types>.*?))?(?: attributes \{(?P<attributes>[^}]*)\})? \{$")
_LINK_WITH = re.compile(r'link_with = "([^"]*)"')
_DEFINITION = re.compile(r"^\s*(%[\w$.]+) = (affine\.apply|arith\.\w+)\b(.*)$")


@dataclass(frozen=True)
class Finding:
    rule: str
    program: str
    where: str    # the launch (and herd or device) the finding is in
    message: str  # what is wrong and what to do

    def __str__(self) -> str:
        return f"[{self.rule}] {self.program}, {self.where}: {self.message}"


# ---- reading the builders' text ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Region:
    op: str
    name: str
    ids: tuple[str, ...]
    sizes: tuple[str, ...]
    bindings: tuple[tuple[str, str, str], ...]  # (block argument, operand, type)
    body: tuple[str, ...]
    depth: int                   # indentation, in the emitted two-space steps
    size_args: tuple[str, ...]   # block arguments that hold the iteration sizes
    link_with: str | None        # a herd's kernel object


def regions(text: str) -> list[Region]:
    """Every air.launch/segment/herd in text order, with the lines of its region."""
    lines = text.splitlines()
    found = []
    for number, line in enumerate(lines):
        match = _HEADER.match(line)
        if not match:
            continue
        closing = match.group("indent") + "}"
        end = next(i for i in range(number + 1, len(lines)) if lines[i] == closing)
        sized = re.findall(r"(%[\w$.]+)=(%[\w$.]+)", match.group("sizes") or "")
        pairs = re.findall(r"(%[\w$.]+)=(%[\w$.]+)", match.group("args") or "")
        types = split_top(match.group("types") or "")
        link_with = _LINK_WITH.search(match.group("attributes") or "")
        found.append(Region(match.group("op"), match.group("name"), tuple(SSA_VALUE.findall(match.group("ids") or "")),
                            tuple(size for _, size in sized),
                            tuple((inner, outer, t) for (inner, outer), t in zip(pairs, types)),
                            tuple(lines[number + 1:end]), len(match.group("indent")) // 2,
                            tuple(inner for inner, _ in sized), link_with.group(1) if link_with else None))
    return found


@dataclass(frozen=True)
class _Side:
    space: int
    dtype: str
    shape: tuple[int, ...]
    sizes: tuple[int, ...]    # empty: the whole buffer, a linear transfer
    strides: tuple[int, ...]
    offsets: tuple[str, ...]  # SSA names


def _dmas(text: str) -> list[tuple[int, str, _Side, _Side]]:
    """(line number, line, dst, src) of every air.dma_memcpy_nd; sizes and strides resolved through the index
    constants."""
    constants = index_constants(text)
    found = []
    for number, line in enumerate(text.splitlines()):
        dma = parse_dma(line) if "air.dma_memcpy_nd" in line else None
        if dma is None or not dma.types:
            continue
        sides = [_Side(memref.space, memref.dtype, memref.shape, tuple(constants[s] for s in side.sizes),
                       tuple(constants[s] for s in side.strides), side.offsets)
                 for side, memref in zip((dma.dst, dma.src), dma.types)]
        found.append((number, line.strip(), *sides))
    return found


def canonical_dims(sizes, strides) -> list[tuple[int, int]]:
    """(size, stride) pairs outermost first, as AIR canonicalizes a window before it becomes a BD: unit
    dimensions dropped, a dimension merged into the next when it continues it contiguously. A single
    stride-1 dimension left over is a linear transfer."""
    dims = [(size, stride) for size, stride in zip(sizes, strides) if size != 1]
    merged: list[tuple[int, int]] = []
    for size, stride in reversed(dims):
        if merged and stride == merged[0][0] * merged[0][1]:
            merged[0] = (merged[0][0] * size, merged[0][1])
        else:
            merged.insert(0, (size, stride))
    return merged


def _linear(dims) -> bool:
    return len(dims) <= 1 and all(stride == 1 for _, stride in dims)


# ---- static rules --------------------------------------------------------------------------------------------
def check_core_compute(text: str, kind: str) -> list[tuple[str, str]]:
    """``gemm-scalar-compute``: (herd, message) for each loop-lowered compute op in a GEMM-class launch's herds."""
    if kind not in GEMM_CLASS_KINDS:
        return []
    problems = []
    for region in regions(text):
        if region.op != "herd":
            continue
        for line in region.body:
            match = _LOOP_COMPUTE.search(line)
            if match and not line.lstrip().startswith("//"):
                problems.append((region.name, f"{match.group(1)} in herd @{region.name} is lowered to scalar loops "
                                              f"by convert-linalg-to-loops; do the {kind} work in a func.call into a "
                                              f"vectorized AIE2P kernel (kernels/aie2p, declared in builders/externs.py)"))
    return problems


def _derived(lines, seeds: set[str]) -> tuple[set[str], list[str]]:
    """Values derived from ``seeds`` through affine.apply and arith ops in ``lines``, and every other line
    that uses one of them, DMAs excepted (their offsets become BD addresses, not core scalars)."""
    derived, uses = set(seeds), []
    for line in lines:
        stripped = line.strip()
        used = set(SSA_VALUE.findall(stripped)) & derived
        if not used:
            continue
        definition = _DEFINITION.match(line)
        if definition:
            derived.add(definition.group(1))
        elif not stripped.startswith("air.dma_memcpy_nd") and not _HEADER.match(line):
            uses.append(stripped)
    return derived, uses


def check_launch_ids(text: str) -> list[tuple[str, str]]:
    """``launch-id-in-core``: (herd, message) for each scalar herd operand derived from launch ids that the
    herd's code uses beyond DMA offsets."""
    found = regions(text)
    tainted = {value for region in found if region.op == "launch" for value in region.ids}
    for line in text.splitlines():  # text order is dominance order: one pass sees every definition first
        header = _HEADER.match(line)
        if header:
            region = next(r for r in found if r.op == header.group("op") and r.name == header.group("name"))
            tainted |= {inner for inner, outer, _ in region.bindings if outer in tainted}
        definition = _DEFINITION.match(line)
        if definition and set(SSA_VALUE.findall(definition.group(3))) & tainted:
            tainted.add(definition.group(1))
    problems = []
    for herd in (r for r in found if r.op == "herd"):
        for inner, outer, type_text in herd.bindings:
            if outer not in tainted or type_text.startswith("memref"):
                continue
            _, uses = _derived(herd.body, {inner})
            if uses:
                problems.append((herd.name, f"herd @{herd.name} operand {outer} ({type_text}) is derived from "
                                            f"air.launch ids and reaches core code ({uses[0][:100]}); aircc makes "
                                            f"it a host-written runtime parameter per launch step (stale-value "
                                            f"risk on silicon): compute it in the core from state it owns, or use "
                                            f"it only in DMA offsets"))
    return problems


def _splits_into_wraps(words: int) -> bool:
    """Whether AIR can re-express a contiguous run of ``words`` as two wraps within the shim's limit."""
    return any(words % f == 0 and words // f <= DEVICE.shim_wrap_max for f in range(1, DEVICE.shim_wrap_max + 1))


def window_problems(side: _Side, lowered: bool = False) -> list[str]:
    """``dma-wrap`` for one side of a DMA, by the BD rules of the tile that serves its memory space.

    A builder's window is first canonicalized as AIR does, and a long contiguous innermost run on the shim
    passes when AIR can split it into two wraps; a ``lowered`` BD is taken as the hardware gets it."""
    if not side.sizes:
        return []
    dims = ([(size, stride) for size, stride in zip(side.sizes, side.strides) if size != 1] if lowered
            else canonical_dims(side.sizes, side.strides))
    if _linear(dims):
        return []
    where = SPACE_NAMES[side.space]
    width = ELEMENT_BYTES[side.dtype]
    problems = []
    if side.space == L3:
        if len(dims) > DEVICE.shim_dims:
            problems.append(f"{len(dims)} dimensions {dims} on {where}: a shim BD has 3 and an iteration")
        if width < DEVICE.dma_word_bytes and dims[-1][1] != 1:
            problems.append(f"innermost stride {dims[-1][1]} on {where}: {side.dtype} moves in 4-byte words, "
                            f"the innermost dimension must be contiguous")
        inner_words = dims[-1][0] * width // DEVICE.dma_word_bytes
        splittable = not lowered and len(dims) < DEVICE.shim_dims and _splits_into_wraps(inner_words)
        if inner_words > DEVICE.shim_wrap_max and not splittable:
            problems.append(f"innermost size {dims[-1][0]} {side.dtype} = {inner_words} words on {where} exceeds "
                            f"{DEVICE.shim_wrap_max}")
        if len(dims) >= 2 and dims[-2][0] > DEVICE.shim_wrap_max:
            problems.append(f"second dimension size {dims[-2][0]} on {where} exceeds {DEVICE.shim_wrap_max}")
        if len(dims) == DEVICE.shim_dims and dims[0][0] > DEVICE.shim_iteration_max:
            problems.append(f"iteration size {dims[0][0]} on {where} exceeds {DEVICE.shim_iteration_max}")
        for size, stride in dims:
            if size > 1 and stride * width // DEVICE.dma_word_bytes > DEVICE.shim_stride_max_words:
                problems.append(f"stride {stride} on {where} exceeds {DEVICE.shim_stride_max_words} words")
        return problems
    if len(dims) > BD_DIMS[side.space]:
        problems.append(f"{len(dims)} dimensions {dims} on {where}: its BDs take {BD_DIMS[side.space]}")
    for size, stride in dims:
        if size > DEVICE.bd_dim_max_elements:
            problems.append(f"size {size} on {where} exceeds {DEVICE.bd_dim_max_elements} elements (aie.dma_bd: "
                            f"\"Size may not exceed 1023\")")
        if stride >= DEVICE.bd_stride_limit_elements:
            problems.append(f"stride {stride} on {where} is not below {DEVICE.bd_stride_limit_elements} elements")
    return problems


def check_windows(text: str) -> list[str]:
    problems = []
    for _, line, dst, src in _dmas(text):
        for name, side in (("dst", dst), ("src", src)):
            problems += [f"{name} of `{line[:120]}`: {p}; split the copy or reshape the window"
                         for p in window_problems(side)]
    return problems


def launch_tiles(steps, tiling) -> list[int]:
    """aircc's inner tile per launch dimension: the largest factor of the trip count not above the tiling
    size; dimensions beyond the tiling sizes stay whole (folded)."""
    return [max(f for f in range(1, min(trips, size) + 1) if trips % f == 0) if i < len(tiling) else trips
            for i, (trips, size) in enumerate(zip(steps, list(tiling) + [0] * len(steps)))]


def check_shim_bds(text: str, tiling) -> list[str]:
    """``shim-bd-budget``, estimated before placement: an L3-side DMA takes one shim BD per batch of launch
    steps when the batch's tile folds into that BD (window dimensions plus the tiled launch dimensions fit
    3 dimensions and an iteration), and one BD per launch step of the tile when it does not. One DMA's BDs
    sit on one shim tile, whose 16 BDs must hold a batch. ``lint_lowered`` counts the real live BDs."""
    launches = [r for r in regions(text) if r.op == "launch"]
    if not launches:
        return []
    constants = index_constants(text)
    steps = [constants[s] for s in launches[0].sizes]
    tiles = launch_tiles(steps, tiling)
    folded = [t for t in tiles if t > 1]
    problems = []
    for _, line, dst, src in _dmas(text):
        shim = dst if dst.space == L3 else src if src.space == L3 else None
        if shim is None:
            continue
        window = canonical_dims(shim.sizes, shim.strides) if shim.sizes else []
        dims = len(window) + len(folded)
        fits = dims <= DEVICE.shim_dims and all(t <= DEVICE.shim_wrap_max for t in folded) and not (
            dims == DEVICE.shim_dims and folded and folded[0] > DEVICE.shim_iteration_max)
        bds = 1 if fits else math.prod(folded)
        if bds > DEVICE.shim_bds:
            problems.append(f"`{line[:120]}` needs {bds} shim BDs per batch of launch steps (launch {steps}, "
                            f"tiles {tiles} from runtime_loop_tiling_sizes {tuple(tiling)}; window {window} and the "
                            f"tile do not fold into one BD); a shim tile has {DEVICE.shim_bds}: lower "
                            f"runtime_loop_tiling_sizes or simplify the window")
    return problems


def _where(index: int, kind: str, detail: str = "") -> str:
    return f"launch {index} ({kind})" + (f", {detail}" if detail else "")


def lint_launch_text(program_name: str, index: int, kind: str, text: str, tiling) -> list[Finding]:
    """Every static rule over one launch's custom-form text."""
    findings = [Finding("gemm-scalar-compute", program_name, _where(index, kind, f"herd @{herd}"), message)
                for herd, message in check_core_compute(text, kind)]
    findings += [Finding("launch-id-in-core", program_name, _where(index, kind, f"herd @{herd}"), message)
                 for herd, message in check_launch_ids(text)]
    findings += [Finding("dma-wrap", program_name, _where(index, kind), m) for m in check_windows(text)]
    findings += [Finding("shim-bd-budget", program_name, _where(index, kind), m) for m in check_shim_bds(text, tiling)]
    return findings


def worst_l1_tile(program: Program) -> TileL1:
    """``program``'s fullest compute tile as its builders plan it (one whose builder finds no plan, if any)."""
    try:
        return worst_tile(program_l1(program))
    except L1BudgetError as exc:
        return exc.tile


def _l1_finding(tile: TileL1) -> Finding:
    if tile.only_misaligned:
        message = f"a buffer placed where a vector load cannot read it: {tile}; pad the buffers before it"
    else:
        message = f"does not fit: {tile}; lower the launch's tiles or CompileOptions.stack_size"
    return Finding("l1-budget", tile.program, _where(tile.launch, tile.kind, tile.tile), message)


def lint_program(program: Program) -> list[Finding]:
    """The static rules over every launch of ``program``, as its builders emit them."""
    findings = []
    for index, launch in enumerate(program.launches):
        text = build_launch(program, launch).text
        findings += lint_launch_text(program.name, index, launch.kind, text,
                                     program.compile_options.runtime_loop_tiling_sizes)
    worst = worst_l1_tile(program)
    return findings + ([] if worst.fits else [_l1_finding(worst)])


# ---- rules on the lowered module ------------------------------------------------------------------------------
_DEVICE = re.compile(r"^  aie\.device\(\w+\)(?: @(\w+))? \{$", re.M)
_SEGMENT_LAUNCH = re.compile(r"^l(\d+)_")
_SHIM_ALLOCATION = re.compile(r"aie\.shim_dma_allocation @(\w+)\(%shim_noc_tile_(\d+)_0, (MM2S|S2MM), (\d+)\)")
_MEMTILE_DMA = re.compile(r"aie\.memtile_dma\(%mem_tile_(\d+_\d+)\) \{")
_DMA_START = re.compile(r"aie\.dma_start\((MM2S|S2MM), (\d+),")
_BD = re.compile(r"aie\.dma_bd\(%\w+ : (memref<[^>]*>), (\d+), (\d+)(?:, \[([^\]]*)\])?")
_BD_DIM = re.compile(r"<size = (\d+), stride = (\d+)>")
_TASK = re.compile(r"(%\w+) = aiex\.dma_configure_task_for @(\w+) \{")
_RELEASE = re.compile(r"aiex\.dma_(?:free|await)_task\((%\w+)\)")


def _devices(npu_module: str) -> dict[str, str]:
    starts = list(_DEVICE.finditer(npu_module))
    return {m.group(1): npu_module[m.end():starts[i + 1].start() if i + 1 < len(starts) else len(npu_module)]
            for i, m in enumerate(starts) if m.group(1)}


def _bd_side(type_text: str, dims_text: str, space: int) -> _Side:
    memref = parse_memref_type(type_text)
    dims = [(int(s), int(t)) for s, t in _BD_DIM.findall(dims_text)]
    return _Side(space, memref.dtype, memref.shape, tuple(s for s, _ in dims), tuple(t for _, t in dims), ())


def shim_bd_overrun(type_text: str, offset: int, length: int, dims_text: str | None) -> str | None:
    """What is wrong with a runtime sequence's ``aie.dma_bd`` on an argument of ``type_text``, or None: its walk
    (``offset`` plus each dimension's last step, outermost first; the innermost three make one pass of ``length``
    elements, a fourth repeats it) must end inside the argument, and one pass must be ``length`` elements."""
    numel = math.prod(parse_memref_type(type_text).shape)
    dims = [(int(size), int(stride)) for size, stride in _BD_DIM.findall(dims_text or "")] or [(length, 1)]
    last = offset + sum((size - 1) * stride for size, stride in dims)
    one_pass = math.prod(size for size, _ in dims[-3:])
    if last >= numel:
        return (f"walks to element {last}, but the argument has {numel} (offset {offset}, dimensions {dims}): it "
                "would move bytes outside the argument")
    if one_pass != length:
        return f"moves {length} elements where its dimensions {dims} walk {one_pass}"
    return None


def _memtile_channels(config: str) -> dict[str, dict[str, set[int]]]:
    channels: dict[str, dict[str, set[int]]] = {}
    for match in _MEMTILE_DMA.finditer(config):
        end = config.find("\n    }", match.end())
        for direction, channel in _DMA_START.findall(config[match.end():end]):
            channels.setdefault(match.group(1), {}).setdefault(direction, set()).add(int(channel))
    return channels


def _live_shim_bds(sequence: str, column_of: dict[str, int]) -> dict[int, int]:
    """The most shim BDs live at once per shim column: a configured task holds its BD IDs until it is freed or
    awaited (aie-assign-runtime-sequence-bd-ids frees after each await), the allocator's own rule."""
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    held: dict[str, tuple[int, int]] = {}
    lines = sequence.splitlines()
    for number, line in enumerate(lines):
        task = _TASK.search(line)
        if task:
            bds = 0
            for following in lines[number + 1:]:
                if "aie.end" in following:
                    break
                bds += "aie.dma_bd(" in following
            column = column_of[task.group(2)]
            held[task.group(1)] = (column, bds)
            live[column] = live.get(column, 0) + bds
            peak[column] = max(peak.get(column, 0), live[column])
        freed = _RELEASE.search(line)
        if freed and freed.group(1) in held:
            column, bds = held.pop(freed.group(1))
            live[column] -= bds
    return peak


def lint_lowered(program: Program, npu_module: str, lowering=None) -> list[Finding]:
    """Rules on what placement did: the npu-stage module of ``air_pipeline.prepare`` (one ``aie.device`` per
    launch segment), and the Lowering's DeviceReports when given."""
    findings = []
    for device, body in _devices(npu_module).items():
        index_match = _SEGMENT_LAUNCH.match(device)
        index = int(index_match.group(1)) if index_match else None
        kind = program.launches[index].kind if index is not None and index < len(program.launches) else "?"
        where = _where(index, kind, f"device @{device}") if index is not None else f"device @{device}"
        config, _, sequence = body.partition("aie.runtime_sequence")

        def add(rule: str, message: str) -> None:
            findings.append(Finding(rule, program.name, where, message))

        shim: dict[tuple[int, str], set[int]] = {}
        column_of = {}
        for symbol, column, direction, channel in _SHIM_ALLOCATION.findall(config):
            shim.setdefault((int(column), direction), set()).add(int(channel))
            column_of[symbol] = int(column)
        shim_channels, memtile_channels = DEVICE.shim_channels_per_direction, DEVICE.memtile_channels_per_direction
        for (column, direction), used in sorted(shim.items()):
            if len(used) > shim_channels or max(used) >= shim_channels:
                add("shim-channels", f"shim tile column {column} uses {direction} channels {sorted(used)}; it has "
                                     f"{shim_channels}: fewer L3 streams per segment (broadcast or merge DMAs)")
        for direction in ("MM2S", "S2MM"):
            total = sum(len(used) for (_, d), used in shim.items() if d == direction)
            if total > shim_channels * DEVICE.columns:
                add("shim-channels",
                    f"{total} shim {direction} channels; the array has {shim_channels * DEVICE.columns}")
        for tile, directions in sorted(_memtile_channels(config).items()):
            for direction, used in sorted(directions.items()):
                if len(used) > memtile_channels or max(used) >= memtile_channels:
                    add("memtile-channels", f"memtile {tile} uses {direction} channels {sorted(used)}; it has "
                                            f"{memtile_channels}: split the L2 traffic over more memtiles or fuse "
                                            f"channels")
        # Tile and memtile BDs carry their buffer's memory space; the runtime sequence's BDs are the shim's.
        for text, in_sequence in ((config, False), (sequence, True)):
            for type_text, _, _, dims in _BD.findall(text):
                space = L3 if in_sequence else parse_memref_type(type_text).space
                for problem in window_problems(_bd_side(type_text, dims, space), lowered=True):
                    add("dma-wrap", f"aie.dma_bd on {type_text}: {problem}")
        read = _BD.findall(sequence)
        for type_text, offset, length, dims in read:
            overrun = shim_bd_overrun(type_text, int(offset), int(length), dims)
            if overrun:
                add("shim-bd-bounds", f"aie.dma_bd on {type_text} {overrun}")
        unread = sequence.count("aie.dma_bd(") - len(read)
        if unread:  # e.g. a buffer whose memref type has a layout: not checked, so not passed either
            add("shim-bd-bounds", f"{unread} runtime-sequence aie.dma_bd(s) this check cannot read")
        for column, peak in sorted(_live_shim_bds(sequence, column_of).items()):
            if peak > DEVICE.shim_bds:
                add("shim-bd-budget", f"{peak} BDs live at once on shim column {column}; a shim tile has "
                                      f"{DEVICE.shim_bds}: lower runtime_loop_tiling_sizes or the DMAs per launch step")
    if lowering is not None:
        for report in lowering.devices:
            if report.runtime_parameters:
                index_match = _SEGMENT_LAUNCH.match(report.name)
                index = int(index_match.group(1)) if index_match else None
                kind = program.launches[index].kind if index is not None else "?"
                findings.append(Finding("launch-id-in-core", program.name, _where(index, kind, f"device @{report.name}"),
                                        f"{report.runtime_parameters} host-written runtime parameter(s) after "
                                        f"placement (__air_herd_rtp_*): a herd operand derived from launch ids"))
    return findings


# Rules the lowered module answers exactly (the real BDs, live BD IDs, runtime parameters), where the static
# rule can only estimate what AIR will do (e.g. it cannot see AIR split a large L2 buffer over memtiles).
EXACT_WHEN_LOWERED = ("dma-wrap", "shim-bd-budget", "launch-id-in-core", "l1-budget")


def lower_and_lint(program: Program) -> tuple[list[Finding], TileL1]:
    """``program`` lowered with the real AIR tools: the rules on what placement did, plus the static rules that
    the lowered module cannot answer (``EXACT_WHEN_LOWERED`` are taken from the lowered module alone); and the
    fullest compute tile at the addresses aiecc gave its buffers. A Program whose shim BDs the build refuses before
    aiecc gets the static runtime-parameter and L1 rules instead, and its fullest tile as planned."""
    from .air_pipeline import SHIM_BD_STAGE, CompileError, lower_to_npu_insts

    build_dir = Path(tempfile.mkdtemp(prefix=f"torch_npu2-lint-{program.name}-"))
    try:
        static = [f for f in lint_program(program) if f.rule not in EXACT_WHEN_LOWERED]
        try:
            lowering = lower_to_npu_insts(program, keep_dir=build_dir)
        except CompileError as exc:
            if exc.stage == SHIM_BD_STAGE:  # refused before aiecc: the passes' module and the planned L1
                planned = [f for f in lint_program(program) if f.rule in ("launch-id-in-core", "l1-budget")]
                return (static + planned + lint_lowered(program, (build_dir / "npu.mlir").read_text()),
                        worst_l1_tile(program))
            if not isinstance(exc.__cause__, L1BudgetError):
                raise
            return static + [_l1_finding(exc.__cause__.tile)], exc.__cause__.tile
        return static + lint_lowered(program, (build_dir / "npu.mlir").read_text(), lowering), worst_tile(lowering.l1)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
