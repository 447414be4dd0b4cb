"""patch_llama(weights=...) on a tiny random Llama: decode reads packed weights, and the patched model passes the
top-5 gate against HF on the same weights dequantized (HF holds them rounded to bf16, the packed GEMVs multiply
by them exactly); unpatch gives the bf16 weights back bit for bit."""
import pytest
import torch

from torch_npu2 import patch_llama, unpatch_llama
from torch_npu2.kernels import quant

from .gate import check_topk_gate, greedy_with_topk
from .tiny import tiny_llama

DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def _dequantized_copy(model, fmt):
    """``model`` with every Linear's weight replaced by its ``fmt`` quantization, dequantized and rounded to bf16."""
    from torch_npu2.patch_llama.patch import _quantize

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                packed = _quantize(module.weight.data, fmt)
                module.weight.copy_(quant.dequantize(quant.weight_format(fmt), packed, module.in_features))
    return model


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_generates_what_hf_generates_on_the_dequantized_weights(runtime, fmt):
    model = tiny_llama(**DIMS)
    reference = _dequantized_copy(tiny_llama(**DIMS), fmt)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    expected = greedy_with_topk(reference, ids, 10)
    patch_llama(model, prefill_buckets=(16,), weights=fmt)
    runs = runtime.xrt.counters
    before = runs["runs:lm_head_gemv_packed"]
    out = greedy_with_topk(model, ids, 10)
    assert runs["runs:lm_head_gemv_packed"] - before == 10  # every new token's logits came from packed rows
    check_topk_gate(*expected, *out, label=fmt)
    # the first token's logits (prefill, then the packed LM head) agree to fp32 summation and bf16 weight rounding
    assert torch.nn.functional.cosine_similarity(out[1][0, 0].float(), expected[1][0, 0].float(), dim=0) > 0.999


def test_unpatch_restores_the_bf16_weights_and_repr(runtime):
    model = tiny_llama(**DIMS)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    plain = repr(model)
    patch_llama(model, prefill_buckets=(16,), weights="q4_1")
    text = repr(model.model.layers[0].mlp.down_proj)
    assert "on the NPU: Q4_1 packed 128×256" in text and "bf16 weight stays" in text
    unpatch_llama(model)
    assert repr(model) == plain
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.int16), before[name].view(torch.int16)), name


def test_a_format_the_ops_do_not_know_is_refused_before_anything_changes(runtime):
    model = tiny_llama(**DIMS)
    with pytest.raises(ValueError, match="weights must be one of"):
        patch_llama(model, weights="q5_k")
    assert not hasattr(model.model.layers[0], "_torch_npu2_patch") and "forward" not in model.model.layers[0].__dict__
