"""Predicted NPU2 times derived from the MLIR-AIR we emit: a cost MODEL, never a measurement.

Every launch of a Program is built by its builder (``kernels.builders.build_launch``) and the model walks that
IR — air.launch → air.segment → air.herd, scf.for trip counts, DMAs, compute — without compiling it:

* compute, per tile: each op's work (MACs or elements) over the throughput of the code that does it. A
  ``func.call`` into one of our AIE2P kernels takes the class its symbol declares (``CALL_COSTS`` in
  kernels/builders/externs.py: vectorized mmul, vector MAC, vector elementwise, ...); ``linalg.matmul`` and
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
  loop, runs in sequence (tests/benchmarks/test_cost_model_pingpong.py checks the rule against the real passes);
* launch steps: aircc tiles the launch nest by the Program's ``runtime_loop_tiling_sizes`` (each dimension by
  its largest factor not above the size, ``kernels.lint.launch_tiles``) and its runtime sequence starts every
  shim DMA task of one batch of steps before it awaits the batch's outputs (tests/benchmarks/
  test_cost_model_batches.py counts them in the real lowering). Inside a batch, nothing but the buffers orders
  one step after the next: a step's first input copy (the first copy of its first double-buffered loop, into a
  buffer the previous step's last trip no longer uses) runs beside the previous step's last compute, and its
  closing writes to DDR run beside the next step's work, as far as DDR is idle then; between batches, steps
  run in sequence;
* overheads: each air.launch iteration, each launch of the multi-launch ELF, one dispatch per Program run;
* branches: an ``scf.if`` is counted as the IR executes it. Its condition is evaluated (with the interpreter's
  integer arithmetic, ``kernels.interpret.IndexArithmetic``) at every point of the iteration space it depends
  on — launch ids, herd tile ids, enclosing ``scf.for`` induction variables — and the branch's work and bytes
  are charged by the fraction of points that take it; its time by that fraction for the slowest tile of each
  herd (tiles run in parallel, launch steps and loop trips in sequence). A condition the model cannot evaluate
  (an op outside that arithmetic, a value loaded from memory) is counted as always taken and reported in
  ``LaunchCost.conditions``.

Each constant below says where it comes from. Where upstream's published times are used, they calibrate only
a class of the same code, each as the tightest lower bound a measurement proves: the BFP16 mmul rate from
upstream's standalone GEMMs measured on NPU2 (its kernel registry), the DDR bandwidth from those GEMMs and its
LM-head GEMV. ``upstream_gemm_replay`` checks the result: the model, given each of those GEMMs at its
published tiling, must land near the measured time. Everything else is a stated hardware fact or an
assumption, labelled as such. KERNELS.md and FACTS.md are the team's design notes
(``shared/design/`` beside this repository, not part of it): each figure taken from them is quoted where used.
"""
from __future__ import annotations

import itertools
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from torch_npu2.kernels.lint import launch_tiles

from . import common

LLAMA_1B_LAYERS = 16
REFERENCE_SEQ = 2048
PROMPTS = (32, 128, 2048)

# ---- hardware and overheads -----------------------------------------------------------------------------
# FACTS.md's 59 TFLOP/s peak for 32 tiles at one 8×8×8 BFP16 mmul (512 MACs) per cycle: 59e12 / (2·512·32) Hz.
CLOCK_HZ = 1.8e9
# A tile DMA channel moves one 32-bit stream word per cycle (an assumption: the AIE-ML stream width); a compute
# tile has two input and two output channels.
TILE_CHANNEL_BYTES_PER_S = 4 * CLOCK_HZ
TILE_CHANNELS = 2
SHIM_COLUMN_BYTES_PER_S = 14e9  # FACTS.md: measured ≈ 14 GB/s per column
# Upstream's standalone bf16-in/bf16-out GEMMs measured on NPU2 (mlir-air kernel_registry/details/
# GEMM_bf16_in_bf16_out.md, "drain" method: an in-herd f32 → bf16 drain like ours, BFP16-emulated multiplies,
# 8×4 herd, June 2026): (M, K, N) → (tile_m, tile_k_l2, tile_k_l1, tile_n), GFLOP/s. They calibrate the BFP16
# mmul rate and the DDR bandwidth below, and ``upstream_gemm_replay`` runs each through the model at its tiling.
UPSTREAM_DRAIN_GEMMS = {
    (2048, 2048, 2048): ((32, 512, 32, 128), 6025), (2048, 2048, 512): ((32, 256, 32, 128), 5626),
    (2048, 2048, 8192): ((32, 256, 32, 128), 5784), (2048, 8192, 2048): ((32, 256, 32, 128), 7234),
    (512, 512, 512): ((32, 256, 32, 128), 1703), (1024, 1024, 1024): ((32, 256, 32, 128), 4637),
    (4096, 4096, 4096): ((32, 512, 32, 128), 7002),
}


