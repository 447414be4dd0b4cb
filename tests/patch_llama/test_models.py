"""Loading checkpoints: the default GGUF model loads dense bf16 weights without transformers' dtype advice."""
import logging

import pytest
import torch

from torch_npu2.patch_llama.models import default_model_path, load_model


def test_default_model_loads_dense_bf16_without_float32_advice():
    pytest.importorskip("gguf", reason="loading a GGUF checkpoint needs gguf (pip install gguf accelerate)")
    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(f"the default model is not installed: {exc}")
    # transformers' library logger does not propagate to the root logger, so listen to it directly
    records = []
    listener = logging.Handler(logging.WARNING)
    listener.emit = records.append
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(listener)
    try:
        model, _ = load_model()
    finally:
        transformers_logger.removeHandler(listener)
    warnings = "\n".join(record.getMessage() for record in records)
    # transformers advises float32 for GGUF weights it keeps packed; patch_llama refuses float32
    assert "dtype=torch.float32" not in warnings, warnings
    assert model.dtype == torch.bfloat16
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
