"""Programs: the one declaration of a fused op that every other layer derives from.

A Program lists its arguments in ELF order (the ABI the runtime binds with ``run.set_arg``) and its
launches in execution order. The runtime's sync/read-back sets, the ops' fake output shapes, the
emulator's execution and the MLIR stitcher's ``func.func`` signature all come from here (ARCHITECTURE.md,
"The Program", lists every reader). The Programs themselves, one factory per fused op, are in catalog.py.
"""
from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from functools import cached_property

import torch

from .device import DEVICE

# "i32": 32-bit words, the dtype of packed block-quantized weights (kernels/quant.py): their rows are whole words,
# and DMAs of words keep a BD dimension within its 512-element wrap where bytes would not (a 640-byte row chunk).
DTYPE_BYTES = {"bf16": 2, "f32": 4, "i32": 4}
TORCH_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32}  # a Program's dtype names as tensors


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows``: a Program's row bucket, or a kernel tile, always runs
    at its full size."""
    if tensor.shape[0] == rows:
        return tensor.contiguous()
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded


class Role(str, enum.Enum):
    """How the host treats an argument's buffer (ARCHITECTURE.md, "The Program")."""

    WEIGHT = "weight"    # written once at load, synced once, never read back
    INPUT = "input"      # written by the host before a run (unless already device-resident)
    SCRATCH = "scratch"  # device-only intermediate: never written, synced or read by the host
    OUTPUT = "output"    # produced by the device, read back (or handed on device-resident)


@dataclass(frozen=True)
class Arg:
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: Role

    @cached_property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @cached_property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class View:
    """A named region of an arena argument that launches read and write as if it were an argument of its own: the
    ``numel(shape)`` elements from element ``offset`` of ``arena`` (same dtype), its role the arena's. Many buffers
    then take one of the ELF's argument slots (MAX_KERNEL_ARGS); the builders address a view's DMAs inside the
    arena (kernels/builders/ir.py, ``MemRef.arena``). An arena is a 1-D scratch (device-only buffers the launches
    pass on) or a 1-D weight (a decoder layer's weights in one NPU buffer: catalog.layer_arenas), whose views
    launches only read and which may hold parts no view names."""

    name: str
    arena: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    def of(self, arena: torch.Tensor) -> torch.Tensor:
        """This view's elements of ``arena`` (a flat tensor holding the arena), shaped as the view."""
        return arena[self.offset:self.offset + math.prod(self.shape)].view(self.shape)


@dataclass(frozen=True)
class Launch:
    """One step of a multi-launch ELF: a launch kind, its parameters and the arguments it touches."""

    kind: str
    params: tuple[tuple[str, object], ...]
    reads: tuple[str, ...]
    writes: tuple[str, ...]

    @cached_property
    def p(self) -> dict:
        return dict(self.params)


PINGPONG_OMISSIONS = ("", "L1", "L2", "all")
# Argument BOs one run may bind: the amdxdna driver's full-ELF path took at most 64 per command until
# amd/xdna-driver #1591 (August 2026), so a Program with more would fail on the drivers before it.
MAX_KERNEL_ARGS = 64
# Each core's stack, carved out of its 64 KiB of data memory. aircc's own default (1024) is upstream's for its
# kernels; ours is bounded from what the AIE paths of kernels/aie2p keep live (no Peano here to measure a frame):
# with every vector value of the busiest loop spilled, gemm.cc's BFP16 build holds four 8x8 fp32 accumulators and
# two A and two W blocks (1536 B), attention.cc's PV and QK updates about 1.2 KiB of 64-lane blocks; a scalar fp32
# division adds 128 B of callee frames (mlir-air #1547 measured it overflowing 1024 B). Rounded up with the core's
# own frame and a margin to 3 KiB, the size upstream gives its decode attention core (attn_decode_npu2.py).
CORE_STACK_BYTES = 3072


