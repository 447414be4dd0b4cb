"""The targets torch_npu2 runs Programs on, one record each (one file per target beside this one).

A :class:`Target` says everything the rest of the package needs to know about a target: how to open its
pyxrt-shaped driver (and why it cannot, on this machine), how to build the artifact its driver loads for a
Program, and the toolchain fingerprint that keys that artifact in the cache. The runtime and the CLI take
targets from :data:`TARGETS` only.

``TORCH_NPU2_BACKEND=auto|npu2|emulator`` (default ``auto``: npu2 when it can run, else the emulator)
forces a choice; asking for npu2 where it cannot run fails with a message naming what is missing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..artifact_cache import ArtifactCache, Builder, default_cache_root

BACKEND_VARIABLE = "TORCH_NPU2_BACKEND"
AUTO = "auto"


class TargetUnavailable(RuntimeError):
    """The requested target cannot run on this machine."""


@dataclass(frozen=True)
class Target:
    name: str
    description: str                        # for messages: what runs the Programs
    problems: Callable[[], list[str]]       # why it cannot run here; empty when it can
    open_driver: Callable[[], object]       # the pyxrt-shaped driver (pyxrt, or EmulatedXrt)
    build_artifact: Builder                 # writes the artifact its driver loads for a Program
    toolchain: Callable[[], str]            # fingerprint of what builds artifacts (part of the cache key)

    def cache(self, root: Path | None = None) -> ArtifactCache:
        """The artifact cache of this target under ``root`` (default: ``default_cache_root()``)."""
        return ArtifactCache(root or default_cache_root(), self.name, self.toolchain(), self.build_artifact)


# Each target file builds its record from Target, so they are imported once it exists.
from . import emulator, npu2  # noqa: E402

TARGETS: dict[str, Target] = {target.name: target for target in (npu2.TARGET, emulator.TARGET)}
BACKEND_CHOICES = (AUTO, *TARGETS)  # what TORCH_NPU2_BACKEND, --backend and create_runtime(backend=) accept


def check_backend(choice: str, source: str = "argument") -> str:
    """``choice`` if it names a target or ``auto``; a ValueError listing the valid names otherwise."""
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_CHOICES)}, got {choice!r} (from {source})")
    return choice


def requested_backend(backend: str | None = None) -> str:
    """The backend asked for: ``backend`` if given, else ``$TORCH_NPU2_BACKEND``, else ``auto``; checked."""
    if backend is not None:
        return check_backend(backend)
    return check_backend(os.environ.get(BACKEND_VARIABLE, AUTO), BACKEND_VARIABLE)


def resolve_target(backend: str | None = None) -> Target:
    """The target to run on: the one asked for (see :func:`requested_backend`), or for ``auto`` npu2 when it
    can run here and the emulator otherwise. A named target that cannot run raises TargetUnavailable."""
    choice = requested_backend(backend)
    if choice == AUTO:
        return TARGETS["npu2"] if not npu2.TARGET.problems() else TARGETS["emulator"]
    target = TARGETS[choice]
    problems = target.problems()
    if problems:
        raise TargetUnavailable(f"the {target.name} backend was requested but cannot run here:\n  "
                                + "\n  ".join(problems))
    return target


__all__ = ["AUTO", "BACKEND_CHOICES", "BACKEND_VARIABLE", "TARGETS", "Target", "TargetUnavailable", "check_backend",
           "requested_backend", "resolve_target"]
