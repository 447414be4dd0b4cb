"""NPU buffers that are neither an op's argument nor its output: state the host and the ops share across calls."""
from __future__ import annotations

import torch

from ..runtime import get_runtime


def device_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in its own NPU buffer of the current runtime (a KV cache's slab): ops bind it
    without a copy, and it stays resident until the tensor's storage dies. Ops never sync it: after writing any of
    it, call ``device_written`` on what was written."""
    return get_runtime().empty_state(tuple(int(d) for d in shape), dtype)


def device_only_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in its own NPU buffer that only ops write (through an ``.into`` overload) and read
    (prefill's dequantized weights): never synced either way, so the host must neither read nor write it."""
    return get_runtime().empty_device(tuple(int(d) for d in shape), dtype)


def device_written(view: torch.Tensor) -> None:
    """The host wrote ``view``, part of a ``device_empty`` tensor: its bytes (only those) reach the device."""
    get_runtime().sync_written(view)