@dataclass(frozen=True)
class CompileOptions:
    """The aircc options a Program's ELF is built with, under aircc's own names (mlir-air
    ``python/air/compiler/aircc``): part of the Program, so of its cache key, never set at call sites.

    ``runtime_loop_tiling_sizes``: extra tiling of the host-side launch loop nest (``shim-dma-tile-sizes``
    of ``air-opt-shim-dma-bds``), which bounds how many shim BDs one batch of launch steps needs;
    ``omit_pingpong``: memory levels left single-buffered ("", "L1", "L2" or "all");
    ``omit_while_true_loop``: cores run their program once instead of looping forever;
    ``omit_auto_broadcast``: skip AIR's detection of DMAs that every tile of a herd repeats;
    ``use_lock_race_condition_fix``: AIR's guard against a lock race, paid for with extra dummy BDs;
    ``stack_size``: bytes of every core's stack (aircc ``--stack-size``, mlir-air #1547 and later), the number
    the L1 budget check (kernels/budgets.py) counts.
    """

    runtime_loop_tiling_sizes: tuple[int, ...] = (4, 4)
    omit_pingpong: str = ""
    omit_while_true_loop: bool = False
    omit_auto_broadcast: bool = False
    use_lock_race_condition_fix: bool = False
    stack_size: int = CORE_STACK_BYTES

    def __post_init__(self):
        sizes = self.runtime_loop_tiling_sizes
        if not isinstance(sizes, tuple) or not all(isinstance(s, int) and s > 0 for s in sizes):
            raise ValueError(f"CompileOptions.runtime_loop_tiling_sizes must be a tuple of positive ints, "
                             f"got {sizes!r}")
        if self.omit_pingpong not in PINGPONG_OMISSIONS:
            raise ValueError(f"CompileOptions.omit_pingpong must be one of {PINGPONG_OMISSIONS}, "
                             f"got {self.omit_pingpong!r}")
        if isinstance(self.stack_size, bool) or not isinstance(self.stack_size, int) or self.stack_size <= 0:
            raise ValueError(f"CompileOptions.stack_size must be a positive int of bytes, got {self.stack_size!r}")
        if self.stack_size % DEVICE.vector_align_bytes:  # aiecc places the first buffer where the stack ends
            raise ValueError(f"CompileOptions.stack_size must be a multiple of {DEVICE.vector_align_bytes} bytes (the "
                             f"tile's buffers start where it ends), got {self.stack_size!r}")

    def aircc_flags(self) -> list[str]:
        """The same options as aircc command-line flags."""
        flags = ["--air-runtime-loop-tiling-sizes", *map(str, self.runtime_loop_tiling_sizes),
                 "--stack-size", str(self.stack_size)]
        if self.omit_pingpong:
            flags.append(f"--omit-ping-pong-transform={self.omit_pingpong}")
        for name in ("omit_while_true_loop", "omit_auto_broadcast", "use_lock_race_condition_fix"):
            if getattr(self, name):
                flags.append("--" + name.replace("_", "-"))
        return flags

    def to_json(self) -> dict:
        return {**asdict(self), "runtime_loop_tiling_sizes": list(self.runtime_loop_tiling_sizes)}

    @classmethod
    def from_json(cls, data: dict) -> "CompileOptions":
        return cls(**{**data, "runtime_loop_tiling_sizes": tuple(data["runtime_loop_tiling_sizes"])})


