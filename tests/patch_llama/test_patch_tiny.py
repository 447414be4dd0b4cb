"""patch_llama on tiny random Llama configs: numerics, generation features, patch/unpatch and bad input."""
import warnings
from collections import Counter

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM, StaticCache

import torch_npu2
from torch_npu2 import compare_layers, create_runtime, patch_llama, unpatch_llama, use_runtime
from torch_npu2.emulator import EmulatedXrt
from torch_npu2.kernels import ModelDims, programs_for_model, quant
from torch_npu2.kernels.catalog import DECODE_GROUP_SIZES, layer_arenas, lm_head_rows
from torch_npu2.patch_llama import layer as layer_module

from .tiny import tiny_llama
from .gate import check_topk_gate, greedy_with_topk

# The tiny configs run on the emulated NPU2 but break NPU2 builder constraints (head_dim 16, widths that
# are not whole vectors): patch_llama warns about that, which the tests below check on their own.
NPU2_WARNING = "patch_llama: LlamaForCausalLM runs here on the emulated NPU2"
pytestmark = pytest.mark.filterwarnings(
    "ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
PREFILL_PROGRAMS = ("rms_gemms_rope", "flash_attn", "o_ffn")
NPU2_BUILDABLE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)

CONFIGS = {
    "odd_dims": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=200),
    "mha_group1": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128),
    "gqa_group3": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=160),
    "gqa_group4": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=256),
    "tied": dict(tie_word_embeddings=True),
    "llama3_rope": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}),
    "head_dim_32": dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


def prompt(length, vocab=300, seed=1):
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layers_and_generation_match_hf(runtime, pair, name):
    reference, model = pair(tiny_llama(**CONFIGS[name]))
    patch_llama(model)
    ids = prompt(21)
    report = compare_layers(reference, model, ids)
    assert report.worst().min_cosine >= 0.999, str(report)
    check_topk_gate(*greedy_with_topk(reference, ids, 16), *greedy_with_topk(model, ids, 16), label=name)
    # the two layers decode in one dispatch with the first one's Q/K/V, the final norm and the LM head
    # (decode_layers2_qkv_final_packed_lm)
    assert (runtime.xrt.counters["runs:flash_attn"] >= 2
            and runtime.xrt.counters["runs:decode_layers2_qkv_final_packed_lm"] >= 2)


def test_prefill_pads_to_bucket_and_tracks_length(runtime, pair):
    reference, model = pair(tiny_llama())
    patch_llama(model, prefill_buckets=(8, 32))
    ids = prompt(9)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), reference(ids).logits.float(), atol=0.08, rtol=0.05)
    assert runtime.xrt.counters["runs:rms_gemms_rope"] == 2  # 9 tokens → one 32-row bucket per layer
    dims = ModelDims.from_config(reference.config)
    built = {e["program_key"] for e in runtime.cache.entries()}
    prefill_32 = [p for p in programs_for_model(dims, (32,)) if p.name in PREFILL_PROGRAMS]
    prefill_8 = [p for p in programs_for_model(dims, (8,)) if p.name in PREFILL_PROGRAMS]
    assert [p.name for p in prefill_32 if p.key not in built] == [], "the 32-row prefill Programs were not built"
    assert [p.name for p in prefill_8 if p.key in built] == [], "9 tokens do not fit the 8-row bucket"


def decode_runs(layers: int, most: int = DECODE_GROUP_SIZES[-1]) -> list[str]:
    """The Programs a decode token runs, in order: runs of up to ``most`` layers, each chaining into the next
    layer's Q/K/V (npu2.decode_layers<n>, or decode_attn_o_gemv_ffn_rms_gemv_rope for a layer alone) but the last,
    which ends with the model's last layer: decode_layers<n>_final_packed_lm, which runs the model's final norm and
    LM head (its Q8_0 copy) too, or decode_attn_o_gemv_ffn for a last layer alone (the LM head then runs alone).
    The first run of several layers is a _qkv one (its first layer's Q/K/V too); a first layer alone has
    rms_gemv_rope run before it."""
    sizes, left = [], layers
    while left:
        sizes.append(min(most, left))
        left -= sizes[-1]
    runs = [f"decode_layers{n}" if n > 1 else "decode_attn_o_gemv_ffn_rms_gemv_rope" for n in sizes[:-1]]
    runs += [f"decode_layers{sizes[-1]}_final_packed_lm" if sizes[-1] > 1 else "decode_attn_o_gemv_ffn"]
    if sizes[0] == 1:
        return ["rms_gemv_rope", *runs]
    return [runs[0].replace(f"decode_layers{sizes[0]}", f"decode_layers{sizes[0]}_qkv"), *runs[1:]]


@pytest.mark.parametrize("layers", [2, 3, 7, 16])
def test_one_decode_token_moves_what_architecture_md_says(runtime, layers):
    """Per decode token of an L-layer model (L ≥ 2), with the NpuKVCache: every layer, up to eight in one dispatch
    (two dispatches at Llama-3.2-1B's 16 layers), the first run starting with the first layer's Q/K/V, each run
    chaining into the next layer's Q/K/V but the last, which ends with the model's last layer and runs the final norm
    and the LM head too (``decode_runs``). No weight
    bytes, 1 staged host copy (the first layer's input), 2(A − 1) syncs in place for A runs (each later one's q and
    input: the previous run's output BOs, bound as they are and flushed, never copied), 2 ranged syncs (the step's
    RoPE LUT row and attention length, written once into buffers every layer binds; the cache slabs are bound as
    they are and never flushed whole), the new K and V row of every layer written by the NPU into the cache through
    2L sub-buffers, never by the host, and one read-back per op output (a K or V row's: just its bytes)."""
    model = patch_llama(tiny_llama(num_hidden_layers=layers))
    ids = prompt(9)

    def counts(new_tokens):
        before, before_xrt = runtime.stats.copy(), runtime.xrt.counters.copy()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return runtime.stats - before, runtime.xrt.counters - before_xrt

    counts(2)  # loads every Program and syncs the weights
    (stats2, xrt2), (stats3, xrt3) = counts(2), counts(3)  # the same prefill; the second decodes one more token
    token, token_xrt = stats3 - stats2, xrt3 - xrt2
    runs = decode_runs(layers)
    assert token["runs"] == len(runs)
    assert {k[len("runs:"):]: v for k, v in token_xrt.items() if k.startswith("runs:")} == Counter(runs)
    assert token_xrt["bytes_to_device:weight"] == 0 == xrt3["syncs_to_device:weight"]
    assert token["host_copies"] == 1
    assert token["bo_inputs_synced"] == 2 * (len(runs) - 1)
    config = model.config
    lut_row_bytes, length_bytes = config.hidden_size // config.num_attention_heads * 2, 4 * 2  # bf16
    assert token["ranged_syncs"] == 2
    assert token["ranged_sync_bytes"] == lut_row_bytes + length_bytes
    assert token["sub_buffers"] == 2 * layers == token_xrt["sub_bos"]
    assert token_xrt["syncs_to_device"] == token["host_copies"] + token["bo_inputs_synced"] + token["ranged_syncs"]
    # every layer's K and V rows; out and the next q of every run but the last, out, the final norm and the logits
    # of the last
    assert token_xrt["syncs_from_device"] == 2 * layers + 2 * (len(runs) - 1) + 3