def _measured_s(shape, gflops) -> float:
    M, K, N = shape
    return 2 * M * K * N / (gflops * 1e9)


def drain_gemm_ddr_bytes(shape, tile_m: int, tile_n: int) -> int:
    """DDR bytes of a drain GEMM on an 8×4 herd, one (8·tile_m)×(4·tile_n) output block per launch step: A read
    again for every block column, W for every block row, C written once (bf16)."""
    M, K, N = shape
    return 2 * (M * K * (N // (4 * tile_n)) + N * K * (M // (8 * tile_m)) + M * N)


# Calibrated: the most DDR bandwidth a published measurement proves. Upstream's lm_head_gemv streams its
# 128256×2048 bf16 weight (525 MB) in 13.6 ms (38.6 GB/s); its 2048×8192×2048 drain GEMM moves 411 MB in 9.50 ms
# (43.3 GB/s, the most of UPSTREAM_DRAIN_GEMMS; FACTS.md: 36–57 GB/s seen in practice). Either is a lower bound
# on what DDR delivers, so the larger is the tighter one.
DDR_BYTES_PER_S = max(128256 * 2048 * 2 / 13.6e-3,
                      *(drain_gemm_ddr_bytes(shape, tiles[0], tiles[3]) / _measured_s(shape, gflops)
                        for shape, (tiles, gflops) in UPSTREAM_DRAIN_GEMMS.items()))
DISPATCH_S = 80e-6           # FACTS.md: a dispatch costs 50–110 µs; the midpoint
LAUNCH_S = 9e-6              # FACTS.md: a step inside a multi-launch ELF costs 3–15 µs; the midpoint
LAUNCH_ITERATION_S = 3e-6    # assumption: an air.launch iteration reprograms shim BDs and waits, FACTS' smallest step

# ---- throughput classes: work per cycle per tile ------------------------------------------------------------
# The rate upstream's fastest measured GEMM proves for its BFP16 mmul kernel, per tile of its 8×4 herd.
MMUL_BFP16_MACS_PER_CYCLE = max(gflops * 1e9 / 2 / (32 * CLOCK_HZ) for _, gflops in UPSTREAM_DRAIN_GEMMS.values())


@dataclass(frozen=True)
class Throughput:
    per_cycle: float
    unit: str
    source: str


THROUGHPUT = {
    "mmul_bfp16": Throughput(
        MMUL_BFP16_MACS_PER_CYCLE, "MAC",
        "calibrated: the fastest of upstream's measured standalone drain GEMMs (UPSTREAM_DRAIN_GEMMS, BFP16-"
        "emulated, 8×4 herd), 2048×8192×2048 at 7234 GFLOP/s, all of its time charged to its MACs: a lower bound "
        "on the kernel's rate (peak 512)"),
    "mmul_bf16": Throughput(
        MMUL_BFP16_MACS_PER_CYCLE / 2, "MAC", "half of mmul_bfp16: exact bf16 runs each 8×8×8 mmul as two 4×8×8 "
        "intrinsics on AIE2P (AIE API aie2p mmul_bf16_bf16), BFP16 emulation as one 8×8×8"),
    "vector_mac": Throughput(
        32.0, "MAC", "assumption: gemv.cc issues one 32-lane aie::mac per step, taken as one per cycle (decode "
        "GEMVs are DMA-bound, so this hardly matters)"),
    "vector_elementwise": Throughput(
        16.0, "element", "assumption: one 16-lane vector operation per cycle (512-bit f32 accumulators)"),
    "vector_transcendental": Throughput(
        4.0, "element", "assumption: a tanh/exp2 over 16 lanes takes about four vector operations"),
    "mlir_vector_op": Throughput(
        1.0, "op", "assumption: each MLIR vector op (≤ 16 lanes) is one instruction; Peano may split bf16 ones"),
    "scalar_mac": Throughput(
        0.05, "MAC", "KERNELS.md: scalar code on a tile runs ≈ 0.02–0.1 MAC/cycle (software-emulated float); "
        "linalg.matmul reaches the core as scalar loops (aircc's convert-linalg-to-loops)"),
    "scalar_float": Throughput(
        0.05, "op", "the scalar_mac estimate for any other float op on the scalar unit (linalg.generic, "
        "arith.*f and math.* on scalars)"),
    "scalar_move": Throughput(1.0, "element", "assumption: one scalar load or store per cycle (linalg.fill, "
                                              "memref.load/store)"),
}
PUBLISHED_MS = {  # upstream llama32_1b on Strix, per call (KERNELS.md)
    ("rms_gemms_rope", REFERENCE_SEQ): 7.3, ("flash_attn", REFERENCE_SEQ): 21.6, ("o_ffn", REFERENCE_SEQ): 41.0,
    ("rms_gemv_rope", None): 0.9, ("o_gemv_ffn", None): 3.6, ("lm_head_gemv", None): 13.6,
}
GEMM_PROGRAMS = ("rms_gemms_rope", "o_ffn")  # the Programs whose GEMMs take a matmul precision
PUBLISHED_O_GEMV_FFN_3_LAUNCH_MS = 2.6
PUBLISHED_PREFILL_2048_S = 1.21          # every prompt padded to 2048
PUBLISHED_DECODE_TOKENS_PER_S = 12.2

L3, L2, L1 = 0, 1, 2
# CompileOptions.omit_pingpong → the memory spaces left single-buffered
OMITTED_SPACES = {"": frozenset(), "L1": frozenset({L1}), "L2": frozenset({L2}), "all": frozenset({L1, L2})}
ELEMENT_BYTES = {"bf16": 2, "f32": 4, "i32": 4}
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

    @property
    def count(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Compute:
    throughput: str
    work: float                     # in the class's unit, one execution


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


_MEMREF = re.compile(r"memref<((?:\d+x)*)(bf16|f32|i32)(?:, strided<[^>]*>)?(?:, (\d) : i32)?>")
_CONSTANT = re.compile(r"^(%[\w]+) = arith\.constant (-?\d+) : (?:index|i32)$")
_SSA = re.compile(r"%[\w]+")
_DMA = re.compile(r"^air\.dma_memcpy_nd \((%\w+)\[([^\]]*)\] \[([^\]]*)\] \[[^\]]*\], "
                  r"(%\w+)\[([^\]]*)\] \[([^\]]*)\] \[[^\]]*\]\) : \((.*)\)$")
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


def memref_types(text: str) -> list[tuple[tuple[int, ...], str, int]]:
    """(shape, dtype, memory space) of every memref type in ``text``, in order."""
    return [(tuple(int(d) for d in dims.split("x") if d), dtype, int(space or L3))
            for dims, dtype, space in _MEMREF.findall(text)]


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
            self.buffer_spaces[name], self.buffer_herds[name] = memref_types(line)[0][2], herd
            scope = max(i for i, r in enumerate(stack) if r.kind in ("segment", "herd"))
            self.buffer_outside[name] = sum(r.kind == "for" for r in stack[:scope])
            return
        if line.startswith("memref.dealloc"):  # fusion moves deallocs along with their allocs
            return
        loops = tuple(r for r in stack if r.kind == "for")
        around_herd = tuple(r for r in stack[:herds[-1]] if r.kind == "for") if herds else loops
        rhs = line.split(" = ", 1)[1] if line.startswith("%") and " = " in line else line
        for buffer in {self._buffer(v) for v in _SSA.findall(rhs)} - {None}:
            self.buffer_uses.setdefault(buffer, []).append((loops, herd, around_herd))

    def _fuse_buffers_into_loops(self) -> None:
        """air-fuse-alloc-dealloc: each buffer goes into the innermost loop around every one of its users.

        An L2 buffer a herd copies from or to is, after air-dma-to-channel, used by a channel op in the segment
        inside the herd's loops too: its uses count where they are. An L1 buffer a herd takes as an argument is
        used by the herd op: where the herd is, unless that herd is its only user, which the alloc then moves
        into (air-fuse-alloc-dealloc on the hierarchy), to fuse it into the herd's own loops."""
        for buffer, uses in self.buffer_uses.items():
            home = self.buffer_herds[buffer]
            positions, outside = [loops for loops, _, _ in uses], self.buffer_outside[buffer]
            if self.buffer_spaces[buffer] == L1 and any(herd is not home for _, herd, _ in uses):
                (herd, *others) = [herd for _, herd, _ in uses]
                if all(other is herd for other in others):
                    positions, outside = [loops[len(around):] for loops, _, around in uses], 0
                else:
                    positions = [loops if user is home else around for loops, user, around in uses]
            common = []
            for levels in zip(*positions):
                if any(loop is not levels[0] for loop in levels):
                    break
                common.append(levels[0])
            if len(common) > outside:  # a loop inside the segment or herd allocating it
                common[-1].buffers[buffer] = self.buffer_spaces[buffer]

    def _const(self, name: str) -> int:
        try:
            return self.constants[name]
        except KeyError:
            raise ValueError(f"cost model: {name} is not an integer constant in this launch") from None

    def _track_values(self, line: str) -> None:
        if m := _CONSTANT.match(line):
            self.constants[m.group(1)] = int(m.group(2))
        if " = " in line and line.startswith("%"):
            result, rhs = line.split(" = ", 1)
            self.definitions[result] = line
            self.tile_ids[result] = frozenset().union(*(self.tile_ids.get(v, ()) for v in _SSA.findall(rhs)))

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
        from torch_npu2.kernels.interpret import IndexArithmetic, InterpretError, parse_op

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
            for operand in _SSA.findall(line.split(" = ", 1)[1]):
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
            return Compute("scalar_mac", math.sqrt(_numel(a[0]) * _numel(b[0]) * _numel(c[0])))
        if name == "linalg.generic":
            return Compute("scalar_float", _numel(memref_types(line)[-1][0]))
        if name == "linalg.fill":
            return Compute("scalar_move", _numel(memref_types(line)[-1][0]))
        if name in ("memref.load", "memref.store"):
            return Compute("scalar_move", 1)
        if "vector<" in line:
            return Compute("mlir_vector_op", 1)
        if name.startswith(("arith.", "math.")):
            return Compute("scalar_float", 1)
        raise ValueError(f"cost model: no cost for {name!r} ({line[:80]}); add it to benchmarks/cost_model.py")

    def _transfer(self, line: str) -> Transfer:
        m = _DMA.match(line)
        assert m, f"unexpected DMA form: {line[:80]}"
        (dst_shape, dtype, dst_space), (src_shape, _, src_space) = memref_types(m.group(7))
        sizes = [s.strip() for s in m.group(6).split(",") if s.strip()]
        count = math.prod(self._const(s) for s in sizes) if sizes else _numel(src_shape)
        self.dmas += 1
        buffers = frozenset({self._buffer(m.group(1)), self._buffer(m.group(4))} - {None})
        if src_space == L1:  # every tile sends its own data
            distinct = self.herd_tiles
        else:  # one read per distinct source window: per value of the tile ids its offsets are computed from
            offsets = [o.strip() for o in m.group(5).split(",") if o.strip()]
            ids = frozenset().union(*(self.tile_ids.get(o, ()) for o in offsets))
            distinct = math.prod(self.tile_extent[i] for i in ids)
        return Transfer(count * ELEMENT_BYTES[dtype], src_space, dst_space, distinct, buffers)

    def _call(self, line: str) -> Compute:
        from torch_npu2.kernels.builders.externs import LAST_OPERAND, MATMUL_OPERANDS, call_cost

        m = _CALL.match(line)
        symbol = m.group(1)
        cost = call_cost(symbol)
        shapes = [shape for shape, _, _ in memref_types(m.group(3))]
        if cost.work == (MATMUL_OPERANDS,):
            work = math.sqrt(_numel(shapes[0]) * _numel(shapes[1]) * _numel(shapes[2]))
        elif cost.work == (LAST_OPERAND,):
            work = _numel(shapes[-1])
        else:
            work = math.prod(self.defines[symbol][macro] for macro in cost.work)
        throughput = cost.kind
        if throughput == "mmul_bf16" and self._bfp16(symbol):
            throughput = "mmul_bfp16"
        return Compute(throughput, work)

    def _bfp16(self, symbol: str) -> bool:
        """BFP16 emulation is a -D choice of the call's build (a define naming BFP16, set), or the launch's
        ``precision`` parameter when the build flag is not among the call's configuration macros."""
        named = any("BFP16" in macro.upper() and value for macro, value in self.defines[symbol].items())
        return named or self.precision == "bfp16"


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

    @property
    def unevaluated_conditions(self) -> list[Condition]:
        return [c for c in self.conditions if c.unevaluated]


class _Evaluator:
    def __init__(self, omitted_spaces: frozenset, cost: LaunchCost, tiling: tuple[int, ...] = ()):
        self.omitted_spaces = omitted_spaces  # memory spaces the Program leaves single-buffered
        self.tiling = tiling                  # the Program's runtime_loop_tiling_sizes
        self.cost = cost
        # inside branches: the share of executions that run them (totals), and of the slowest tile (times)
        self.work_share = self.time_share = 1.0
        self.pipeline: tuple[float, float] | None = None  # the loop just timed: (first copy, last compute)
        self.step: StepOverlap | None = None              # the segment just timed

    def launch(self, region: Region) -> float:
        segment_s = self.block(region.body, copies=region.count, tiles=0, ddr_rate=DDR_BYTES_PER_S)
        batch = math.prod(launch_tiles(region.sizes, self.tiling))
        segments = sum(1 for item in region.body if isinstance(item, Region) and item.kind == "segment")
        hidden = self.step.hidden() if self.step and segments == 1 else 0.0
        batches = region.count // batch
        return LAUNCH_S + region.count * LAUNCH_ITERATION_S + batches * (batch * segment_s - (batch - 1) * hidden)

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
            rate = THROUGHPUT[item.throughput].per_cycle * CLOCK_HZ
            done = item.work * copies * max(tiles, 1) * self.work_share
            self.cost.work[item.throughput] = self.cost.work.get(item.throughput, 0.0) + done
            self.cost.compute_s[item.throughput] = self.cost.compute_s.get(item.throughput, 0.0) + \
                item.work / rate * copies * self.time_share
            return item.work / rate
        if isinstance(item, Transfer):
            return self.transfer(item, copies, tiles, ddr_rate)
        if item.kind == "segment":
            columns = max((r.sizes[0] for r in _regions(item, "herd")), default=1)
            rate = min(DDR_BYTES_PER_S, columns * SHIM_COLUMN_BYTES_PER_S)
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
            rate = TILE_CHANNEL_BYTES_PER_S
            if L3 in (t.src_space, t.dst_space):
                rate = min(rate, ddr_rate / reads)
            return t.nbytes / rate
        return t.nbytes / ddr_rate

    def loop(self, region: Region, copies: int, tiles: int, ddr_rate: float) -> float:
        trips = region.sizes[0]
        inner = copies * trips
        transfers = [i for i in region.body if isinstance(i, Transfer)]
        rest = [i for i in region.body if not isinstance(i, Transfer)]
        compute = self.block(rest, inner, tiles, ddr_rate)
        pingpong = region.buffers.keys() if rest and self.double_buffered(region) else set()
        overlapped = [t for t in transfers if t.buffers & pingpong]
        serial = [t for t in transfers if not t.buffers & pingpong]
        overlapped_dma = self.dma_time(overlapped, inner, tiles, ddr_rate)
        serial_dma = self.dma_time(serial, inner, tiles, ddr_rate)
        if overlapped:
            # a pipeline: the first trip's copies, then each trip's compute beside the next trip's copies, then the
            # last compute (never slower than running the trips in sequence)
            if not tiles and not serial:
                self.pipeline = (overlapped_dma, compute)
            return overlapped_dma + (trips - 1) * max(compute, overlapped_dma) + compute + trips * serial_dma
        return trips * (compute + serial_dma)

    def double_buffered(self, region: Region) -> bool:
        """air-label-scf-for-to-ping-pong labels a loop that allocates a buffer in its body, unless one of those
        buffers is in a memory space the Program omits; air-ping-pong-transform unrolls it by two and chains the
        ping and pong copies through the unrolled loop, so a loop of two trips (unrolled away: its second trip
        waits for the first) or of an odd count (not seen on our IR, so not claimed) stays sequential."""
        trips = region.sizes[0]
        return (bool(region.buffers) and trips >= 4 and trips % 2 == 0
                and not set(region.buffers.values()) & self.omitted_spaces)

    def dma_time(self, transfers: list[Transfer], copies: int, tiles: int, ddr_rate: float) -> float:
        times = [self.transfer(t, copies, tiles, ddr_rate) for t in transfers]
        if not tiles:
            return sum(times)
        # Inside a herd, a tile's copies spread over its two channels each way, but every tile's DDR copies
        # share DDR: together they take at least their bytes over the DDR rate.
        ddr = sum(t.nbytes * t.distinct for t in transfers if L3 in (t.src_space, t.dst_space)) / ddr_rate
        return max(max(times, default=0.0), sum(times) / TILE_CHANNELS, ddr)

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


def launch_cost(ir, compile_options, precision: str | None = None) -> LaunchCost:
    """Predicted time of one launch from its builder output (``LaunchIR``) and the Program's aircc options.
    ``precision`` is the launch's matmul precision parameter, if it has one."""
    parser = _Parser(ir.externs, precision)
    root = parser.parse(ir.text)
    assert parser.dmas == len(ir.dmas), f"parsed {parser.dmas} DMAs, the builder recorded {len(ir.dmas)}"
    (launch,) = root.body
    cost = LaunchCost(ir.kind, 0.0, launch.count, conditions=parser.conditions)
    evaluator = _Evaluator(OMITTED_SPACES[compile_options.omit_pingpong], cost,
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
    evaluator = _Evaluator(OMITTED_SPACES[compile_options.omit_pingpong], LaunchCost(ir.kind, 0.0, 0))
    found = set()

    def walk(region: Region, level: str) -> None:
        for item in region.body:
            if not isinstance(item, Region):
                continue
            if item.kind == "for" and evaluator.double_buffered(item):
                found.update(PingPongBuffer(level, item.sizes[0], space) for space in item.buffers.values())
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


def program_cost(program) -> ProgramCost:
    from torch_npu2.kernels.builders import build_launch

    launches = [launch_cost(build_launch(program, launch), program.compile_options, launch.p.get("precision"))
                for launch in program.launches]
    return ProgramCost(program.name, DISPATCH_S + sum(l.seconds for l in launches), launches)


def gemm_program(M: int, K: int, N: int, precision: str = "bfp16", compile_options=None):
    """A Program of one prefill GEMM, ``C = A · Wᵀ`` (the prefill Programs' aircc options unless given)."""
    from torch_npu2.kernels.catalog import PREFILL_OPTIONS
    from torch_npu2.kernels.program import Arg, Launch, Program, Role

    return Program("gemm", (Arg("a", (M, K), "bf16", Role.INPUT), Arg("w", (N, K), "bf16", Role.WEIGHT),
                            Arg("c", (M, N), "bf16", Role.OUTPUT)),
                   (Launch("gemm", (("M", M), ("K", K), ("N", N), ("precision", precision)), ("a", "w"), ("c",)),),
                   compile_options=compile_options or PREFILL_OPTIONS)


def upstream_gemm_replay() -> list[dict]:
    """Each of upstream's measured drain GEMMs (``UPSTREAM_DRAIN_GEMMS``) through the model: our gemm builder at
    upstream's shape and tiling, BFP16 multiplies, one dispatch, against the time upstream measured; and, in the
    same model, the shape at the tiling our builder chooses."""
    from torch_npu2.kernels.builders import build_launch

    rows = []
    for (M, K, N), ((tile_m, tile_k_l2, tile_k_l1, tile_n), gflops) in UPSTREAM_DRAIN_GEMMS.items():
        program = gemm_program(M, K, N)
        tuning = {"herd_m": 8, "herd_n": 4, "tile_m": tile_m, "tile_n": tile_n, "tile_k_l1": tile_k_l1,
                  "tile_k_l2": tile_k_l2, "drain_n": tile_n}  # upstream's drain rounds the whole tile
        launch = program.launches[0]
        cost = launch_cost(build_launch(program, launch, tuning), program.compile_options, "bfp16")
        ours = launch_cost(build_launch(program, launch), program.compile_options, "bfp16")
        measured_ms = _measured_s((M, K, N), gflops) * 1e3
        predicted_ms = (DISPATCH_S + cost.seconds) * 1e3
        rows.append({"shape": [M, K, N], "tiles": [tile_m, tile_k_l2, tile_k_l1, tile_n],
                     "measured_ms": measured_ms, "predicted_ms": predicted_ms, "ratio": predicted_ms / measured_ms,
                     "ddr_mb": cost.ddr_bytes / 1e6, "predicted_ours_ms": (DISPATCH_S + ours.seconds) * 1e3})
    return rows


# ---- Llama-3.2-1B predictions -------------------------------------------------------------------------------
def llama_1b_dims():
    from torch_npu2.kernels.catalog import ModelDims

    return ModelDims.from_config(common.llama_config(**common.LLAMA_1B_SHAPE))


def program(name: str, dims, seq: int | None = None, precision: str = "bf16"):
    """Llama-3.2-1B's Program ``name`` (prefill Programs at ``seq`` rows, their GEMMs at matmul ``precision``)."""
    from torch_npu2.kernels import catalog

    d = dims
    build = {
        "rms_gemms_rope": lambda: catalog.rms_gemms_rope_program(d.hidden, d.heads, d.kv_heads, d.head_dim, d.eps, seq,
                                                                 precision),
        "flash_attn": lambda: catalog.flash_attn_program(d.heads, d.kv_heads, d.head_dim, seq),
        "o_ffn": lambda: catalog.o_ffn_program(d.hidden, d.q_dim, d.intermediate, d.eps, seq, precision),
        "rms_gemv_rope": lambda: catalog.rms_gemv_rope_program(d.hidden, d.heads, d.kv_heads, d.head_dim, d.eps),
        "o_gemv_ffn": lambda: catalog.o_gemv_ffn_program(d.hidden, d.q_dim, d.intermediate, d.eps),
        "o_gemv_ffn_rms_gemv_rope": lambda: catalog.o_gemv_ffn_rms_gemv_rope_program(
            d.hidden, d.q_dim, d.intermediate, d.eps, d.heads, d.kv_heads, d.head_dim, d.eps),
        "lm_head_gemv": lambda: catalog.lm_head_gemv_program(d.hidden, d.vocab),
    }
    return build[name]()


@lru_cache(maxsize=None)
def _seconds(name: str, dims, seq: int | None, precision: str = "bf16") -> float:
    return program_cost(program(name, dims, seq, precision)).seconds


def decode_ms(dims, layers: int) -> float:
    """NPU time of one decode token, following NpuDecoderLayer: rms_gemv_rope for the first layer, then per layer
    o_gemv_ffn_rms_gemv_rope (its o_gemv_ffn and the next layer's rms_gemv_rope in one dispatch), o_gemv_ffn for
    the last; then the LM head."""
    chained = _seconds("o_gemv_ffn_rms_gemv_rope", dims, None) * (layers - 1)
    ends = _seconds("rms_gemv_rope", dims, None) + _seconds("o_gemv_ffn", dims, None)
    return (ends + chained + _seconds("lm_head_gemv", dims, None)) * 1e3


def prefill_ms(dims, layers: int, chunks, precision: str = "bf16") -> float:
    """NPU time of a prefill over ``chunks`` [(start, stop, padded)] with the GEMMs at matmul ``precision``,
    following NpuDecoderLayer: flash_attn runs on the NPU only for a single chunk (several chunks attend on the
    host, not modelled here); then the LM head on the last row."""
    per_layer = 0.0
    for _, _, padded in chunks:
        per_layer += _seconds("rms_gemms_rope", dims, padded, precision) + _seconds("o_ffn", dims, padded, precision)
        if len(chunks) == 1:
            per_layer += _seconds("flash_attn", dims, padded)
    return (layers * per_layer + _seconds("lm_head_gemv", dims, None)) * 1e3


def per_program(dims) -> list[dict]:
    """Each Program upstream publishes a time for; a prefill Program also with its GEMMs at bfp16 (upstream's
    mode: its published times are of BFP16-emulated GEMMs) and with only its gate/up GEMM at bfp16."""
    rows = []
    for (name, seq), published in PUBLISHED_MS.items():
        row = program_cost(program(name, dims, seq)).summary()
        gemms = name in GEMM_PROGRAMS
        rows.append({**row, "seq": seq, "upstream_published_ms": published,
                     "ratio_to_upstream": row["predicted_ms"] / published,
                     "predicted_ms_bfp16": _seconds(name, dims, seq, "bfp16") * 1e3 if gemms else None,
                     "predicted_ms_bfp16_gate_up": _seconds(name, dims, seq, "bfp16_gate_up") * 1e3 if gemms else None})
    return rows


def predictions(prompts=PROMPTS, host: dict | None = None) -> dict:
    """Prefill and decode predictions; ``host`` is the host-overhead section's measurement (``host_measurement``),
    added to the predicted NPU time of a decode token when given."""
    from .work import shared_state

    dims, layers, state = llama_1b_dims(), LLAMA_1B_LAYERS, shared_state()
    prefill = []
    for length in prompts:
        ours = prefill_ms(dims, layers, state.chunks(length))
        bfp16 = prefill_ms(dims, layers, state.chunks(length), "bfp16")
        gate_up = prefill_ms(dims, layers, state.chunks(length), "bfp16_gate_up")
        upstream = PUBLISHED_PREFILL_2048_S * 1e3
        prefill.append({"prompt_tokens": length, "buckets": [p for _, _, p in state.chunks(length)],
                        "predicted_ms": ours, "upstream_published_ms": upstream, "ratio_to_upstream": ours / upstream,
                        "predicted_ms_bfp16": bfp16, "ratio_to_upstream_bfp16": bfp16 / upstream,
                        "predicted_ms_bfp16_gate_up": gate_up})
    npu_ms = decode_ms(dims, layers)
    host_ms = host["token_ms"] if host else None
    total = npu_ms + (host_ms or 0.0)
    decode = {"npu_ms_per_token": npu_ms, "host_ms_per_token_measured_here": host_ms, "host_measurement": host,
              "total_ms_per_token": total, "tokens_per_s": 1e3 / total,
              "upstream_published_tokens_per_s": PUBLISHED_DECODE_TOKENS_PER_S,
              "upstream_published_ms_per_token": 1e3 / PUBLISHED_DECODE_TOKENS_PER_S}
    return {"prefill": prefill, "decode": decode}


def host_measurement(out_dir) -> dict | None:
    """Host time per decode token measured by the host section (``benchmarks/host_overhead.py``) in ``out_dir``,
    at its shortest context, if it ran there: the whole token with the NPU's arithmetic removed, host attention
    included (decode attention runs on the CPU in this design, in series with the NPU launches)."""
    path = out_dir / "host_overhead.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    shortest = result["contexts"][0]
    return {"token_ms": shortest["token_ms"], "host_attention_ms": shortest["host_attention_ms"],
            "host_overhead_ms": shortest["host_overhead_ms"], "context_tokens": shortest["context_tokens"],
            "mode": result["mode"], "finished": result["finished"]}


def decode_line(decode: dict) -> str:
    """The decode prediction in words, labelled: predicted NPU time, plus the host time measured here if any."""
    host_ms, host = decode["host_ms_per_token_measured_here"], decode.get("host_measurement")
    if host_ms is None:
        total = (f"NPU {decode['npu_ms_per_token']:.1f} ms ({decode['tokens_per_s']:.1f} tok/s, NPU only: no host "
                 f"measurement in this run)")
    else:
        where = (f" (the host section, {host['mode']} mode, context {host['context_tokens']}: overhead "
                 f"{host['host_overhead_ms']:.2f} ms + host attention {host['host_attention_ms']:.2f} ms)"
                 if host else "")
        total = (f"{decode['total_ms_per_token']:.1f} ms ({decode['tokens_per_s']:.1f} tok/s) = predicted NPU "
                 f"{decode['npu_ms_per_token']:.1f} ms + measured host {host_ms:.2f} ms{where}")
    return (f"Decode per token: {total}; upstream published {decode['upstream_published_tokens_per_s']} tok/s "
            f"({decode['upstream_published_ms_per_token']:.0f} ms).")


def constants() -> dict:
    return {"clock_hz": CLOCK_HZ, "tile_channel_gb_per_s": TILE_CHANNEL_BYTES_PER_S / 1e9,
            "shim_column_gb_per_s": SHIM_COLUMN_BYTES_PER_S / 1e9, "ddr_gb_per_s": DDR_BYTES_PER_S / 1e9,
            "dispatch_us": DISPATCH_S * 1e6, "launch_us": LAUNCH_S * 1e6,
            "launch_iteration_us": LAUNCH_ITERATION_S * 1e6,
            "throughput": {name: {"per_cycle_per_tile": t.per_cycle, "unit": t.unit, "source": t.source}
                           for name, t in THROUGHPUT.items()}}


def plot(data: dict, path) -> None:
    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    rows = data["per_program"]
    names = [f"{r['program']}\n{r['seq'] or 'decode'}" for r in rows]
    positions = range(len(rows))
    left.bar([p - 0.2 for p in positions], [r["predicted_ms"] for r in rows], width=0.4, color="tab:blue",
             label="ours (MODEL)")
    left.bar([p + 0.2 for p in positions], [r["upstream_published_ms"] for r in rows], width=0.4, color="tab:red",
             label="upstream (published)")
    left.set_xticks(list(positions), names, fontsize=7)
    left.set_yscale("log")
    left.set_ylabel("ms per call")
    left.set_title("Predicted (MODEL, not measured) vs upstream, Llama-3.2-1B", fontsize=10)
    left.legend(fontsize=8)
    prefill = data["predictions"]["prefill"]
    lengths = [r["prompt_tokens"] for r in prefill]
    right.plot(lengths, [r["predicted_ms"] for r in prefill], marker="o", color="tab:blue", label="ours (MODEL)")
    right.plot(lengths, [r["upstream_published_ms"] for r in prefill], marker="o", color="tab:red",
               label="upstream, pad to 2048 (published)")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("prompt tokens")
    right.set_ylabel("prefill ms (NPU)")
    right.set_title("Prefill: MODEL, not a measurement", fontsize=10)
    right.legend(fontsize=8)
    common.save_figure(fig, path)


def run(mode: str, out_dir, log=print) -> dict:
    started = time.perf_counter()
    dims = llama_1b_dims()
    rows = per_program(dims)
    data = {
        "label": "MODEL (predicted NPU2 times from our emitted IR), not a measurement",
        "method": __doc__.strip(),
        "constants": constants(),
        "per_program": rows,
        "predictions": predictions(host=host_measurement(out_dir)),
        "upstream_gemm_replay": upstream_gemm_replay(),
    }
    for r in rows:
        bound = max(r["compute_ms_by_class"].items(), key=lambda kv: kv[1])
        bfp16 = f" ({r['predicted_ms_bfp16']:.2f} ms with bfp16 GEMMs)" if r["predicted_ms_bfp16"] else ""
        log(f"{r['program']:>15} {str(r['seq'] or 'decode'):>6}: predicted {r['predicted_ms']:10.2f} ms{bfp16}, "
            f"upstream {r['upstream_published_ms']:5.1f} ms (×{r['ratio_to_upstream']:.1f}); largest compute: "
            f"{bound[0]} {bound[1]:.2f} ms")
        for c in r["conditions"]:
            log(f"{'':>23} {c['launch']}: {c['text']}: " + (
                f"NOT EVALUATED ({c['unevaluated']}), counted as always taken" if c["unevaluated"] else
                f"taken in {c['work_share']:.1%} of executions, {c['time_share']:.1%} for the slowest tile"))
    for p in data["predictions"]["prefill"]:
        log(f"prefill {p['prompt_tokens']:5d} tokens: predicted {p['predicted_ms']:7.0f} ms (bf16 GEMMs), "
            f"{p['predicted_ms_bfp16_gate_up']:7.0f} ms (bfp16 gate/up), {p['predicted_ms_bfp16']:7.0f} ms "
            f"(bfp16 GEMMs); upstream published {p['upstream_published_ms']:.0f} ms")
    log(decode_line(data["predictions"]["decode"]))
    replay = data["upstream_gemm_replay"]
    log("upstream's measured standalone GEMMs through the model (M×K×N: measured ms; predicted at upstream's "
        "tiling, ratio; predicted at ours):")
    for r in replay:
        log(f"{'x'.join(map(str, r['shape'])):>15}: {r['measured_ms']:6.2f} ms; {r['predicted_ms']:6.2f} ms "
            f"(×{r['ratio']:.2f}); {r['predicted_ours_ms']:6.2f} ms")
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(data, out_dir / "cost_model.png")
    common.write_result("cost_model", data, out_dir, mode, started)
    return data
