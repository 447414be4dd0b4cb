"""On-disk cache of compiled artifacts (ELFs, or emulator Programs), safe across processes.

An entry lives in ``<root>/<target>/<program>-<key>/`` with the artifact and a ``manifest.json`` written
last. The key hashes the Program's content, the target and the toolchain fingerprint, so a toolchain
change lands in a new entry. Builds hold a per-key file lock and publish with an atomic rename. The
manifest's checksum covers the key and the artifact's bytes, so an artifact from another entry fails it
even with its own valid checksum. An entry that is not a readable directory with a valid manifest and
artifact, or a lock path that is not a file, is rebuilt; a cache root that cannot be written raises
``ArtifactCacheError`` naming it and ``TORCH_NPU2_CACHE_DIR``.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .kernels.program import Program

MANIFEST = "manifest.json"
CACHE_DIR_VARIABLE = "TORCH_NPU2_CACHE_DIR"

# Writes the artifact for a Program into a directory and returns the artifact's path there.
Builder = Callable[[Program, Path], Path]


class ArtifactCacheError(RuntimeError):
    """The cache directory cannot be created or written."""


def default_cache_root() -> Path:
    explicit = os.environ.get(CACHE_DIR_VARIABLE)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch_npu2"


def _checksum(key: str, path: Path) -> str:
    """sha256 of the entry's key, then the artifact's bytes: binds the artifact to the entry it belongs to."""
    h = hashlib.sha256(key.encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _remove(path: Path) -> None:
    """Remove whatever is at ``path``: an old entry directory, or a file or link left where one belongs."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _open_lock(path: Path):
    """The lock file, opened for flock; a directory in its place (not ours) is removed first."""
    try:
        return open(path, "a")
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
        return open(path, "a")


@dataclass
class ArtifactCache:
    root: Path
    target: str
    toolchain: str
    builder: Builder

    def __post_init__(self):
        self.root = Path(self.root)
        self.builds = 0

    def key(self, program: Program) -> str:
        return hashlib.sha256(f"{program.key}|{self.target}|{self.toolchain}".encode()).hexdigest()

    def entry_dir(self, program: Program) -> Path:
        return self.root / self.target / f"{program.name}-{self.key(program)[:24]}"

    def get(self, program: Program) -> Path:
        """The artifact's path, building it first if the cache has no valid entry."""
        entry = self.entry_dir(program)
        found = self._valid_artifact(entry, program)
        if found is not None:
            return found
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            lock = _open_lock(entry.parent / f".{entry.name}.lock")
        except OSError as exc:
            raise self._unusable(exc) from None
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = self._valid_artifact(entry, program)
            if found is not None:
                return found
            return self._build(entry, program)

    def _unusable(self, exc: OSError) -> ArtifactCacheError:
        where = exc.filename or self.root
        return ArtifactCacheError(
            f"torch_npu2 artifact cache: cannot use {self.root} ({exc.strerror or exc} at {where}); set "
            f"{CACHE_DIR_VARIABLE} to a writable directory (it is now "
            f"{os.environ.get(CACHE_DIR_VARIABLE) or 'unset, so the default applies'})")

    def _valid_artifact(self, entry: Path, program: Program) -> Path | None:
        key = self.key(program)
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
            artifact = entry / manifest["artifact"]
            if manifest["key"] != key or _checksum(key, artifact) != manifest["checksum"]:
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return artifact

    def _build(self, entry: Path, program: Program) -> Path:
        try:
            staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        except OSError as exc:
            raise self._unusable(exc) from None
        try:
            started = time.perf_counter()
            artifact = self.builder(program, staging)
            manifest = {
                "program": program.name,
                "program_key": program.key,
                "key": self.key(program),
                "target": self.target,
                "toolchain": self.toolchain,
                "artifact": artifact.name,
                "checksum": _checksum(self.key(program), artifact),
                "size": artifact.stat().st_size,
                "build_seconds": round(time.perf_counter() - started, 3),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            with open(staging / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _remove(entry)
            os.rename(staging, entry)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        self.builds += 1
        return entry / artifact.name

    def entries(self) -> list[dict]:
        """Manifests of every valid-looking entry for this target (for ``torch-npu2 info``)."""
        out = []
        for manifest in sorted((self.root / self.target).glob(f"*/{MANIFEST}")):
            try:
                out.append(json.loads(manifest.read_text()))
            except (OSError, ValueError):
                continue
        return out