@dataclass(frozen=True)
class Program:
    name: str
    args: tuple[Arg, ...]
    launches: tuple[Launch, ...]
    params: tuple[tuple[str, object], ...] = field(default=())
    compile_options: CompileOptions = field(default=CompileOptions())
    views: tuple[View, ...] = field(default=())

    def __post_init__(self):
        names = [a.name for a in self.args]
        if len(names) > MAX_KERNEL_ARGS:
            raise ValueError(f"Program {self.name}: {len(names)} arguments, more than the {MAX_KERNEL_ARGS} buffers "
                             "one run may bind")
        if len(set(names + [v.name for v in self.views])) != len(names) + len(self.views):
            raise ValueError(f"Program {self.name}: duplicate argument or view names in "
                             f"{names + [v.name for v in self.views]}")
        self._check_views()
        arenas = {v.arena for v in self.views}
        known = set(names + [v.name for v in self.views]) - arenas  # launches use an arena through its views
        written: set[str] = set()
        for i, launch in enumerate(self.launches):
            for n in launch.reads + launch.writes:
                if n not in known:
                    raise ValueError(f"Program {self.name}: launch {i} ({launch.kind}) uses unknown argument {n!r}")
            for n in launch.reads:
                role = self.arg(n).role
                if role in (Role.SCRATCH, Role.OUTPUT) and n not in written:
                    raise ValueError(f"Program {self.name}: launch {i} ({launch.kind}) reads {n!r} before any launch writes it")
            for n in launch.writes:
                if self.arg(n).role in (Role.WEIGHT, Role.INPUT):
                    raise ValueError(f"Program {self.name}: launch {i} ({launch.kind}) writes {self.arg(n).role.value} {n!r}")
            written.update(launch.writes)
        for a in self.buffers:
            if a.role in (Role.SCRATCH, Role.OUTPUT) and a.name not in written:
                raise ValueError(f"Program {self.name}: {a.role.value} {a.name!r} is never written")

    def _check_views(self) -> None:
        args = {a.name: a for a in self.args}
        taken: dict[str, list[tuple[int, int, str]]] = {}
        for v in self.views:
            arena = args.get(v.arena)
            if arena is None:
                raise ValueError(f"Program {self.name}: view {v.name!r} is in {v.arena!r}, which is no argument")
            if len(arena.shape) != 1 or v.dtype != arena.dtype or arena.role not in (Role.SCRATCH, Role.WEIGHT):
                raise ValueError(f"Program {self.name}: view {v.name!r}'s arena {v.arena!r} must be a 1-D scratch or "
                                 f"weight argument of its dtype {v.dtype}, got {arena.role.value} {arena.dtype} "
                                 f"{arena.shape}")
            numel = Arg(v.name, v.shape, v.dtype, arena.role).numel
            word = DEVICE.dma_word_bytes  # a shim DMA's base address is a whole word
            if v.offset < 0 or v.offset * DTYPE_BYTES[v.dtype] % word or v.offset + numel > arena.numel:
                raise ValueError(f"Program {self.name}: view {v.name!r} ({numel} elements at {v.offset}) must start "
                                 f"at a multiple of {word} bytes inside {v.arena!r} ({arena.numel} elements)")
            taken.setdefault(v.arena, []).append((v.offset, v.offset + numel, v.name))
        for arena, spans in taken.items():
            spans.sort()
            for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
                if start < end:
                    raise ValueError(f"Program {self.name}: views {first!r} and {second!r} overlap in {arena!r}")

    def arg(self, name: str) -> Arg:
        """The argument, or the view (as an Arg of its arena's role), called ``name``."""
        return self._by_name[name]

    @cached_property
    def buffers(self) -> tuple[Arg, ...]:
        """What launches read and write by name: the arguments that hold no views, then the views (as Args)."""
        arenas = {v.arena for v in self.views}
        return (*(a for a in self.args if a.name not in arenas), *(self._by_name[v.name] for v in self.views))

    def view(self, name: str) -> View | None:
        return self._views.get(name)

    @cached_property
    def _views(self) -> dict[str, View]:
        return {v.name: v for v in self.views}

    def index(self, name: str) -> int:
        return self._index[name]

    @cached_property
    def _by_name(self) -> dict[str, Arg]:
        args = {a.name: a for a in self.args}
        return {**args, **{v.name: Arg(v.name, v.shape, v.dtype, args[v.arena].role) for v in self.views}}

    @cached_property
    def _index(self) -> dict[str, int]:
        return {a.name: i for i, a in enumerate(self.args)}

    def indices(self, *roles: Role) -> tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.args) if a.role in roles)

    @cached_property
    def host_args(self) -> tuple[Arg, ...]:
        """Arguments the caller supplies (weights and inputs), in ELF order: the op's tensor arguments."""
        return tuple(a for a in self.args if a.role in (Role.WEIGHT, Role.INPUT))

    @cached_property
    def outputs(self) -> tuple[Arg, ...]:
        return tuple(a for a in self.args if a.role is Role.OUTPUT)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "params": [list(p) for p in self.params],
            "args": [{"name": a.name, "shape": list(a.shape), "dtype": a.dtype, "role": a.role.value} for a in self.args],
            "launches": [
                {"kind": l.kind, "params": [list(p) for p in l.params], "reads": list(l.reads), "writes": list(l.writes)}
                for l in self.launches
            ],
            "compile_options": self.compile_options.to_json(),
            **({"views": [{"name": v.name, "arena": v.arena, "offset": v.offset, "shape": list(v.shape),
                           "dtype": v.dtype} for v in self.views]} if self.views else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Program":
        return cls(
            name=data["name"],
            params=tuple(tuple(p) for p in data["params"]),
            args=tuple(Arg(a["name"], tuple(a["shape"]), a["dtype"], Role(a["role"])) for a in data["args"]),
            launches=tuple(
                Launch(l["kind"], tuple(tuple(p) for p in l["params"]), tuple(l["reads"]), tuple(l["writes"]))
                for l in data["launches"]
            ),
            compile_options=CompileOptions.from_json(data["compile_options"]),
            views=tuple(View(v["name"], v["arena"], v["offset"], tuple(v["shape"]), v["dtype"])
                        for v in data.get("views", ())),
        )

    @cached_property
    def key(self) -> str:
        """Content hash: two Programs with the same key compile to the same ELF."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()
