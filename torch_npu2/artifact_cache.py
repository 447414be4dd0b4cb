"""On-disk cache of compiled artifacts (ELFs, or emulator Programs), safe across processes.

An entry lives in ``<root>/<target>/<program>-<key>/`` with the artifact and a ``manifest.json`` written
last. The key hashes the Program's content, the target and the toolchain fingerprint, so a toolchain
change lands in a new entry. Builds hold a per-key file lock and publish with an atomic rename; an entry
whose manifest is missing or unreadable, or whose artifact is missing or fails its checksum, is rebuilt.
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

# Writes the artifact for a Program into a directory and returns the artifact's path there.
Builder = Callable[[Program, Path], Path]


def default_cache_root() -> Path:
    explicit = os.environ.get("TORCH_NPU2_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch_npu2"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock_path = entry.parent / f".{entry.name}.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = self._valid_artifact(entry, program)
            if found is not None:
                return found
            return self._build(entry, program)

    def _valid_artifact(self, entry: Path, program: Program) -> Path | None:
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
            artifact = entry / manifest["artifact"]
            if manifest["key"] != self.key(program) or _sha256(artifact) != manifest["sha256"]:
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return artifact

    def _build(self, entry: Path, program: Program) -> Path:
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
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
                "sha256": _sha256(artifact),
                "size": artifact.stat().st_size,
                "build_seconds": round(time.perf_counter() - started, 3),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            with open(staging / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            if entry.exists():
                shutil.rmtree(entry)
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
