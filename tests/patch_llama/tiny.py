"""Tiny random Llama models for tests that need a real HF model in seconds (a module, not a conftest, so
that tests in other folders can import it)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed=0, **overrides):
    """A small random bf16 Llama; larger init than HF's default so that logits are not near-uniform."""
    params = dict(hidden_size=96, intermediate_size=200, num_attention_heads=6, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=300, max_position_embeddings=512, initializer_range=0.05)
    params.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**params)).to(torch.bfloat16).eval()


def tiny_qwen2(seed=0, bias_scale=0.5, **overrides):
    """A small random bf16 Qwen2 (q/k/v biases, tied embeddings, as Qwen2.5-0.5B). HF initializes biases to zero,
    which would let a model that drops them pass: they are drawn at ``bias_scale`` instead."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    params = dict(hidden_size=96, intermediate_size=200, num_attention_heads=6, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=300, max_position_embeddings=512, initializer_range=0.05,
                  tie_word_embeddings=True)
    params.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**params)).to(torch.bfloat16).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_(0.0, bias_scale)
    return model
