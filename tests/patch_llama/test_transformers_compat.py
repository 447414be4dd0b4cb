"""The patched layer against the installed transformers: arguments bound by the names HF really uses, an unknown
transformers refused before anything changes, no keyword silently dropped, attention weights where asked for."""
import importlib
import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from torch_npu2 import is_patched, patch_llama
from torch_npu2.patch_llama import transformers_compat
from torch_npu2.patch_llama.transformers_compat import (KNOWN_SIGNATURES, TESTED_TRANSFORMERS, TransformersMismatch,
                                                        layer_signature)

from .tiny import tiny_llama

pytestmark = [pytest.mark.compat, pytest.mark.filterwarnings(
    "ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")]

PROMPT = torch.randint(3, 300, (1, 11), generator=torch.Generator().manual_seed(5))


@pytest.fixture(autouse=True)
def fresh_probe():
    """Each test sees the probe run again (it is memoized per model class and transformers)."""
    transformers_compat._probe_layer_calls.cache_clear()
    yield
    transformers_compat._probe_layer_calls.cache_clear()


def _untouched_state(model):
    return ([(name, p.data_ptr()) for name, p in model.named_parameters()],
            [sorted(vars(m)) for m in model.modules()])


def test_the_installed_transformers_has_a_known_layer_signature():
    signature = layer_signature(LlamaDecoderLayer)
    assert signature in KNOWN_SIGNATURES
    hf = [p for p in inspect.signature(LlamaDecoderLayer.forward).parameters][2:-1]
    assert list(signature.params) == hf and signature.cache in hf


