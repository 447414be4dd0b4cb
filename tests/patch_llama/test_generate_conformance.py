"""What transformers' generation tests exercise on a patched model, checked through the public API:
every generate() mode runs the npu2 ops, attention weights and dtype changes are refused clearly, logits
have one dtype on every path, a compiled forward does not recompile between decode steps, and a norm's
epsilon is read when the layer runs."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import StaticCache, TextIteratorStreamer

from torch_npu2 import patch_llama, unpatch_llama

from .tiny import tiny_llama

pytestmark = pytest.mark.filterwarnings(
    "ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")

PREFILL_OPS = {"rms_gemms_rope", "o_ffn"}
# ops only a decode step runs (the LM head also runs after a prefill): with the NpuKVCache, the decode groups
DECODE_OPS = {"rms_gemv_rope", "o_gemv_ffn", "o_gemv_ffn_rms_gemv_rope"}
REPEATING = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10]])  # gives prompt lookup something to find


class CountNpu2Calls(TorchDispatchMode):
    """Counts calls of torch.ops.npu2.* ops under it, by op name."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "npu2":
            self.calls[func._opname] += 1
        return func(*args, **(kwargs or {}))


def _assistant():
    return tiny_llama(seed=3, num_hidden_layers=1)


GENERATE_MODES = {
    "greedy": dict(),
    "sampling": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
    "beam_search": dict(num_beams=2),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "static_cache": dict(cache_implementation="static"),
    "prompt_lookup": dict(prompt_lookup_num_tokens=2),
    "prompt_lookup_dict_outputs": dict(prompt_lookup_num_tokens=2, return_dict_in_generate=True,
                                       output_scores=True, output_hidden_states=True),
    "assisted": dict(assistant_model="assistant"),
    "streamer": dict(streamer="streamer"),
}


@pytest.mark.parametrize("mode", list(GENERATE_MODES))
def test_every_generate_mode_runs_the_npu2_ops(runtime, pair, mode):
    reference, model = pair(tiny_llama())
    patch_llama(model)
    kwargs = dict(GENERATE_MODES[mode])
    if kwargs.get("assistant_model"):
        kwargs["assistant_model"] = _assistant()
    if kwargs.get("streamer"):
        kwargs["streamer"] = TextIteratorStreamer(_CharTokenizer())
    torch.manual_seed(0)
    with CountNpu2Calls() as counter:
        out = model.generate(REPEATING, max_new_tokens=6, min_new_tokens=6, **kwargs)
    assert PREFILL_OPS <= set(counter.calls), counter.calls
    decoded = DECODE_OPS & set(counter.calls) or any(name.startswith("decode_") for name in counter.calls)
    assert decoded or counter.calls["rms_gemms_rope"] > 2, counter.calls
    if not kwargs.get("do_sample"):
        kwargs.pop("streamer", None)
        if "assistant_model" in kwargs:
            kwargs["assistant_model"] = _assistant()
        expected = reference.generate(REPEATING, max_new_tokens=6, min_new_tokens=6, **kwargs)
        sequences = (lambda o: o.sequences if hasattr(o, "sequences") else o)
        assert torch.equal(sequences(out), sequences(expected))


class _CharTokenizer:
    """The least a streamer needs from a tokenizer."""

    def decode(self, ids, **kwargs):
        return " ".join(str(int(i)) for i in ids)


def test_batch_with_left_padding_runs_the_npu2_ops(runtime):
    """Decode attention included: the padded sequence attends on the NPU from its first real row, so both decode
    layers of each sequence run as one op from the first layer's Q/K/V on, the final norm and the LM head with
    them (decode_layers2_qkv_final_packed_lm); the first token's LM head (after the prefill) runs alone."""
    model = tiny_llama()
    patch_llama(model)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with CountNpu2Calls() as counter:
        model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    chained = {"decode_layers2_qkv_final_packed_lm"}
    assert PREFILL_OPS | {"lm_head_gemv_packed"} | chained <= set(counter.calls), counter.calls
    assert "o_gemv_ffn" not in counter.calls  # no layer attended on the host


