"""An interpreter of the MLIR-AIR our builders emit: runs a stitched module on the host, as the NPU would.

It reads the module as the real ``air-opt`` prints it (:func:`canonical_text`), so it executes what the compiler
reads, and it runs the C++ kernels a herd calls through their host builds (``host_build``: the same sources and
``-D`` configuration as each ``ObjectBuild`` of the stitched module, symbol renames included).

Semantics, for the subset the builders emit (anything else is an :class:`UnsupportedOp` naming the op):

* ``air.launch`` iterates its points, ``air.segment`` runs once per point, ``air.herd`` runs its body once per
  tile; block arguments are bound to the hierarchy's ids, sizes and forwarded operands. Everything runs
  sequentially in program order: async tokens (which AIR's dependency analysis derives from the same program
  order) are ignored. Tiles of one herd run one after the other, so a race between them is detected instead:
  a tile that writes, or reads, an element of a shared (L2/L3) buffer another tile of the same herd execution
  wrote is a :class:`TileRace`.
* ``memref.alloc`` creates a fresh buffer whose elements are poison (NaN, and marked unwritten); reading an
  unwritten element, through a DMA, a vector read, a load or a kernel call's input, is an
  :class:`UninitializedRead`, so a missing DMA cannot pass by reading zeros. An L1 buffer allocated in a herd
  is private to the tile running that body (each tile allocates its own); an L1 buffer allocated at segment
  scope (the GEMM accumulator) is one slab per tile, and a tile that touches an element another tile touched
  is a :class:`TileAliasing` error.
* ``air.dma_memcpy_nd`` moves elements in the order of its windows (offsets, sizes, strides in elements of the
  memref's row-major layout; an empty window is the whole memref); a window reaching outside its buffer is an
  :class:`OutOfBounds` error.
* Storage is bf16, f32 or i32 (a packed weight's words) as the memref says; arith on bf16 values computes in fp32 and rounds to bf16 once per
  op (torch's bf16 CPU arithmetic); f32 stays f32.
* ``func.call`` of an external kernel stages each memref argument into a guarded copy: inputs must be fully
  written (the kernel's record in builders/externs.py says which arguments it reads), outputs are fully
  written afterwards, and a kernel writing past the end of its argument is a :class:`KernelOverrun`.
"""
from __future__ import annotations

import ctypes
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import host_build
from .air_pipeline import check_windows
from .builders.externs import KERNEL_SYMBOLS, SCALAR_TYPES
from .mlir_text import SSA, DmaSide, MlirTextError, Op, parse_dma, parse_memref_type, parse_module, split_top
from .program import TORCH_DTYPES, Program, Role
from .stitch import ObjectBuild, StitchedModule, stitch
from .toolchain import Toolchain, find_toolchain

INTEGER_TYPES = ("index", "i32", "i64", "i1")

# How each external kernel uses its memref arguments, in order (builders/externs.py's records say it): "r" reads
# it whole, "w" writes it whole, "m" reads and then writes it whole, "p" reads and writes part of it: staged with
# its contents as they are, unwritten elements still poisoned with NaN, and only the elements the call changed
# are written back.
KERNEL_ARGUMENT_ACCESS = {name: entry.access for name, entry in KERNEL_SYMBOLS.items()}
_SAME_WIDTH_INTEGER = {torch.bfloat16: torch.int16, torch.float32: torch.int32,  # to compare values bit for bit
                       torch.int32: torch.int32}
KERNEL_GUARD_ELEMENTS = 64  # canary elements after each staged kernel argument


class InterpretError(RuntimeError):
    """The module cannot be run, or running it did something the NPU would get wrong."""


class UnsupportedOp(InterpretError):
    pass


class OutOfBounds(InterpretError):
    pass


class UninitializedRead(InterpretError):
    pass


class TileAliasing(InterpretError):
    pass


class TileRace(InterpretError):
    pass


class KernelOverrun(InterpretError):
    pass


class UnwrittenOutput(InterpretError):
    pass


