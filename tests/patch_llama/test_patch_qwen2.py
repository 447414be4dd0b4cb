"""patch_llama on tiny random Qwen2 models (q/k/v biases, tied embeddings): the Llama gates against HF's own Qwen2, in
every weight format and prefill precision, with the biased ops doing the work; what a Qwen2 it cannot run is told."""
import pytest
import torch

from torch_npu2 import compare_layers, patch_llama, unpatch_llama
from torch_npu2.emulator import launches

from .gate import check_topk_gate, greedy_with_topk
from .test_patch_packed import _dequantized_copy
from .tiny import tiny_qwen2

# The NPU2 builders' smallest dims (the integer GEMMs' too) and head_dim 32; the odd tiny dims warn that NPU2 could not
# build them, which test_patch_tiny.py checks for Llama.
BUILDABLE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=512)
pytestmark = pytest.mark.filterwarnings("ignore:patch_llama. Qwen2ForCausalLM runs here on the emulated NPU2")


def prompt(length, vocab=300, seed=1):
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def _count_bias_adds(monkeypatch) -> list:
    calls = []

    def spy(p, *tensors, run=launches.LAUNCH_KINDS["bias_add"]):
        calls.append(p["rows"])
        return run(p, *tensors)
    monkeypatch.setitem(launches.LAUNCH_KINDS, "bias_add", spy)
    return calls


# bfp16's block floats are lossy: a tiny Llama of BUILDABLE's dims keeps a cosine of 0.996 under them
@pytest.mark.parametrize("dims,precision,min_cosine", [({}, "auto", 0.999), (BUILDABLE, "w8x2a16", 0.999),
                                                       (BUILDABLE, "bfp16", 0.995)],
                         ids=["odd-bf16", "buildable-w8x2a16", "buildable-bfp16"])
def test_layers_and_generation_match_hf_qwen2(runtime, pair, monkeypatch, dims, precision, min_cosine):
    """Per-layer cosine and the top-5 gate against HF's Qwen2; prefill and every decode token add the biases on the
    NPU (bias_add after each projection: prefill's three, a decode token's two, Q's and K's as one), the decode
    layers grouped into one dispatch as Llama's are."""
    reference, model = pair(tiny_qwen2(**dims))
    patch_llama(model, prefill_buckets=(16, 32), matmul_precision=precision)
    bias_adds = _count_bias_adds(monkeypatch)
    ids = prompt(21)
    report = compare_layers(reference, model, ids)
    assert report.worst().min_cosine >= min_cosine, str(report)
    before = runtime.xrt.counters.copy()
    check_topk_gate(*greedy_with_topk(reference, ids, 12), *greedy_with_topk(model, ids, 12), label=precision)
    runs = runtime.xrt.counters - before
    # each decode token one dispatch: both layers, their biases from their norms arenas, the final norm and LM head
    decode_runs = {name: n for name, n in runs.items() if name.startswith("runs:") and n and (
        "decode" in name or "gemv_rope" in name or "o_gemv" in name)}
    assert list(decode_runs) == ["runs:decode_layers2_qkv_final_packed_lm"], decode_runs
    assert decode_runs["runs:decode_layers2_qkv_final_packed_lm"] >= 11
    assert bias_adds.count(32) >= 3 * 2 and bias_adds.count(1) >= 2 * 2 * 11  # prefill rows, decode rows


def test_qwen2_decodes_a_layer_per_dispatch_when_asked(runtime, pair, monkeypatch):
    """decode_layers_per_dispatch=1: each layer from its attention on is one run of the biased layer ops."""
    reference, model = pair(tiny_qwen2())
    patch_llama(model, prefill_buckets=(32,), decode_layers_per_dispatch=1)
    bias_adds = _count_bias_adds(monkeypatch)
    ids = prompt(21)
    before = runtime.xrt.counters.copy()
    check_topk_gate(*greedy_with_topk(reference, ids, 6), *greedy_with_topk(model, ids, 6), label="one layer a run")
    runs = runtime.xrt.counters - before
    assert runs["runs:decode_attn_o_gemv_ffn_rms_gemv_rope"] >= 5 and runs["runs:decode_attn_o_gemv_ffn"] >= 5
    assert not any(name.startswith("runs:decode_layers") for name, n in runs.items() if n)
    assert bias_adds.count(1) >= 2 * 2 * 5


