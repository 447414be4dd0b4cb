import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from torch_npu2 import create_runtime, use_runtime
from torch_npu2.emulator import EmulatedXrt


def tiny_llama(seed=0, **overrides):
    """A small random bf16 Llama; larger init than HF's default so that logits are not near-uniform."""
    params = dict(hidden_size=96, intermediate_size=200, num_attention_heads=6, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=300, max_position_embeddings=512, initializer_range=0.05)
    params.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**params)).to(torch.bfloat16).eval()


@pytest.fixture
def pair():
    """(reference, to-be-patched) copies of a model factory's output."""
    def make(model):
        return model, copy.deepcopy(model)
    return make


@pytest.fixture(scope="session")
def smollm2(smollm2_loaded, tmp_path_factory):
    """(HF reference model, patched model, tokenizer, runtime) on a fast emulated NPU2, built once."""
    import torch_npu2

    model, tokenizer = smollm2_loaded
    reference = copy.deepcopy(model)
    runtime = create_runtime(driver=EmulatedXrt(coherency="fast"), cache_root=tmp_path_factory.mktemp("artifacts"))
    with use_runtime(runtime):
        torch_npu2.patch_llama(model)
        yield reference, model, tokenizer, runtime
