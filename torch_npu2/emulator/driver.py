"""An emulated NPU2 behind the part of pyxrt's interface that torch_npu2's runtime uses.

``EmulatedXrt()`` is used in place of the ``pyxrt`` module: ``device``, ``elf``, ``hw_context``,
``ext.kernel``, ``ext.bo`` (``map``/``sync``/``size``), ``bo(parent, size, offset)`` (pyxrt's sub-buffer: ``size``
bytes of ``parent`` from ``offset``, sharing its host and device bytes), ``run``
(``set_arg``/``start``/``wait2``/``state``), ``ert_cmd_state`` and ``xclBOSyncDirection``. The "ELF" it loads is the emulator artifact (a JSON
Program); a run interprets the Program launch by launch (see ``launches.py``).

Coherency: ``strict`` keeps separate host and device copies of every BO and moves bytes only on
``sync`` (a forgotten sync reads stale data, as on silicon); ``fast`` shares one buffer.
"""
from __future__ import annotations

import enum
import json
from collections import Counter
from types import SimpleNamespace

import numpy as np
import torch

from ..kernels.device import DEVICE
from ..kernels.program import TORCH_DTYPES, Program, Role
from .launches import run_launch


ARTIFACT_FORMAT = "torch_npu2-emulator-program"


class xclBOSyncDirection(enum.Enum):
    XCL_BO_SYNC_BO_TO_DEVICE = 0
    XCL_BO_SYNC_BO_FROM_DEVICE = 1


class ert_cmd_state(enum.Enum):
    ERT_CMD_STATE_NEW = 1
    ERT_CMD_STATE_QUEUED = 2
    ERT_CMD_STATE_COMPLETED = 4
    ERT_CMD_STATE_ERROR = 5
    ERT_CMD_STATE_ABORT = 6
    ERT_CMD_STATE_TIMEOUT = 10


def _sync_counter_keys(way: str) -> dict:
    """Counter names per BO role for one sync direction, built once: sync() runs for every argument of every
    run (keyed by the role string, not the direction: an Enum's hash is a Python call)."""
    return {role: (f"syncs_{way}", f"bytes_{way}", f"syncs_{way}:{role or 'unbound'}", f"bytes_{way}:{role or 'unbound'}")
            for role in (None, *(r.value for r in Role))}


_TO_DEVICE_KEYS, _FROM_DEVICE_KEYS = _sync_counter_keys("to_device"), _sync_counter_keys("from_device")


class _Device:
    def __init__(self, emu: "EmulatedXrt", index: int = 0):
        if index != 0:
            raise RuntimeError(f"emulated NPU2: no device at index {index} (only device 0 exists)")
        self.emu = emu


class _Elf:
    def __init__(self, path):
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != ARTIFACT_FORMAT:
            raise RuntimeError(f"emulated NPU2: {path} is not an emulator artifact")
        self.program = Program.from_json(data["program"])


class _HwContext:
    def __init__(self, device: _Device, elf: _Elf):
        self.device, self.elf = device, elf


class _Kernel:
    def __init__(self, ctx: _HwContext, name: str):
        expected = f"main:{ctx.elf.program.name}"
        if name != expected:
            raise RuntimeError(f"emulated NPU2: no kernel {name!r} in this ELF (it has {expected!r})")
        self.ctx, self.program = ctx, ctx.elf.program


