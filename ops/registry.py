"""Registers Programs as torch.library custom ops in the ``npu2`` namespace.

A fused op's schema, argument checks and fake kernel all come from its Program: the tensor arguments
are the Program's weights and inputs in ELF order, the outputs its output arguments. Ops are defined
with the low-level ``torch.library.Library`` route (cheaper per call than ``custom_op``), are functional
(outputs are fresh BO-backed tensors, never aliases of inputs) and inference-only: with grad mode on, an
argument that requires grad is refused rather than given a backward that would compute nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Callable

import torch

from ..kernels.catalog import BF16_WEIGHT_PRECISIONS, INTEGER_PRECISION
from ..kernels.quant import FORMATS
from ..kernels.program import TORCH_DTYPES, Program
from ..runtime import get_runtime

NAMESPACE = "npu2"
_LIB = torch.library.Library(NAMESPACE, "DEF")


@dataclass(frozen=True, eq=False)  # hashed by identity: it keys the per-shape Program cache
class FusedOp:
    """How an op's tensors map to a Program.

    ``program_for(shapes, *scalars)`` builds the Program from the tensor arguments' shapes (in ELF order)
    and the scalar arguments; ``example`` is a Program of this op at small dims, which fixes argument
    names, ranks and outputs for the schema.
    """

    name: str
    scalars: tuple[tuple, ...]  # (name, schema type) or (name, schema type, default)
    program_for: Callable[..., Program]
    example: Program
    # (output, argument name) per output the ``.into`` overload writes into a tensor the caller gives (a KV cache's
    # row); empty: the op has no such overload
    into: tuple[tuple[str, str], ...] = ()

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}.{self.name}"

    def with_defaults(self, scalars: tuple) -> tuple:
        """The scalar arguments of a call, defaults filled in (the dispatcher hands over only those given)."""
        return tuple(scalars) + tuple(s[2] for s in self.scalars[len(scalars):])

    @cached_property
    def expected(self) -> tuple[tuple[str, torch.dtype, int], ...]:
        """(name, dtype, rank) of each tensor argument: what every call is checked against."""
        return tuple((a.name, TORCH_DTYPES[a.dtype], len(a.shape)) for a in self.example.host_args)

    @cached_property
    def into_positions(self) -> tuple[int, ...]:
        """The positions among the Program's outputs of the ``into`` outputs, in ``into``'s order."""
        names = [a.name for a in self.example.outputs]
        return tuple(names.index(output) for output, _ in self.into)

    def schema(self, into: bool = False) -> str:
        """The default overload's schema; with ``into``, the ``.into`` overload's: the ``into`` outputs become
        mutable tensor arguments after the others, and are left out of the returns."""
        params = [f"Tensor {a.name}" for a in self.example.host_args]
        if into:
            params += [f"Tensor({chr(ord('a') + i)}!) {name}" for i, (_, name) in enumerate(self.into)]
        params += [f"{s[1]} {s[0]}" + (f"={_schema_literal(s[2])}" if len(s) == 3 else "") for s in self.scalars]
        returned = len(self.example.outputs) - (len(self.into) if into else 0)
        outs = "Tensor" if returned == 1 else f"({', '.join('Tensor' for _ in range(returned))})"
        return f"{self.name}{'.into' if into else ''}({', '.join(params)}) -> {outs}"


def _schema_literal(value) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


class BadArgument(ValueError):
    """Raised by a ``program_for`` that can tell which argument is at fault (reported like a shape check)."""

    def __init__(self, arg: str, expected: str, given):
        super().__init__(arg, expected, given)
        self.arg, self.expected, self.given = arg, expected, given


def _fail(op: FusedOp, arg: str, expected: str, given) -> ValueError:
    return ValueError(f"{op.qualname}: argument '{arg}' expected {expected}, got {given}")


def _check_tensors(op: FusedOp, tensors, real: bool) -> None:
    grad = torch.is_grad_enabled()
    for (name, dtype, rank), t in zip(op.expected, tensors):
        if not isinstance(t, torch.Tensor):
            raise _fail(op, name, "a torch.Tensor", type(t).__name__)
        if t.dtype is not dtype:
            raise _fail(op, name, f"dtype {dtype}", t.dtype)
        if t.dim() != rank:
            raise _fail(op, name, f"a {rank}-D tensor", f"shape {tuple(t.shape)}")
        if real and not t.is_cpu:
            raise _fail(op, name, "a CPU tensor (NPU buffers are host-mapped)", f"device {t.device}")
        if real and not t.is_contiguous():
            raise _fail(op, name, "a contiguous tensor", f"strides {t.stride()}")
        if grad and t.requires_grad:
            raise _fail(op, name, "a tensor that does not require grad (the npu2 ops are inference-only: call "
                        "them under torch.no_grad() or pass .detach())", "requires_grad=True")
    # The real path checks each device above. All-meta (or all-fake) arguments infer shapes; a meta tensor
    # among CPU ones also dispatches to the fake kernel, and is the one to blame.
    if not real and len({t.device for t in tensors}) > 1:
        name, t = next((name, t) for (name, _, _), t in zip(op.expected, tensors) if not t.is_cpu)
        raise _fail(op, name, "a CPU tensor like the other arguments (NPU buffers are host-mapped)",
                    f"device {t.device}")


_POSITIVE_FLOAT = (lambda v: math.isfinite(v) and v > 0, "a finite float > 0")
# What each scalar argument (by name) must be: a predicate and the expectation an error states.
SCALAR_CHECKS = {
    "eps": _POSITIVE_FLOAT,
    "next_eps": _POSITIVE_FLOAT,
    "final_eps": _POSITIVE_FLOAT,
    "precision": (lambda v: v in BF16_WEIGHT_PRECISIONS,
                  f"one of {', '.join(map(repr, BF16_WEIGHT_PRECISIONS))} (for {INTEGER_PRECISION!r}: the *_w8x2 ops, "
                  "over prepared weights)"),
    "head_dim": (lambda v: v > 0, "a positive int"),
    "heads": (lambda v: v > 0, "a positive int"),
    "intermediate": (lambda v: v > 0, "a positive int"),
    "in_features": (lambda v: v > 0 and v % 32 == 0, "a positive multiple of 32 (whole 32-element blocks)"),
    "weights": (lambda v: v in FORMATS, f"one of {', '.join(map(repr, FORMATS))} (a packed weight format)"),
    "head_weights": (lambda v: v in FORMATS, f"one of {', '.join(map(repr, FORMATS))} (a packed weight format)"),
}


@lru_cache(maxsize=512)
def _program(op: FusedOp, shapes: tuple, scalars: tuple) -> Program:
    shapes = tuple(tuple(shape) for shape in shapes)  # a torch.Size key hits the same entry; errors print tuples
    for (name, *_), value in zip(op.scalars, scalars):
        valid, expected = SCALAR_CHECKS[name]
        if not valid(value):
            raise _fail(op, name, expected, repr(value))
    try:
        program = op.program_for(shapes, *scalars)
    except BadArgument as exc:
        raise _fail(op, exc.arg, exc.expected, exc.given) from None
    except ValueError as exc:
        raise ValueError(f"{op.qualname}: inconsistent arguments: {exc}") from None
    for arg, shape in zip(program.host_args, shapes):
        if shape != arg.shape:
            raise _fail(op, arg.name, f"shape {arg.shape}", f"shape {shape}")
    return program


def program_of(op: FusedOp, tensors, scalars, real: bool = True) -> Program:
    """The Program for these arguments, after checking them (``ValueError`` naming op and argument)."""
    _check_tensors(op, tensors, real)
    if real:  # torch.Size hashes and compares as the tuple of its sizes: no conversion per call
        return _program(op, tuple([t.shape for t in tensors]), tuple(scalars))
    # NPU kernels are compiled per static shape, so symbolic sizes (torch.compile) are specialized here.
    return _program(op, tuple(tuple(int(d) for d in t.shape) for t in tensors), tuple(scalars))


def _check_into(op: FusedOp, program: Program, targets, real: bool) -> None:
    """The tensors an ``.into`` call gives its outputs: each of the output's shape and dtype (on the CPU when real)."""
    outputs = program.outputs
    for (output, name), position, t in zip(op.into, op.into_positions, targets):
        arg = outputs[position]
        if not isinstance(t, torch.Tensor):
            raise _fail(op, name, "a torch.Tensor", type(t).__name__)
        if t.dtype is not TORCH_DTYPES[arg.dtype] or t.shape != arg.shape:
            raise _fail(op, name, f"a {TORCH_DTYPES[arg.dtype]} tensor of shape {arg.shape} (the op's {output})",
                        f"{t.dtype} of shape {tuple(t.shape)}")
        if real and not t.is_cpu:
            raise _fail(op, name, "a CPU tensor (NPU buffers are host-mapped)", f"device {t.device}")


