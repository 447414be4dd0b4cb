"""A GGUF file's tensors by their HF names, read with the ``gguf`` package (memory-mapped, read on demand).

The packed formats (Q4_0, Q4_1, Q8_0: ``kernels/quant.py``) are handed over as their raw blocks, reordered into
the packed row layout and never dequantized; every other tensor (F32 norms, an F16 or K-quant tensor) can be read
dequantized, exactly as gguf-py dequantizes it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..kernels import quant

# HF module → the GGUF tensor that holds it (llama.cpp's names)
PROJECTIONS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
_LAYER_TENSORS = {**{gguf: hf + ".weight" for hf, gguf in PROJECTIONS.items()},
                  "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight"}
_MODEL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter a GGUF tensor holds; None for one HF's Llama does not read (e.g. llama.cpp's rope_freqs)."""
    if gguf_name in _MODEL_TENSORS:
        return _MODEL_TENSORS[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    return None


def projection_types(path) -> set:
    """The GGUF types (lower case) of a file's projection tensors, from its header (no tensor data read)."""
    import gguf

    pattern = re.compile(rf"blk\.\d+\.({'|'.join(PROJECTIONS.values())})\.weight")
    return {t.tensor_type.name.lower() for t in gguf.GGUFReader(str(path)).tensors if pattern.fullmatch(t.name)}


@dataclass(frozen=True)
class TensorInfo:
    name: str          # the GGUF name
    type: str          # GGUF's type name, lower case: "q4_1", "f32", "q6_k"…
    shape: tuple       # HF's (rows, columns)
    file_bytes: int    # what the file holds

    @property
    def packable(self) -> bool:
        return self.type in quant.FORMATS


class GgufFile:
    """A GGUF file's tensors: raw blocks packed for the NPU, or values dequantized, rows in HF's order."""

    DEQUANTIZE_ROWS = 4096

    def __init__(self, path, config):
        import gguf

        self.path = path
        self.reader = gguf.GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.layers = config.num_hidden_layers

    def info(self, name: str) -> TensorInfo:
        tensor = self.tensors[name]
        return TensorInfo(name, tensor.tensor_type.name.lower(), tuple(int(s) for s in reversed(tensor.shape)),
                          int(tensor.n_bytes))

    def format_of(self, name: str) -> str | None:
        """The packed format of tensor ``name``; None when it is absent or of another type."""
        return self.info(name).type if name in self.tensors and self.info(name).packable else None

    def head_tensor(self) -> str:
        """The tensor the LM head reads: output.weight, or the embedding when the model ties them."""
        return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"

    def projection_formats(self) -> set:
        """The packed format of every layer's projections (None for a tensor of another type)."""
        return {self.format_of(f"blk.{i}.{name}.weight") for i in range(self.layers) for name in PROJECTIONS.values()}

    def _unpermute(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """llama.cpp permutes Q and K rows for its rotary layout; HF's loader reverses it (a reordering of rows)."""
        heads = {"attn_q": self.heads, "attn_k": self.kv_heads}.get(name.split(".")[-2])
        if not heads:
            return rows
        N = rows.shape[0]
        return rows.reshape(heads, N // heads // 2, 2, -1).transpose(1, 2).reshape(N, -1)

    def packed(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``name`` (of a packed format) in the packed row layout (into ``out`` if given): its blocks
        reordered, nothing converted."""
        tensor = self.tensors[name]
        K, N = (int(s) for s in tensor.shape)
        rows = self._unpermute(name, torch.from_numpy(tensor.data.reshape(N, -1).copy()))
        return quant.from_gguf_blocks(quant.weight_format(self.format_of(name)), rows, K, out)

    def dequantized(self, name: str, dtype=torch.float32) -> torch.Tensor:
        """Tensor ``name`` in HF's shape, dequantized as gguf-py does (to fp32) and then given ``dtype``; a few
        thousand rows at a time, so the fp32 values of a large tensor (an embedding) never exist all at once."""
        import gguf

        tensor = self.tensors[name]
        shape = self.info(name).shape
        raw = tensor.data.reshape(shape[0], -1)
        out = torch.empty(shape[0], torch.Size(shape).numel() // shape[0], dtype=dtype)
        for start in range(0, shape[0], self.DEQUANTIZE_ROWS):
            rows = gguf.quants.dequantize(raw[start:start + self.DEQUANTIZE_ROWS], tensor.tensor_type)
            out[start:start + rows.shape[0]] = torch.from_numpy(rows.reshape(rows.shape[0], -1).astype("float32"))
        return self._unpermute(name, out).reshape(shape)