def test_the_biases_change_what_qwen2_generates(runtime):
    """The gate above is only worth something if the biases matter: the same model without them predicts otherwise."""
    ids = prompt(21)
    with_biases = patch_llama(tiny_qwen2(), prefill_buckets=(32,))
    without = tiny_qwen2()
    with torch.no_grad():
        for layer in without.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.zero_()
    patch_llama(without, prefill_buckets=(32,))
    with torch.no_grad():
        a, b = with_biases(ids).logits, without(ids).logits
    assert (a.argmax(-1) != b.argmax(-1)).float().mean() > 0.2


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_packed_qwen2_generates_what_hf_generates_on_the_dequantized_weights(runtime, fmt):
    """Packed projections, bf16 biases (in the layers' norms arenas): each decode token one packed group run, gated
    against HF's Qwen2 holding the dequantized weights."""
    reference = _dequantized_copy(tiny_qwen2(**BUILDABLE), fmt)
    model = patch_llama(tiny_qwen2(**BUILDABLE), prefill_buckets=(16,), weights=fmt)
    ids = prompt(9)
    before = runtime.xrt.counters.copy()
    check_topk_gate(*greedy_with_topk(reference, ids, 8), *greedy_with_topk(model, ids, 8), label=fmt)
    assert (runtime.xrt.counters - before)["runs:decode_layers2_qkv_final_lm_packed"] >= 7


def test_unpatch_restores_qwen2_bit_for_bit(runtime, pair):
    reference, model = pair(tiny_qwen2())
    patch_llama(model, prefill_buckets=(32,))
    unpatch_llama(model)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    ids = prompt(12)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("overrides,match", [
    (dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), "sliding-window attention"),
])
def test_a_qwen2_the_ops_cannot_run_is_refused_before_any_change(runtime, overrides, match):
    model = tiny_qwen2(**overrides)
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        patch_llama(model)
    assert all(torch.equal(p, snapshot[n]) for n, p in model.named_parameters())


def test_a_qwen2_missing_a_bias_is_refused(runtime):
    model = tiny_qwen2()
    model.model.layers[1].self_attn.k_proj.bias = None
    with pytest.raises(ValueError, match=r"layer 1 k_proj lacks a bias, but .*qwen2"):
        patch_llama(model)


def test_a_qwen2_checkpoint_loads_packed_and_runs_as_its_bf16_model_patched_packed(runtime, tmp_path):
    """load_model(<Qwen2 checkpoint>, weights="q4_1") builds a Qwen2ForCausalLM (biases read from the files, the
    projections packed from them at patch time): the same tokens and logits as the bf16 model patched packed."""
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    from torch_npu2.patch_llama.models import load_checkpoint_packed

    tiny_qwen2(**BUILDABLE).save_pretrained(tmp_path / "ckpt")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16).eval()
    loaded = load_checkpoint_packed(tmp_path / "ckpt", "q4_1")
    assert isinstance(loaded, Qwen2ForCausalLM) and loaded.model.layers[0].self_attn.q_proj.weight.is_meta
    assert torch.equal(loaded.model.layers[1].self_attn.k_proj.bias, reference.model.layers[1].self_attn.k_proj.bias)
    patch_llama(reference, prefill_buckets=(16,), weights="q4_1")
    patch_llama(loaded, prefill_buckets=(16,))
    ids = prompt(9)
    expected, got = greedy_with_topk(reference, ids, 6), greedy_with_topk(loaded, ids, 6)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