def register_into(op: FusedOp):
    """Defines ``torch.ops.npu2.<name>.into``: the op, with the outputs ``op.into`` names written into tensors the
    caller gives after its tensor arguments (a KV cache's rows: the NPU writes them in place, runtime.run's
    ``into``); returns the other outputs (None when there are none). Returns the overload."""
    count, placed = len(op.example.host_args), len(op.into)
    returned = len(op.example.outputs) - placed  # the schema returns nothing, one tensor or a tuple
    positions = op.into_positions

    def npu_impl(*args):
        tensors, targets = args[:count], args[count:count + placed]
        program = program_of(op, tensors, op.with_defaults(args[count + placed:]))
        _check_into(op, program, targets, real=True)
        outputs = get_runtime().run(program, tensors, dict(zip(positions, targets)))
        return outputs[0] if returned == 1 else outputs if returned else None

    def fake_impl(*args):
        tensors, targets = args[:count], args[count:count + placed]
        program = program_of(op, tensors, op.with_defaults(args[count + placed:]), real=False)
        _check_into(op, program, targets, real=False)
        like = tensors[0]
        outputs = tuple(like.new_empty(a.shape, dtype=TORCH_DTYPES[a.dtype])
                        for i, a in enumerate(program.outputs) if i not in positions)
        return outputs[0] if returned == 1 else outputs if returned else None

    _LIB.define(op.schema(into=True))
    _LIB.impl(f"{op.name}.into", torch.compiler.disable(npu_impl, reason="torch_npu2 runs an NPU Program"),
              "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{op.name}.into", fake_impl, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), op.name).into


