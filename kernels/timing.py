"""Predicted NPU2 time of a Program, derived from the MLIR-AIR its builders emit and from what the core executes:
a timing MODEL, never a measurement. Every prediction is a range, between a fast and a slow end (``FAST``,
``SLOW``), each set by stated assumptions.

Every launch of a Program is built by its builder (``kernels.builders.build_launch``) and the model walks that
IR — air.launch → air.segment → air.herd, scf.for trip counts, DMAs, compute — without compiling it:

* compute, per tile. A ``func.call`` into one of our AIE2P kernels costs the instructions that call executes:
  ``kernels.core_ops`` runs the kernel's own AIE path against a counting stand-in of the AIE API (loads, stores,
  multiplies, vector-unit operations, moves, exp2/tanh, software float), and expands each ``aie::mmul`` into what
  aie_api emits for it on AIE2P (BFP16 and int16 × int8; exact bf16, which AIE2P cannot multiply as matrices, the
  kernels write as elementwise multiply-accumulates, counted like any vector code). Cycles from
  instructions: at the fast end a VLIW cycle issues two loads, a store, one vector-unit operation (multiplies
  included) and one move, operands an ``aie::mmul`` shares with another call are prepared once, and the kernel's
  integer arguments take their cheapest values (``core_ops.WORK_ARGUMENTS``); at the slow end every instruction
  takes a cycle of its own, as the source writes it, with the dearest arguments. ``linalg.matmul`` and
  ``linalg.generic`` left in a herd are lowered by aircc's convert-linalg-to-loops to scalar loops over
  software-emulated float, and cost that; MLIR vector ops cost an instruction each;
* DMAs, from the ``air.dma_memcpy_nd`` windows: DDR (shim) traffic over the DDR bandwidth the segment's columns
  reach (a copy every tile of a herd makes alike is one broadcast read); memtile ↔ tile traffic over the tile's
  two DMA channels;
* overlap: the loops AIR double-buffers are found by the rule its passes apply (mlir-air 0e3df89d):
  ``air-fuse-alloc-dealloc`` moves each L1/L2 buffer into the innermost loop that holds every use of it, and
  ``air-label-scf-for-to-ping-pong`` labels each loop that then allocates a buffer in its body (unless the Program
  omits ping-pong for that buffer's memory space), which ``air-ping-pong-transform`` unrolls by two over a ping
  and a pong copy (a loop of at least four trips: two are unrolled away, in sequence). In such a loop the DMAs
  into or out of those buffers pipeline with the compute, ``DMA + (trips − 1) × max(compute, DMA) + compute``
  (the first copy, then each compute beside the next copy, then the last compute); every other DMA, and every other
  loop, runs in sequence. A herd with no loop of its own inside a segment loop runs in its own copy of that loop
  (air-isolate-async-dma-loop-nests), which double-buffers the herd's L1 buffers: its copies into or out of them are
  a further stage, ``DMA + herd DMA + (trips − 1) × max(compute, DMA, herd DMA) + compute``
  (tests/benchmarks/test_cost_model_pingpong.py checks the rule against the real passes);
* launch steps: aircc tiles the launch nest by the Program's ``runtime_loop_tiling_sizes`` (each dimension by
  its largest factor not above the size, ``kernels.lint.launch_tiles``) and its runtime sequence starts every
  shim DMA task of one batch of steps before it awaits the batch's outputs (tests/benchmarks/
  test_cost_model_batches.py counts them in the real lowering). Inside a batch, nothing but the buffers orders
  one step after the next: a step's first input copy (the first copy of its first double-buffered loop, into a
  buffer the previous step's last trip no longer uses) runs beside the previous step's last compute, and its
  closing writes to DDR run beside the next step's work, as far as DDR is idle then; between batches, steps
  run in sequence;
* overheads: each air.launch iteration, each launch of the multi-launch ELF, one dispatch per Program run, and
  entering each launch's device after the first (every launch is an aie.device of its own: ``CONFIGURE_S``);
* branches: an ``scf.if`` is counted as the IR executes it. Its condition is evaluated (with the interpreter's
  integer arithmetic, ``kernels.interpret.IndexArithmetic``) at every point of the iteration space it depends
  on — launch ids, herd tile ids, enclosing ``scf.for`` induction variables — and the branch's work and bytes
  are charged by the fraction of points that take it; its time by that fraction for the slowest tile of each
  herd (tiles run in parallel, launch steps and loop trips in sequence). A condition the model cannot evaluate
  (an op outside that arithmetic, a value loaded from memory) is counted as always taken and reported in
  ``LaunchCost.conditions``.

Nothing is fitted. Each constant says where it comes from: a hardware fact, a figure of the team's design notes
(FACTS.md and KERNELS.md in ``shared/design/`` beside this repository, quoted where used), or, for the two ends of
the DDR rate, what upstream's measured runs on NPU2 stream (mlir-air's kernel registry).
"""
from __future__ import annotations

import itertools
import math
import re
import statistics
from dataclasses import asdict, dataclass, field

from . import core_ops
from .builders.ir import ELEMENT_BYTES, L1, L2, L3
from .device import DEVICE
from .lint import launch_tiles
from .mlir_text import SSA_VALUE, constant, memref_types, parse_dma, parse_op, split_top

# ---- hardware: the device record (kernels/device.py), and what was measured on it ----------------------------
SHIM_COLUMN_BYTES_PER_S = 14e9  # FACTS.md: measured ≈ 14 GB/s per column