def _group_runs(runtime) -> int:
    return sum(v for k, v in runtime.xrt.counters.items() if k.startswith("runs:decode_layers"))


@pytest.mark.compat
def test_decode_groups_give_the_layer_by_layer_logits_bit_for_bit(runtime):
    """Eleven layers decode as decode_layers8_qkv and decode_layers3_final_packed_lm per token; the
    logits are those of the layers one dispatch each, bit for bit (strict coherency). A forward hook on a layer
    (anything may read its output) keeps that layer out of every group: with one on each, no group runs."""
    model = patch_llama(tiny_llama(num_hidden_layers=11))
    ids = prompt(9)

    def logits():
        out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        return torch.stack(out.logits)

    before = _group_runs(runtime)
    grouped = logits()
    assert _group_runs(runtime) - before == 2 * 4  # two groups per decode token
    seen = []
    hooks = [layer.register_forward_hook(lambda module, args, out: seen.append(out)) for layer in model.model.layers]
    try:
        before = _group_runs(runtime)
        one_by_one = logits()
        assert _group_runs(runtime) == before and len(seen) == 11 * 5
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(grouped, one_by_one)


def decode_runs_and_logits(runtime, model, ids, counted):
    """Greedy generate() of 3 tokens: (runs of the Programs whose name ``counted`` accepts, the logits)."""
    before = runtime.xrt.counters.copy()
    out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    runs = runtime.xrt.counters - before
    return ({k[len("runs:"):]: n for k, n in runs.items() if k.startswith("runs:") and counted(k[len("runs:"):])},
            torch.stack(out.logits))


@pytest.mark.parametrize("hook", ["global", "pre", "wrapped"])
def test_any_code_that_may_see_a_layers_output_keeps_it_out_of_groups(runtime, hook):
    """A forward hook on every module, a forward pre-hook on a layer, or a wrapper around a layer's patched forward
    (as accelerate's hooks and transformers 5.0's output capture install): that layer runs on its own (with a
    global hook every one does), and the logits stay those of the groups."""
    model = patch_llama(tiny_llama(num_hidden_layers=5))
    ids = prompt(9)

    def decode():
        return decode_runs_and_logits(runtime, model, ids, lambda name: name.startswith("decode_layers"))

    groups, expected = decode()
    assert groups == {"decode_layers5_qkv_final_packed_lm": 2}  # every layer, in each of the two decode steps
    layer = model.model.layers[2]
    if hook == "global":
        handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    elif hook == "pre":
        handle = layer.register_forward_pre_hook(lambda module, args: None)
    else:
        patched = layer.forward
        layer.forward = lambda *args, **kwargs: patched(*args, **kwargs)
    try:
        groups, logits = decode()
    finally:
        if hook == "wrapped":
            layer.forward = patched
        else:
            handle.remove()
    # with a hook on layer 2: layers 0-1 in one dispatch, layer 2 on its own, layers 3-4 in one
    assert groups == ({} if hook == "global" else {"decode_layers2_qkv": 2, "decode_layers2_final_packed_lm": 2})
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("hooked", ["norm", "lm_head"])
def test_a_hook_on_the_final_norm_or_the_lm_head_keeps_them_out_of_the_last_group(runtime, hooked):
    """The last decode group runs the model's final norm and LM head (decode_layers<n>_final_packed_lm) only while
    nothing but HF's forward sees what they return: with a forward hook on either, the group is a _final one, HF's
    norm and lm_head_gemv_packed run, the hook sees every call, and the logits are the same bit for bit; without it,
    the group takes them again."""
    model = patch_llama(tiny_llama(num_hidden_layers=3))
    ids = prompt(9)

    def decode():
        return decode_runs_and_logits(runtime, model, ids,
                                      lambda name: name.startswith("decode_layers") or name == "lm_head_gemv_packed")

    # the prefill's token has its LM head alone
    joined = {"decode_layers3_qkv_final_packed_lm": 2, "lm_head_gemv_packed": 1}
    runs, expected = decode()
    assert runs == joined
    seen = []
    handle = (model.model.norm if hooked == "norm" else model.lm_head).register_forward_hook(
        lambda module, args, out: seen.append(out))
    try:
        runs, logits = decode()
    finally:
        handle.remove()
    assert runs == {"decode_layers3_qkv_final": 2, "lm_head_gemv_packed": 3} and len(seen) == 3
    assert torch.equal(logits, expected)
    assert decode()[0] == joined


@pytest.mark.parametrize("most, runs", [(1, {"decode_attn_o_gemv_ffn_rms_gemv_rope": 6, "decode_attn_o_gemv_ffn": 1}),
                                        (2, {"decode_layers2_qkv": 1, "decode_layers2": 2,
                                             "decode_attn_o_gemv_ffn": 1}),
                                        (3, {"decode_layers3_qkv": 1, "decode_layers3": 1,
                                             "decode_attn_o_gemv_ffn": 1}),
                                        (4, {"decode_layers4_qkv": 1, "decode_layers3_final_packed_lm": 1})])
