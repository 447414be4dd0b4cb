"""NpuKVCache (patch_llama/kv_cache.py): the default cache of a patched model's generate(), its layout in NPU
buffers, HF's Cache API on it, and tokens identical to the host path over HF's DynamicCache."""
import pytest
import torch
from transformers import DynamicCache, StaticCache

from torch_npu2 import ops, patch_llama, unpatch_llama
from torch_npu2.kernels.catalog import DECODE_ATTN_ROWS_MULTIPLE, decode_attn_capacity
from torch_npu2.patch_llama import layer as layer_module
from torch_npu2.patch_llama.kv_cache import GROW_TOKENS, KVCacheFullError, NpuKVCache

from .tiny import tiny_llama

pytestmark = pytest.mark.filterwarnings(
    "ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")

PROMPT = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10]])  # repeats: prompt lookup finds candidates


def _patched(**overrides):
    model = tiny_llama(**overrides)
    patch_llama(model)
    return model


def _cache_of(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, return_dict_in_generate=True, **kwargs).past_key_values


@pytest.mark.compat
def test_generate_uses_an_npu_kv_cache_whose_slabs_are_npu_buffers(runtime):
    model = _patched()
    cache = _cache_of(model, PROMPT, max_new_tokens=5)
    assert type(cache) is NpuKVCache
    config = model.config
    kv_dim = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    length = PROMPT.shape[1] + 4  # the last token is generated, never fed back
    assert cache.get_seq_length() == length
    for layer in cache.layers:
        assert layer.k.shape == layer.v.shape == (1, layer.capacity, kv_dim) and layer.capacity >= length
        assert layer.k.dtype == torch.bfloat16 and layer.k.is_contiguous()
        assert runtime.is_bo_backed(layer.k) and runtime.is_bo_backed(layer.v)
        keys = layer.keys  # HF's (batch, kv_heads, length, head_dim): a view of the slab, not a copy
        assert keys.shape == (1, config.num_key_value_heads, length, kv_dim // config.num_key_value_heads)
        assert keys.data_ptr() == layer.k.data_ptr()
        assert torch.equal(keys.transpose(1, 2).reshape(1, length, kv_dim), layer.k[:, :length])


def _same_as_host_path(model, ids, **kwargs):
    """generate() with the default NpuKVCache and with an explicit HF DynamicCache (today's host path)."""
    npu = model.generate(ids, do_sample=False, return_dict_in_generate=True, **kwargs)
    host = model.generate(ids, do_sample=False, return_dict_in_generate=True,
                          past_key_values=DynamicCache(config=model.config), **kwargs)
    assert type(npu.past_key_values) is NpuKVCache and type(host.past_key_values) is DynamicCache
    assert torch.equal(npu.sequences, host.sequences), (npu.sequences, host.sequences)
    return npu


MODES = {
    "greedy": dict(max_new_tokens=12),
    "beam_search": dict(max_new_tokens=8, num_beams=3, num_return_sequences=2),
    "prompt_lookup": dict(max_new_tokens=8, prompt_lookup_num_tokens=3),
    "repetition_penalty": dict(max_new_tokens=8, repetition_penalty=1.3),
}


@pytest.mark.compat
@pytest.mark.parametrize("mode", list(MODES))
def test_tokens_match_the_host_path(runtime, mode):
    model = _patched()
    _same_as_host_path(model, PROMPT, **MODES[mode])


def test_assisted_generation_crops_the_cache_and_matches_the_host_path(runtime, monkeypatch):
    model = _patched()
    crops = []
    original = NpuKVCache.crop
    monkeypatch.setattr(NpuKVCache, "crop", lambda self, n: (crops.append(n), original(self, n))[1])
    for _ in range(2):  # the same assistant (a fresh copy each time): its own cache starts empty
        _same_as_host_path(model, PROMPT, max_new_tokens=8, assistant_model=tiny_llama(seed=3, num_hidden_layers=1))
    assert crops, "assisted generation never cropped the NpuKVCache (rejected candidates must be dropped)"


def test_left_padded_batch_matches_the_host_path_and_single_rows(runtime):
    model = _patched()
    long, short = torch.randint(1, 300, (14,), generator=torch.Generator().manual_seed(2)), \
        torch.randint(1, 300, (6,), generator=torch.Generator().manual_seed(3))
    ids = torch.stack([long, torch.cat([torch.zeros(8, dtype=long.dtype), short])])
    mask = (torch.arange(14) >= torch.tensor([[0], [8]])).long()
    out = _same_as_host_path(model, ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    one = model.generate(short[None], max_new_tokens=10, do_sample=False)
    assert out.sequences[1, 14:].tolist() == one[0, 6:].tolist()


@pytest.mark.compat
def test_a_cache_passed_back_prefills_only_the_new_tokens_and_matches_a_fresh_run(runtime):
    model = _patched(num_hidden_layers=3)
    first = model.generate(PROMPT, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    cache = first.past_key_values
    cached = cache.get_seq_length()
    follow = torch.cat([first.sequences, torch.tensor([[11, 12, 13, 14, 15]])], dim=1)
    rows = []
    original = layer_module.rms_gemms_rope
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layer_module, "rms_gemms_rope", lambda x, *a: (rows.append(int(x.shape[0])), original(x, *a))[1])
        # the second turn: the first turn's answer's last token and the new turn's tokens are not cached yet
        again = model.generate(follow, max_new_tokens=6, do_sample=False, past_key_values=cache)
    new_tokens = follow.shape[1] - cached
    assert rows and len(rows) == model.config.num_hidden_layers  # one prefill chunk per layer ...
    assert all(r == model._torch_npu2_patch.shared.settings.bucket(new_tokens) for r in rows)  # ... of the new tokens only (padded to their bucket), not the whole history
    fresh = model.generate(follow, max_new_tokens=6, do_sample=False)
    assert torch.equal(again, fresh)


@pytest.mark.compat
def test_explicit_hf_caches_still_take_the_host_path(runtime):
    model = _patched()
    static = StaticCache(config=model.config, max_cache_len=40)
    out = model.generate(PROMPT, max_new_tokens=4, do_sample=False, past_key_values=static)
    dynamic = _cache_of(model, PROMPT, max_new_tokens=4, cache_implementation="dynamic")
    assert type(dynamic) is DynamicCache
    assert torch.equal(out, model.generate(PROMPT, max_new_tokens=4, do_sample=False))


@pytest.mark.compat
def test_unpatch_restores_hf_s_default_cache(runtime):
    model = _patched()
    unpatch_llama(model)
    assert "_prepare_cache_for_generation" not in model.__dict__
    assert type(_cache_of(model, PROMPT, max_new_tokens=2)) is DynamicCache


def test_hf_cache_api_on_the_slabs(runtime):
    """update/get_seq_length/get_mask_sizes/crop/reorder_cache/batch_select_indices/batch_repeat_interleave/reset
    give what HF's DynamicCache gives for the same calls."""
    config = tiny_llama().config
    npu, hf = NpuKVCache(config, max_length=4), DynamicCache(config=config)
    shape = lambda n: (3, config.num_key_value_heads, n, config.hidden_size // config.num_attention_heads)  # noqa: E731
    torch.manual_seed(0)

    def both(call):
        for cache in (npu, hf):
            call(cache)
        for layer in range(config.num_hidden_layers):
            assert npu.get_seq_length(layer) == hf.get_seq_length(layer)
            assert torch.equal(npu.layers[layer].keys, hf.layers[layer].keys)
            assert torch.equal(npu.layers[layer].values, hf.layers[layer].values)

    for n in (5, 1, 1):  # the second and third writes grow the first allocation (4 rows)
        k, v = torch.randn(shape(n)).bfloat16(), torch.randn(shape(n)).bfloat16()
        both(lambda c: [c.update(k, v, layer) for layer in range(config.num_hidden_layers)])
    assert npu.get_mask_sizes(*_mask_size_args(2)) == hf.get_mask_sizes(*_mask_size_args(2))
    both(lambda c: c.crop(-2))
    both(lambda c: c.reorder_cache(torch.tensor([2, 0, 0])))
    both(lambda c: c.batch_select_indices(torch.tensor([1, 2])))
    both(lambda c: c.batch_repeat_interleave(2))
    buffer = npu.layers[0].k
    npu.reset()
    assert npu.get_seq_length() == 0 and npu.layers[0].k is buffer  # reset keeps the buffers


def _mask_size_args(query_length: int):
    """get_mask_sizes' arguments in the installed transformers: (query_length or cache_position, layer_idx)."""
    import inspect

    from transformers.cache_utils import DynamicLayer

    first = list(inspect.signature(DynamicLayer.get_mask_sizes).parameters)[1]
    return (torch.arange(query_length) if first == "cache_position" else query_length), 0


def test_growth_is_in_chunks_and_the_limit_is_a_clear_error(runtime):
    config = tiny_llama(max_position_embeddings=3 * GROW_TOKENS).config
    cache = NpuKVCache(config, max_length=8)
    layer = cache.layers[0]
    row = torch.ones(1, 1, layer.kv_dim, dtype=torch.bfloat16)
    layer.append_rows(row, row)
    assert layer.capacity == DECODE_ATTN_ROWS_MULTIPLE  # 8 rounded up to the rows npu2.decode_attn reads
    more = DECODE_ATTN_ROWS_MULTIPLE
    layer.append_rows(torch.zeros(1, more, layer.kv_dim, dtype=torch.bfloat16), row.expand(1, more, -1))
    assert layer.capacity == GROW_TOKENS and layer.length == more + 1  # grew once, to a whole chunk
    assert torch.equal(layer.k[0, 0], row[0, 0]) and runtime.is_bo_backed(layer.k)  # the cached row moved along
    layer.reserve(1, 2 * GROW_TOKENS + 1)
    assert layer.capacity == 3 * GROW_TOKENS  # the limit caps the growth
    with pytest.raises(KVCacheFullError, match=r"do not fit its limit of 3072 \(the model's context"):
        layer.append_rows(torch.zeros(1, 3 * GROW_TOKENS, layer.kv_dim, dtype=torch.bfloat16),
                          torch.zeros(1, 3 * GROW_TOKENS, layer.kv_dim, dtype=torch.bfloat16))
    assert layer.length == more + 1  # nothing changed
    with pytest.raises(ValueError, match="holds 1 sequences, got a write for 2"):
        layer.append_rows(row.expand(2, 1, -1), row.expand(2, 1, -1))


def test_decode_that_grows_the_slabs_attends_over_the_new_ones(runtime):
    """The decode layers keep views of the slabs from step to step (NpuKVLayer.view_memo). A step that grows the
    slabs must leave none of the old ones in use: the tokens match the host path's, and every view kept is of the
    new slabs."""
    model = _patched()
    ids = torch.randint(1, 300, (1, DECODE_ATTN_ROWS_MULTIPLE - 3), generator=torch.Generator().manual_seed(4))
    cache = NpuKVCache(model.config, max_length=ids.shape[1])
    npu = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache)
    host = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=DynamicCache(config=model.config))
    assert torch.equal(npu, host)
    for layer in cache.layers:
        assert layer.capacity > DECODE_ATTN_ROWS_MULTIPLE  # the prompt filled one granule; decoding grew it
        assert layer.view_memo, "the decode steps kept no views of the slabs"
        for k_view, v_view in layer.view_memo.values():
            assert k_view.untyped_storage().data_ptr() == layer.k.untyped_storage().data_ptr()
            assert v_view.untyped_storage().data_ptr() == layer.v.untyped_storage().data_ptr()


def test_keys_and_values_cannot_be_replaced(runtime):
    layer = NpuKVCache(tiny_llama().config).layers[0]
    with pytest.raises(TypeError, match="views of the cache's NPU buffers"):
        layer.keys = torch.zeros(1)


def test_a_mask_other_than_left_padding_attends_on_the_host_with_the_mask(runtime):
    """A decode mask that hides a key in the middle is not causal + left padding: the slab path must not drop it."""
    assert layer_module._decode_starts(torch.zeros(1, 1, 1, 6), 1, 6) == (0,)
    assert layer_module._decode_starts(torch.tensor([[[[False, True, True]]], [[[True, True, True]]]]), 2, 3) == (1, 0)
    holes = torch.zeros(1, 1, 1, 6)
    holes[..., 2] = torch.finfo(torch.float32).min
    assert layer_module._decode_starts(holes, 1, 6) is None
    biased = torch.zeros(1, 1, 1, 6)
    biased[..., 0] = -1.0  # a bias, not a mask: no key may be dropped
    assert layer_module._decode_starts(biased, 1, 6) is None
    model = _patched()
    prefix = model.generate(PROMPT, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    length = prefix.past_key_values.get_seq_length()
    token = prefix.sequences[:, -1:]
    mask = torch.zeros(1, 1, 1, length + 1)
    mask[..., 3] = torch.finfo(torch.float32).min
    logits, seam_calls = {}, []
    seams = {name: getattr(layer_module, name)
             for name in ("_decode_attention", "_on_device_attention", "_slab_attention")}
    for name, cache in (("npu", prefix.past_key_values), ("host", DynamicCache(config=model.config))):
        if name == "host":
            model(PROMPT, past_key_values=cache, use_cache=True)
            assert cache.get_seq_length() == length
        with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
            for seam, original in seams.items():
                patch.setattr(layer_module, seam, lambda *a, f=original: (seam_calls.append(1), f(*a))[1])
            logits[name] = model(token, past_key_values=cache, attention_mask=mask,
                                 position_ids=torch.tensor([[length]]), use_cache=True).logits
    assert not seam_calls  # the masked key made both layers attend on the host with the mask
    assert prefix.past_key_values.get_seq_length() == length + 1  # and the new rows went into the slabs
    assert torch.equal(logits["npu"], logits["host"])


@pytest.mark.parametrize("heads, kv_heads, head_dim, start, length, spare", [
    (6, 2, 16, 3, 9, 0), (6, 2, 16, 0, 1, 0), (32, 8, 64, 0, 700, 0), (9, 3, 64, 5, 300, 0),
    (6, 2, 16, 3, 9, 128), (9, 3, 64, 5, 300, 128),
    (4, 2, 64, 200, 250, 128)])
def test_decode_attention_seam_matches_host_attention_over_the_rows(heads, kv_heads, head_dim, start, length, spare):
    """The seam's contract: rows start..length-1 of the slabs, GQA. On the NPU it is npu2.decode_attn over the rows
    from ``start`` (a whole bucket of them, which may run past the slab into ``spare`` rows of its storage, as an
    NpuKVCache keeps), within two bf16 ulps of the output's scale of _host_attention (where the probabilities round
    differs); a left-padded slab without room for its bucket attends on the host, the same bits as
    _host_attention."""
    torch.manual_seed(length)
    capacity = -(-(length + 4) // DECODE_ATTN_ROWS_MULTIPLE) * DECODE_ATTN_ROWS_MULTIPLE  # as NpuKVCache allocates
    q = torch.randn(heads * head_dim).bfloat16()
    k, v = (torch.randn(capacity + spare, kv_heads * head_dim).bfloat16()[:capacity] for _ in range(2))
    scale = head_dim ** -0.5
    out = layer_module._decode_attention(q, k, v, start, length, head_dim, scale)
    rows = length - start
    keys, values = (t[start:length].view(1, rows, kv_heads, head_dim).transpose(1, 2) for t in (k, v))
    want = layer_module._host_attention(q.view(1, heads, 1, head_dim), keys, values, None, scale).reshape(-1)
    assert out.shape == (heads * head_dim,) and out.dtype == torch.bfloat16
    if start == 0 or spare:
        room = capacity - start + spare
        bucket = decode_attn_capacity(rows, room - room % DECODE_ATTN_ROWS_MULTIPLE)
        assert bucket >= rows and (start == 0 or start + bucket > capacity)  # from row start: into the spare rows
        from_start = (t.view(-1)[start * t.shape[1]:].view(-1, t.shape[1])[:bucket] for t in (k._base, v._base))
        assert torch.equal(out, ops.decode_attn(q, *from_start, ops.decode_attn_length(rows), head_dim))
        assert (out.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    else:
        assert torch.equal(out, want)
    k[length:], k[:start] = float("nan"), float("nan")  # rows outside start..length-1 are never read
    if spare:
        k._base[capacity:] = float("nan")
    assert torch.equal(layer_module._decode_attention(q, k, v, start, length, head_dim, scale), out)
