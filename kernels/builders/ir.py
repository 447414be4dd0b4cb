"""MLIR text emission for one launch: the AIR hierarchy and DMAs, plus upstream dialect ops.

Every op is written in its custom assembly form, the form ``air-opt`` prints. For ``air.dma_memcpy_nd``
that matters beyond looks: its offsets, sizes and strides are SSA index operands, which AIR before and
after mlir-air #1762 both read, where the generic form's ``static_*`` properties are silently dropped
by the older AIR. Each DMA is also recorded (:class:`Dma`), so that a test can read the windows back
from ``air-opt``'s own print and compare them with what the builder meant.

A builder creates a :class:`LaunchBuilder` over its operand types, emits through it and calls
:meth:`LaunchBuilder.finish`. Operands are named ``%operand0..N`` (the launch's reads then writes, in the
Program's order); the stitcher maps those to the ELF's ``func.func`` arguments and prefixes every other
SSA value and symbol per launch.
"""
from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..device import DEVICE
from ..program import DTYPE_BYTES
from .externs import object_for_symbol

L3, L2, L1 = 0, 1, 2  # AIR memory spaces: DDR, memtile, compute-tile memory
# aie-assign-buffer-addresses packs a tile's buffers end to end above the stack, so a buffer of whole runs of the
# widest vector's alignment, above a stack of whole runs (CompileOptions), starts where a vector load can read it.
L1_BUFFER_GRANULE = DEVICE.vector_align_bytes
ELEMENT_BYTES = {**DTYPE_BYTES, "i32": 4}  # Program dtypes plus i32, the scalar type passed to kernel calls
OPERAND_PREFIX = "operand"


@dataclass(frozen=True)
class MemRef:
    shape: tuple[int, ...]
    dtype: str
    space: int = L3
    layout: str = ""  # e.g. "strided<[64, 1], offset: ?>" for a subview
    # (arena elements, element offset) for a Program view (kernels/program.py, View): the builder plans with the
    # view's shape, the text types it as its 1-D arena argument and LaunchBuilder.dma moves its windows there
    arena: tuple[int, int] | None = None

    def __str__(self) -> str:
        if self.arena is not None:
            return f"memref<{self.arena[0]}x{self.dtype}>"
        parts = ["x".join(str(d) for d in self.shape) + "x" + self.dtype if self.shape else self.dtype]
        if self.layout:
            parts.append(self.layout)
        if self.space != L3:
            parts.append(f"{self.space} : i32")
        return f"memref<{', '.join(parts)}>"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ELEMENT_BYTES[self.dtype]


@dataclass(frozen=True)
class Value:
    """An SSA value (name including ``%``) and its type (a MemRef or a builtin type name)."""

    ssa: str
    type: object


@dataclass(frozen=True)
class Window:
    """A DMA access pattern in elements; an offset may be an SSA name. Empty means the whole buffer."""

    offsets: tuple = ()
    sizes: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


WHOLE = Window()


def rows_window(ref: MemRef, row, nrows: int, col, ncols: int) -> Window:
    """Rows ``[row, row+nrows)`` × columns ``[col, col+ncols)`` of a row-major (rows, cols) operand.

    A 1-D operand is a Program's single-row (decode) form: only ``nrows == 1`` at row 0 exists, so the
    row offset is dropped.
    """
    if len(ref.shape) == 2:
        return Window((row, col), (nrows, ncols), (ref.shape[1], 1))
    if len(ref.shape) != 1 or nrows != 1:
        raise ValueError(f"rows_window: expected a 2-D operand, or a 1-D one with nrows=1; got {ref}, "
                         f"nrows={nrows}")
    return Window((col,), (ncols,), (1,))


@dataclass(frozen=True)
class Dma:
    """One ``air.dma_memcpy_nd`` as the builder meant it: destination and source windows."""

    dst: Window
    src: Window