def test_decode_layers_per_dispatch_caps_the_groups(runtime, most, runs):
    """patch_llama(decode_layers_per_dispatch=n) runs at most n layers per decode dispatch (1: each on its own)."""
    model = patch_llama(tiny_llama(num_hidden_layers=7), decode_layers_per_dispatch=most)
    ids = prompt(9)

    def runs_of(new_tokens):
        before = runtime.xrt.counters.copy()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return runtime.xrt.counters - before

    runs_of(2)  # loads every Program
    token = runs_of(3) - runs_of(2)
    assert {k[len("runs:"):]: n for k, n in token.items() if k.startswith("runs:decode_")} == runs


def test_a_first_layer_normalized_with_another_eps_projects_its_qkv_alone(runtime):
    """A _qkv group normalizes its first layer's input with the group's next_eps: a first layer whose input norm has
    another eps runs rms_gemv_rope alone, then the group from its attention on, and gives the logits of the layers
    one per dispatch; with the eps alike, the group takes its Q/K/V again."""
    ids = prompt(9)

    def decode(most, eps):
        model = patch_llama(tiny_llama(num_hidden_layers=3), decode_layers_per_dispatch=most)
        model.model.layers[0].input_layernorm.variance_epsilon = eps
        return decode_runs_and_logits(runtime, model, ids, lambda name: name.startswith(("decode_", "rms_gemv")))

    eps = tiny_llama().config.rms_norm_eps
    runs, logits = decode(4, 3 * eps)
    assert runs == {"rms_gemv_rope": 2, "decode_layers3_final_packed_lm": 2}
    assert torch.equal(logits, decode(1, 3 * eps)[1])
    assert decode(4, eps)[0] == {"decode_layers3_qkv_final_packed_lm": 2}


@pytest.mark.parametrize("most", [0, 9, 2.0, True, "4"])
def test_a_bad_decode_layers_per_dispatch_is_refused_before_the_model_is_touched(most):
    model = tiny_llama()
    forward = model.model.layers[0].forward
    with pytest.raises(ValueError, match=r"decode_layers_per_dispatch must be 1 to 8, got"):
        patch_llama(model, decode_layers_per_dispatch=most)
    assert model.model.layers[0].forward == forward and not torch_npu2.is_patched(model)


def test_the_lm_heads_q8_0_copy_is_rescored_to_the_bf16_weights_best_tokens(runtime):
    """A bf16 model's LM head GEMV reads a Q8_0 copy of its weight (lm_head="auto"). Over rows whose tokens nearly tie,
    where the copy's rounding reorders them, every row's best token is the bf16 weight's, and so is every logit the
    copy put within twice its error bound of the best; the others are the copy's, each within the bound of the bf16
    one. With the bound taken away (only the copy's own best scored again) other tokens win: the margin is what makes
    the best token right."""
    model = tiny_llama()
    vocab, hidden = model.lm_head.weight.shape
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # every token's row one direction plus a little noise: near ties the copy can reorder
        model.lm_head.weight.copy_(0.05 * torch.randn(hidden, generator=g) + 1e-3 * torch.randn(vocab, hidden,
                                                                                              generator=g))
    patch_llama(model)
    head = model.lm_head.forward
    fmt, words = head.packed
    assert fmt == "q8_0" and head.bound > 0 and "on the NPU: Q8_0 packed" in repr(model.lm_head)
    x = torch.randn(32, 1, hidden, generator=g).bfloat16()
    exact = torch.nn.functional.linear(x.float(), model.lm_head.weight.float())[:, 0]
    copy = torch.stack([torch.ops.npu2.lm_head_gemv_packed(row, words, fmt)[:vocab] for row in x[:, 0]])
    bound = head.bound * torch.linalg.vector_norm(x[:, 0].float(), dim=-1, keepdim=True)
    assert ((copy - exact).abs() <= bound).all()  # the bound holds
    assert (copy.argmax(-1) != exact.argmax(-1)).any(), "no row's best token moved: the test cannot tell"
    with torch.no_grad():
        logits = model.lm_head(x)[:, 0]
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    rescored = copy >= copy.max(-1, keepdim=True).values - 2 * bound
    torch.testing.assert_close(logits[rescored], exact[rescored], rtol=0, atol=1e-5)
    assert torch.equal(logits[~rescored], copy[~rescored])
    head.bound = 0.0
    with torch.no_grad():
        assert not torch.equal(model.lm_head(x)[:, 0].argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("kwargs, message", [
    (dict(lm_head="q4_1"), r"lm_head must be one of 'auto', 'bf16', 'q8_0', got 'q4_1'"),
    (dict(lm_head=None), r"lm_head must be one of 'auto', 'bf16', 'q8_0', got None"),
    (dict(lm_head="bf16", weights="q4_1"), r"lm_head='bf16' chooses between copies of a bf16 LM head; with "
                                           r"weights='q4_1' the LM head is packed as 'q4_1'")])
def test_a_bad_lm_head_is_refused_before_the_model_is_touched(kwargs, message):
    model = tiny_llama()
    forward = model.model.layers[0].forward
    with pytest.raises(ValueError, match=message + ".*the model was not modified"):
        patch_llama(model, **kwargs)
    assert model.model.layers[0].forward == forward and not torch_npu2.is_patched(model)


@pytest.mark.compat
def test_hidden_states_asked_for_are_each_layers_own(runtime):
    """With output_hidden_states HF records every layer's output, so no layer runs in a group then; once the capture
    is over, groups run again."""
    model = patch_llama(tiny_llama(num_hidden_layers=5))
    ids = prompt(9)
    before = _group_runs(runtime)
    out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, output_hidden_states=True,
                         return_dict_in_generate=True)
    assert _group_runs(runtime) == before
    step = out.hidden_states[-1]  # the last decode step: the embeddings, then each layer's output (the last normed)
    assert len(step) == 6 and all(not torch.equal(a, b) for a, b in zip(step[1:-1], step[2:-1]))
    model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert _group_runs(runtime) > before