# ---- what upstream's measured runs on NPU2 stream from DDR (mlir-air programming_examples/kernel_registry) -----
# Standalone bf16-in/bf16-out GEMMs, details/GEMM_bf16_in_bf16_out.md at mlir-air b2959c9 ("drain" method: an in-herd
# f32 → bf16 drain like ours, BFP16-emulated multiplies, 8×4 herd, June 2026): (M, K, N) → (tile_m, tile_k_l2,
# tile_k_l1, tile_n), GFLOP/s.
UPSTREAM_DRAIN_GEMMS = {
    (2048, 2048, 2048): ((32, 512, 32, 128), 6025), (2048, 2048, 512): ((32, 256, 32, 128), 5626),
    (2048, 2048, 8192): ((32, 256, 32, 128), 5784), (2048, 8192, 2048): ((32, 256, 32, 128), 7234),
    (512, 512, 512): ((32, 256, 32, 128), 1703), (1024, 1024, 1024): ((32, 256, 32, 128), 4637),
    (4096, 4096, 4096): ((32, 512, 32, 128), 7002),
}
# Standalone bf16 GEMVs (y = A·x, A M×K), details/GEMV_bf16.md at mlir-air 45c69ab: (M, K) → measured µs, the
# shapes that move at least 32 MB (a stream, not launch overheads), other models' than Llama-3.2-1B: those
# (UPSTREAM_LLAMA_GEMVS, benchmarks/cost_model.py) are replayed through the model instead.
UPSTREAM_GEMV_STREAMS = {
    (49152, 2048): 6187, (16384, 1536): 1545, (11008, 2048): 1414, (2048, 11008): 1631, (9728, 2560): 1530,
    (2560, 9728): 1608, (16384, 2560): 2777, (3072, 8192): 1710, (8192, 3072): 1563, (16384, 3072): 3083,
}


def measured_gemm_s(shape, gflops) -> float:
    M, K, N = shape
    return 2 * M * K * N / (gflops * 1e9)


