"""Which pyxrt-shaped driver the runtime talks to: real ``pyxrt`` with an NPU, or the emulated NPU2.

``TORCH_NPU2_BACKEND=auto|npu|emulator`` (default ``auto``) forces a choice; asking for ``npu`` where it
cannot work fails with a message naming what is missing. ``TORCH_NPU2_EMULATOR_COHERENCY=fast|strict``
picks the emulator's coherency mode (default ``fast``).
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

BACKENDS = ("auto", "npu", "emulator")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this machine."""


@dataclass
class Probe:
    """What this machine offers for the real NPU path."""

    pyxrt: object | None = None
    device_ok: bool = False
    problems: list[str] = field(default_factory=list)


def probe_npu() -> Probe:
    probe = Probe()
    try:
        probe.pyxrt = importlib.import_module("pyxrt")
    except ImportError as exc:
        probe.problems.append(
            f"pyxrt: cannot be imported ({exc}); install XRT with the amdxdna driver and "
            "`source /opt/xilinx/xrt/setup.sh`")
        return probe
    try:
        probe.pyxrt.device(0)
        probe.device_ok = True
    except Exception as exc:
        probe.problems.append(f"device: no NPU device answers at index 0 ({exc}); `xrt-smi examine` should list it")
    return probe


def resolve_backend(backend: str | None = None) -> tuple[str, object]:
    """Returns ``(target, driver)``: ``("npu2", pyxrt)`` or ``("emulator", EmulatedXrt)``."""
    choice = backend or os.environ.get("TORCH_NPU2_BACKEND", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {choice!r} (from TORCH_NPU2_BACKEND or argument)")
    if choice in ("auto", "npu"):
        probe = probe_npu()
        if probe.device_ok:
            return "npu2", probe.pyxrt
        if choice == "npu":
            raise BackendUnavailable("the npu backend was requested but cannot run here:\n  " + "\n  ".join(probe.problems))
    from .emulator import EmulatedXrt

    coherency = os.environ.get("TORCH_NPU2_EMULATOR_COHERENCY", "fast")
    return "emulator", EmulatedXrt(coherency=coherency)