def test_layers_reordered_after_patching_are_refused_while_a_group_is_due(runtime):
    """A group runs its layers before HF calls them, in the order patch_llama linked them: layers reordered after
    patching make the next decode step raise, naming the layer that was due, rather than return another layer's
    output."""
    model = patch_llama(tiny_llama(num_hidden_layers=5))
    layers = model.model.layers
    layers[2], layers[3] = layers[3], layers[2]
    with pytest.raises(RuntimeError, match=r"decoder layer 3 was called while layer 2, which an earlier layer's NPU "
                                           r"run already computed, was due"):
        model.generate(prompt(9), max_new_tokens=2, min_new_tokens=2, do_sample=False)


@pytest.mark.compat
def test_a_group_left_by_an_interrupted_forward_is_not_taken(runtime):
    """A decode step that stops after a group leader (its caller called layer 0 alone) leaves layers 1-4 due; the
    next forward, another step, runs every layer itself and gives the logits it gives without the leftover."""
    model = patch_llama(tiny_llama(num_hidden_layers=5))
    ids = prompt(9)

    def logits():
        out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        return torch.stack(out.logits), out.past_key_values

    expected, cache = logits()
    leader = model.model.layers[0].forward
    position = torch.tensor([[cache.get_seq_length()]])
    hidden = model.model.embed_tokens(torch.tensor([[7]]))
    with torch.no_grad():
        leader(hidden, attention_mask=None, position_ids=position, use_cache=True,
               position_embeddings=model.model.rotary_emb(hidden, position), **{leader.signature.cache: cache})
    assert [layer.layer_idx for layer in leader.shared.grouped.layers] == [1, 2, 3, 4]  # due, never called
    assert torch.equal(logits()[0], expected)


@pytest.mark.parametrize("layers", [2, 4, 6])
@pytest.mark.parametrize("padded", [None, "second", "first"])
def test_a_batch_decodes_over_every_sequences_cache_in_place(runtime, padded, layers):
    """Two prompts decode as each does alone (strict coherency), every layer's attention on the NPU, and no decode
    token copies a cache slab: the second sequence's slab, which starts inside its layer's BO, is bound as a
    sub-buffer of it like the K/V rows; a left-padded sequence's attention reads from its first real row, its
    bucket running into the cache's spare rows. A token's copies are the batch's hidden rows only (HF hands the
    layers one stacked tensor), whatever the context. The layers run in decode groups, one run per sequence
    (``decode_runs``: with six, a group of four that hands the fifth its Q, then decode_layers2_final)."""
    model = patch_llama(tiny_llama(num_hidden_layers=layers))
    groups = {name: runtime.xrt.counters[f"runs:{name}"] for name in decode_runs(layers)}
    prompts = [prompt(9, seed=1), prompt(5 if padded else 9, seed=2)]
    if padded == "first":
        prompts.reverse()
    ids = torch.cat([torch.nn.functional.pad(p, (9 - p.shape[1], 0)) for p in prompts])
    mask = (torch.arange(9) >= torch.tensor([[9 - p.shape[1]] for p in prompts])).long()
    alone = [model.generate(p, max_new_tokens=4, do_sample=False)[:, p.shape[1]:] for p in prompts]
    host_attention = []

    def counts(new_tokens):
        before = runtime.stats.copy()
        with pytest.MonkeyPatch.context() as patch:
            for name in ("_host_attention", "_decode_attention"):  # the host paths, and the seam's
                original = getattr(layer_module, name)
                patch.setattr(layer_module, name, lambda *a, f=original, n=name: (host_attention.append(n), f(*a))[1])
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    do_sample=False, pad_token_id=0)
        return tokens, runtime.stats - before

    (tokens, _), (_, stats3), (_, stats4) = counts(4), counts(3), counts(4)
    assert torch.equal(tokens[:, 9:], torch.cat(alone)) and not host_attention
    token = stats4 - stats3
    row_bytes = model.config.hidden_size * 2
    assert 0 < token["host_copies"] and token["host_copy_bytes"] == token["host_copies"] * row_bytes
    # the LUT rows of both sequences and the lengths, each written once into a step buffer every layer binds (the
    # padded sequence's length counts from its first real row: a buffer of its own)
    assert token["ranged_syncs"] == 2 + 1 + (padded is not None)
    assert token["sub_buffers"] == 2 * 2 * layers  # each sequence's new K and V rows, per layer; the slabs' reused
    # one group run per sequence and decode step: 3 + 2 + 3 steps of the batch (n new tokens, the first from the
    # prefill), 3 of each prompt alone
    assert {name: runtime.xrt.counters[f"runs:{name}"] - n for name, n in groups.items()} == {
        name: (3 + 2 + 3) * 2 + 3 * 2 for name in groups}


