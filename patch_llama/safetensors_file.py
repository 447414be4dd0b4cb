"""A HF checkpoint's safetensors tensors, read one at a time, for loading a model whose projections decode packed.

``load_model(directory, weights="q4_1")`` builds the model on the meta device and reads from here only its norms
and embedding; ``patch_llama`` then packs each projection (and the LM head) through ``CheckpointPacker``: the bf16
rows are read, quantized as patch-time quantization does (``patch._quantize``) and released, a few thousand rows at
a time, so the model's bf16 weights are never in memory together.

Tensors are read with plain file reads, not through a mapping: pages a mapping has touched stay in the process's
RSS until it is unmapped, so reading every projection through one (as ``safetensors.safe_open`` does) would leave
the whole file resident. The embedding is the exception on purpose: a bf16 embedding becomes a copy-on-write
mapping of its bytes in the file, resident only in the rows lookups read (as ``patch_llama/spill.py`` does for
the bf16 originals it sets aside).
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels import quant
from .gguf_file import hf_name

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}  # what a Llama checkpoint holds


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str      # safetensors' name: "BF16", "F32"…
    shape: tuple
    offset: int     # of its first byte in the file

    @property
    def row_bytes(self) -> int:
        columns = torch.Size(self.shape[1:]).numel()
        return columns * DTYPES[self.dtype].itemsize


def read_header(file: Path) -> tuple[dict, int]:
    """A safetensors file's tensors by name (its ``__metadata__`` left out), from its JSON header alone, and the
    offset in the file where the tensors' data begins."""
    with open(file, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    return {name: entry for name, entry in header.items() if name != "__metadata__"}, 8 + size


class SafetensorsCheckpoint:
    """The tensors of every ``*.safetensors`` file in a directory (a sharded checkpoint is one set of names)."""

    def __init__(self, directory):
        directory = Path(directory)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{directory} has no *.safetensors file (a checkpoint of .bin files loads with "
                                    "weights='bf16')")
        self.tensors: dict[str, StoredTensor] = {}
        self._mappings: dict[Path, torch.Tensor] = {}
        for file in files:
            try:
                header, data_start = read_header(file)
            except (OSError, struct.error, UnicodeDecodeError, ValueError) as exc:
                raise ValueError(f"{file} is not a readable safetensors file ({exc})") from None
            for name, entry in header.items():
                if name in self.tensors:
                    raise ValueError(f"tensor {name} is in both {self.tensors[name].file.name} and {file.name}")
                self.tensors[name] = StoredTensor(file, entry["dtype"], tuple(entry["shape"]),
                                                  data_start + entry["data_offsets"][0])

    def problems(self, expected: dict) -> list[str]:
        """What keeps the checkpoint from filling parameters of the ``expected`` shapes (name → shape): each missing
        tensor, each tensor of another shape or of a dtype we do not read, by name."""
        found = []
        for name, shape in expected.items():
            stored = self.tensors.get(name)
            if stored is None:
                found.append(f"tensor {name} is missing (expected shape {list(shape)})")
            elif stored.shape != tuple(shape):
                found.append(f"tensor {name} has shape {list(stored.shape)}, expected {list(shape)}")
            elif stored.dtype not in DTYPES:
                found.append(f"tensor {name} is {stored.dtype}; a Llama checkpoint's tensors are one of "
                             f"{', '.join(DTYPES)}")
        return found

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` in bf16 (converted as ``.to(torch.bfloat16)`` does), in memory of
        their own."""
        stored = self.tensors[name]
        rows = stored.shape[0] if stored.shape else 1
        stop = rows if stop is None else min(stop, rows)
        raw = torch.empty((stop - start) * stored.row_bytes, dtype=torch.uint8)
        with open(stored.file, "rb", buffering=0) as f:
            f.seek(stored.offset + start * stored.row_bytes)
            if f.readinto(memoryview(raw.numpy())) != raw.numel():
                raise ValueError(f"{stored.file} ends inside tensor {name}")
        values = raw.view(DTYPES[stored.dtype]).view((stop - start, *stored.shape[1:]) if stored.shape else ())
        return values.to(torch.bfloat16)

    def mapped(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` as a copy-on-write mapping of its bytes (resident only where read); None when it is not
        stored in bf16 at an even offset (then ``read`` it)."""
        stored = self.tensors[name]
        if stored.dtype != "BF16" or stored.offset % 2:
            return None
        mapping = self._mappings.get(stored.file)
        if mapping is None:
            size = os.path.getsize(stored.file)
            storage = torch.UntypedStorage.from_file(str(stored.file), shared=False, nbytes=size)
            mapping = self._mappings[stored.file] = torch.empty(0, dtype=torch.uint8).set_(storage)
        nbytes = torch.Size(stored.shape).numel() * 2
        return mapping[stored.offset:stored.offset + nbytes].view(torch.bfloat16).view(stored.shape)


class CheckpointPacker:
    """What ``patch_llama`` packs a model loaded by ``load_model(directory, weights=fmt)`` from, in the interface of
    ``GgufFile`` (llama.cpp's tensor names): every projection and the LM head in ``fmt``, quantized from the
    checkpoint's bf16 rows exactly as ``patch_llama(model, weights=fmt)`` quantizes a bf16 model's."""

    def __init__(self, checkpoint: SafetensorsCheckpoint, fmt: str, tied: bool):
        self.checkpoint, self.fmt, self.tied = checkpoint, fmt, tied

    def projection_formats(self) -> set:
        return {self.fmt}

    def format_of(self, name: str) -> str:
        return self.fmt

    def head_tensor(self) -> str:
        return "token_embd.weight" if self.tied else "output.weight"

    def packed(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The packed rows of tensor ``name`` (into ``out`` if given), read and quantized ``patch.QUANTIZE_ROWS`` rows
        at a time."""
        from .patch import QUANTIZE_ROWS, _quantize

        stored = self.checkpoint.tensors[hf_name(name)]
        N, K = stored.shape
        if out is None:
            out = torch.empty(N, quant.weight_format(self.fmt).row_bytes(K), dtype=torch.uint8)
        for start in range(0, N, QUANTIZE_ROWS):
            rows = self.checkpoint.read(hf_name(name), start, start + QUANTIZE_ROWS)
            _quantize(rows, self.fmt, out[start:start + rows.shape[0]])
            del rows  # the bf16 rows go before the next are read
        return out
