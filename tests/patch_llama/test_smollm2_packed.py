"""SmolLM2-135M-Instruct in its GGUF's own formats (Q4_1 projections, Q8_0 tied LM head) on the emulated NPU2:
decode reads the file's blocks packed, dequantizing them in the GEMVs, against HF's model dequantized from the
same file."""
import copy

import pytest
import torch

from torch_npu2.emulator import EmulatedXrt
from torch_npu2.kernels import quant
from torch_npu2.runtime import create_runtime, use_runtime

from .gate import check_topk_gate, greedy_with_topk
from .test_smollm2 import all_prompts, chat_ids, packed_lm_head_runs


@pytest.fixture(scope="module")
def smollm2_packed(smollm2_loaded, tmp_path_factory):
    """(HF reference model, patched model, tokenizer, runtime): patched with the GGUF file's own blocks."""
    import torch_npu2
    from torch_npu2.patch_llama.models import default_model_path

    model, tokenizer = smollm2_loaded
    model = copy.deepcopy(model)  # the session's model stays unpatched for the other modules
    reference = copy.deepcopy(model)
    runtime = create_runtime(driver=EmulatedXrt(coherency="fast"), cache_root=tmp_path_factory.mktemp("artifacts"))
    with use_runtime(runtime):
        torch_npu2.patch_llama(model, gguf=default_model_path())
        yield reference, model, tokenizer, runtime


def test_the_packed_blocks_are_hf_weights_before_rounding(smollm2_packed):
    """Each projection's packed rows (Q/K rows un-permuted) dequantize to what HF loaded, up to its bf16 rounding."""
    reference, model, _, _ = smollm2_packed
    layer = model.model.layers[3]
    packed = layer.forward.packed if hasattr(layer.forward, "packed") else layer._old_forward.packed
    attn = reference.model.layers[3].self_attn
    qk = packed.dequantized("wqk", attn.q_proj.in_features)  # Q's rows, then K's
    for name, module, exact in (("wq", attn.q_proj, qk[:attn.q_proj.out_features]),
                                ("wk", attn.k_proj, qk[attn.q_proj.out_features:]),
                                ("wo", attn.o_proj, packed.dequantized("wo", attn.o_proj.in_features))):
        assert packed.format == "q4_1" and torch.equal(exact, module.weight), name


def test_repr_says_what_the_npu_holds(smollm2_packed):
    _, model, _, _ = smollm2_packed
    text = repr(model.model.layers[0].self_attn.q_proj)
    assert "Q4_1 packed 576×576" in text and "bf16 weight set aside" in text
    assert "Q8_0 packed 49152×576" in repr(model.lm_head)


def test_topk_gate_on_varied_prompts(smollm2_packed):
    reference, model, tokenizer, runtime = smollm2_packed
    identical = 0
    heads_before = packed_lm_head_runs(runtime)
    generated = 0
    for kind, text, ids in all_prompts(tokenizer):
        ref = greedy_with_topk(reference, ids, 32)
        out = greedy_with_topk(model, ids, 32)
        identical += check_topk_gate(*ref, *out, label=f"{kind}: {text!r}") == [None]
        generated += out[0].shape[1]
    assert packed_lm_head_runs(runtime) - heads_before == generated  # decode ran packed
    print(f"{identical}/{len(all_prompts(tokenizer))} prompts gave identical 32-token greedy outputs")


def test_answers_the_capital_question(smollm2_packed):
    _, model, tokenizer, _ = smollm2_packed
    ids = chat_ids(tokenizer, "What is the capital of France?")
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_a_model_loaded_packed_decodes_as_the_dequantized_one_patched_from_the_file(smollm2_packed, smollm2_loaded):
    """load_model(weights="native") keeps the file's Q4_1 projections packed (never bf16); patched, it gives the same logits as
    transformers' dequantized model patched from the same file, and unpatch_llama gives it transformers' weights."""
    from torch_npu2 import patch_llama, unpatch_llama
    from torch_npu2.patch_llama.models import load_model

    _, patched, tokenizer, runtime = smollm2_packed
    dense, _ = smollm2_loaded
    model, _ = load_model(weights="native")
    ids = chat_ids(tokenizer, "Name three colours.")
    with use_runtime(runtime):
        patch_llama(model)
        expected = greedy_with_topk(patched, ids, 12)
        out = greedy_with_topk(model, ids, 12)
        unpatch_llama(model)
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
    reference = dict(dense.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.view(torch.int16), reference[name].view(torch.int16)), name