@pytest.mark.parametrize("edit", [None, "in_place", "replaced", "reordered"])
def test_chained_decode_layers_match_unchained_ones_and_see_hook_edits(runtime, edit):
    """A decode layer runs the next layer's rms_gemv_rope in its own dispatch, and the first layer's runs in the
    group it leads; the logits are bit-identical to layers that do not chain (each its own rms_gemv_rope). A forward
    hook on layer 0 that edits its output (in place, or by returning a new tensor) keeps it out of groups (its
    rms_gemv_rope runs alone) and makes layer 1 recompute from the edited state, in the group it leads with layer 2;
    layers reordered after patching each compute their own."""
    def halve(module, args, output):
        if edit == "in_place":
            output.mul_(0.5)
            return None
        return output * 0.5

    logits, runs = [], []
    for chain in (True, False):
        model = patch_llama(tiny_llama(num_hidden_layers=3))
        if not chain:
            for layer in model.model.layers:
                layer.forward.next_layer = None
        if edit == "reordered":
            model.model.layers = torch.nn.ModuleList(reversed(model.model.layers))
        elif edit:
            model.model.layers[0].register_forward_hook(halve)
        before = runtime.xrt.counters.copy()
        out = model.generate(prompt(9), max_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        logits.append(torch.stack(out.logits))
        runs.append((runtime.xrt.counters - before)["runs:rms_gemv_rope"])
    assert torch.equal(logits[0], logits[1])
    decode_steps = 3  # 4 new tokens: the first comes from the prefill
    assert runs == [decode_steps * {None: 0, "in_place": 1, "replaced": 1, "reordered": 3}[edit], decode_steps * 3]


def test_prompt_longer_than_largest_bucket_is_chunked(runtime, pair):
    reference, model = pair(tiny_llama())
    patch_llama(model, prefill_buckets=(16,))
    ids = prompt(40)
    report = compare_layers(reference, model, ids)
    assert report.worst().min_cosine >= 0.999, str(report)
    assert runtime.xrt.counters["runs:rms_gemms_rope"] == 2 * 3  # 40 rows → 3 chunks of 16, per layer


def test_a_chunked_prefill_gives_the_heap_back_after_each_layer(runtime, monkeypatch):
    """A prompt of several chunks releases the heap's free pages once per layer (its short-lived tensors would stay
    in the process otherwise, torch_npu2/host_memory.py); a prompt of one chunk, and decode, do not."""
    from torch_npu2.patch_llama import layer

    calls = []
    monkeypatch.setattr(layer, "release_free_heap", lambda: calls.append(1) or True)
    model = patch_llama(tiny_llama(), prefill_buckets=(16,))
    layers = model.config.num_hidden_layers
    model.generate(prompt(40), max_new_tokens=3, do_sample=False)
    assert len(calls) == layers
    model.generate(prompt(12), max_new_tokens=3, do_sample=False)
    assert len(calls) == layers


def test_a_prompt_longer_than_the_context_is_refused_before_any_op_runs(runtime):
    """The Python API's check: one PromptTooLongError at the first layer, before any op and before the cache is
    touched, for a fresh prompt and for one that continues a cached conversation past the context."""
    model = patch_llama(tiny_llama(max_position_embeddings=48))
    cache = DynamicCache(config=model.config)
    with pytest.raises(torch_npu2.PromptTooLongError) as refused:
        model.generate(prompt(49), max_new_tokens=2, do_sample=False, past_key_values=cache)
    assert str(refused.value) == ("the prompt has 49 tokens, more than the model's context of 48 tokens "
                                  "(config.max_position_embeddings)")
    assert runtime.stats["runs"] == 0 and cache.get_seq_length() == 0
    out = model.generate(prompt(30), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    before = runtime.stats["runs"]
    with pytest.raises(torch_npu2.PromptTooLongError, match=r"^the prompt has 54 tokens \(33 of them already cached\)"):
        model(prompt(21), past_key_values=out.past_key_values, use_cache=True)
    assert runtime.stats["runs"] == before and out.past_key_values.get_seq_length() == 33
    assert model(prompt(48)).logits.shape == (1, 48, model.config.vocab_size)  # the whole context is fine


def test_full_sequence_logits_stay_correct(runtime, pair):
    reference, model = pair(tiny_llama())
    patch_llama(model)
    ids = prompt(12)
    with torch.no_grad():
        ref, out = reference(ids).logits, model(ids).logits
    assert out.shape == ref.shape
    cos = torch.nn.functional.cosine_similarity(ref.float(), out.float(), dim=-1)
    assert cos.min() >= 0.999


def test_batch_with_left_padding_matches_single_rows(runtime, pair):
    reference, model = pair(tiny_llama())
    patch_llama(model)
    long, short = prompt(14, seed=2)[0], prompt(6, seed=3)[0]
    ids = torch.stack([long, torch.cat([torch.zeros(8, dtype=long.dtype), short])])
    mask = torch.stack([torch.ones(14, dtype=torch.long), torch.cat([torch.zeros(8), torch.ones(6)]).long()])
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    one = model.generate(long[None], max_new_tokens=10, do_sample=False)
    two = model.generate(short[None], max_new_tokens=10, do_sample=False)
    assert batch[0, 14:].tolist() == one[0, 14:].tolist()
    assert batch[1, 14:].tolist() == two[0, 6:].tolist()
    ref_tokens, ref_logits = greedy_with_topk(reference, ids, 10, attention_mask=mask, pad_token_id=0)
    out_tokens, out_logits = greedy_with_topk(model, ids, 10, attention_mask=mask, pad_token_id=0)
    check_topk_gate(ref_tokens, ref_logits, out_tokens, out_logits, label="batch2")
    report = compare_layers(reference, model, ids, attention_mask=mask)
    assert report.worst().min_cosine >= 0.999, str(report)


def test_static_cache(runtime, pair):
    reference, model = pair(tiny_llama())
    patch_llama(model)
    ids = prompt(10)
    kwargs = dict(cache_implementation="static")
    check_topk_gate(*greedy_with_topk(reference, ids, 12, **kwargs), *greedy_with_topk(model, ids, 12, **kwargs),
                    label="static")
    cache = StaticCache(config=model.config, max_cache_len=64)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True).logits
        ref = reference(ids, past_key_values=StaticCache(config=model.config, max_cache_len=64), use_cache=True).logits
    assert torch.nn.functional.cosine_similarity(ref.float(), out.float(), dim=-1).min() >= 0.999
    assert runtime.xrt.counters["runs:flash_attn"] >= 2  # a static cache's masked tail keeps prefill on the NPU


def test_multi_turn_past_key_values(runtime, pair):
    reference, model = pair(tiny_llama())
    patch_llama(model)
    first, follow = prompt(9, seed=4), prompt(7, seed=5)
    results = []
    for m in (reference, model):
        out = m.generate(first, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
        ids = torch.cat([out.sequences, follow], 1)
        results.append(greedy_with_topk(m, ids, 8, past_key_values=out.past_key_values))
    check_topk_gate(*results[0], *results[1], label="multi-turn")


def test_sampling_with_fixed_seed(runtime, pair):
    reference, model = pair(tiny_llama())
    patch_llama(model)
    ids = prompt(8)
    kwargs = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2, max_new_tokens=12)
    torch.manual_seed(123)
    ref = reference.generate(ids, **kwargs)
    torch.manual_seed(123)
    out = model.generate(ids, **kwargs)
    torch.manual_seed(123)
    again = model.generate(ids, **kwargs)
    assert out.tolist() == again.tolist()
    agree = (ref[0, 8:] == out[0, 8:]).int().cumprod(0).sum().item()
    assert agree >= 4, f"sampled tokens agree with HF for only {agree} steps: {ref[0, 8:]} vs {out[0, 8:]}"


def test_unpatch_restores_bit_identical_outputs(runtime):
    model = tiny_llama()
    ids = prompt(11)
    with torch.no_grad():
        before = model(ids).logits
    patch_llama(model)
    assert torch_npu2.is_patched(model)
    unpatch_llama(model)
    assert not torch_npu2.is_patched(model)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)
    assert not any(runtime.is_bo_backed(p) for p in model.parameters())
    assert all("forward" not in m.__dict__ for m in (*model.model.layers, model.model.norm, model.lm_head))


