"""load_model(<HF checkpoint directory>, weights="q4_1"|…): the model built on meta, each projection (and the LM head)
quantized from the safetensors files as patch_llama reads them. Against the existing path (the whole bf16 model
loaded, then patch_llama(model, weights=fmt)): the same packed bytes, logits and tokens; and the errors a user
meets with a checkpoint that is not the model its config describes."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from torch_npu2 import patch_llama, unpatch_llama
from torch_npu2.patch_llama.models import load_checkpoint_packed
from torch_npu2.patch_llama.patch import _quantize

from .tiny import tiny_llama

DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
PROMPT = torch.tensor([[1, 5, 7, 9, 11, 3]])


def _checkpoint(tmp_path, **overrides):
    """A tiny random checkpoint directory, and its model as the existing path loads it (from_pretrained in bf16:
    the rotary frequencies stay fp32, which a model built and then cast to bf16 would not keep)."""
    from transformers import AutoModelForCausalLM

    tiny_llama(**{**DIMS, **overrides}).save_pretrained(tmp_path / "ckpt")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16).eval(), tmp_path / "ckpt"


def _greedy(model, new_tokens=6):
    with torch.no_grad():
        out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("fmt,tied", [("q4_1", True), ("q8_0", False)])
def test_same_packed_bytes_tokens_and_logits_as_patching_the_bf16_model(runtime, tmp_path, fmt, tied):
    reference, directory = _checkpoint(tmp_path, tie_word_embeddings=tied)
    loaded = load_checkpoint_packed(directory, fmt)
    assert all(p.device.type == "meta" for layer in loaded.model.layers for p in (layer.self_attn.q_proj.weight,
                                                                                   layer.mlp.down_proj.weight))
    assert loaded.lm_head.weight.device.type == "meta"
    assert loaded.torch_npu2_weights.format == fmt
    packer = getattr(loaded, "_torch_npu2_checkpoint")
    down = packer.packed("blk.1.ffn_down.weight")  # the packer's bytes are patch-time quantization's, bit for bit
    assert torch.equal(down, _quantize(reference.model.layers[1].mlp.down_proj.weight.data, fmt))
    head = packer.packed(packer.head_tensor())
    assert torch.equal(head, _quantize(reference.lm_head.weight.data, fmt))

    patch_llama(reference, prefill_buckets=(16,), weights=fmt)
    patch_llama(loaded, prefill_buckets=(16,))  # the format comes from the loaded model
    for mine, theirs in zip(loaded.model.layers, reference.model.layers):  # what the NPU holds, as a user reads it
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
            assert repr(mine.get_submodule(module)).split(";")[:2] == repr(theirs.get_submodule(module)).split(";")[:2]
    expected, got = _greedy(reference), _greedy(loaded)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])  # every step's logits, bit for bit
    theirs = dict(reference.named_parameters())
    for name, param in loaded.named_parameters():  # norms and embedding: the checkpoint's values
        if param.device.type != "meta":
            assert torch.equal(param.view(torch.int16), theirs[name].view(torch.int16)), name


def test_the_packed_words_decode_reads_are_the_same(runtime, tmp_path):
    reference, directory = _checkpoint(tmp_path)
    loaded = load_checkpoint_packed(directory, "q4_1")
    patch_llama(reference, prefill_buckets=(16,), weights="q4_1")
    patch_llama(loaded, prefill_buckets=(16,))
    for mine, theirs in zip(loaded.model.layers, reference.model.layers):
        ours, other = mine.forward.packed, theirs.forward.packed
        for field in ("wqk", "wv", "wo", "gate_up", "down"):
            assert torch.equal(getattr(ours, field), getattr(other, field)), field
    assert torch.equal(loaded.lm_head.forward.packed[1], reference.lm_head.forward.packed[1])


def test_unpatch_gives_dequantized_projections_and_ties_the_head_to_the_embedding_again(runtime, tmp_path):
    from torch_npu2.kernels import quant

    reference, directory = _checkpoint(tmp_path, tie_word_embeddings=True)
    loaded = load_checkpoint_packed(directory, "q4_1")
    patch_llama(loaded, prefill_buckets=(16,))
    unpatch_llama(loaded)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight.view(torch.int16), reference.lm_head.weight.view(torch.int16))
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    up, original = loaded.model.layers[1].mlp.up_proj.weight, reference.model.layers[1].mlp.up_proj.weight
    exact = quant.dequantize(quant.weight_format("q4_1"), _quantize(original.data, "q4_1"), up.shape[1])
    assert torch.equal(up.view(torch.int16), exact.to(torch.bfloat16).view(torch.int16))


def test_a_tensor_of_the_wrong_shape_or_missing_is_named_before_anything_loads(tmp_path):
    _, directory = _checkpoint(tmp_path)
    (file,) = directory.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:, :64].clone()
    del tensors["model.layers.0.input_layernorm.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError) as caught:
        load_checkpoint_packed(directory, "q4_1")
    message = str(caught.value)
    assert "tensor model.layers.1.mlp.up_proj.weight has shape [256, 64], expected [256, 128]" in message
    assert "tensor model.layers.0.input_layernorm.weight is missing (expected shape [128])" in message


def test_missing_files_and_configs_that_are_not_a_supported_llama_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_checkpoint_packed(tmp_path, "q4_1")
    _, directory = _checkpoint(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    for file in directory.glob("*.safetensors"):
        file.rename(file.with_suffix(".moved"))
    with pytest.raises(FileNotFoundError, match=r"has no \*.safetensors file"):
        load_checkpoint_packed(directory, "q4_1")
    for file in directory.glob("*.moved"):
        file.rename(file.with_suffix(".safetensors"))
    (directory / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ValueError, match="has attention_bias=True; the fused ops run llama models with no biases"):
        load_checkpoint_packed(directory, "q4_1")
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ValueError, match="describes a 'mistral' model; torch_npu2 runs the model types 'llama'"):
        load_checkpoint_packed(directory, "q4_1")
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))  # a Qwen2 has q/k/v biases
    with pytest.raises(ValueError, match=r"does not hold the model its config.json describes: tensor "
                                         r"model.layers.0.self_attn.q_proj.bias is missing \(expected shape \[128\]\)"):
        load_checkpoint_packed(directory, "q4_1")


def test_a_float32_checkpoint_is_read_as_bf16_like_from_pretrained(runtime, tmp_path):
    reference = tiny_llama(**DIMS).float()
    reference.save_pretrained(tmp_path / "fp32")
    loaded = load_checkpoint_packed(tmp_path / "fp32", "q4_1")
    expected = reference.to(torch.bfloat16)
    assert torch.equal(loaded.model.embed_tokens.weight.view(torch.int16),
                       expected.model.embed_tokens.weight.view(torch.int16))
    packer = getattr(loaded, "_torch_npu2_checkpoint")
    assert torch.equal(packer.packed("blk.0.attn_q.weight"),
                       _quantize(expected.model.layers[0].self_attn.q_proj.weight.data, "q4_1"))