def register(op: FusedOp):
    """Defines ``torch.ops.npu2.<name>`` with its NPU implementation and fake; returns the overload."""
    count = len(op.example.host_args)
    arity = count + len(op.scalars)
    single = len(op.example.outputs) == 1

    def npu_impl(*args):
        tensors = args[:count]
        scalars = args[count:] if len(args) == arity else op.with_defaults(args[count:])
        program = program_of(op, tensors, scalars)
        outputs = get_runtime().run(program, tensors)
        return outputs[0] if single else outputs

    def fake_impl(*args):
        tensors, scalars = args[:count], op.with_defaults(args[count:])
        program = program_of(op, tensors, scalars, real=False)
        like = tensors[0]
        outputs = tuple(like.new_empty(a.shape, dtype=TORCH_DTYPES[a.dtype]) for a in program.outputs)
        return outputs[0] if single else outputs

    _LIB.define(op.schema())
    # CompositeExplicitAutograd: every device reaches npu_impl, which names a wrong device clearly.
    # Dynamo traces an op through its fake; the real kernel is opaque to it. Without disable(), code that
    # runs eagerly inside a compiled region (after a graph break) would have dynamo trace into the runtime.
    _LIB.impl(op.name, torch.compiler.disable(npu_impl, reason="torch_npu2 runs an NPU Program"),
              "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{op.name}", fake_impl, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), op.name).default