def drain_gemm_ddr_bytes(shape, tile_m: int, tile_n: int) -> int:
    """DDR bytes of a drain GEMM on an 8×4 herd, one (8·tile_m)×(4·tile_n) output block per launch step: A read
    again for every block column, W for every block row, C written once (bf16)."""
    M, K, N = shape
    return 2 * (M * K * (N // (4 * tile_n)) + N * K * (M // (8 * tile_m)) + M * N)


def gemv_bytes(M: int, K: int) -> int:
    return 2 * (M * K + K + M)


# The most any measurement implies: upstream's 2048×8192×2048 drain GEMM moves 411 MB in 9.50 ms (43.3 GB/s; its
# llama32_1b LM-head GEMV streams 38.6 GB/s, docs/profile.md at f36b9e5; FACTS.md: 36–57 GB/s seen in practice).
DDR_BEST_BYTES_PER_S = max(drain_gemm_ddr_bytes(shape, tiles[0], tiles[3]) / measured_gemm_s(shape, gflops)
                           for shape, (tiles, gflops) in UPSTREAM_DRAIN_GEMMS.items())
# What upstream's standalone GEMVs stream: the median of UPSTREAM_GEMV_STREAMS (32.1 GB/s; they range 27.7–32.7).
DDR_GEMV_BYTES_PER_S = statistics.median(gemv_bytes(*shape) / (us * 1e-6)
                                         for shape, us in UPSTREAM_GEMV_STREAMS.items())
LAUNCH_ITERATION_S = 3e-6  # assumption: an air.launch iteration reprograms shim BDs and waits, FACTS' smallest step
# Entering another design inside one dispatch. Each launch of our ELF is an aie.device of its own, which the main
# runtime sequence enters with an aiex.configure (air-to-aie; aiecc --expand-load-pdis turns it into PDI loads;
# tests/kernels/test_air_pipeline.py counts one per launch in the real lowering). IRON measured that configure on
# NPU2 inside its fused ELFs, which aiecc builds the same way (amd/IRON iron/lm/llama3/costs_npu2.json at 04e0f3e,
# decode_costs_npu2.json at adbcfca, "calibrations"): its fixed part ("base_us") 37.4–43.7 µs, a switch between two
# small designs ("switch_us") 42.9–47.4 µs. FACTS' 3–15 µs "step" is a design repeated without one (IRON's
# "t_step_us", probe.py). A dispatch's own cost covers its first launch's configure: upstream's one-launch AIR ELFs
# take ≈ 80 µs for tiny work (mlir-air kernel_registry/details/RoPE_bf16.md), inside FACTS' 50–110 µs. IRON's designs
# are small: mlir-air measured a full reload of a flash-attention device at ≈ 180–280 µs (commits 59beeb6, e0b9a29),
# so the slow end is likely low for large devices; no source says how the cost grows with tiles, so it is not scaled.
CONFIGURE_S = (37.4e-6, 47.4e-6)  # (fast: the lowest base measured, slow: the highest switch)


# ---- the two ends of a prediction ------------------------------------------------------------------------------
@dataclass(frozen=True)
class End:
    """The assumptions that set one end of every predicted range."""
    name: str
    ddr_bytes_per_s: float
    dispatch_s: float               # FACTS.md: a dispatch costs 50–110 µs
    launch_s: float                 # FACTS.md: a step inside a multi-launch ELF costs 3–15 µs
    configure_s: float              # entering each launch's device after the first (CONFIGURE_S)
    co_issue: bool                  # a cycle issues two loads, a store, a vector-unit op and a move (else one op)
    share_operands: bool            # an aie::mmul operand used by several calls is prepared once
    cheapest_arguments: bool        # a kernel's integer arguments at their cheapest (else dearest) values
    scalar_float_cycles: float      # one software-emulated scalar float operation
    assumption: str


# KERNELS.md: scalar code on a tile runs ≈ 0.02–0.1 MAC/cycle (software-emulated float): 10–50 cycles per multiply
# and add, 5–25 cycles per float operation.
FAST = End("fast", DDR_BEST_BYTES_PER_S, 50e-6, 3e-6, CONFIGURE_S[0], True, True, True, 5.0,
           "DDR at 43.3 GB/s (the most upstream's measured runs imply); the core issues two loads, a store, one "
           "vector-unit op and one move per cycle; an mmul operand shared by calls is prepared once; kernels' "
           "integer arguments at their cheapest; a scalar float op in 5 cycles; dispatch 50 µs, launch 3 µs, "
           "entering each further launch's device 37.4 µs")
SLOW = End("slow", DDR_GEMV_BYTES_PER_S, 110e-6, 15e-6, CONFIGURE_S[1], False, False, False, 25.0,
           "DDR at 32.1 GB/s (what upstream's standalone GEMVs stream); every core instruction in a cycle of its "
           "own, as the source writes it; kernels' integer arguments at their dearest; a scalar float op in 25 "
           "cycles; dispatch 110 µs, launch 15 µs, entering each further launch's device 47.4 µs")
ENDS = (FAST, SLOW)


def core_cycles(instructions: dict[str, float], end: End) -> float:
    """Cycles of a kernel call that executes ``instructions`` (by ``core_ops.KINDS``) at ``end``."""
    n = instructions
    scalar = n["scalar_float"] * end.scalar_float_cycles
    if end.co_issue:
        return max(n["load"] / DEVICE.load_units, n["store"], n["mac"] + n["vector"] + n["nonlinear"], n["move"],
                   scalar)
    return n["load"] + n["store"] + n["mac"] + n["vector"] + n["nonlinear"] + n["move"] + scalar


# ---- compute that is not a kernel call: work per cycle per tile, (fast, slow) ------------------------------------
@dataclass(frozen=True)
class Throughput:
    per_cycle: tuple[float, float]
    unit: str
    source: str


THROUGHPUT = {
    "mlir_vector_op": Throughput(
        (1.0, 1.0), "op",
        "assumption: each MLIR vector op (≤ 16 lanes) is one instruction; Peano may split bf16 ones"),
    "scalar_mac": Throughput(
        (1 / (2 * FAST.scalar_float_cycles), 1 / (2 * SLOW.scalar_float_cycles)), "MAC",
        "KERNELS.md: scalar code on a tile runs ≈ 0.02–0.1 MAC/cycle (software-emulated float); linalg.matmul "
        "reaches the core as scalar loops (aircc's convert-linalg-to-loops)"),
    "scalar_float": Throughput(
        (1 / FAST.scalar_float_cycles, 1 / SLOW.scalar_float_cycles), "op",
        "a software-emulated float op (5–25 cycles, from KERNELS.md's scalar MAC rate) for linalg.generic and "
        "arith.*f / math.* on scalars"),
    "scalar_move": Throughput((1.0, 1.0), "element", "assumption: one scalar load or store per cycle (linalg.fill, "
                                                     "memref.load/store)"),
}

# CompileOptions.omit_pingpong → the memory spaces left single-buffered
OMITTED_SPACES = {"": frozenset(), "L1": frozenset({L1}), "L2": frozenset({L2}), "all": frozenset({L1, L2})}
# Points of a condition's iteration space the model enumerates at most (flash_attn at 2048 needs 2048).
MAX_CONDITION_POINTS = 1 << 20


# ---- the IR, as a tree ----------------------------------------------------------------------------------
@dataclass
class Region:
    kind: str                       # "launch", "segment", "herd", "for", "if" (a branch of an scf.if)
    sizes: tuple[int, ...] = ()     # launch/herd extents, or (trips,) for a loop
    body: list = field(default_factory=list)
    work_share: float = 1.0         # a branch: the fraction of its scf.if's executions that run it, over all tiles
    time_share: float = 1.0         # ... and over the slowest tile of each herd
    condition: str | None = None    # a branch: the i1 value it runs on (None: not evaluated)
    negated: bool = False           # a branch: runs where that value is false (the else branch)
    # a loop: the L1/L2 buffers AIR's alloc fusion moves into its body (name → memory space), its ping-pong candidates
    buffers: dict[str, int] = field(default_factory=dict)
    # a segment loop around a herd: that herd's L1 buffers fused into the herd's own copy of the loop
    # (``_Parser._fuse_buffers_into_loops``), ping-pong candidates of their own
    herd_buffers: dict[str, int] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Compute:
    kind: str                       # what the work is: a key of THROUGHPUT, or a kernel call's CallCost kind
    work: float                     # in the kind's unit, one execution
    cycles: tuple[float, float]     # one execution, at the fast and at the slow end


def _by_throughput(kind: str, work: float) -> Compute:
    return Compute(kind, work, tuple(work / per_cycle for per_cycle in THROUGHPUT[kind].per_cycle))


@dataclass(frozen=True)
class Condition:
    """An ``scf.if`` of a launch and how often its then-branch runs."""
    text: str                       # the scf.if line and the op defining its condition
    work_share: float               # fraction of executions (every tile, launch step and loop trip) that take it
    time_share: float               # the same for the slowest tile of each herd
    unevaluated: str = ""           # why the model could not evaluate it: then counted as always taken (1, 1)


class _Unevaluable(Exception):
    pass


@dataclass(frozen=True)
class Transfer:
    nbytes: int
    src_space: int
    dst_space: int
    distinct: int                   # distinct copies among a herd's tiles (1: one broadcast read for all)
    buffers: frozenset = frozenset()  # the allocated L1/L2 buffers at either end


_CALL = re.compile(r"^func\.call @(\w+)\(([^)]*)\) : \(([^)]*)\)")
_EXTENTS = re.compile(r" in \(([^)]*)\)")
_TILE_IDS = re.compile(r"tile \(([^)]*)\)")
_IDS = re.compile(r"@\w+ (?:tile )?\(([^)]*)\) in \(")
_ARGS = re.compile(r" args\(([^)]*)\)")
_IV = re.compile(r"^scf\.for (%\w+) = ")
_FOR = re.compile(r"^scf\.for %\w+ = (%\w+) to (%\w+) step (%\w+) \{$")
# Ops that cost nothing on the core: bookkeeping, index math, allocation.
_FREE = ("arith.constant", "affine.apply", "arith.index_cast", "arith.cmpi", "memref.alloc", "memref.dealloc",
         "memref.subview", "linalg.yield", "//", "^bb0")
# The hierarchy levels a condition can depend on; herd tile ids are the parallel one.
LAUNCH, HERD, LOOP = "launch", "herd", "loop"


def _numel(shape) -> int:
    return math.prod(shape)


class _Parser:
    """Turns one launch's text (the form kernels/builders/ir.py emits) into a Region tree."""

    def __init__(self, externs, precision: str | None):
        self.constants: dict[str, int] = {}
        self.tile_ids: dict[str, frozenset] = {}   # SSA value → the herd tile ids it is computed from
        self.tile_extent: dict[str, int] = {}      # herd tile id → the herd's extent along it
        self.herd_tiles = 1                        # tiles of the herd being read
        self.defines = {decl.symbol: dict(decl.defines) for decl in externs}
        self.precision = precision
        self.dmas = 0
        self.definitions: dict[str, str] = {}      # SSA value → the op line defining it
        self.bindings: dict[str, str] = {}         # launch/segment/herd block argument → the value bound to it
        self.variables: dict[str, tuple[str, range]] = {}  # launch id, herd tile id, loop iv → (level, values)
        self.conditions: list[Condition] = []
        self._else_shares: dict[int, tuple[float, float]] = {}  # id of a then-branch → its else branch's shares
        self.buffer_spaces: dict[str, int] = {}    # memref.alloc result → its memory space
        self.buffer_herds: dict[str, Region | None] = {}  # memref.alloc result → the herd allocating it
        self.buffer_outside: dict[str, int] = {}  # memref.alloc result → loops around the segment/herd allocating it
        self.segment_outside: dict[str, int] = {}  # memref.alloc result → loops around its segment
        self.buffer_uses: dict[str, list[tuple]] = {}  # buffer → for each op using it: (loops, herd, loops around it)

    def parse(self, text: str) -> Region:
        root = Region("root")
        stack, opaque = [root], 0
        for raw in text.splitlines():
            line = raw.strip()
            if opaque:  # inside a linalg.generic body: the generic itself was costed
                opaque += line.endswith("{") - (line == "}")
                continue
            if line == "}":
                stack.pop()
                continue
            if line == "} else {":
                orelse = self._orelse(stack.pop())
                stack[-1].body.append(orelse)
                stack.append(orelse)
                continue
            self._track_values(line)
            region = self._region(line, stack)
            if region is not None:
                stack[-1].body.append(region)
                stack.append(region)
                continue
            self._track_buffers(line, stack)
            item = self._item(line, inside_herd=any(r.kind == "herd" for r in stack))
            if item is not None:
                stack[-1].body.append(item)
            if line.startswith("linalg.generic") and line.endswith("{"):
                opaque = 1
        assert len(stack) == 1, "unbalanced regions"
        self._fuse_buffers_into_loops()
        return root

    def _buffer(self, name: str) -> str | None:
        """The allocated buffer ``name`` is, through herd/segment block arguments; None for anything else."""
        while name not in self.buffer_spaces and name in self.bindings:
            name = self.bindings[name]
        return name if name in self.buffer_spaces else None

    def _track_buffers(self, line: str, stack: list[Region]) -> None:
        """Records L1/L2 allocations and, for every other op, which of them it uses: inside which herd (None:
        outside any), and inside which loops, all of them and those around that herd."""
        herds = [i for i, r in enumerate(stack) if r.kind == "herd"]
        herd = stack[herds[-1]] if herds else None
        if " = memref.alloc()" in line:
            name = line.split(" = ", 1)[0]
            self.buffer_spaces[name], self.buffer_herds[name] = memref_types(line)[0].space, herd
            scope = max(i for i, r in enumerate(stack) if r.kind in ("segment", "herd"))
            self.buffer_outside[name] = sum(r.kind == "for" for r in stack[:scope])
            segment = max((i for i, r in enumerate(stack) if r.kind == "segment"), default=scope)
            self.segment_outside[name] = sum(r.kind == "for" for r in stack[:segment])
            return
        if line.startswith("memref.dealloc"):  # fusion moves deallocs along with their allocs
            return
        loops = tuple(r for r in stack if r.kind == "for")
        around_herd = tuple(r for r in stack[:herds[-1]] if r.kind == "for") if herds else loops
        rhs = line.split(" = ", 1)[1] if line.startswith("%") and " = " in line else line
        for buffer in {self._buffer(v) for v in SSA_VALUE.findall(rhs)} - {None}:
            self.buffer_uses.setdefault(buffer, []).append((loops, herd, around_herd))

    def _fuse_buffers_into_loops(self) -> None:
        """air-fuse-alloc-dealloc: each buffer goes into the innermost loop around every one of its users.

        An L2 buffer a herd copies from or to is, after air-dma-to-channel, used by a channel op in the segment
        inside the herd's loops too: its uses count where they are. An L1 buffer a herd takes as an argument is
        used by the herd op: where the herd is, unless that herd is its only user, which the alloc then moves
        into (air-fuse-alloc-dealloc on the hierarchy), to fuse it into the herd's own loops.

        A herd with no loop of its own inside loops of its segment gets a copy of those loops of its own from
        air-isolate-async-dma-loop-nests, which splits the segment's channel side from the herd's (decode
        attention's herd shows it; a herd with loops of its own, the GEMVs', stays inside the segment's loop): its
        L1 buffers are fused into the herd's copy of the innermost segment loop around every use
        (``Region.herd_buffers``). tests/benchmarks/test_cost_model_pingpong.py checks both against the real
        passes."""
        for buffer, uses in self.buffer_uses.items():
            home = self.buffer_herds[buffer]
            positions, outside = [loops for loops, _, _ in uses], self.buffer_outside[buffer]
            segment_loops = 0  # loops of the segment around the herd allocating it (which gets copies of them)
            if self.buffer_spaces[buffer] == L1 and any(herd is not home for _, herd, _ in uses):
                (herd, *others) = [herd for _, herd, _ in uses]
                if all(other is herd for other in others):
                    positions, outside = [loops[len(around):] for loops, _, around in uses], 0
                else:
                    positions = [loops if user is home else around for loops, user, around in uses]
            elif self.buffer_spaces[buffer] == L1 and home is not None and not any(_regions(home, "for")):
                segment_loops = outside - self.segment_outside[buffer]
                outside -= segment_loops
            common = []
            for levels in zip(*positions):
                if any(loop is not levels[0] for loop in levels):
                    break
                common.append(levels[0])
            if len(common) > outside + segment_loops:  # a loop inside the segment or herd allocating it
                common[-1].buffers[buffer] = self.buffer_spaces[buffer]
            elif len(common) > outside:  # a segment loop around the herd allocating it: the herd's copy of it
                common[-1].herd_buffers[buffer] = L1

    def _const(self, name: str) -> int:
        try:
            return self.constants[name]
        except KeyError:
            raise ValueError(f"timing model: {name} is not an integer constant in this launch") from None

    def _track_values(self, line: str) -> None:
        if defined := constant(line):
            self.constants[defined[0]] = defined[1]
        if " = " in line and line.startswith("%"):
            result, rhs = line.split(" = ", 1)
            self.definitions[result] = line
            self.tile_ids[result] = frozenset().union(*(self.tile_ids.get(v, ()) for v in SSA_VALUE.findall(rhs)))

    def _bind(self, line: str, level: str | None, extents: tuple[int, ...] = ()) -> None:
        """Records a hierarchy op's block arguments: its ids (as variables of ``level``), extents and args."""
        if m := _ARGS.search(line):
            for pair in m.group(1).split(","):
                inner, outer = (v.strip() for v in pair.split("="))
                self.bindings[inner] = outer
        if level is None:
            return
        for pair, extent in zip(_EXTENTS.search(line).group(1).split(","), extents):
            self.constants[pair.split("=")[0].strip()] = extent
        for name, extent in zip(_IDS.search(line).group(1).split(","), extents):
            self.variables[name.strip()] = (level, range(extent))

    def _extents(self, line: str) -> tuple[int, ...]:
        return tuple(self._const(pair.split("=")[1].strip()) for pair in _EXTENTS.search(line).group(1).split(","))

    def _region(self, line: str, stack: list[Region]) -> Region | None:
        if line.startswith("air.launch "):
            extents = self._extents(line)
            self._bind(line, LAUNCH, extents)
            return Region("launch", extents)
        if line.startswith("air.segment "):
            self._bind(line, None)
            return Region("segment")
        if line.startswith("air.herd "):
            extents = self._extents(line)
            self._bind(line, HERD, extents)
            self.herd_tiles = math.prod(extents)
            for tile_id, extent in zip(_TILE_IDS.search(line).group(1).split(","), extents):
                self.tile_ids[tile_id.strip()] = frozenset([tile_id.strip()])
                self.tile_extent[tile_id.strip()] = extent
            return Region("herd", extents)
        if m := _FOR.match(line):
            assert self._const(m.group(3)) == 1, "the builders' loops step by 1"
            lower, upper = self._const(m.group(1)), self._const(m.group(2))
            self.variables[_IV.match(line).group(1)] = (LOOP, range(lower, upper))
            return Region("for", (upper - lower,))
        if line.startswith("scf.if "):
            return self._branch(line, stack)
        return None

    def _branch(self, line: str, stack: list[Region]) -> Region:
        """The then-branch of an ``scf.if``, charged by how often its condition holds (see the module doc)."""
        condition = line.removeprefix("scf.if ").removesuffix("{").strip()
        enclosing = [(r.condition, r.negated) for r in stack if r.kind == "if" and r.condition is not None]
        text = f"{line.removesuffix('{').strip()} ({self.definitions.get(condition, 'undefined')})"
        try:
            (work, time), orelse = self._shares(condition, enclosing)
        except _Unevaluable as why:
            self.conditions.append(Condition(text, 1.0, 1.0, str(why)))
            branch = Region("if")
            self._else_shares[id(branch)] = (1.0, 1.0)
            return branch
        self.conditions.append(Condition(text, work, time))
        branch = Region("if", work_share=work, time_share=time, condition=condition)
        self._else_shares[id(branch)] = orelse
        return branch

    def _orelse(self, then: Region) -> Region:
        work, time = self._else_shares.pop(id(then))
        return Region("if", work_share=work, time_share=time, condition=then.condition, negated=True)

    def _shares(self, condition: str, enclosing: list[tuple[str, bool]]):
        """((work, time) shares of the then-branch, (work, time) of the else branch), given the enclosing
        branches' conditions: counted over every point of the ids and ivs these conditions depend on."""
        from .interpret import IndexArithmetic, InterpretError

        ops, free = {}, {}
        for name in [condition, *(c for c, _ in enclosing)]:
            self._dependencies(name, ops, free, IndexArithmetic.OPS)
        names = sorted(free, key=lambda n: (LAUNCH, HERD, LOOP).index(free[n][0]))
        spaces = [free[n][1] for n in names]
        if math.prod(len(r) for r in spaces) > MAX_CONDITION_POINTS:
            raise _Unevaluable(f"its iteration space has over {MAX_CONDITION_POINTS} points")
        parsed = [(result, parse_op(line)) for result, line in ops.items()]
        arithmetic = IndexArithmetic()
        launch_dims = sum(free[n][0] == LAUNCH for n in names)
        herd_dims = launch_dims + sum(free[n][0] == HERD for n in names)
        # per (launch ids, herd tile ids): points where the enclosing branches run, where this one runs, its else
        counts: dict[tuple, list[int]] = {}
        for point in itertools.product(*spaces):
            env = _Bound(self.bindings, zip(names, point))
            try:
                for result, op in parsed:
                    env[result] = arithmetic.evaluate(op, env)
            except InterpretError as error:
                raise _Unevaluable(str(error)) from None
            if all(bool(env[c]) != negated for c, negated in enclosing):
                tally = counts.setdefault(point[:herd_dims], [0, 0, 0])
                tally[0] += 1
                tally[1 if env[condition] else 2] += 1

        inside = sum(tally[0] for tally in counts.values())
        if not inside:  # the enclosing branches never run
            return (0.0, 0.0), (0.0, 0.0)

        def slowest_tiles(column: int) -> int:
            """Summed over launch steps: the count of the tile whose count in ``column`` is largest."""
            slowest: dict[tuple, int] = {}
            for key, tally in counts.items():
                slowest[key[:launch_dims]] = max(slowest.get(key[:launch_dims], 0), tally[column])
            return sum(slowest.values())

        def shares(column: int) -> tuple[float, float]:
            return sum(t[column] for t in counts.values()) / inside, slowest_tiles(column) / slowest_tiles(0)

        return shares(1), shares(2)

    def _dependencies(self, name: str, ops: dict, free: dict, evaluable) -> None:
        """Adds to ``ops`` (result → op line, in definition order) the ops ``name`` is computed by and to
        ``free`` the ids and ivs it depends on; raises _Unevaluable on anything outside ``evaluable``."""
        while name in self.bindings and name not in self.definitions:
            name = self.bindings[name]
        if name in ops or name in free:
            return
        if name in self.variables:
            free[name] = self.variables[name]
            return
        if name in self.definitions:
            line = self.definitions[name]
            op = line.split(" = ", 1)[1].split(" ", 1)[0]
            if op not in evaluable:
                raise _Unevaluable(f"{name} comes from {op}, which the model does not evaluate")
            for operand in SSA_VALUE.findall(line.split(" = ", 1)[1]):
                self._dependencies(operand, ops, free, evaluable)
            ops[name] = line
            return
        if name in self.constants:  # a hierarchy extent
            ops[name] = f"{name} = arith.constant {self.constants[name]} : index"
            return
        raise _Unevaluable(f"{name} is not defined in the launch")

    def _item(self, line: str, inside_herd: bool):
        op = line.split(" = ", 1)[1] if line.startswith("%") and " = " in line else line
        name = op.split(" ", 1)[0].split("(", 1)[0]
        if name.startswith(_FREE):
            return None
        if name == "air.dma_memcpy_nd":
            return self._transfer(line)
        if name == "func.call":
            return self._call(line)
        if name == "linalg.matmul":
            a, b, c = memref_types(line)[:3]
            return _by_throughput("scalar_mac", math.sqrt(_numel(a.shape) * _numel(b.shape) * _numel(c.shape)))
        if name == "linalg.generic":
            return _by_throughput("scalar_float", _numel(memref_types(line)[-1].shape))
        if name == "linalg.fill":
            return _by_throughput("scalar_move", _numel(memref_types(line)[-1].shape))
        if name in ("memref.load", "memref.store"):
            return _by_throughput("scalar_move", 1)
        if "vector<" in line:
            return _by_throughput("mlir_vector_op", 1)
        if name.startswith(("arith.", "math.")):
            return _by_throughput("scalar_float", 1)
        raise ValueError(f"timing model: no cost for {name!r} ({line[:80]}); add it to kernels/timing.py")

    def _transfer(self, line: str) -> Transfer:
        dma = parse_dma(line)
        assert dma is not None and dma.types, f"unexpected DMA form: {line[:80]}"
        dst_type, src_type = dma.types
        sizes = dma.src.sizes
        count = math.prod(self._const(s) for s in sizes) if sizes else _numel(src_type.shape)
        self.dmas += 1
        buffers = frozenset({self._buffer(dma.dst.value), self._buffer(dma.src.value)} - {None})
        if src_type.space == L1:  # every tile sends its own data
            distinct = self.herd_tiles
        else:  # one read per distinct source window: per value of the tile ids its offsets are computed from
            ids = frozenset().union(*(self.tile_ids.get(o, ()) for o in dma.src.offsets))
            distinct = math.prod(self.tile_extent[i] for i in ids)
        return Transfer(count * ELEMENT_BYTES[dst_type.dtype], src_type.space, dst_type.space, distinct, buffers)

    def _call(self, line: str) -> Compute:
        """A kernel call: its work for reports (``CallCost``), its cycles from what it executes (``core_ops``)."""
        from .builders.externs import LAST_OPERAND, MATMUL_OPERANDS, call_cost

        m = _CALL.match(line)
        symbol = m.group(1)
        cost = call_cost(symbol)
        types = split_top(m.group(3))
        shapes = [memref.shape for memref in memref_types(m.group(3))]
        if cost.work == (MATMUL_OPERANDS,):
            work = math.sqrt(_numel(shapes[0]) * _numel(shapes[1]) * _numel(shapes[2]))
        elif cost.work == (LAST_OPERAND,):
            work = _numel(shapes[-1])
        else:
            work = cost.factor * math.prod(self.defines[symbol][macro] for macro in cost.work)
        defines = dict(self.defines[symbol])
        if self.precision == "bfp16" and cost.kind == "mmul_bf16":  # the launch's precision, if its build does not say
            defines[core_ops.BFP16_DEFINE] = 1
        bfp16 = cost.kind == "mmul_bf16" and bool(defines.get(core_ops.BFP16_DEFINE))
        scalars = [operand.strip() for operand, type_ in zip(m.group(2).split(","), types) if "memref" not in type_]
        params = [p for p in core_ops.entry_points(core_ops.source_of(symbol))[symbol] if "*" not in p.kind]
        known = {p.name: self.constants[ssa] for p, ssa in zip(params, scalars)
                 if p.kind == "int" and ssa in self.constants}
        cheapest, dearest = core_ops.call_ops(symbol, defines, known)
        cycles = tuple(core_cycles(core_ops.instructions(cheapest if end.cheapest_arguments else dearest,
                                                         end.share_operands), end) for end in ENDS)
        return Compute("mmul_bfp16" if bfp16 else cost.kind, work, cycles)


class _Bound(dict):
    """SSA values, reading a block argument through the value bound to it."""

    def __init__(self, bindings: dict[str, str], values):
        super().__init__(values)
        self.bindings = bindings

    def __missing__(self, name: str):
        if name in self.bindings:
            return self[self.bindings[name]]
        raise KeyError(name)


# ---- evaluation -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepOverlap:
    """What of one launch step can run beside its neighbours in a batch of steps (seconds)."""
    seconds: float                  # the step alone
    head: float                     # its first input copy, before any compute
    head_window: float              # its own time after its last input copy, until its closing writes
    tail: float                     # its closing writes to DDR
    ddr_busy: float                 # its DDR traffic at the segment's DDR rate

    def hidden(self) -> float:
        """Time one step shares with its predecessor: the head beside the predecessor's head window, the
        predecessor's tail beside this step's work, together no more than DDR is idle in a step."""
        shared = min(self.head, self.head_window) + min(self.tail, self.seconds - self.tail)
        return max(0.0, min(shared, self.seconds - self.ddr_busy))


@dataclass
class LaunchCost:
    kind: str
    seconds: float
    iterations: int
    compute_s: dict = field(default_factory=dict)   # class → serial compute time of one tile, whole launch
    work: dict = field(default_factory=dict)        # class → work summed over every tile
    ddr_bytes: float = 0.0
    tile_dma_bytes: float = 0.0                     # memtile ↔ tile and DDR ↔ tile, summed over tiles
    conditions: list[Condition] = field(default_factory=list)  # every scf.if, with how often it is taken
    tiles: int = 0                                  # compute tiles of its largest herd

    @property
    def unevaluated_conditions(self) -> list[Condition]:
        return [c for c in self.conditions if c.unevaluated]


class _Evaluator:
    def __init__(self, omitted_spaces: frozenset, cost: LaunchCost, end: End, tiling: tuple[int, ...] = ()):
        self.omitted_spaces = omitted_spaces  # memory spaces the Program leaves single-buffered
        self.end, self.end_index = end, ENDS.index(end)
        self.tiling = tiling                  # the Program's runtime_loop_tiling_sizes
        self.cost = cost
        # inside branches: the share of executions that run them (totals), and of the slowest tile (times)
        self.work_share = self.time_share = 1.0
        self.pipeline: tuple[float, float] | None = None  # the loop just timed: (first copy, last compute)
        # the L1 buffers a herd double-buffers over its copy of the segment loop being timed, and the time of one
        # trip's copies into or out of them (``loop``)
        self.staged: set[str] = set()
        self.staged_s = 0.0
        self.step: StepOverlap | None = None              # the segment just timed

    def launch(self, region: Region) -> float:
        segment_s = self.block(region.body, copies=region.count, tiles=0, ddr_rate=self.end.ddr_bytes_per_s)
        batch = math.prod(launch_tiles(region.sizes, self.tiling))
        segments = sum(1 for item in region.body if isinstance(item, Region) and item.kind == "segment")
        hidden = self.step.hidden() if self.step and segments == 1 else 0.0
        batches = region.count // batch
        steps_s = batches * (batch * segment_s - (batch - 1) * hidden)
        return self.end.launch_s + region.count * LAUNCH_ITERATION_S + steps_s

    def segment(self, region: Region, copies: int, tiles: int, ddr_rate: float) -> float:
        """One step of a segment, and what of it overlaps its neighbours (``StepOverlap``)."""
        ddr_before = self.cost.ddr_bytes
        times, pipelines, moves_ddr = [], [], []
        for item in region.body:
            self.pipeline, item_ddr_before = None, self.cost.ddr_bytes
            times.append(self.item(item, copies, tiles, ddr_rate))
            pipelines.append(self.pipeline if isinstance(item, Region) and item.kind == "for" else None)
            moves_ddr.append(self.cost.ddr_bytes > item_ddr_before)
        seconds = sum(times)
        tail_start = len(times)
        while tail_start and isinstance(region.body[tail_start - 1], Transfer) and \
                region.body[tail_start - 1].dst_space == L3:
            tail_start -= 1
        head = head_window = 0.0
        for index, (pipeline, moved) in enumerate(zip(pipelines, moves_ddr)):
            if pipeline is not None:
                head, last_compute = pipeline
                head_window = last_compute + sum(times[index + 1:tail_start])
                break
            if moved:
                break  # DDR traffic before any pipeline: no head to move
        busy = (self.cost.ddr_bytes - ddr_before) / max(copies, 1) / ddr_rate
        self.step = StepOverlap(seconds, head, head_window, sum(times[tail_start:]), busy)
        return seconds

    def block(self, items, copies: int, tiles: int, ddr_rate: float) -> float:
        """Time of a sequence of items run ``copies`` times over, each by ``tiles`` tiles in parallel (0: by the
        segment, outside any herd)."""
        return sum(self.item(i, copies, tiles, ddr_rate) for i in items)

    def item(self, item, copies: int, tiles: int, ddr_rate: float) -> float:
        if isinstance(item, Compute):
            seconds = item.cycles[self.end_index] / DEVICE.clock_hz
            done = item.work * copies * max(tiles, 1) * self.work_share
            self.cost.work[item.kind] = self.cost.work.get(item.kind, 0.0) + done
            serial = seconds * copies * self.time_share
            self.cost.compute_s[item.kind] = self.cost.compute_s.get(item.kind, 0.0) + serial
            return seconds
        if isinstance(item, Transfer):
            return self.transfer(item, copies, tiles, ddr_rate)
        if item.kind == "segment":
            columns = max((r.sizes[0] for r in _regions(item, "herd")), default=1)
            rate = min(self.end.ddr_bytes_per_s, columns * SHIM_COLUMN_BYTES_PER_S)
            return self.segment(item, copies, tiles, rate)
        if item.kind == "herd":
            return self.block(item.body, copies, max(tiles, 1) * item.count, ddr_rate)
        if item.kind == "for":
            return self.loop(item, copies, tiles, ddr_rate)
        if item.kind == "if":
            return self.branch(item, copies, tiles, ddr_rate)
        raise AssertionError(f"{item.kind} inside a launch")

    def transfer(self, t: Transfer, copies: int, tiles: int, ddr_rate: float) -> float:
        reads = t.distinct if tiles else 1   # a copy several tiles make alike is one broadcast read
        if L3 in (t.src_space, t.dst_space):
            self.cost.ddr_bytes += t.nbytes * copies * reads * self.work_share
        if L1 in (t.src_space, t.dst_space):
            self.cost.tile_dma_bytes += t.nbytes * copies * tiles * self.work_share
            rate = DEVICE.tile_channel_bytes_per_s
            if L3 in (t.src_space, t.dst_space):
                rate = min(rate, ddr_rate / reads)
            if t.buffers & self.staged:  # a stage of the loop being timed (``loop``)
                self.staged_s += t.nbytes / rate
                return 0.0
            return t.nbytes / rate
        return t.nbytes / ddr_rate

    def loop(self, region: Region, copies: int, tiles: int, ddr_rate: float) -> float:
        trips = region.sizes[0]
        inner = copies * trips
        transfers = [i for i in region.body if isinstance(i, Transfer)]
        rest = [i for i in region.body if not isinstance(i, Transfer)]
        # the herds' copies into or out of their buffers double-buffered over their copy of this loop: a stage of
        # the pipeline of their own, timed apart from the herds' other work
        outer_staged, self.staged = self.staged, (set(region.herd_buffers)
                                                  if self.double_buffered(region, region.herd_buffers) else set())
        outer_staged_s, self.staged_s = self.staged_s, 0.0
        compute = self.block(rest, inner, tiles, ddr_rate)
        staged_dma = self.staged_s
        self.staged, self.staged_s = outer_staged, outer_staged_s
        pingpong = region.buffers.keys() if rest and self.double_buffered(region, region.buffers) else set()
        overlapped = [t for t in transfers if t.buffers & pingpong]
        serial = [t for t in transfers if not t.buffers & pingpong]
        overlapped_dma = self.dma_time(overlapped, inner, tiles, ddr_rate)
        serial_dma = self.dma_time(serial, inner, tiles, ddr_rate)
        if overlapped or staged_dma:
            # a pipeline: the first trip's copies, then each trip's compute beside the next trip's copies, then the
            # last compute (never slower than running the trips in sequence)
            if not tiles and not serial:
                self.pipeline = (overlapped_dma + staged_dma, compute)
            return (overlapped_dma + staged_dma + (trips - 1) * max(compute, overlapped_dma, staged_dma) + compute
                    + trips * serial_dma)
        return trips * (compute + serial_dma)

    def double_buffered(self, region: Region, buffers: dict[str, int]) -> bool:
        """air-label-scf-for-to-ping-pong labels a loop that allocates a buffer in its body (``buffers``: the
        loop's own, or those of the herd's copy of it), unless one of those buffers is in a memory space the
        Program omits; air-ping-pong-transform unrolls it by two and chains the ping and pong copies through the
        unrolled loop, so a loop of two trips (unrolled away: its second trip waits for the first) or of an odd
        count (not seen on our IR, so not claimed) stays sequential."""
        trips = region.sizes[0]
        return (bool(buffers) and trips >= 4 and trips % 2 == 0
                and not set(buffers.values()) & self.omitted_spaces)

    def dma_time(self, transfers: list[Transfer], copies: int, tiles: int, ddr_rate: float) -> float:
        times = [self.transfer(t, copies, tiles, ddr_rate) for t in transfers]
        if not tiles:
            return sum(times)
        # Inside a herd, a tile's copies spread over its two channels each way, but every tile's DDR copies
        # share DDR: together they take at least their bytes over the DDR rate.
        ddr = sum(t.nbytes * t.distinct for t in transfers if L3 in (t.src_space, t.dst_space)) / ddr_rate
        return max(max(times, default=0.0), sum(times) / DEVICE.tile_channels_per_direction, ddr)

    def branch(self, region: Region, copies: int, tiles: int, ddr_rate: float) -> float:
        """One execution of an scf.if branch: its body's time, weighted by how often it runs."""
        outer = self.work_share, self.time_share
        self.work_share, self.time_share = outer[0] * region.work_share, outer[1] * region.time_share
        body_s = self.block(region.body, copies, tiles, ddr_rate)
        self.work_share, self.time_share = outer
        return region.time_share * body_s


def _regions(region: Region, kind: str):
    for item in region.body:
        if isinstance(item, Region):
            if item.kind == kind:
                yield item
            yield from _regions(item, kind)


def launch_cost(ir, compile_options, end: End, precision: str | None = None) -> LaunchCost:
    """Predicted time of one launch at ``end`` from its builder output (``LaunchIR``) and the Program's aircc
    options. ``precision`` is the launch's matmul precision parameter, if it has one."""
    parser = _Parser(ir.externs, precision)
    root = parser.parse(ir.text)
    assert parser.dmas == len(ir.dmas), f"parsed {parser.dmas} DMAs, the builder recorded {len(ir.dmas)}"
    (launch,) = root.body
    cost = LaunchCost(ir.kind, 0.0, launch.count, conditions=parser.conditions,
                      tiles=max((herd.count for herd in _regions(launch, "herd")), default=0))
    evaluator = _Evaluator(OMITTED_SPACES[compile_options.omit_pingpong], cost, end,
                           compile_options.runtime_loop_tiling_sizes)
    cost.seconds = evaluator.launch(launch)
    return cost


@dataclass(frozen=True)
class PingPongBuffer:
    """A buffer AIR double-buffers over a loop: where the loop runs, its trips, the buffer's memory space."""
    level: str                      # "herd" (a loop on the tiles) or "segment"
    trips: int
    space: int


def pingpong_buffers(ir, compile_options) -> set[PingPongBuffer]:
    """The buffers of one launch (``LaunchIR``) the model double-buffers, by the rule in the module doc."""
    evaluator = _Evaluator(OMITTED_SPACES[compile_options.omit_pingpong], LaunchCost(ir.kind, 0.0, 0), FAST)
    found = set()

    def walk(region: Region, level: str) -> None:
        for item in region.body:
            if not isinstance(item, Region):
                continue
            if item.kind == "for" and evaluator.double_buffered(item, item.buffers):
                found.update(PingPongBuffer(level, item.sizes[0], space) for space in item.buffers.values())
            if item.kind == "for" and evaluator.double_buffered(item, item.herd_buffers):
                found.update(PingPongBuffer("herd", item.sizes[0], L1) for _ in item.herd_buffers)
            walk(item, "herd" if item.kind == "herd" else level)

    walk(_Parser(ir.externs, None).parse(ir.text), "segment")
    return found


@dataclass
class ProgramCost:
    name: str
    seconds: float
    launches: list[LaunchCost]

    def compute_s(self) -> dict:
        total: dict = {}
        for launch in self.launches:
            for cls, s in launch.compute_s.items():
                total[cls] = total.get(cls, 0.0) + s
        return total

    def summary(self) -> dict:
        return {"program": self.name, "predicted_ms": self.seconds * 1e3,
                "launch_iterations": sum(l.iterations for l in self.launches),
                "ddr_mb": sum(l.ddr_bytes for l in self.launches) / 1e6,
                "compute_ms_by_class": {c: s * 1e3 for c, s in sorted(self.compute_s().items())},
                "launches": [{"kind": l.kind, "predicted_ms": l.seconds * 1e3, "iterations": l.iterations}
                             for l in self.launches],
                "conditions": [{"launch": l.kind, **asdict(c)} for l in self.launches for c in l.conditions]}


def run_seconds(launches: list[LaunchCost], end: End) -> float:
    """A Program run of ``launches`` at ``end``: one dispatch (its first launch's device configured with it), the
    launches, and entering each further launch's device."""
    return end.dispatch_s + (len(launches) - 1) * end.configure_s + sum(l.seconds for l in launches)


def program_cost(program, end: End) -> ProgramCost:
    """Predicted time of one run of ``program`` at ``end`` (``run_seconds``)."""
    from .builders import build_launch

    launches = [launch_cost(build_launch(program, launch), program.compile_options, end, launch.p.get("precision"))
                for launch in program.launches]
    return ProgramCost(program.name, run_seconds(launches, end), launches)

