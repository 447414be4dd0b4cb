"""NPU buffers that are neither an op's argument nor its output: state the host and the ops share across calls."""
from __future__ import annotations

import torch

from ..runtime import get_runtime


def device_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in its own NPU buffer of the current runtime (a KV cache's slab): ops bind it
    without a copy, and it stays resident until the tensor's storage dies."""
    return get_runtime().empty(tuple(int(d) for d in shape), dtype)