def test_an_unknown_layer_signature_is_refused_before_the_model_changes(runtime, monkeypatch):
    hf_forward = LlamaDecoderLayer.forward

    def renamed(self, hidden_states, attention_mask=None, position_ids=None, kv_state=None, use_cache=False,
                position_embeddings=None, **kwargs):
        return hf_forward(self, hidden_states, attention_mask, position_ids, kv_state, use_cache,
                          position_embeddings, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", renamed)
    model = tiny_llama()
    before = _untouched_state(model)
    with pytest.raises(TransformersMismatch) as error:
        patch_llama(model)
    message = str(error.value)
    assert f"transformers {transformers.__version__} is not supported" in message
    assert "kv_state" in message and f"{TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[1]}" in message
    assert "not modified" in message
    assert not is_patched(model) and _untouched_state(model) == before


def test_a_model_that_hands_its_layers_a_renamed_keyword_is_refused(runtime, monkeypatch):
    # what transformers 5.24 did: the model passes the cache as `cache=`, a name the 5.23 layer does not have
    signature = layer_signature(LlamaDecoderLayer)
    other = "past_key_values" if signature.cache == "cache" else "cache"

    def call_with_renamed_cache(self, *args, **kwargs):
        if signature.cache in kwargs:
            kwargs[other] = kwargs.pop(signature.cache)
        return nn.Module.__call__(self, *args, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "__call__", call_with_renamed_cache)
    model = tiny_llama()
    before = _untouched_state(model)
    with pytest.raises(TransformersMismatch, match=f"arguments the patched layer does not take.*'{other}'"):
        patch_llama(model)
    assert not is_patched(model) and _untouched_state(model) == before


def test_a_keyword_the_layer_does_not_handle_is_an_error_naming_it(runtime):
    model = patch_llama(tiny_llama())
    with torch.no_grad(), pytest.raises(TypeError, match="'max_length_q'"):
        model(PROMPT, max_length_q=4)  # LlamaForCausalLM hands its **kwargs to every decoder layer
    layer = model.model.layers[0]
    hidden = torch.zeros(1, 3, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad(), pytest.raises(TypeError, match="'kv_cache'"):
        layer(hidden, kv_cache=None, position_embeddings=None)
    with torch.no_grad(), pytest.raises(TypeError, match="multiple values for argument 'attention_mask'"):
        layer(hidden, None, attention_mask=None)


def test_output_hidden_states_is_ignored_by_the_layer_and_still_collected(runtime, pair):
    reference, model = pair(tiny_llama())
    patch_llama(model)
    with torch.no_grad():
        ours = model(PROMPT, output_hidden_states=True).hidden_states
        theirs = reference(PROMPT, output_hidden_states=True).hidden_states
    assert len(ours) == len(theirs) == model.config.num_hidden_layers + 1
    for mine, hf in zip(ours, theirs):
        torch.testing.assert_close(mine, hf, rtol=0.05, atol=0.05)


def test_the_cache_is_bound_by_the_installed_name(runtime, pair):
    """Decode attends to the whole cache: each step's logits match HF's over a DynamicCache."""
    reference, model = pair(tiny_llama())
    patch_llama(model)
    signature = layer_signature(LlamaDecoderLayer)
    logits = []
    for m in (reference, model):
        cache, steps = DynamicCache(config=m.config), []
        with torch.no_grad():
            out = m(PROMPT, past_key_values=cache, use_cache=True)
            for _ in range(3):
                out = m(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
                steps.append(out.logits[0, -1].float())
        assert cache.get_seq_length() == PROMPT.shape[1] + 3
        logits.append(steps)
    for step, (hf, ours) in enumerate(zip(*logits)):
        assert torch.nn.functional.cosine_similarity(hf, ours, dim=0) > 0.999, (step, signature.cache)


def test_a_newer_transformers_with_a_known_interface_warns_and_patches(runtime, monkeypatch):
    model = tiny_llama()
    # the module as imported now: building a model can replace transformers' lazy module in sys.modules
    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", "99.0.0")
    with pytest.warns(UserWarning, match="transformers 99.0.0 is newer than the newest release"):
        patch_llama(model)
    assert is_patched(model)


def test_an_attention_implementation_without_4d_masks_is_refused(runtime):
    model = tiny_llama()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attention implementation 'flex_attention' is not supported"):
        patch_llama(model)
    assert not is_patched(model)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_output_attentions_gives_what_hf_gives(runtime, pair, attention):
    """A call that asks for attention weights runs HF's own layers (the fused attention never has them), in
    forward and generate alike, and says so once."""
    reference, model = pair(tiny_llama())
    for m in (reference, model):
        m.config._attn_implementation = attention
    patch_llama(model)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = model(PROMPT, output_attentions=True).attentions
        hf = reference(PROMPT, output_attentions=True).attentions
    assert sum("runs HF's own decoder layers" in str(w.message) for w in caught) == 1
    if attention == "eager":
        assert len(ours) == len(hf) == model.config.num_hidden_layers
    else:  # sdpa computes no weights: transformers gives an empty tuple or None, depending on the release
        assert not ours and type(ours) is type(hf)
    for mine, theirs in zip(ours or (), hf or ()):
        assert torch.equal(mine, theirs)
    kwargs = dict(max_new_tokens=3, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    ours, hf = model.generate(PROMPT, **kwargs), reference.generate(PROMPT, **kwargs)
    assert torch.equal(ours.sequences, hf.sequences)
    assert len(ours.attentions) == len(hf.attentions) == 3
    for step_ours, step_hf in zip(ours.attentions, hf.attentions):
        assert type(step_ours) is type(step_hf) and len(step_ours or ()) == len(step_hf or ())
        for mine, theirs in zip(step_ours or (), step_hf or ()):
            assert torch.equal(mine, theirs)
    # the next call without attentions is back on the NPU
    runs = runtime.xrt.counters["runs"]
    with torch.no_grad():
        model(PROMPT)
    assert runtime.xrt.counters["runs"] > runs


def test_setup_and_readme_declare_the_tested_range():
    """install_requires and the README name the transformers range the compatibility job runs on."""
    root = Path(__file__).resolve().parents[2]
    low, high = (Version(v) for v in TESTED_TRANSFORMERS)
    declared = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', (root / "setup.py").read_text())
    assert declared, "setup.py has no transformers>=…,<… requirement"
    assert Version(declared[1]) == Version(f"{low.major}.{low.minor}")
    assert Version(declared[2]) == Version(f"{high.major}.{high.minor + 1}")
    assert f"transformers {TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[1]}" in (root / "README.md").read_text()
