"""The constraint checks every builder shares, against the device's capacities (kernels/device.py).

A builder refuses, with a :class:`LaunchConstraintError` naming the launch kind, the parameter and the
rule, any launch it cannot emit as something that fits: tiles that do not divide the problem, L1 or L2
buffers over budget, operands whose shapes disagree with the launch parameters.
"""
from __future__ import annotations

from ..device import DEVICE
from ..program import CORE_STACK_BYTES
from .ir import ELEMENT_BYTES, L1_BUFFER_GRANULE, MemRef

STACK_BYTES = CORE_STACK_BYTES        # the Programs' default stack, at the bottom of L1
# Left free above the buffers: the linker places the kernels' .data/.rodata/.bss after the highest buffer (64 B in
# kernels/aie2p today, attention's lane table; aie_api's and the runtime's share cannot be seen without Peano).
L1_HEADROOM = 1024
L1_AVAILABLE = DEVICE.l1_bytes - STACK_BYTES - L1_HEADROOM  # what a tile's buffers may take


class LaunchConstraintError(ValueError):
    """A launch's parameters or tuning cannot be emitted as an NPU2 kernel."""

    def __init__(self, kind: str, param: str, value, constraint: str):
        super().__init__(f"{kind} launch: {param}={value!r}: {constraint}")
        self.kind, self.param, self.value, self.constraint = kind, param, value, constraint


class BudgetExceeded(LaunchConstraintError):
    """A launch whose buffers do not fit L1 or a memtile: ``level`` ("L1" or "L2") and the buffers (name, bytes)."""

    def __init__(self, kind: str, level: str, buffers: dict[str, int], constraint: str):
        super().__init__(kind, f"{level} bytes", sum(buffers.values()), constraint)
        self.level, self.buffers = level, dict(buffers)


def require(condition: bool, kind: str, param: str, value, constraint: str) -> None:
    if not condition:
        raise LaunchConstraintError(kind, param, value, constraint)


def check_tuning(kind: str, tuning: dict, allowed) -> None:
    for key, value in tuning.items():
        require(key in allowed, kind, key, value, f"unknown tuning parameter; known: {', '.join(allowed)}")
        require(isinstance(value, int) and value > 0, kind, key, value, "must be a positive int")


def check_params(kind: str, params: dict, names) -> None:
    missing = [n for n in names if n not in params]
    require(not missing, kind, "params", sorted(params), f"missing {', '.join(missing)}")
    for name in names:
        value = params[name]
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        require(value > 0, kind, name, value, "must be positive")


def row_shapes(rows: int, cols: int) -> set[tuple[int, ...]]:
    """Shapes a (rows, cols) activation may have: 1-D when it is a single (decode) row."""
    return {(rows, cols), (cols,)} if rows == 1 else {(rows, cols)}


def check_operands(kind: str, operands, expected) -> None:
    """``expected``: (role, accepted shapes, dtype) per operand, in the launch's reads-then-writes order."""
    require(len(operands) == len(expected), kind, "operands", len(operands),
            f"expects {len(expected)} operands ({', '.join(e[0] for e in expected)})")
    for ref, (role, shapes, dtype) in zip(operands, expected):
        require(isinstance(ref, MemRef) and tuple(ref.shape) in shapes and ref.dtype == dtype, kind, role,
                str(ref), f"must be {' or '.join(str(MemRef(s, dtype)) for s in sorted(shapes))}")


def check_budget(kind: str, level: str, buffers: dict[str, int], advice: str) -> None:
    """Sum of buffer bytes (callers count double-buffered ones twice) against L1 or one memtile."""
    limit = L1_AVAILABLE if level == "L1" else DEVICE.l2_bytes
    total = sum(buffers.values())
    if total > limit:
        items = ", ".join(f"{name} {size} B" for name, size in buffers.items())
        where = (f"{L1_AVAILABLE} B per compute tile ({DEVICE.l1_bytes // 1024} KiB minus the {STACK_BYTES} B stack "
                 f"and {L1_HEADROOM} B of headroom)" if level == "L1"
                 else f"{DEVICE.l2_bytes} B of one memtile")
        raise BudgetExceeded(kind, level, buffers, f"exceeds {where} ({items}); {advice}")


def pingpong_copies(trips: int) -> int:
    """How many copies AIR's ping-pong transform keeps of a buffer a loop of ``trips`` iterations fills: none
    extra for one trip (the loop folds away), ping and pong for an even count, and a third for an odd one
    (the loop is unrolled by two and the left-over iteration gets buffers of its own)."""
    return 1 if trips == 1 else 2 if trips % 2 == 0 else 3


def nbytes(shape, dtype: str) -> int:
    n = ELEMENT_BYTES[dtype]
    for d in shape:
        n *= d
    return n


def l1_elements(count: int, dtype: str) -> int:
    """``count`` elements of ``dtype`` rounded up to an L1 buffer of whole ``L1_BUFFER_GRANULE`` bytes (the kernels
    use the first ``count``; DMAs move those)."""
    per = L1_BUFFER_GRANULE // ELEMENT_BYTES[dtype]
    return -(-count // per) * per


def largest_dividing(count: int, candidates) -> int | None:
    return next((c for c in candidates if count % c == 0), None)


def divisors_descending(n: int, at_most: int | None = None) -> list[int]:
    cap = n if at_most is None else min(n, at_most)
    return [d for d in range(cap, 0, -1) if n % d == 0]