# ---- memory ------------------------------------------------------------------------------------------------
class Buffer:
    """One allocation: flat storage, which elements were written, and for shared or segment-scope L1 memory who
    touched which element."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str, space: int, in_herd: bool):
        numel = math.prod(shape)
        self.name, self.shape, self.dtype, self.space = name, shape, dtype, space
        self.data = _poisoned(numel, TORCH_DTYPES[dtype])
        self.written = torch.zeros(numel, dtype=torch.bool)
        self.freed = False
        # A segment-scope L1 buffer: one slab per tile; element -> the tile that first touched it (-1: none).
        self.owner = torch.full((numel,), -1, dtype=torch.int32) if space == 2 and not in_herd else None

    @property
    def numel(self) -> int:
        return self.data.numel()


@dataclass(frozen=True)
class View:
    """A memref value: a buffer seen through an offset, shape and strides (in elements)."""

    buffer: Buffer
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def whole(cls, buffer: Buffer) -> "View":
        return cls(buffer, 0, buffer.shape, _row_major(buffer.shape))

    @property
    def contiguous(self) -> bool:
        return self.strides == _row_major(self.shape)

    def indices(self) -> torch.Tensor | slice:
        return _shifted(_pattern(self.shape, self.strides), self.offset)


def _row_major(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


_PATTERNS: dict[tuple, torch.Tensor | slice] = {}

def _pattern(sizes, strides) -> torch.Tensor | slice:
    """Flat element offsets of an access pattern from 0, in row-major order of its dims: a slice when they are
    one contiguous run (most windows; slicing is much faster than gathering), else an index tensor."""
    key = (tuple(sizes), tuple(strides))
    if key not in _PATTERNS:
        moving = [(size, stride) for size, stride in zip(sizes, strides) if size != 1]
        if all(stride == math.prod(size for size, _ in moving[i + 1:]) for i, (_, stride) in enumerate(moving)):
            _PATTERNS[key] = slice(0, math.prod(sizes))
        else:
            offsets = torch.zeros((), dtype=torch.int64)
            for size, stride in zip(sizes, strides):
                offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
            _PATTERNS[key] = offsets.reshape(-1)
    return _PATTERNS[key]


def _shifted(indices: torch.Tensor | slice, base: int) -> torch.Tensor | slice:
    return slice(indices.start + base, indices.stop + base) if isinstance(indices, slice) else indices + base


def _count(indices: torch.Tensor | slice) -> int:
    return indices.stop - indices.start if isinstance(indices, slice) else indices.numel()


def _bounds(indices: torch.Tensor | slice) -> tuple[int, int]:
    if isinstance(indices, slice):
        return indices.start, indices.stop - 1
    return int(indices.min()), int(indices.max())


def _element(indices: torch.Tensor | slice, position: int) -> int:
    return indices.start + position if isinstance(indices, slice) else int(indices[position])


# ---- parsing -----------------------------------------------------------------------------------------------
_AFFINE_MAP = re.compile(r"affine_map<\(([^)]*)\)\[([^\]]*)\] -> \((.*)\)>")


def _memref_type(text: str):
    try:
        return parse_memref_type(text)
    except MlirTextError as error:
        raise UnsupportedOp(str(error)) from None


class AffineMap:
    def __init__(self, text: str):
        match = _AFFINE_MAP.fullmatch(text.strip())
        if not match:
            raise UnsupportedOp(f"affine map {text!r}: expected affine_map<(dims)[symbols] -> (one result)>")
        dims, symbols, expr = (g.strip() for g in match.groups())
        if dims or "," in split_top(expr)[0] or len(split_top(expr)) != 1:
            raise UnsupportedOp(f"affine map {text!r}: only symbol-only maps with one result are emitted")
        if re.search(r"\b(floordiv|ceildiv|mod)\b", expr):
            raise UnsupportedOp(f"affine map {text!r}: floordiv/ceildiv/mod are not supported")
        names = [s.strip() for s in symbols.split(",") if s.strip()]
        if not re.fullmatch(r"[\ds*+\-() ]*", expr):
            raise UnsupportedOp(f"affine map {text!r}: unexpected tokens in {expr!r}")
        self._code = compile(expr, text, "eval")
        self._names = names

    def __call__(self, symbols: list[int]) -> int:
        return int(eval(self._code, {"__builtins__": {}}, dict(zip(self._names, symbols))))


_PREDICATES = {"eq": int.__eq__, "ne": int.__ne__, "slt": int.__lt__, "sle": int.__le__,
               "sgt": int.__gt__, "sge": int.__ge__}


def _divsi(a: int, b: int) -> int:
    """arith.divsi: signed division rounding toward zero (Python's // rounds down)."""
    quotient = abs(a) // abs(b)
    return quotient if (a < 0) == (b < 0) else -quotient


_BINARY_INTEGER = {"addi": int.__add__, "subi": int.__sub__, "muli": int.__mul__, "divsi": _divsi,
                   "remsi": lambda a, b: a - b * _divsi(a, b), "floordivsi": int.__floordiv__,
                   "ceildivsi": lambda a, b: -(-a // b), "minsi": min, "maxsi": max,
                   "andi": int.__and__, "ori": int.__or__, "xori": int.__xor__}


class IndexArithmetic:
    """The integer ops of the subset over Python ints: integer ``arith.constant``, ``affine.apply``,
    ``arith.index_cast``, ``arith.cmpi`` and the ``arith`` integer binary ops. The interpreter runs them with it;
    the timing model (kernels/timing.py) evaluates ``scf.if`` conditions with it over their iteration space.
    ``aliases`` are the module's affine map aliases (``#map = affine_map<...>``)."""

    OPS = frozenset({"arith.constant", "affine.apply", "arith.index_cast", "arith.cmpi",
                     *(f"arith.{name}" for name in _BINARY_INTEGER)})

    def __init__(self, aliases: dict[str, str] | None = None):
        self.aliases = aliases or {}
        self._maps: dict[str, AffineMap] = {}

    def evaluate(self, op: Op, env: dict):
        """The value ``op`` defines, reading its operands from ``env`` (SSA name → value)."""
        if op.name == "arith.constant":
            match = re.fullmatch(r"\s*(\S+) : (\w+)", op.body)
            if not match or match.group(2) not in INTEGER_TYPES:
                raise UnsupportedOp(f"arith.constant of this form or type ({op.where()})")
            literal, type_ = match.groups()
            if type_ == "i1":  # printed true/false; an integer literal reads as its truth
                return literal == "true" if literal in ("true", "false") else int(literal) != 0
            return int(literal)
        if op.name == "affine.apply":
            match = re.fullmatch(rf"\s*(#\w+|affine_map<.*>)\(\)\[([^\]]*)\]", op.body)
            if not match:
                raise UnsupportedOp(f"affine.apply with dims ({op.where()})")
            symbols = [_lookup(env, s.strip()) for s in match.group(2).split(",") if s.strip()]
            return self._map(match.group(1))(symbols)
        if op.name == "arith.index_cast":
            match = re.fullmatch(rf"\s*({SSA}) : (\w+) to (\w+)", op.body)
            value = _lookup(env, match.group(1))
            if match.group(3) == "i32" and not -2 ** 31 <= value < 2 ** 31:
                raise InterpretError(f"index {value} does not fit i32")
            return value
        if op.name == "arith.cmpi":
            match = re.fullmatch(rf"\s*(\w+), ({SSA}), ({SSA}) : (index|i32|i64)", op.body)
            if not match or match.group(1) not in _PREDICATES:
                raise UnsupportedOp(f"arith.cmpi of this form ({op.where()})")
            return _PREDICATES[match.group(1)](_lookup(env, match.group(2)), _lookup(env, match.group(3)))
        binary = _BINARY_INTEGER.get(op.name.removeprefix("arith."))
        match = re.fullmatch(rf"\s*({SSA}), ({SSA}) : ({'|'.join(INTEGER_TYPES)})", op.body)
        if binary is None or not match:
            raise UnsupportedOp(f"{op.name} is not an integer op of the subset ({op.where()})")
        try:
            return binary(_lookup(env, match.group(1)), _lookup(env, match.group(2)))
        except ZeroDivisionError:
            raise InterpretError(f"{op.name} divides by zero ({op.where()})") from None

    def _map(self, text: str) -> AffineMap:
        text = self.aliases.get(text, text)
        if text not in self._maps:
            self._maps[text] = AffineMap(text)
        return self._maps[text]


def _lookup(env: dict, name: str):
    try:
        return env[name]
    except KeyError:
        raise InterpretError(f"{name} is not defined here") from None


# ---- execution ---------------------------------------------------------------------------------------------
@dataclass
class _Tile:
    herd: str
    coords: tuple[int, ...]
    number: int  # unique per (herd, coords) for ownership records


@dataclass
class _HerdRun:
    """Writes of one herd execution to shared (L2/L3) buffers: element -> the writing tile's number."""

    writers: dict[int, torch.Tensor] = field(default_factory=dict)


class Interpreter:
    """Runs one function of a printed module. ``objects`` are the stitched module's kernel builds."""

    def __init__(self, text: str, objects: tuple[ObjectBuild, ...]):
        try:
            self.aliases, ops = parse_module(text)
        except MlirTextError as error:
            raise UnsupportedOp(str(error)) from None
        if len(ops) != 1 or ops[0].name != "module":
            raise UnsupportedOp("expected one top-level module")
        self.functions: dict[str, Op] = {}
        self.externs: dict[str, tuple[str, ObjectBuild]] = {}  # symbol -> (original symbol, build)
        builds = {b.object: b for b in objects}
        for op in ops[0].regions[0]:
            if op.name != "func.func":
                raise UnsupportedOp(f"module-level op {op.name}: {op.where()}")
            symbol = re.search(r"@([\w$.]+)", op.body).group(1)
            if op.body.lstrip().startswith("private"):
                linked = re.search(r'link_with = "([^"]+)"', op.body)
                if not linked or linked.group(1) not in builds:
                    raise InterpretError(f"external @{symbol} links no object of the stitched module: {op.where()}")
                build = builds[linked.group(1)]
                original = {new: old for old, new in build.renames}.get(symbol, symbol)
                self.externs[symbol] = (original, build)
            else:
                self.functions[symbol] = op
        self._integers = IndexArithmetic(self.aliases)
        self._kernels: dict[str, ctypes._CFuncPtr] = {}
        self._tile_numbers: dict[tuple, int] = {}
        self._handlers = {
            **{name: self._integer for name in IndexArithmetic.OPS}, "arith.constant": self._constant,
            "arith.extf": self._float_cast, "arith.truncf": self._float_cast,
            "math.rsqrt": self._rsqrt, "vector.broadcast": self._broadcast, "vector.reduction": self._reduction,
            "vector.transfer_read": self._transfer_read, "vector.transfer_write": self._transfer_write,
            "memref.alloc": self._alloc, "memref.dealloc": self._dealloc, "memref.subview": self._subview,
            "memref.load": self._load, "memref.store": self._store,
            "air.dma_memcpy_nd": self._dma, "func.call": self._call,
            "scf.for": self._for, "scf.if": self._if,
            "air.launch": self._hierarchy, "air.segment": self._hierarchy, "air.herd": self._hierarchy,
            **{f"arith.{name}": self._binary for name in _BINARY_FLOAT},
        }

    # ---- entry --------------------------------------------------------------------------------------------
    def run(self, function: str, arguments: list[torch.Tensor | None]) -> list[Buffer]:
        """Runs ``function``; ``arguments`` hold a tensor per memref argument (its initial contents) or None
        for a buffer nothing wrote yet (scratch, outputs). Returns the argument buffers as the run left them."""
        try:
            func = self.functions[function]
        except KeyError:
            raise InterpretError(f"no func.func @{function} in the module; found {', '.join(self.functions)}") \
                from None
        signature = re.search(rf"@{re.escape(function)}\((.*)\)\s*\{{$", func.text).group(1)
        params = [p.split(":", 1) for p in split_top(signature)]
        if len(params) != len(arguments):
            raise ValueError(f"arguments: @{function} takes {len(params)} memrefs, got {len(arguments)}")
        env, buffers = {}, []
        for (name, type_text), tensor in zip(params, arguments):
            t = _memref_type(type_text)
            buffer = Buffer(name.strip(), t.shape, t.dtype, t.space, in_herd=False)
            if tensor is not None:
                if tuple(tensor.shape) != t.shape or tensor.dtype != TORCH_DTYPES[t.dtype]:
                    raise ValueError(f"arguments: {name.strip()} is {type_text.strip()}, got "
                                     f"{tuple(tensor.shape)} {tensor.dtype}")
                buffer.data.copy_(tensor.reshape(-1))
                buffer.written.fill_(True)
            env[name.strip()] = View.whole(buffer)
            buffers.append(buffer)
        self._region(func.regions[0], env, tile=None, herd_run=None)
        return buffers

    def _region(self, ops: list[Op], env: dict, tile: _Tile | None, herd_run: _HerdRun | None) -> None:
        for op in ops:
            if op.name in ("return", "scf.yield"):
                continue
            handler = self._handlers.get(op.name)
            if handler is None:
                raise UnsupportedOp(f"unsupported op {op.name} ({op.where()})")
            try:
                handler(op, env, tile, herd_run)
            except InterpretError as exc:
                if op.name in ("scf.for", "scf.if", "air.launch", "air.segment", "air.herd"):
                    raise
                raise type(exc)(f"{exc} ({op.where()})") from None

    def _value(self, env: dict, name: str):
        return _lookup(env, name)

    # ---- scalars and vectors ------------------------------------------------------------------------------
    def _integer(self, op, env, tile, herd_run):
        env[op.results[0]] = self._integers.evaluate(op, env)

    def _constant(self, op, env, tile, herd_run):
        match = re.fullmatch(r"\s*(\S+) : (\w+)", op.body)
        if not match:
            raise UnsupportedOp(f"arith.constant of this form ({op.where()})")
        literal, type_ = match.groups()
        if type_ in INTEGER_TYPES:
            value = self._integers.evaluate(op, env)
        elif type_ in TORCH_DTYPES:
            if literal.startswith("0x"):
                bits = int(literal, 16)
                value = (torch.tensor(bits, dtype=torch.int16 if type_ == "bf16" else torch.int32)
                         .view(TORCH_DTYPES[type_]))
            else:
                value = torch.tensor(float(literal), dtype=TORCH_DTYPES[type_])
        else:
            raise UnsupportedOp(f"arith.constant of type {type_} ({op.where()})")
        env[op.results[0]] = value

    def _binary(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*({SSA}), ({SSA}) : (\S+)", op.body)
        if not match:
            raise UnsupportedOp(f"{op.name} of this form ({op.where()})")
        lhs, rhs = self._value(env, match.group(1)), self._value(env, match.group(2))
        if lhs.dtype != rhs.dtype or lhs.dtype != _element_dtype(match.group(3)):
            raise InterpretError(f"{op.name}: operands {lhs.dtype}, {rhs.dtype} do not match {match.group(3)}")
        env[op.results[0]] = _BINARY_FLOAT[op.name.split(".", 1)[1]](lhs, rhs)

    def _float_cast(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*({SSA}) : (\S+) to (\S+)", op.body)
        value = self._value(env, match.group(1))
        if value.dtype != _element_dtype(match.group(2)):
            raise InterpretError(f"{op.name}: operand is {value.dtype}, the op says {match.group(2)}")
        env[op.results[0]] = value.to(_element_dtype(match.group(3)))

    def _rsqrt(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*({SSA}) : (\S+)", op.body)
        env[op.results[0]] = torch.rsqrt(self._value(env, match.group(1)))

    def _broadcast(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*({SSA}) : (\w+) to vector<(\d+)x(\w+)>", op.body)
        if not match:
            raise UnsupportedOp(f"vector.broadcast of this form ({op.where()})")
        scalar = self._value(env, match.group(1))
        env[op.results[0]] = scalar.reshape(1).expand(int(match.group(3))).clone()

    def _reduction(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*<add>, ({SSA}) : vector<\d+x(\w+)> into (\w+)", op.body)
        if not match or match.group(2) != match.group(3):
            raise UnsupportedOp(f"vector.reduction of this form ({op.where()})")
        env[op.results[0]] = self._value(env, match.group(1)).sum(dtype=TORCH_DTYPES[match.group(3)])

    # ---- memory -------------------------------------------------------------------------------------------
    def _alloc(self, op, env, tile, herd_run):
        t = _memref_type(op.body)
        env[op.results[0]] = View.whole(Buffer(op.results[0], t.shape, t.dtype, t.space, in_herd=tile is not None))

    def _dealloc(self, op, env, tile, herd_run):
        name = re.match(rf"\s*({SSA})", op.body).group(1)
        self._value(env, name).buffer.freed = True

    def _subview(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*({SSA})\[([^\]]*)\] \[([^\]]*)\] \[([^\]]*)\] : (.*) to (.*)", op.body)
        if not match:
            raise UnsupportedOp(f"memref.subview of this form ({op.where()})")
        source = self._value(env, match.group(1))
        offsets = [self._operand(env, v) for v in split_top(match.group(2))]
        sizes = [int(v) for v in split_top(match.group(3))]
        steps = [int(v) for v in split_top(match.group(4))]
        result = _memref_type(match.group(6))
        for offset, size, extent in zip(offsets, sizes, source.shape):
            if not 0 <= offset <= extent - size:
                raise OutOfBounds(f"subview [{offset}, {offset + size}) of a dimension of {extent} in "
                                  f"{source.buffer.name}")
        # Rank reduction drops unit dimensions from the front until the result's rank is reached.
        keep, dropping = [], len(sizes) - len(result.shape)
        for dim, size in enumerate(sizes):
            if size == 1 and dropping:
                dropping -= 1
            else:
                keep.append(dim)
        if tuple(sizes[d] for d in keep) != result.shape:
            raise UnsupportedOp(f"memref.subview result shape {result.shape} from sizes {sizes}")
        offset = source.offset + sum(o * s for o, s in zip(offsets, source.strides))
        env[op.results[0]] = View(source.buffer, offset, result.shape,
                                  tuple(source.strides[d] * steps[d] for d in keep))

    def _operand(self, env, text: str) -> int:
        text = text.strip()
        return self._value(env, text) if text.startswith("%") else int(text)

    def _access(self, view: View, indices: torch.Tensor | slice, write: bool, what: str, tile, herd_run) -> None:
        """Checks one read or write of ``indices`` (flat, into the view's buffer) before it happens."""
        buffer = view.buffer
        if buffer.freed:
            raise InterpretError(f"{what}: {buffer.name} was deallocated")
        low, high = _bounds(indices)
        if low < 0 or high >= buffer.numel:
            raise OutOfBounds(f"{what}: elements [{low}, {high}] of {buffer.name} ({buffer.numel} elements, "
                              f"memref<{'x'.join(map(str, buffer.shape))}x{buffer.dtype}, {buffer.space}>)")
        if not write:
            unwritten = ~buffer.written[indices]
            if bool(unwritten.any()):
                first = _element(indices, int(unwritten.nonzero()[0, 0]))
                raise UninitializedRead(f"{what}: reads {int(unwritten.sum())} element(s) of {buffer.name} "
                                        f"nothing wrote (first: element {first})")
        if tile is None:
            return
        if buffer.owner is not None:
            owners = buffer.owner[indices]
            foreign = (owners != -1) & (owners != tile.number)
            if bool(foreign.any()):
                other = next(k for k, v in self._tile_numbers.items() if v == int(owners[foreign][0]))
                raise TileAliasing(f"{what}: tile {tile.coords} of {tile.herd} touches {buffer.name} elements "
                                   f"that tile {other[1]} of {other[0]} uses: L1 memory is private to a tile")
            buffer.owner[indices] = tile.number
        elif buffer.space != 2 and herd_run is not None:
            writers = herd_run.writers.get(id(buffer))
            if writers is not None:
                seen = writers[indices]
                foreign = (seen != -1) & (seen != tile.number)
                if bool(foreign.any()):
                    raise TileRace(f"{what}: tile {tile.coords} of {tile.herd} {'writes' if write else 'reads'} "
                                   f"{int(foreign.sum())} element(s) of {buffer.name} another tile of the herd "
                                   f"wrote in the same run")
            if write:
                if writers is None:
                    writers = herd_run.writers[id(buffer)] = torch.full((buffer.numel,), -1, dtype=torch.int32)
                writers[indices] = tile.number

    def _read(self, view: View, indices, what, tile, herd_run) -> torch.Tensor:
        self._access(view, indices, False, what, tile, herd_run)
        return view.buffer.data[indices].clone()  # a value, not a view of memory that later writes change

    def _write(self, view: View, indices, values: torch.Tensor, what, tile, herd_run) -> None:
        self._access(view, indices, True, what, tile, herd_run)
        view.buffer.data[indices] = values.to(view.buffer.data.dtype)
        view.buffer.written[indices] = True

    def _element_indices(self, env, view: View, index_text: str, lanes: int = 1) -> torch.Tensor:
        """Flat indices of ``lanes`` consecutive elements along the last dimension from a memref index."""
        indices = [self._operand(env, v) for v in split_top(index_text)]
        if len(indices) != len(view.shape):
            raise InterpretError(f"{len(indices)} indices into a rank-{len(view.shape)} memref")
        ends = indices[:-1] + [indices[-1] + lanes - 1]
        if any(not 0 <= i < extent for i, extent in zip(indices + ends, view.shape + view.shape)):
            raise OutOfBounds(f"{lanes} element(s) from index {indices} leave memref shape {view.shape} of "
                              f"{view.buffer.name}")
        start = view.offset + sum(i * s for i, s in zip(indices, view.strides))
        return _shifted(_pattern((lanes,), (view.strides[-1],)), start)

    def _transfer_read(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*({SSA})\[([^\]]*)\], ({SSA}) \{{in_bounds = \[true\]\}} : (.*), "
                             rf"vector<(\d+)x(\w+)>", op.body)
        if not match:
            raise UnsupportedOp(f"vector.transfer_read of this form ({op.where()})")
        view, lanes = self._value(env, match.group(1)), int(match.group(5))
        indices = self._element_indices(env, view, match.group(2), lanes)
        env[op.results[0]] = self._read(view, indices, "vector.transfer_read", tile, herd_run)

    def _transfer_write(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*({SSA}), ({SSA})\[([^\]]*)\] \{{in_bounds = \[true\]\}} : vector<(\d+)x(\w+)>, "
                             rf"(.*)", op.body)
        if not match:
            raise UnsupportedOp(f"vector.transfer_write of this form ({op.where()})")
        vector, view, lanes = self._value(env, match.group(1)), self._value(env, match.group(2)), int(match.group(4))
        if vector.dtype != view.buffer.data.dtype:
            raise InterpretError(f"vector.transfer_write of {vector.dtype} into a {view.buffer.dtype} memref")
        indices = self._element_indices(env, view, match.group(3), lanes)
        self._write(view, indices, vector, "vector.transfer_write", tile, herd_run)

    def _load(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*({SSA})\[([^\]]*)\] : (.*)", op.body)
        view = self._value(env, match.group(1))
        index = self._element_indices(env, view, match.group(2))
        value = self._read(view, index, "memref.load", tile, herd_run)[0]
        # an integer element is a scalar like the integer arithmetic's (a core's own counters, a length it was sent)
        env[op.results[0]] = int(value) if not value.is_floating_point() else value

    def _store(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*({SSA}), ({SSA})\[([^\]]*)\] : (.*)", op.body)
        value, view = self._value(env, match.group(1)), self._value(env, match.group(2))
        index = self._element_indices(env, view, match.group(3))
        if isinstance(value, int):
            value = torch.tensor(value, dtype=view.buffer.data.dtype)
        self._write(view, index, value.reshape(1), "memref.store", tile, herd_run)

    def _window(self, env, view: View, side: DmaSide) -> torch.Tensor:
        offsets, sizes, strides = ([self._operand(env, v) for v in f] for f in (side.offsets, side.sizes, side.strides))
        if not (len(offsets) == len(sizes) == len(strides)):
            raise InterpretError(f"DMA window with {len(offsets)} offsets, {len(sizes)} sizes, {len(strides)} strides")
        if not sizes:
            return view.indices()
        if view.offset or not view.contiguous:
            raise UnsupportedOp("a DMA window on a subview")
        return _shifted(_pattern(sizes, strides), sum(o * s for o, s in zip(offsets, strides)))

    def _dma(self, op, env, tile, herd_run):
        dma = parse_dma(op.text)
        if dma is None or not dma.types:
            raise UnsupportedOp(f"air.dma_memcpy_nd of this form ({op.where()})")
        dst, src = self._value(env, dma.dst.value), self._value(env, dma.src.value)
        dst_indices = self._window(env, dst, dma.dst)
        src_indices = self._window(env, src, dma.src)
        if _count(dst_indices) != _count(src_indices):
            raise InterpretError(f"DMA moves {_count(src_indices)} elements into {_count(dst_indices)}")
        if dst.buffer.dtype != src.buffer.dtype:
            raise InterpretError(f"DMA from {src.buffer.dtype} to {dst.buffer.dtype}")
        values = self._read(src, src_indices, f"DMA source {src.buffer.name}", tile, herd_run)
        self._write(dst, dst_indices, values, f"DMA destination {dst.buffer.name}", tile, herd_run)

    # ---- kernels ------------------------------------------------------------------------------------------
    def _kernel(self, symbol: str) -> tuple[str, ctypes._CFuncPtr]:
        try:
            original, build = self.externs[symbol]
        except KeyError:
            raise InterpretError(f"func.call of @{symbol}, which the module does not declare") from None
        if symbol not in self._kernels:
            library = host_build.load(build.source, {**dict(build.defines), **dict(build.renames)})
            self._kernels[symbol] = getattr(library, symbol)
            self._kernels[symbol].restype = None
        return original, self._kernels[symbol]

    def _call(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*@([\w$.]+)\(([^)]*)\) : \((.*)\) -> \(\)", op.body)
        if not match:
            raise UnsupportedOp(f"func.call of this form ({op.where()})")
        original, kernel = self._kernel(match.group(1))
        entry = KERNEL_SYMBOLS.get(original)
        if entry is None:
            raise InterpretError(f"@{original}: no record in builders/externs.py")
        values = [self._value(env, a.strip()) for a in split_top(match.group(2))]
        passed = "".join("m" if isinstance(v, View) else "s" for v in values)
        if passed != "".join("s" if a in SCALAR_TYPES else "m" for a in entry.arguments):
            raise InterpretError(f"@{original} takes ({entry.arguments}) (memref access letters, scalars "
                                 f"{SCALAR_TYPES!r}); the call passes {len(values)} arguments ({passed}: m memref, "
                                 f"s scalar)")
        staged, c_args, modes = [], [], iter(entry.access)
        for value, letter in zip(values, entry.arguments):
            if not isinstance(value, View):
                c_args.append(ctypes.c_float(float(value)) if letter == "f" else ctypes.c_int32(int(value)))
                continue
            mode = next(modes)
            if not value.contiguous:
                raise InterpretError(f"@{original}: a memref argument is not contiguous (strides {value.strides})")
            indices = value.indices()
            what = f"@{original} argument {len(staged)} ({value.buffer.name})"
            if mode in "rm":
                contents = self._read(value, indices, what, tile, herd_run)
            elif mode == "p":
                self._access(value, indices, True, what, tile, herd_run)
                contents = value.buffer.data[indices].clone()
            else:
                contents = _poisoned(_count(indices), value.buffer.data.dtype)
            guard = _canary(value.buffer.data.dtype)
            copy = torch.cat((contents, guard))
            staged.append((value, indices, mode, copy, guard))
            c_args.append(ctypes.c_void_p(copy.data_ptr()))
        kernel(*c_args)
        for number, (value, indices, mode, copy, guard) in enumerate(staged):
            count = _count(indices)
            if not torch.equal(copy[count:].view(torch.uint8), guard.view(torch.uint8)):
                raise KernelOverrun(f"@{original} wrote past the end of argument {number} "
                                    f"({value.buffer.name}, {count} elements)")
            if mode in "wm":
                self._write(value, indices, copy[:count], f"@{original}", tile, herd_run)
            elif mode == "p":
                before = value.buffer.data[indices]
                bits = _SAME_WIDTH_INTEGER[copy.dtype]
                changed = (copy[:count].view(bits) != before.view(bits)).nonzero().flatten()
                if changed.numel():
                    flat = indices if isinstance(indices, torch.Tensor) else torch.arange(indices.start, indices.stop)
                    self._write(value, flat[changed], copy[:count][changed], f"@{original}", tile, herd_run)

    # ---- control flow and hierarchy ----------------------------------------------------------------------
    def _for(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*({SSA}) = ({SSA}|\d+) to ({SSA}|\d+) step ({SSA}|\d+) \{{", op.body)
        if not match:
            raise UnsupportedOp(f"scf.for of this form (iter_args or results are not emitted) ({op.where()})")
        lower, upper, step = (self._operand(env, g) for g in match.group(2, 3, 4))
        for i in range(lower, upper, step):
            env[match.group(1)] = i
            self._region(op.regions[0], env, tile, herd_run)

    def _if(self, op, env, tile, herd_run):
        match = re.fullmatch(rf"\s*({SSA}) \{{", op.body)
        if not match:
            raise UnsupportedOp(f"scf.if of this form ({op.where()})")
        taken = 0 if self._value(env, match.group(1)) else 1
        if taken < len(op.regions):
            self._region(op.regions[taken], env, tile, herd_run)

    _HIERARCHY = re.compile(rf"\s*(?:async (?:\[[^\]]*\] )?)?@([\w$.]+)\s*(?:tile )?"
                            rf"(?:\(([^)]*)\) in \(([^)]*)\)\s*)?(?:args\((.*?)\) : (.*?))?"
                            rf"(?: attributes \{{[^}}]*\}})?\s*\{{")

    def _hierarchy(self, op, env, tile, herd_run):
        match = self._HIERARCHY.fullmatch(op.body)
        if not match:
            raise UnsupportedOp(f"{op.name} of this form ({op.where()})")
        name, ids, extents, args = match.group(1), match.group(2), match.group(3), match.group(4)
        ids = [i.strip() for i in ids.split(",")] if ids else []
        extent_pairs = [e.split("=") for e in split_top(extents)] if extents else []
        sizes = [self._value(env, value.strip()) for _, value in extent_pairs]
        inner = {}
        for pair in split_top(args) if args else []:
            block_arg, outer = (p.strip() for p in pair.split("="))
            inner[block_arg] = self._value(env, outer)
        for (extent, _), size in zip(extent_pairs, sizes):
            inner[extent.strip()] = size
        if op.name == "air.herd":
            if tile is not None:
                raise UnsupportedOp(f"a herd inside a herd ({op.where()})")
            run = _HerdRun()
            for coords in _points(sizes):
                number = self._tile_numbers.setdefault((name, coords), len(self._tile_numbers))
                self._region(op.regions[0], {**inner, **dict(zip(ids, coords))}, _Tile(name, coords, number), run)
            return
        for coords in _points(sizes):
            self._region(op.regions[0], {**inner, **dict(zip(ids, coords))}, tile, herd_run)


def _points(sizes) -> list[tuple[int, ...]]:
    points = [()]
    for size in sizes:
        points = [p + (i,) for p in points for i in range(size)]
    return points


def _element_dtype(type_text: str) -> torch.dtype:
    match = re.fullmatch(r"(?:vector<\d+x)?(\w+)>?", type_text.strip())
    if not match or match.group(1) not in TORCH_DTYPES:
        raise UnsupportedOp(f"element type {type_text}")
    return TORCH_DTYPES[match.group(1)]


def _poisoned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Storage not yet written: NaN, or for words (packed weights) 0xA5A5A5A5."""
    return torch.full((numel,), -0x5A5A5A5B if dtype == torch.int32 else float("nan"), dtype=dtype)


def _canary(dtype: torch.dtype) -> torch.Tensor:
    element_bytes = torch.empty((), dtype=dtype).element_size()
    pattern = torch.tensor([0xA5, 0x5A, 0xC3, 0x3C], dtype=torch.uint8)
    return pattern.repeat(KERNEL_GUARD_ELEMENTS * element_bytes // 4).view(dtype).clone()


_BINARY_FLOAT = {"addf": torch.add, "subf": torch.sub, "mulf": torch.mul, "divf": torch.div,
                 "maximumf": torch.maximum, "minimumf": torch.minimum}


# ---- Programs ----------------------------------------------------------------------------------------------
def canonical_text(program: Program, stitched: StitchedModule | None = None, tc: Toolchain | None = None) -> str:
    """The stitched module as the real air-opt prints it (its DMA windows checked against the builders')."""
    stitched = stitched or stitch(program)
    with tempfile.TemporaryDirectory(prefix=f"torch_npu2-interpret-{program.name}-") as build_dir:
        check_windows(program.name, stitched, Path(build_dir), tc or find_toolchain())
        return (Path(build_dir) / "parsed.mlir").read_text()


def run_program_ir(program: Program, inputs: dict[str, torch.Tensor], text: str | None = None,
                   stitched: StitchedModule | None = None) -> dict[str, torch.Tensor]:
    """Every argument of ``program`` after interpreting its IR on ``inputs`` (its weights and inputs by name).

    ``text`` is a printed module to run instead of the Program's own (a test's mutated copy, say).
    """
    missing = [a.name for a in program.host_args if a.name not in inputs]
    unknown = sorted(set(inputs) - {a.name for a in program.host_args})
    if missing or unknown:
        raise ValueError(f"inputs: {program.name} takes {', '.join(a.name for a in program.host_args)}; "
                         f"missing {missing}, not host arguments {unknown}")
    stitched = stitched or stitch(program)
    text = text if text is not None else canonical_text(program, stitched)
    buffers = Interpreter(text, stitched.objects).run(program.name, [inputs.get(a.name) for a in program.args])
    values = {a.name: (b.data.reshape(b.shape), b.written) for a, b in zip(program.args, buffers)}
    for view in program.views:  # its region of the arena (whose gaps between views nothing writes)
        data, written = values[view.arena]
        numel = program.arg(view.name).numel
        values[view.name] = (data[view.offset: view.offset + numel], written[view.offset: view.offset + numel])
    for arg in program.buffers:
        written = values[arg.name][1]
        if arg.role in (Role.SCRATCH, Role.OUTPUT) and not bool(written.all()):
            raise UnwrittenOutput(f"{program.name}: {int((~written).sum())} of {written.numel()} elements of "
                                  f"{arg.role.value} {arg.name!r} were never written")
    return {name: data.reshape(program.arg(name).shape) for name, (data, _) in values.items()}
