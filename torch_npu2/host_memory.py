"""Giving freed host memory back to the operating system.

glibc's malloc keeps what a process frees inside its heap: a free block below a block still in use cannot shrink
the heap, so its pages stay in the process's RSS until a later allocation reuses them. Large allocations are exempt
(they get their own mmap, unmapped on free), but glibc raises that threshold to the size of each such block freed,
up to 32 MiB, so after a model loads nearly every tensor lives in the heap. Two things then leave free pages behind:
patching, which frees every weight's original storage once its copy sits in an NPU buffer, and the prefill of a
long prompt, which allocates tens of MB of short-lived tensors per layer around the cache's long-lived K/V (at
8026 tokens on SmolLM2 the heap's free blocks grew by about 20 MB a layer, 0.6 GB over the prefill).
``malloc_trim(0)`` hands every whole free page back (glibc ≥ 2.8 also releases pages inside the heap).
"""
from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library the process runs on
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to call
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the heap's free pages to the OS; False where the C library has no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


__all__ = ["release_free_heap"]