def test_unpatch_frees_the_npu_buffers_of_a_model_that_ran(runtime):
    """After decoding (every decode Program keeps a run per set of weights, holding their BOs), unpatch_llama leaves
    none of the model's NPU buffers alive: the runs that bound them go with them, so patching again does not hold
    two copies of the weights."""
    import gc
    import weakref

    model = tiny_llama(num_hidden_layers=3)
    patch_llama(model)
    first = model.generate(prompt(6), max_new_tokens=3, do_sample=False)
    buffers = [weakref.ref(b) for b in runtime._resident.values()]
    assert len(buffers) > 2 * 3 and sum(len(l.bindings) for l in runtime._loaded.values()) > 0
    unpatch_llama(model)
    gc.collect()
    assert [r() for r in buffers if r() is not None] == []
    patch_llama(model)  # and the model runs again, its runs made anew, to the same tokens
    assert torch.equal(model.generate(prompt(6), max_new_tokens=3, do_sample=False), first)


def test_hf_slice_of_the_layers_is_kept_while_its_layers_are_the_same(runtime):
    model = tiny_llama(num_hidden_layers=3)
    layers, ids = model.model.layers, prompt(7)
    with torch.no_grad():
        before = model(ids).logits
    patch_llama(model)
    n = model.config.num_hidden_layers
    model(ids)  # HF's forward slices the list
    kept = layers[:n]
    assert layers[:n] is kept and list(kept) == list(layers) and layers[:2] is not kept
    assert list(layers[:2]) == list(layers)[:2] and layers[1] is list(layers)[1]
    kept.append(torch.nn.Identity())  # a slice someone changed is not handed out again
    assert layers[:n] is not kept and list(layers[:n]) == list(layers)
    again = layers[:n]
    layers[0], first = torch.nn.Identity(), layers[0]  # nor is one of a list that changed
    assert layers[:n] is not again and layers[:n][0] is layers[0]
    layers[0] = first
    unpatch_llama(model)
    assert type(layers) is torch.nn.ModuleList and "_torch_npu2_slice" not in layers.__dict__
    assert layers[:n] is not layers[:n]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("name", ["tied", "llama3_rope"])
def test_decode_steps_take_hf_rope_values_from_a_table(runtime, name):
    model = tiny_llama(**CONFIGS[name])
    rotary, hidden = model.model.rotary_emb, torch.zeros(1, 1, model.config.hidden_size, dtype=torch.bfloat16)
    positions = [0, 1, 5, 1023, 1024, 3000, 2]  # the table grows past its first chunk, then is read back
    expected = [rotary(hidden, torch.tensor([[p]])) for p in positions]
    batch = torch.tensor([[7], [1500]])
    expected_batch = rotary(hidden.expand(2, 1, -1), batch)
    prefill = rotary(hidden.expand(1, 4, -1), torch.arange(4)[None])
    patch_llama(model)
    assert "forward" in rotary.__dict__
    for p, (cos, sin) in zip(positions, expected):
        got = rotary(hidden, torch.tensor([[p]]))
        assert torch.equal(got[0], cos) and torch.equal(got[1], sin), p
    assert all(torch.equal(a, b) for a, b in zip(rotary(hidden.expand(2, 1, -1), batch), expected_batch))
    assert all(torch.equal(a, b) for a, b in zip(rotary(hidden.expand(1, 4, -1), torch.arange(4)[None]), prefill))
    far = torch.tensor([[1 << 17]])  # past the table's reach: HF's forward, no table that large
    with torch.no_grad():
        assert torch.equal(rotary(hidden, far)[0], rotary.__dict__["forward"].forward(hidden, far)[0])
    assert len(rotary.__dict__["forward"].tables[(torch.bfloat16, hidden.device)][2]) == 4096
    with torch.no_grad():
        rotary.inv_freq.mul_(2)  # frequencies changed in place: the table is made again from HF's forward
    changed = rotary(hidden, torch.tensor([[1024]]))
    unpatch_llama(model)
    assert "forward" not in rotary.__dict__
    assert all(torch.equal(a, b) for a, b in zip(changed, rotary(hidden, torch.tensor([[1024]]))))
    assert not torch.equal(changed[0], expected[4][0])


def test_a_rope_whose_frequencies_move_is_left_to_hf(runtime):
    model = tiny_llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    patch_llama(model)
    assert "forward" not in model.model.rotary_emb.__dict__


@pytest.mark.parametrize("lm_head", ["bf16", "auto"])
def test_weights_become_bo_backed_views_held_once(runtime, lm_head):
    """Each decoder layer's weights go into its two arenas (catalog.layer_arenas), every other weight into a BO of
    its own, nothing else yet; each is synced once. By default the LM head's (here the tied embedding's) Q8_0 copy
    takes that BO, and the bf16 weight stays a host tensor, which decode never syncs (rescoring reads it on the
    host)."""
    model = tiny_llama(tie_word_embeddings=True)
    layers = {id(p) for layer in model.model.layers for p in layer.parameters()}
    head = model.lm_head.weight
    # the final norm's too: a group runs it
    weights = {id(p): p for p in model.parameters() if id(p) not in layers and p is not head}
    vocab, hidden = head.shape  # the LM head's buffer pads the vocabulary to whole 256-row groups
    row_bytes = hidden * 2 if lm_head == "bf16" else quant.weight_format("q8_0").row_bytes(hidden)
    weight_bytes = sum(p.numel() * 2 for p in weights.values()) + lm_head_rows(vocab) * row_bytes
    config = model.config
    head_dim = hidden // config.num_attention_heads
    arenas = layer_arenas(hidden, hidden, config.num_key_value_heads * head_dim, config.intermediate_size)
    weight_bytes += config.num_hidden_layers * (arenas.weights.nbytes + arenas.norms.nbytes)
    patch_llama(model, lm_head=lm_head)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(runtime.is_bo_backed(p) == (p is not head or lm_head == "bf16") for p in model.parameters())
    assert runtime.stats["bo_bytes"] == weight_bytes
    for _ in range(2):
        model.generate(prompt(5), max_new_tokens=3, do_sample=False)
    assert runtime.xrt.counters["bytes_to_device:weight"] == weight_bytes  # each weight synced once