class _Bo:
    def __init__(self, device: _Device, nbytes: int):
        if nbytes <= 0:
            raise RuntimeError(f"emulated NPU2: BO size must be positive, got {nbytes}")
        self.emu = device.emu
        self.nbytes = nbytes
        self._host = np.zeros(nbytes, np.uint8)
        self._device = np.zeros(nbytes, np.uint8) if self.emu.coherency == "strict" else self._host
        self._device_views: dict[torch.dtype, torch.Tensor] = {}
        self.role = None
        self.emu.counters["bos"] += 1

    @classmethod
    def sub(cls, parent: "_Bo", size: int, offset: int) -> "_Bo":
        """pyxrt's ``bo(parent, size, offset)``: ``size`` bytes of ``parent`` from ``offset``, its host and device
        bytes the parent's own (a write through either is seen by both; syncs move the same bytes)."""
        if not isinstance(parent, _Bo):
            raise RuntimeError(f"emulated NPU2: bo(parent, size, offset) takes a BO as parent, got "
                               f"{type(parent).__name__}")
        if size <= 0 or offset < 0 or offset + size > parent.nbytes:
            raise RuntimeError(f"emulated NPU2: a sub-buffer of {size} bytes at offset {offset} does not fit its "
                               f"{parent.nbytes}-byte parent")
        if offset % DEVICE.dma_word_bytes:  # a shim DMA addresses DDR in words
            raise RuntimeError(f"emulated NPU2: a sub-buffer at offset {offset}, not a multiple of the shim DMA's "
                               f"{DEVICE.dma_word_bytes}-byte word, cannot be a DMA's base address")
        bo = cls.__new__(cls)
        bo.emu, bo.nbytes, bo.role, bo._device_views = parent.emu, size, None, {}
        bo._host = parent._host[offset:offset + size]
        bo._device = bo._host if parent._device is parent._host else parent._device[offset:offset + size]
        parent.emu.counters["sub_bos"] += 1
        return bo

    def device_view(self, dtype: torch.dtype) -> torch.Tensor:
        """The device copy's bytes as a flat tensor of ``dtype`` (what the NPU's DMAs read and write)."""
        view = self._device_views.get(dtype)
        if view is None:
            usable = self._device[: self._device.nbytes // dtype.itemsize * dtype.itemsize]
            view = self._device_views[dtype] = torch.frombuffer(usable, dtype=dtype)
        return view

    def size(self) -> int:
        return self.nbytes

    def map(self) -> memoryview:
        return memoryview(self._host)

    def sync(self, direction, size: int | None = None, offset: int = 0):
        n = self._host.nbytes - offset if size is None else size
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise RuntimeError(f"emulated NPU2: sync of {n} bytes at offset {offset} outside a {self.nbytes}-byte BO")
        if direction is xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE:
            if self._device is not self._host:
                self._device[offset:offset + n] = self._host[offset:offset + n]
            keys = _TO_DEVICE_KEYS
        elif direction is xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE:
            if self._device is not self._host:
                self._host[offset:offset + n] = self._device[offset:offset + n]
            keys = _FROM_DEVICE_KEYS
        else:
            raise RuntimeError(f"emulated NPU2: unknown sync direction {direction!r}")
        c = self.emu.counters
        syncs, nbytes, role_syncs, role_bytes = keys[self.role]
        c[syncs] += 1
        c[nbytes] += n
        c[role_syncs] += 1
        c[role_bytes] += n


class _Run:
    def __init__(self, kernel: _Kernel):
        self.kernel, self.program = kernel, kernel.program
        self.emu = kernel.ctx.device.emu
        self.bos: list[_Bo | None] = [None] * len(self.program.args)
        self.run_counter = f"runs:{self.program.name}"
        self.roles = [arg.role.value for arg in self.program.args]
        self.min_sizes = [arg.nbytes for arg in self.program.args]
        # Arguments unbound or bound to a BO too small: kept by set_arg so that start() need not scan them all.
        self._misfits = set(range(len(self.bos)))
        self._state = ert_cmd_state.ERT_CMD_STATE_NEW

    def set_arg(self, index: int, bo: _Bo):
        if not 0 <= index < len(self.bos):
            raise RuntimeError(f"emulated NPU2: {self.program.name} has no argument {index}")
        self.bos[index] = bo
        bo.role = self.roles[index]
        if bo.nbytes >= self.min_sizes[index]:
            self._misfits.discard(index)
        else:
            self._misfits.add(index)

    def start(self):
        self.emu.counters["runs"] += 1
        self.emu.counters[self.run_counter] += 1
        injected = self.emu.injected_states.pop(0) if self.emu.injected_states else None
        if injected is not None:
            self._state = injected
        elif self._misfits:  # an unbound or too small argument: the command fails, as on the device
            self._state = ert_cmd_state.ERT_CMD_STATE_ERROR
        else:
            if self.emu.compute:
                self._execute()
            self._state = ert_cmd_state.ERT_CMD_STATE_COMPLETED

    def _execute(self):
        views = {
            arg.name: bo.device_view(TORCH_DTYPES[arg.dtype])[: arg.numel] for arg, bo in zip(self.program.args, self.bos)
        }
        for view in self.program.views:  # a region of its arena's buffer, as the NPU addresses it
            views[view.name] = views[view.arena][view.offset: view.offset + self.program.arg(view.name).numel]
        for launch in self.program.launches:
            for name, result in zip(launch.writes, run_launch(launch, [views[n] for n in launch.reads])):
                views[name].copy_(result.reshape(-1))

    def wait2(self, timeout_ms: int = 0):
        return self._state

    def state(self):
        return self._state


class EmulatedXrt:
    """A pyxrt-shaped module object for one emulated NPU2.

    ``compute=False`` skips the launches' arithmetic (everything else stays real) so that benchmarks
    can measure the host-side cost alone. ``injected_states`` lets tests make the next runs finish in
    a given ``ert_cmd_state``.
    """

    def __init__(self, coherency: str = "fast", compute: bool = True):
        if coherency not in ("strict", "fast"):
            raise ValueError(f"EmulatedXrt: coherency must be 'strict' or 'fast', got {coherency!r}")
        self.coherency, self.compute = coherency, compute
        self.counters: Counter = Counter()
        self.injected_states: list[ert_cmd_state] = []
        self.xclBOSyncDirection, self.ert_cmd_state = xclBOSyncDirection, ert_cmd_state
        self.elf, self.run = _Elf, _Run
        self.ext = SimpleNamespace(kernel=_Kernel, bo=lambda device, nbytes: _Bo(device, nbytes))
        self.bo = _Bo.sub

    def device(self, index: int = 0) -> _Device:
        return _Device(self, index)

    def hw_context(self, device: _Device, elf: _Elf) -> _HwContext:
        return _HwContext(device, elf)


def write_artifact(program: Program, path, mlir: str | None = None, mlir_problem: str | None = None) -> None:
    """The emulator's "ELF": the Program it interprets, plus its MLIR (or why there is none), for inspection."""
    with open(path, "w") as f:
        json.dump({"format": ARTIFACT_FORMAT, "program": program.to_json(), "mlir": mlir,
                   "mlir_problem": mlir_problem}, f)


__all__ = ["EmulatedXrt", "write_artifact", "ARTIFACT_FORMAT"]
