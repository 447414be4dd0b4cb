"""patch_llama(weights=...) on a tiny random Llama: decode reads packed weights, and the patched model passes the
top-5 gate against HF on the same weights dequantized (HF holds them rounded to bf16, the packed GEMVs multiply
by them exactly); unpatch gives the bf16 weights back bit for bit."""
import pytest
import torch

from torch_npu2 import patch_llama, unpatch_llama
from torch_npu2.kernels import quant

from .gate import check_topk_gate, greedy_with_topk
from .test_smollm2 import packed_lm_head_runs
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
    before = packed_lm_head_runs(runtime)
    out = greedy_with_topk(model, ids, 10)
    assert packed_lm_head_runs(runtime) - before == 10  # every new token's logits came from packed rows
    check_topk_gate(*expected, *out, label=fmt)
    # the first token's logits (prefill, then the packed LM head) agree to fp32 summation and bf16 weight rounding
    assert torch.nn.functional.cosine_similarity(out[1][0, 0].float(), expected[1][0, 0].float(), dim=0) > 0.999


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_down_projection_past_one_dma_dimension_runs_in_groups(runtime, fmt):
    """An intermediate size of 3520 (110 blocks, not whole 1024-element groups): each packed down-projection row is
    two groups of 55 blocks (kernels/quant.py), which the K-split GEMV takes a group per chunk. Every Program builds
    for NPU2 (no warning) and the model passes the gate against HF on the dequantized weights."""
    import warnings

    dims = dict(DIMS, intermediate_size=3520)
    assert quant.weight_format(fmt).group_blocks(3520) == 55
    model = tiny_llama(**dims)
    reference = _dequantized_copy(tiny_llama(**dims), fmt)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    expected = greedy_with_topk(reference, ids, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_llama(model, prefill_buckets=(16,), weights=fmt)
    check_topk_gate(*expected, *greedy_with_topk(model, ids, 10), label=fmt)


def test_prefill_dequantizes_every_layer_into_the_same_npu_buffers(runtime):
    """Packed prefill's bf16 weights are made by the NPU (npu2.dequantize_rows) in one NPU buffer per projection that
    every layer reuses: the ops bind them (no host copy of a weight is staged) and they cost one layer's bf16
    weights, however many layers and prefill buckets run."""
    model = tiny_llama(**DIMS, num_hidden_layers=3)
    patch_llama(model, prefill_buckets=(16, 32), weights="q4_1")
    shared = model._torch_npu2_patch.shared
    layer = model.model.layers[0].forward
    one_layer = sum(getattr(layer.packed, n).shape[0] * k for n, k in (
        ("wqk", 128), ("wv", 128), ("wo", 128), ("gate_up", 256), ("down", 256))) * 2
    copied = runtime.stats["host_copy_bytes"]
    with torch.no_grad():
        model(torch.tensor([[1, 5, 7, 9, 11, 3]]))
        model(torch.arange(1, 21).unsqueeze(0))  # the second bucket
    buffers = {name: t.data_ptr() for name, t in shared.dequantized.items()}
    assert sorted(buffers) == ["down", "gate_up", "wo", "wqk", "wv"]
    assert sum(t.nbytes for t in shared.dequantized.values()) == one_layer
    assert runtime.stats["host_copy_bytes"] - copied < one_layer  # activations only: the weights were bound
    # made on the NPU, their device bytes are the last layer's, exactly; never synced back, the host views hold nothing
    last = model.model.layers[-1].forward.packed
    down = shared.dequantized["down"]
    on_device = runtime._resident[down.data_ptr()].bo.device_view(torch.bfloat16).view(down.shape)
    assert torch.equal(on_device, last.dequantized("down", 256)) and not down.any()


def test_unpatch_restores_the_bf16_weights_and_repr(runtime):
    model = tiny_llama(**DIMS)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    plain = repr(model)
    patch_llama(model, prefill_buckets=(16,), weights="q4_1")
    text = repr(model.model.layers[0].mlp.down_proj)
    assert "on the NPU: Q4_1 packed 128×256" in text and "bf16 weight set aside" in text
    unpatch_llama(model)
    assert repr(model) == plain
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.int16), before[name].view(torch.int16)), name


