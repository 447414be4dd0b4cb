"""bf16 weights set aside while a model decodes from packed copies of them.

``patch_llama(model, weights="q4_1")`` packs the projections and the LM head; their bf16 originals are then only
needed by ``unpatch_llama``. Each is written to one temporary file as it is packed and its memory freed; once all
are written the file is memory-mapped (copy-on-write) and unlinked, and each parameter becomes a view of its bytes.
The parameters keep their values, shapes and dtypes, yet cost no resident memory until something reads them (a
tied embedding's lookups touch only the rows they read), and no file is left behind, even after a crash.
``unpatch_llama`` copies them back into ordinary memory, bit for bit.

The file goes to ``$TORCH_NPU2_SPILL_DIR``, else Python's temporary directory (``$TMPDIR``, /tmp). On a tmpfs
it occupies RAM (as page cache, outside the process's RSS); point the variable at a disk to free RAM as well.
"""
from __future__ import annotations

import os
import tempfile

import torch

SPILL_DIR_VARIABLE = "TORCH_NPU2_SPILL_DIR"
ALIGN = 64  # every tensor starts 64-byte aligned in the file, so its view is aligned for any dtype


class WeightSpill:
    """Parameters moved out of memory into one mapped temporary file (``add`` each, then ``map`` once)."""

    def __init__(self, directory=None):
        directory = directory or os.environ.get(SPILL_DIR_VARIABLE) or None
        fd, self.path = tempfile.mkstemp(prefix="torch_npu2-bf16-", suffix=".bin", dir=directory)
        self._file = os.fdopen(fd, "wb")
        self._entries = []  # (parameter, byte offset, shape, dtype)
        self.bytes = 0

    def add(self, param) -> None:
        """Write ``param``'s values to the file and free its memory (it is an empty tensor until ``map``)."""
        data = param.data.contiguous()
        offset = -(-self._file.tell() // ALIGN) * ALIGN
        self._file.write(b"\0" * (offset - self._file.tell()))
        self._file.write(data.view(torch.uint8).reshape(-1).numpy())
        self._entries.append((param, offset, tuple(data.shape), data.dtype))
        self.bytes += data.numel() * data.element_size()
        param.data = torch.empty(0, dtype=data.dtype)

    def map(self) -> None:
        """Map the file and make every added parameter a view of its bytes; the file's name is removed."""
        self._file.close()
        try:
            size = os.path.getsize(self.path)
            if size:
                storage = torch.UntypedStorage.from_file(self.path, shared=False, nbytes=size)
                mapped = torch.empty(0, dtype=torch.uint8).set_(storage)
        finally:
            os.unlink(self.path)
        for param, offset, shape, dtype in self._entries:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            param.data = mapped[offset:offset + nbytes].view(dtype).view(shape)

    def parameters(self) -> list:
        return [param for param, _, _, _ in self._entries]

    def restore(self) -> None:
        """Every parameter back in ordinary memory, with the values it had when added."""
        for param, _, _, _ in self._entries:
            param.data = param.data.clone()
        self._entries = []

    def abandon(self) -> None:
        """After a failed patch: the added parameters read back from the file (not yet mapped), the file removed."""
        self._file.close()
        try:
            with open(self.path, "rb") as f:
                for param, offset, shape, dtype in self._entries:
                    f.seek(offset)
                    nbytes = torch.Size(shape).numel() * dtype.itemsize
                    raw = bytearray(f.read(nbytes))
                    param.data = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape).clone()
        finally:
            os.unlink(self.path)
        self._entries = []