def test_assisted_generation_with_output_attentions_gives_hf_s_weights(runtime, pair):
    """output_attentions=True runs HF's own layers for those calls (tests/patch_llama/test_transformers_compat.py);
    assisted decoding, which verifies several drafted tokens per call, gets HF's weights too."""
    reference, model = pair(tiny_llama())
    for m in (reference, model):
        m.config._attn_implementation = "eager"  # HF records attention weights only in eager attention
    patch_llama(model)
    kwargs = dict(max_new_tokens=3, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    with pytest.warns(UserWarning, match="runs HF's own decoder layers"):
        ours = model.generate(REPEATING, assistant_model=_assistant(), **kwargs)
    hf = reference.generate(REPEATING, assistant_model=_assistant(), **kwargs)
    assert torch.equal(ours.sequences, hf.sequences)
    flat_ours = [a for step in ours.attentions for a in step]
    flat_hf = [a for step in hf.attentions for a in step]
    assert len(flat_ours) == len(flat_hf) > 0
    assert all(torch.equal(a, b) for a, b in zip(flat_ours, flat_hf))


@pytest.mark.parametrize("convert", [
    lambda m: m.to(torch.float32), lambda m: m.half(), lambda m: m.float(), lambda m: m.to("meta"),
    lambda m: m.model.to(torch.float16), lambda m: m.model.layers[0].to(dtype=torch.float32),
    lambda m: m.model.embed_tokens.float(),
], ids=["to_fp32", "half", "float", "to_meta", "inner_model_fp16", "one_layer_fp32", "embedding_float"])
def test_dtype_or_device_change_of_a_patched_model_raises_before_any_change(runtime, convert):
    model = tiny_llama()
    patch_llama(model)
    before = model(REPEATING).logits
    with pytest.raises(RuntimeError, match="unpatch_llama"):
        convert(model)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(model(REPEATING).logits, before)


def test_no_op_conversions_pass_and_unpatch_lifts_the_guard(runtime):
    model = tiny_llama()
    patch_llama(model)
    before = model(REPEATING).logits
    assert model.to(torch.bfloat16) is model and model.cpu() is model and model.to("cpu", torch.bfloat16) is model
    assert torch.equal(model(REPEATING).logits, before)
    unpatch_llama(model)
    assert "_apply" not in vars(model) and "_apply" not in vars(model.model.layers[0])
    assert model.float().lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("lm_head", ["bf16", "auto"])
def test_logits_have_one_dtype_on_every_path(runtime, lm_head):
    """Both paths give fp32 logits of the bf16 weight: every token's with lm_head="bf16"; with the Q8_0 copy, the
    best token's (rescored) and the others' within the copy's bound."""
    model = tiny_llama()
    patch_llama(model, lm_head=lm_head)
    with torch.no_grad():
        full = model(REPEATING).logits                      # every position: the host path
        last = model(REPEATING, logits_to_keep=1).logits     # generate()'s path: lm_head_gemv(_packed)
    assert full.dtype == last.dtype == torch.float32
    if lm_head == "bf16":
        torch.testing.assert_close(full[:, -1], last[:, -1], rtol=1e-5, atol=1e-5)
        return
    best = full[0, -1].argmax()
    assert last[0, -1].argmax() == best
    torch.testing.assert_close(last[0, -1, best], full[0, -1, best], rtol=1e-5, atol=1e-5)
    assert (last[0, -1] - full[0, -1]).abs().max() > 0  # the copy's own logits elsewhere


def test_compiled_forward_does_not_recompile_between_decode_steps(runtime):
    model = tiny_llama()
    patch_llama(model)
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        out = model(REPEATING, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
        length = REPEATING.shape[1]
        eager_tokens, compiled_tokens = [], []
        for step in range(3):
            position = torch.tensor([[length + step]])
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                logits = compiled(token, past_key_values=cache, position_ids=position,
                                  cache_position=position[0], use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            compiled_tokens.append(int(token))
    reference = tiny_llama()
    eager_tokens = reference.generate(REPEATING, max_new_tokens=4, do_sample=False)[0, length + 1:].tolist()
    assert compiled_tokens == eager_tokens


def test_norm_epsilon_changed_after_patching_applies(runtime, pair):
    reference, model = pair(tiny_llama())
    patch_llama(model)
    for m in (reference, model):
        for layer in m.model.layers:
            layer.input_layernorm.variance_epsilon = 0.5
            layer.post_attention_layernorm.variance_epsilon = 0.5
    with torch.no_grad():
        ref, out = reference(REPEATING).logits[0, -1], model(REPEATING, logits_to_keep=1).logits[0, -1]
    baseline = tiny_llama()(REPEATING).logits[0, -1]
    assert torch.nn.functional.cosine_similarity(ref.float(), out.float(), dim=0) > 0.999
    assert torch.nn.functional.cosine_similarity(baseline.float(), out.float(), dim=0) < 0.99
