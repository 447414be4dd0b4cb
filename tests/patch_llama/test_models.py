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


@pytest.fixture(scope="module")
def packed_and_dense():
    """The default GGUF loaded packed (its projections never dequantized) and dequantized by transformers."""
    pytest.importorskip("gguf", reason="loading a GGUF checkpoint needs gguf (pip install gguf accelerate)")
    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(f"the default model is not installed: {exc}")
    return load_model(weights="native")[0], load_model()[0]


def test_a_packed_gguf_load_never_materialises_its_quantized_projections(packed_and_dense):
    packed, dense = packed_and_dense
    linears = [m for m in packed.modules() if isinstance(m, torch.nn.Linear) and m is not packed.lm_head]
    assert len(linears) == 210 and all(m.weight.device.type == "meta" for m in linears)
    weights = packed.torch_npu2_weights
    assert (weights.format, weights.source) == ("q4_1", "gguf blocks")
    assert weights.dequantized == {"token_embd.weight": "q8_0"}  # the embedding: looked up on the host, in bf16
    assert "dequantized to bf16: Q8_0: token_embd.weight" in weights.note()
    assert "Q4_1: " in dense.torch_npu2_weights.note() and len(dense.torch_npu2_weights.dequantized) == 211
    reference = dict(dense.named_parameters())
    loaded = [(n, p) for n, p in packed.named_parameters() if p.device.type != "meta"]
    assert len(loaded) == 1 + 2 * 30 + 1  # embedding (tied LM head), two norms a layer, the final norm
    for name, param in loaded:  # the same values transformers' dequantizing loader gives
        assert torch.equal(param.view(torch.int16), reference[name].view(torch.int16)), name
    assert packed.lm_head.weight is packed.model.embed_tokens.weight
    assert torch.equal(packed.model.rotary_emb.inv_freq, dense.model.rotary_emb.inv_freq)
    assert packed.generation_config.to_dict() == dense.generation_config.to_dict()


def test_a_packed_load_refuses_another_format_naming_the_argument():
    pytest.importorskip("gguf")
    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(f"the default model is not installed: {exc}")
    with pytest.raises(ValueError, match="weights='q4_0', but SmolLM2-135M-Instruct.Q4_1.gguf holds 'q4_1'"):
        load_model(weights="q4_0")
    with pytest.raises(ValueError, match="weights must be one of native, bf16, q4_0, q4_1, q8_0"):
        load_model(weights="q5_k")


def test_an_unloaded_weight_is_refused_without_its_file(packed_and_dense):
    from torch_npu2 import patch_llama
    from torch_npu2.patch_llama.patch import GGUF_PATH_ATTR

    packed, _ = packed_and_dense
    path = getattr(packed, GGUF_PATH_ATTR)
    delattr(packed, GGUF_PATH_ATTR)
    try:
        with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight was never loaded"):
            patch_llama(packed, weights="q4_1")
    finally:
        setattr(packed, GGUF_PATH_ATTR, path)