def test_a_format_the_ops_do_not_know_is_refused_before_anything_changes(runtime):
    model = tiny_llama(**DIMS)
    with pytest.raises(ValueError, match="weights must be one of"):
        patch_llama(model, weights="q5_k")
    assert not hasattr(model.model.layers[0], "_torch_npu2_patch") and "forward" not in model.model.layers[0].__dict__


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _spill_mapping_rss() -> int:
    """Resident bytes of the (unlinked) spill file's mapping, from /proc/self/smaps; -1 when it is not mapped."""
    total, inside = -1, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                inside = len(fields) >= 6 and "torch_npu2-bf16-" in fields[5]
                total = max(total, 0) if inside else total
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def test_packing_sets_the_bf16_weights_aside_out_of_memory_and_unpatch_restores_them(tmp_path):
    """Patching packed frees the bf16 originals (RSS drops by most of their bytes; their mapped file holds them,
    not resident), the model's parameters still read their values, and unpatch restores them bit for bit. On a
    fast-coherency emulator: a strict one keeps a device-side copy of every buffer, which the NPU does not."""
    import gc

    from torch_npu2.emulator import EmulatedXrt
    from torch_npu2.host_memory import release_free_heap
    from torch_npu2.runtime import create_runtime, use_runtime

    shape = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2,
                 num_hidden_layers=3, vocab_size=4096)
    with use_runtime(create_runtime(driver=EmulatedXrt(coherency="fast"), cache_root=tmp_path)):
        warm_up = patch_llama(tiny_llama(**shape), prefill_buckets=(16,), weights="q4_1")  # one-time costs
        del warm_up  # (Programs, imports, the transformers probe) out of the measurement
        model = tiny_llama(**shape)
        before = {name: p.detach().view(torch.int16).clone() for name, p in model.named_parameters()}
        projections = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, torch.nn.Linear))
        gc.collect()
        release_free_heap()
        rss = _rss_bytes()
        patch_llama(model, prefill_buckets=(16,), weights="q4_1")
        gc.collect()
        dropped = rss - _rss_bytes()
        # the bf16 bytes leave (95 MiB), their Q4_1 copies (5/16 of them) arrive: about 65 MiB less
        assert dropped > 0.5 * projections, (dropped, projections)
        assert 0 <= _spill_mapping_rss() < 0.05 * projections  # mapped, and not read in
        weight = model.model.layers[1].mlp.down_proj.weight
        assert torch.equal(weight.view(torch.int16), before["model.layers.1.mlp.down_proj.weight"])  # readable
        unpatch_llama(model)
    assert _spill_mapping_rss() == -1  # nothing refers to the file any more
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.int16), before[name]), name


def test_a_failed_packing_leaves_the_bf16_weights_in_place(runtime, monkeypatch):
    from torch_npu2.patch_llama import patch as patch_module

    model = tiny_llama(**DIMS)
    before = {name: p.detach().view(torch.int16).clone() for name, p in model.named_parameters()}

    def fail(*args):
        raise RuntimeError("pin failed")
    monkeypatch.setattr(patch_module, "_pack_linear", fail)
    with pytest.raises(RuntimeError, match="pin failed"):
        patch_llama(model, prefill_buckets=(16,), weights="q4_1")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.int16), before[name]), name


@pytest.mark.parametrize("layers", [2, 3, 10])
def test_a_packed_decode_token_runs_its_layers_in_groups(runtime, layers):
    """With packed weights and the NpuKVCache a decode token runs as the bf16 one does (ARCHITECTURE.md, "One decode
    token"): every layer, up to eight in one dispatch (decode_layers<n>_packed), the first run starting with the first
    layer's Q/K/V (decode_layers<n>_qkv_packed), the last run ending with the model's last layer, the final norm and
    the LM head (decode_layers<n>_final_lm_packed); and the logits those of the unchained ops."""
    model = tiny_llama(**DIMS, num_hidden_layers=layers)
    patch_llama(model, prefill_buckets=(16,), weights="q4_1")
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])

    def runs(new_tokens):
        before = runtime.xrt.counters.copy()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        return runtime.xrt.counters - before, out

    runs(2)  # loads every Program
    (two, _), (three, chained) = runs(2), runs(3)
    token = {k[len("runs:"):]: three[k] - two[k] for k in three if k.startswith("runs:") and three[k] > two[k]}
    grouped = {2: {"decode_layers2_qkv_final_lm_packed": 1}, 3: {"decode_layers3_qkv_final_lm_packed": 1},
               10: {"decode_layers8_qkv_packed": 1, "decode_layers2_final_lm_packed": 1}}[layers]
    assert token == grouped
    for layer in model.model.layers:  # unchained: every layer rms_gemv_rope → decode_attn_o_gemv_ffn
        layer.forward.next_layer = None
    _, unchained = runs(3)
    assert torch.equal(torch.stack(chained.logits), torch.stack(unchained.logits))


def test_packed_weights_with_integer_prefill_gemms(runtime, monkeypatch):
    """weights="q4_1" with matmul_precision="w8x2a16": decode reads the packed rows, prefill runs the integer GEMMs
    over copies prepared from the packed rows' exact weights (no bf16 weight is kept, none is made per prefill: no
    dequantize_rows runs), and greedy decoding passes the top-5 gate against HF on the dequantized weights; "auto"
    keeps bf16 prefill GEMMs for packed weights."""
    from torch_npu2.emulator import launches

    kinds = []
    for kind in ("gemm", "gemm_int_swiglu", "rms_gemv", "dequant_rows"):
        def spy(p, *tensors, kind=kind, run=launches.LAUNCH_KINDS[kind]):
            kinds.append((kind, "weights" in p))
            return run(p, *tensors)
        monkeypatch.setitem(launches.LAUNCH_KINDS, kind, spy)
    reference = _dequantized_copy(tiny_llama(**DIMS), "q4_1")
    model = patch_llama(tiny_llama(**DIMS), prefill_buckets=(16,), weights="q4_1", matmul_precision="w8x2a16")
    assert model.model.layers[0].forward.prepared is not None
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    check_topk_gate(*greedy_with_topk(reference, ids, 8), *greedy_with_topk(model, ids, 8), label="q4_1 + w8x2a16")
    assert ("gemm_int_swiglu", False) in kinds and ("rms_gemv", True) in kinds
    assert all(k not in ("gemm", "dequant_rows") for k, _ in kinds)
    default = patch_llama(tiny_llama(**DIMS), prefill_buckets=(16,), weights="q4_1")
    assert default.model.layers[0].forward.prepared is None
    kinds.clear()
    default(ids)  # its prefill's bf16 GEMMs take weights dequantize_rows makes
    assert {"dequant_rows", "gemm"} <= {k for k, _ in kinds}