@dataclass(frozen=True)
class ExternDecl:
    """A ``func.func private`` the launch calls: C symbol, argument types, the object it links and the
    ``-D`` configuration (tile-size macros) that object must be compiled with."""

    symbol: str
    arg_types: tuple[str, ...]
    object: str
    defines: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class LaunchIR:
    """What a builder returns: the launch op text, its operands, the external kernels it calls, its DMAs in
    text order, and the L1 buffers one tile of its herd holds as the builder planned them (name, bytes; AIR's
    ping-pong copies counted), which kernels/budgets.py checks."""

    kind: str
    text: str
    operands: tuple[Value, ...]
    externs: tuple[ExternDecl, ...]
    dmas: tuple[Dma, ...]
    l1_buffers: tuple[tuple[str, int], ...]


def extern_declaration(symbol: str, arg_types, object_name: str) -> str:
    return (f"func.func private @{symbol}({', '.join(arg_types)}) "
            f'attributes {{link_with = "{object_name}", llvm.emit_c_interface}}')


def float_literal(value: float) -> str:
    """An MLIR float literal: MLIR needs the '.', and ten significant digits round-trip any f32."""
    return f"{float(value):.9e}"


def _row_major(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


def _strided_layout(shape: tuple[int, ...], keep: int) -> str:
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return f"strided<[{', '.join(str(s) for s in strides[-keep:])}], offset: ?>"


@dataclass
class _Scope:
    isolated: bool
    constants: dict = field(default_factory=dict)


class LaunchBuilder:
    """Emits one launch's text with unique SSA names, recording the external kernels it calls."""

    def __init__(self, kind: str, operand_types, roles):
        """``roles`` name the operands (e.g. "x", "weight", "out"); they become block-argument names."""
        self.kind = kind
        self.operands = tuple(Value(f"%{OPERAND_PREFIX}{i}", t) for i, t in enumerate(operand_types))
        self._roles = tuple(roles)
        self._lines: list[str] = []
        self._depth = 0
        self._used = {v.ssa[1:] for v in self.operands}
        self._scopes = [_Scope(isolated=True)]
        self._externs: dict[str, ExternDecl] = {}
        self._dmas: list[Dma] = []

    # ---- plumbing -------------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        base = re.sub(r"\W", "_", hint)
        name, n = base, 1
        while name in self._used:
            n += 1
            name = f"{base}_{n}"
        self._used.add(name)
        return "%" + name

    def _block_arg_hint(self, ssa: str) -> str:
        name = ssa[1:]
        if name.startswith(OPERAND_PREFIX):
            return self._roles[int(name[len(OPERAND_PREFIX):])]
        return re.sub(r"_\d+$", "", name)

    def emit(self, line: str) -> None:
        self._lines.append("  " * self._depth + line)

    def comment(self, text: str) -> None:
        self.emit(f"// {text}")

    @contextmanager
    def _region(self, isolated: bool):
        self._depth += 1
        self._scopes.append(_Scope(isolated))
        try:
            yield
        finally:
            self._scopes.pop()
            self._depth -= 1

    def const(self, value, type_: str = "index") -> str:
        """An ``arith.constant``, reused while visible (isolated regions start a fresh set)."""
        key = (value, type_)
        for scope in reversed(self._scopes):
            if key in scope.constants:
                return scope.constants[key]
            if scope.isolated:
                break
        if type_ in ("f32", "bf16"):
            literal = float_literal(value)
            hint = "cst_" + type_
        else:
            literal = str(int(value))
            hint = f"c{int(value)}" + ("" if type_ == "index" else "_" + type_)
        name = self.fresh(hint)
        self.emit(f"{name} = arith.constant {literal} : {type_}")
        self._scopes[-1].constants[key] = name
        return name

    # ---- AIR hierarchy --------------------------------------------------------------------------------
    @contextmanager
    def hierarchy(self, op: str, name: str, sizes, operands, link_with: str | None = None):
        """``air.launch`` / ``air.segment`` / ``air.herd``; yields (ids, sizes, operand block args).

        The region is isolated from above, so every value it uses arrives as an operand and is
        re-bound to a block argument of the same type.
        """
        size_values = [self.const(s) for s in sizes]
        axes = "xyz"
        ids = [self.fresh(f"{op[0]}{axes[i]}") for i in range(len(sizes))]
        extents = [self.fresh(f"{op[0]}s{axes[i]}") for i in range(len(sizes))]
        args = [Value(self.fresh(self._block_arg_hint(v.ssa)), v.type) for v in operands]
        header = f"air.{op} @{name}" + (" tile" if op == "herd" else "")
        if sizes:
            header += (f" ({', '.join(ids)}) in "
                       f"({', '.join(f'{e}={s}' for e, s in zip(extents, size_values))})")
        if operands:
            header += (f" args({', '.join(f'{a.ssa}={v.ssa}' for a, v in zip(args, operands))}) : "
                       f"{', '.join(str(v.type) for v in operands)}")
        if link_with:
            header += f' attributes {{link_with = "{link_with}"}}'
        self.emit(header + " {")
        with self._region(isolated=True):
            yield ids, extents, args
        self.emit("}")

    def launch(self, name, sizes, operands):
        return self.hierarchy("launch", name, sizes, operands)

    def segment(self, name, operands):
        return self.hierarchy("segment", name, (), operands)

    def herd(self, name, sizes, operands, link_with=None):
        return self.hierarchy("herd", name, sizes, operands, link_with)

    def dma(self, dst: Value, dst_window: Window, src: Value, src_window: Window) -> None:
        """``air.dma_memcpy_nd``: copy ``src_window`` of ``src`` into ``dst_window`` of ``dst``.

        Offsets, sizes and strides are SSA index values (constants where static): the custom form that
        AIR before and after mlir-air #1762 both read (see the toolchain README).
        """
        dst_count = dst_window.numel if dst_window.sizes else dst.type.numel
        src_count = src_window.numel if src_window.sizes else src.type.numel
        if dst_count != src_count:
            raise ValueError(f"{self.kind} DMA: moves {src_count} elements into {dst_count}")
        if dst.type.dtype != src.type.dtype:
            raise ValueError(f"{self.kind} DMA: cannot convert {src.type.dtype} to {dst.type.dtype}")
        for window in (dst_window, src_window):
            if not len(window.offsets) == len(window.sizes) == len(window.strides):
                raise ValueError(f"{self.kind} DMA: window {window} needs as many offsets, sizes and strides")
        sides = []
        dst_window, src_window = self._in_arena(dst.type, dst_window), self._in_arena(src.type, src_window)
        for value, window in ((dst, dst_window), (src, src_window)):
            lists = [[o if isinstance(o, str) else self.const(o) for o in window.offsets],
                     [self.const(s) for s in window.sizes], [self.const(s) for s in window.strides]]
            sides.append(value.ssa + " ".join(f"[{', '.join(values)}]" for values in lists))
        self.emit(f"air.dma_memcpy_nd ({sides[0]}, {sides[1]}) : ({dst.type}, {src.type})")
        self._dmas.append(Dma(dst_window, src_window))

    def _in_arena(self, ref, window: Window) -> Window:
        """``window`` of a view (``ref.arena``) as the same elements of its arena: the view's start added to the
        offset of a dimension whose stride divides it, from the innermost out (a window with none raises). A window
        with static offsets must stay inside its view: past it, the arena's bounds, which are all the interpreter and
        the shim BD lint see, would not stop it from writing a neighbour. A memref.reinterpret_cast of the arena would
        say the same to air-opt, but mlir-aie (c668d2cb) drops a cast's offset when it lowers a runtime sequence's
        BDs to NPU instructions: every view would read the arena's start (tests/kernels/test_air_pipeline.py lowers
        a view and finds its offset in the instructions)."""
        if not isinstance(ref, MemRef) or ref.arena is None:
            return window
        if not window.sizes:
            window = Window((0,) * len(ref.shape), ref.shape, _row_major(ref.shape))
        if all(isinstance(o, int) for o in window.offsets):
            last = sum((o + n - 1) * s for o, n, s in zip(window.offsets, window.sizes, window.strides))
            if last >= ref.numel:
                raise ValueError(f"{self.kind} DMA: window {window} reaches element {last} of a view of {ref.numel}")
        start = ref.arena[1]
        if start == 0:
            return window
        for dim in reversed(range(len(window.strides))):
            stride = window.strides[dim]
            if stride and start % stride == 0:
                offset, shift = window.offsets[dim], start // stride
                moved = offset + shift if isinstance(offset, int) else self.affine(f"s0 + {shift}", [offset], "at")
                return Window(window.offsets[:dim] + (moved,) + window.offsets[dim + 1:], window.sizes,
                              window.strides)
        raise ValueError(f"{self.kind} DMA: no stride of {window} divides its view's start {start} in its arena")

    def broadcast_dma(self, dst: Value, dst_window: Window, src: Value, src_window: Window) -> None:
        """A copy every tile of a herd makes alike (AIR turns it into one broadcast stream), before a loop.

        It is emitted inside a one-trip ``scf.for``: AIR 0e3df89d's air-dma-to-channel leaves the token of a
        herd-level broadcast dangling when a later loop depends on it ("operand does not dominate this
        use"; fixed upstream in mlir-air #1489), and the loop keeps that token inside its region.
        """
        with self.loop(0, 1, 1, "once"):
            self.dma(dst, dst_window, src, src_window)

    # ---- upstream dialects ----------------------------------------------------------------------------
    @contextmanager
    def loop(self, lower: int, upper: int, step: int = 1, hint: str = "i"):
        """Iterates an index over ``[lower, upper)`` by ``step``; yields that index.

        The ``scf.for`` itself always counts trips with step 1 and the index is an ``affine.apply`` of the
        trip: AIR (0e3df89d) folds a DMA's enclosing loop into its access pattern using the loop's trip
        count but not its step, so a DMA under a loop of step 8 would read rows 0, 1, 2 instead of 0, 8, 16.
        """
        if (upper - lower) % step:
            raise ValueError(f"{self.kind} loop: [{lower}, {upper}) is not whole steps of {step}")
        trip = self.fresh(hint if step == 1 and lower == 0 else f"{hint}_trip")
        self.emit(f"scf.for {trip} = {self.const(0)} to {self.const((upper - lower) // step)} step {self.const(1)} {{")
        with self._region(isolated=False):
            yield trip if step == 1 and lower == 0 else self.affine(f"s0 * {step} + {lower}", [trip], hint)
        self.emit("}")

    @contextmanager
    def when(self, condition: str):
        """``scf.if`` on an ``i1`` value: the body runs only where ``condition`` holds. The else branch is
        written out empty: AIR's dependency analysis gives the op a token result, and an ``scf.if`` with
        results needs both branches."""
        self.emit(f"scf.if {condition} {{")
        with self._region(isolated=False):
            yield
        self.emit("} else {")
        self.emit("}")

    def index_at_most(self, lhs: str, rhs: str, hint: str = "at_most") -> str:
        """``lhs <= rhs`` (signed) for two index values, as an ``i1``."""
        return self.assign(hint, f"arith.cmpi sle, {lhs}, {rhs} : index", "i1").ssa

    def affine(self, expr: str, symbols, hint: str = "idx") -> str:
        """``affine.apply`` of ``expr`` over symbols ``s0..`` bound to the given index values."""
        names = ", ".join(f"s{i}" for i in range(len(symbols)))
        result = self.fresh(hint)
        self.emit(f"{result} = affine.apply affine_map<()[{names}] -> ({expr})>()[{', '.join(symbols)}]")
        return result

    def index_to_i32(self, index: str, hint: str = "i32") -> Value:
        return self.assign(hint, f"arith.index_cast {index} : index to i32", "i32")

    def alloc(self, ref: MemRef, hint: str) -> Value:
        if ref.space == L1 and ref.nbytes % L1_BUFFER_GRANULE:
            from .npu2 import LaunchConstraintError
            raise LaunchConstraintError(self.kind, hint, ref.nbytes, f"an L1 buffer is whole {L1_BUFFER_GRANULE}-byte "
                                        f"runs, or aiecc places the buffers after it off the boundary a vector load "
                                        f"needs: pad it (l1_elements)")
        name = self.fresh(hint)
        self.emit(f"{name} = memref.alloc() : {ref}")
        return Value(name, ref)

    def zero_tail(self, buffer: Value, start: int) -> None:
        """Zeros a 1-D L1 buffer from element ``start`` on: the padding (npu2.l1_elements) of a buffer a kernel is
        handed whole, which its record (builders/externs.py) says it reads whole; the kernels use the head."""
        ref = buffer.type
        if start >= ref.numel:
            return
        zero = self.const(0.0, ref.dtype)
        for i in range(start, ref.numel):  # unrolled: AIR 0e3df89d's passes ran for over 25 min on it as a loop
            self.emit(f"memref.store {zero}, {buffer.ssa}[{self.const(i)}] : {ref}")

    def dealloc(self, *values: Value) -> None:
        for v in values:
            self.emit(f"memref.dealloc {v.ssa} : {v.type}")

    def slab(self, buffer: Value, coords, hint: str = "slab") -> Value:
        """The calling core's slab ``buffer[coords..., :, ...]`` of a herd-shared L1 buffer (rank-reducing)."""
        ref = buffer.type
        keep = len(ref.shape) - len(coords)
        offsets = list(coords) + ["0"] * keep
        sizes = ["1"] * len(coords) + [str(d) for d in ref.shape[len(coords):]]
        result = MemRef(ref.shape[len(coords):], ref.dtype, ref.space, _strided_layout(ref.shape, keep))
        name = self.fresh(hint)
        self.emit(f"{name} = memref.subview {buffer.ssa}[{', '.join(offsets)}] [{', '.join(sizes)}] "
                  f"[{', '.join(['1'] * len(ref.shape))}] : {ref} to {result}")
        return Value(name, result)

    def call(self, symbol: str, args, defines: dict[str, int]) -> None:
        """``func.call`` of an external AIE2P kernel built with ``defines``; recorded for the stitcher."""
        kernel = object_for_symbol(symbol)
        if not set(kernel.config_macros) <= set(defines) <= {*kernel.config_macros, *kernel.optional_macros}:
            raise ValueError(f"{self.kind} call of {symbol}: defines {sorted(defines)} must hold "
                             f"{sorted(kernel.config_macros)} and at most {sorted(kernel.optional_macros)} besides")
        decl = ExternDecl(symbol, tuple(str(a.type) for a in args), kernel.object, tuple(sorted(defines.items())))
        if self._externs.setdefault(symbol, decl) != decl:
            raise ValueError(f"{self.kind}: {symbol} called two ways in one launch")
        self.emit(f"func.call @{symbol}({', '.join(a.ssa for a in args)}) : ({', '.join(decl.arg_types)}) -> ()")

    def assign(self, hint: str, rhs: str, type_) -> Value:
        """``%name = <rhs>`` for an op whose text the caller writes; returns the result."""
        name = self.fresh(hint)
        self.emit(f"{name} = {rhs}")
        return Value(name, type_)

    def vector_read(self, buffer: Value, index: str, lanes: int, hint: str = "v") -> Value:
        vtype = f"vector<{lanes}x{buffer.type.dtype}>"
        pad = self.const(0.0, buffer.type.dtype)
        return self.assign(hint, f"vector.transfer_read {buffer.ssa}[{index}], {pad} {{in_bounds = [true]}} : "
                                 f"{buffer.type}, {vtype}", vtype)

    def vector_write(self, vector: Value, buffer: Value, index: str) -> None:
        self.emit(f"vector.transfer_write {vector.ssa}, {buffer.ssa}[{index}] {{in_bounds = [true]}} : "
                  f"{vector.type}, {buffer.type}")

    def finish(self, l1_buffers: dict[str, int]) -> LaunchIR:
        """The launch, with ``l1_buffers``: one herd tile's L1 buffers as planned (the dict its budget check took)."""
        assert self._depth == 0, "unclosed region"
        return LaunchIR(self.kind, "\n".join(self._lines), self.operands, tuple(self._externs.values()),
                        tuple(self._dmas), tuple(l1_buffers.items()))