def test_patching_twice_warns_and_is_a_no_op(runtime):
    model = patch_llama(tiny_llama())
    layer_forward = model.model.layers[0].forward
    with pytest.warns(UserWarning, match="already patched"):
        assert patch_llama(model) is model
    assert model.model.layers[0].forward is layer_forward


def test_accelerate_hooks_are_respected(runtime, pair):
    from accelerate.hooks import ModelHook, add_hook_to_module

    reference, model = pair(tiny_llama())
    for layer in model.model.layers:
        add_hook_to_module(layer, ModelHook())
    patch_llama(model)
    report = compare_layers(reference, model, prompt(12))
    assert report.worst().min_cosine >= 0.999
    assert runtime.xrt.counters["runs:o_ffn"] == 2


def _unmodified(model, snapshot):
    same = all(p.device.type == "meta" or torch.equal(p, snapshot[n]) for n, p in model.named_parameters())
    return all("forward" not in m.__dict__ for m in model.modules()) and same and not torch_npu2.is_patched(model)


@pytest.mark.parametrize("make,match", [
    (lambda: MistralForCausalLM(MistralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                              num_key_value_heads=2, num_hidden_layers=1, vocab_size=100)
                                ).to(torch.bfloat16),
     r"model_type 'mistral' \(MistralForCausalLM\) is not supported; supported model types: 'llama'"),
    (lambda: tiny_llama().model, "expected a LlamaForCausalLM for model_type 'llama', got LlamaModel"),
    (lambda: tiny_llama(attention_bias=True), "attention or MLP bias"),
    (lambda: tiny_llama(mlp_bias=True), "attention or MLP bias"),
    (lambda: tiny_llama(hidden_act="relu"), r"config.hidden_act='relu' \(ReLU\) is not supported"),
    (lambda: tiny_llama(hidden_act="gelu"), r"config.hidden_act='gelu' .* SiLU\(gate\)"),
    (lambda: tiny_llama().float(), "dtype torch.float32, expected torch.bfloat16"),
    (lambda: tiny_llama().to("meta"), r"model.embed_tokens.weight was never loaded \(it is on the meta device\)"),
])
def test_bad_models_are_rejected_before_any_change(runtime, make, match):
    model = make()
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        patch_llama(model)
    assert _unmodified(model, snapshot)


def test_unknown_rope_type_and_quantized_models_are_rejected(runtime):
    model = tiny_llama()
    model.config.rope_parameters = {"rope_type": "mystery", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="unknown rope type 'mystery'"):
        patch_llama(model)
    model = tiny_llama()
    model.config.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match="quantized models are not supported"):
        patch_llama(model)
    assert not torch_npu2.is_patched(model)


def test_bad_buckets_and_backend(runtime):
    with pytest.raises(ValueError, match="prefill_buckets must be positive ints"):
        patch_llama(tiny_llama(), prefill_buckets=(0, 16))
    with pytest.raises(ValueError, match="backend='npu2' was requested but this process already runs on the emulator"):
        patch_llama(tiny_llama(), backend="npu2")


@pytest.mark.parametrize("buckets,error", [
    (None, TypeError), (16, TypeError), ((), ValueError), ((16, True), ValueError), ("16", ValueError),
    ((16, 2.5), ValueError), ((16, -32), ValueError),
])
def test_bad_prefill_buckets_are_named_before_any_change(runtime, buckets, error):
    model = tiny_llama()
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(error, match=r"prefill_buckets must be positive ints in a non-empty iterable such as "
                                    r"\(16, 32, 64\), got .*the model was not modified"):
        patch_llama(model, prefill_buckets=buckets)
    assert _unmodified(model, snapshot)


@pytest.mark.parametrize("precision", ["fp8", "BFP16", None])
def test_unknown_matmul_precision_is_rejected_before_any_change(runtime, precision):
    model = tiny_llama()
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"matmul_precision must be 'auto' or one of 'bf16', 'bfp16', 'bfp16_gate_up', "
                                         r"'w8x2a16', got .*the model was not modified"):
        patch_llama(model, matmul_precision=precision)
    assert _unmodified(model, snapshot)


def test_matmul_precision_reaches_the_prefill_gemms_only(runtime, pair, monkeypatch):
    """What the emulated NPU runs: every prefill GEMM launch in the chosen precision (both precisions under
    "bfp16_gate_up"), decode GEMVs without one; bfp16 GEMMs change the prompt's logits."""
    from torch_npu2.emulator import launches

    seen = []
    for kind in ("gemm", "rms_gemv"):
        def spy(p, *tensors, kind=kind, run=launches.LAUNCH_KINDS[kind]):
            seen.append((kind, p.get("precision")))
            return run(p, *tensors)
        monkeypatch.setitem(launches.LAUNCH_KINDS, kind, spy)
    ids, logits = prompt(12), {}
    # at 16 rows the gate and up projections are gemm launches of their own (no gemm_swiglu)
    gemm_precisions = {"bf16": {"bf16"}, "bfp16": {"bfp16"}, "bfp16_gate_up": {"bf16", "bfp16"}}
    for precision, expected in gemm_precisions.items():
        _, model = pair(tiny_llama())
        patch_llama(model, matmul_precision=precision)
        seen.clear()
        with torch.no_grad():
            logits[precision] = model(ids).logits
        model.generate(ids, max_new_tokens=2, do_sample=False)
        assert {p for kind, p in seen if kind == "gemm"} == expected
        assert {p for kind, p in seen if kind == "rms_gemv"} == {None}
    assert not torch.equal(logits["bf16"], logits["bfp16"])
    assert not torch.equal(logits["bfp16_gate_up"], logits["bf16"])
    assert not torch.equal(logits["bfp16_gate_up"], logits["bfp16"])


