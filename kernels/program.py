"""Programs: the one declaration of a fused op that every other layer derives from.

A Program lists its arguments in ELF order (the ABI the runtime binds with ``run.set_arg``) and its
launches in execution order. The runtime's sync/read-back sets, the ops' fake output shapes, the
emulator's execution and the MLIR stitcher's ``func.func`` signature all come from here.
"""
from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property

DTYPE_BYTES = {"bf16": 2, "f32": 4}


class Role(str, enum.Enum):
    """How the host treats an argument's buffer (see ARCHITECTURE.md, "Programs")."""

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
class Launch:
    """One step of a multi-launch ELF: a launch kind, its parameters and the arguments it touches."""

    kind: str
    params: tuple[tuple[str, object], ...]
    reads: tuple[str, ...]
    writes: tuple[str, ...]

    @cached_property
    def p(self) -> dict:
        return dict(self.params)


@dataclass(frozen=True)
class Program:
    name: str
    args: tuple[Arg, ...]
    launches: tuple[Launch, ...]
    params: tuple[tuple[str, object], ...] = field(default=())

    def __post_init__(self):
        names = [a.name for a in self.args]
        if len(set(names)) != len(names):
            raise ValueError(f"Program {self.name}: duplicate argument names in {names}")
        known = set(names)
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
        for a in self.args:
            if a.role in (Role.SCRATCH, Role.OUTPUT) and a.name not in written:
                raise ValueError(f"Program {self.name}: {a.role.value} {a.name!r} is never written")

    def arg(self, name: str) -> Arg:
        return self._by_name[name]

    def index(self, name: str) -> int:
        return self._index[name]

    @cached_property
    def _by_name(self) -> dict[str, Arg]:
        return {a.name: a for a in self.args}

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
        )

    @cached_property
    def key(self) -> str:
        """Content hash: two Programs with the same key compile to the same ELF."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()
