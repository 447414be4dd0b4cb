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