def test_integer_gemms_run_prefill_on_prepared_weights_and_keep_hf_tokens(runtime, pair, monkeypatch):
    """matmul_precision="w8x2a16": prefill quantizes each GEMM input and multiplies prepared integer weights
    (rms_gemms_rope_w8x2 and o_ffn_w8x2: no bf16-weight GEMM runs), decode keeps its bf16 GEMVs, and greedy
    decoding passes HF's top-5 gate, with prompts in two buckets and one over the largest (host attention)."""
    from torch_npu2.emulator import launches

    kinds = []
    for kind in ("gemm", "gemm_int", "gemm_int_swiglu", "quantize_rows", "rms_gemv"):
        def spy(p, *tensors, kind=kind, run=launches.LAUNCH_KINDS[kind]):
            kinds.append(kind)
            return run(p, *tensors)
        monkeypatch.setitem(launches.LAUNCH_KINDS, kind, spy)
    reference, model = pair(tiny_llama(**NPU2_BUILDABLE))
    patch_llama(model, matmul_precision="w8x2a16", prefill_buckets=(16, 32))
    layer = model.model.layers[0].forward
    assert layer.prepared is not None and layer.prepared.gate_up.dtype == torch.int32
    for length in (12, 30, 45):
        ids = prompt(length)
        kinds.clear()
        with torch.no_grad():
            model(ids)
        assert "gemm" not in kinds and {"gemm_int", "gemm_int_swiglu", "quantize_rows"} <= set(kinds)
        check_topk_gate(*greedy_with_topk(reference, ids, 6), *greedy_with_topk(model, ids, 6), label=f"{length}")
    assert "rms_gemv" in kinds  # decode
    unpatch_llama(model)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_integer_gemms_refuse_dims_they_cannot_run_before_any_change(runtime):
    model = tiny_llama()  # hidden 96: rows quantize_rows cannot take (pairs of 32-value runs)
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"needs projections whose in features are multiples of 64 .* q_proj is "
                                         r"96 × 96.*the model was not modified"):
        patch_llama(model, matmul_precision="w8x2a16")
    assert _unmodified(model, snapshot)
    patch_llama(model)  # "auto" takes bf16 GEMMs for it
    assert model.model.layers[0].forward.prepared is None


def test_model_stays_usable_after_a_rejected_patch(runtime):
    model = tiny_llama().float()
    with pytest.raises(ValueError):
        patch_llama(model)
    with torch.no_grad():
        assert torch.isfinite(model(prompt(5)).logits).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "patch_llama. LlamaForCausalLM runs here on the emulated NPU2")
        patch_llama(model.to(torch.bfloat16))
    assert torch_npu2.is_patched(model)


def test_a_model_the_npu_can_build_patches_without_warnings(runtime):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_llama(tiny_llama(**NPU2_BUILDABLE), prefill_buckets=(16, 32))


def test_emulator_warns_once_per_model_about_programs_the_npu_cannot_build(runtime):
    model = tiny_llama()  # head_dim 16, intermediate 200
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patch_llama(model, prefill_buckets=(16, 32))
    (warning,) = [w for w in caught if NPU2_WARNING in str(w.message)]
    lines = str(warning.message).splitlines()
    assert lines[0].endswith("but 7 of its Programs cannot be compiled for NPU2:")
    assert lines[1] == ("  rms_gemms_rope (hidden=96, heads=6, kv_heads=2, head_dim=16, eps=1e-06, rows=16): "
                        "rope launch: head_dim=16: must be a multiple of 32 so each rotated half is whole 16-lane "
                        "vectors")
    assert lines[4] == ("  o_ffn (hidden=96, q_dim=96, intermediate=200, eps=1e-06, rows=32): gemm_swiglu launch: N=200: must be "
                        "a multiple of 16")
    with torch.no_grad():  # and it runs all the same
        assert torch.isfinite(model(prompt(5)).logits).all()


def test_npu_backend_refuses_programs_it_cannot_build_before_any_weight_moves(tmp_path):
    npu = create_runtime(driver=EmulatedXrt(), backend="npu2", cache_root=tmp_path)
    assert npu.backend == "npu2"
    model = tiny_llama()
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    with use_runtime(npu), pytest.raises(ValueError, match=r"(?s)7 of the model's Programs cannot be compiled for "
                                                            r"NPU2:\n  rms_gemms_rope .*the model was not modified"):
        patch_llama(model, backend="npu2", prefill_buckets=(16, 32))
    assert _unmodified(model, snapshot) and npu.stats["bo_allocs"] == 0


def test_dynamic_cache_explicit(runtime, pair):
    reference, model = pair(tiny_llama())
    patch_llama(model)
    ids = prompt(13)
    check_topk_gate(*greedy_with_topk(reference, ids, 8, past_key_values=DynamicCache(config=reference.config)),
                    *greedy_with_topk(model, ids, 8, past_key_values=DynamicCache(config=model.config)),
                    label="dynamic")


def test_compare_layers_table_and_plot(runtime, pair, tmp_path):
    reference, model = pair(tiny_llama())
    patch_llama(model)
    report = compare_layers(reference, model, prompt(10))
    text = str(report)
    assert text.splitlines()[0].split() == ["layer", "min", "cos", "mean", "cos", "max", "|diff|"]
    assert [r.name for r in report] == ["layer 0", "layer 1", "logits"]
    report.plot(tmp_path / "layers.png")
    assert (tmp_path / "layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq\)"):
        compare_layers(reference, model, prompt(10)[0])


def test_multi_turn_with_left_padding_stays_finite(runtime, pair):
    reference, model = pair(tiny_llama())
    patch_llama(model)
    ids = torch.stack([prompt(10, seed=6)[0], torch.cat([torch.zeros(4, dtype=torch.long), prompt(6, seed=7)[0]])])
    mask = (ids != 0).long()
    mask[0] = 1
    results = []
    for m in (reference, model):
        out = m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
        follow = torch.cat([out.sequences, prompt(5, seed=8).expand(2, -1)], 1)
        follow_mask = torch.cat([mask, torch.ones(2, 9, dtype=torch.long)], 1)
        results.append(greedy_with_topk(m, follow, 6, attention_mask=follow_mask, pad_token_id=0,
                                        past_key_values=out.past_key_values))
    assert torch.isfinite(results[1][1]).all()
    check_topk_gate(*results[0], *results[1], label="multi-turn batch")
