"""The quick host-overhead path on a tiny model: runs, and its JSON is well formed."""
import json

import pytest
import torch

from benchmarks import common, host_overhead
from tests.patch_llama.tiny import tiny_llama

# The benchmarks' tiny models (head_dim 16) run on the emulated NPU2 only; patch_llama says so, as it should.
pytestmark = pytest.mark.filterwarnings(
    "ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")


@pytest.fixture(scope="module")
def report():
    return host_overhead.host_report(tiny_llama(), contexts=(8, 20), decode_steps=4, repeats=1,
                                     log=lambda _: None)


def test_report_is_json_with_the_expected_fields(report):
    data = json.loads(json.dumps(report))
    assert data["layers"] == 2 and data["torch_threads"] == host_overhead.HOST_THREADS
    assert [c["context_tokens"] for c in data["contexts"]] == [8, 20]
    assert [c["cache"] for c in data["contexts"]] == ["npu"] * 2
    assert [c["cache"] for c in data["hf_cache_contexts"]] == ["hf"] * 2
    # 2 layers, decode only: the first chains into the second; with the NpuKVCache attention runs on the NPU, both
    # layers from the first one's Q/K/V on in one run (a group ending with the model's last layer, which runs the
    # final norm and the LM head too), and the NPU writes the K and V rows into the cache (the ops' .into overloads);
    # with HF's cache the LM head runs on its own (on its bf16 rows: host_report patches with lm_head="bf16")
    layer_ops = {"npu": ("decode_layers2_qkv_final_lm_into",),
                 "hf": ("rms_gemv_rope", "o_gemv_ffn_rms_gemv_rope", "o_gemv_ffn", "lm_head_gemv")}
    for context in data["contexts"] + data["hf_cache_contexts"]:
        on_npu = context["cache"] == "npu"
        assert context["token_ms"] > 0 and (context["host_attention_ms"] == 0) == on_npu
        assert context["host_overhead_ms"] == pytest.approx(context["token_ms"] - context["host_attention_ms"])
        assert len(context["per_layer_ms"]) == 2
        ops = layer_ops[context["cache"]]
        assert set(context["ops"]) == set(ops) and set(ops) <= set(host_overhead.TIMED_OPS)
        for name in ops:
            assert context["ops"][name]["calls_per_token"] == 1
        # the first forward feeds the last prompt token over the filled cache, then 4 decode steps: L + 2 runs each
        # with HF's cache, 1 with the NpuKVCache (the group with the first Q/K/V and the LM head)
        assert context["per_generate_counts"]["runs"] == 5 * len(ops)
        # per forward: the LUT row; with the NpuKVCache also the length, and nothing of the cache (the NPU writes
        # the new K and V rows; the slabs are never synced whole)
        assert context["per_generate_counts"]["ranged_syncs"] == 5 * (1 + on_npu)
        assert context["hot_functions"] and {"function", "own_us_per_token"} <= set(context["hot_functions"][0])
    batched = data["batch_contexts"]
    assert [(c["context_tokens"], c["batch"], c["padded"]) for c in batched] == [
        (8, 2, False), (20, 2, False), (8, 2, True), (20, 2, True)]
    for context in batched:  # no cache slab is copied: what is, is the hidden rows HF stacks (and a padded length)
        counts = context["per_generate_counts"]
        assert context["cache"] == "npu" and context["host_attention_ms"] == 0
        assert counts["host_copy_bytes"] <= counts["host_copies"] * data["hidden"] * 2
        assert counts["runs"] == 2 * 5 * 1  # per sequence, as one
    dispatch = data["dispatch"]
    assert dispatch["library_define_impl_us"] > 0 and dispatch["custom_op_us"] > 0
    assert data["hf_framework"]["token_ms"] > 0


def test_issue_targets_count_the_dispatches_per_decode_token(report):
    """The tiny model's two layers and LM head decode in one dispatch per token (decode_layers2_qkv_final_lm): the
    dispatch target is met; five dispatches per token would miss it."""
    targets = host_overhead.issue_targets(report)
    assert len(targets) == 2 + 1 + 1  # two contexts, their ratio, the dispatches
    dispatch = targets[-1]
    assert dispatch["measured"] == "1" and dispatch["met"]
    counts = report["contexts"][0]["per_generate_counts"]
    more = {**report, "contexts": [{**report["contexts"][0],
                                    "per_generate_counts": {**counts, "runs": 5 * counts["runs"]}}]}
    assert host_overhead.issue_targets(more)[-1]["measured"] == "5" and not host_overhead.issue_targets(more)[-1]["met"]


def test_each_run_starts_from_the_filled_cache(report):
    """The cache is cropped back between runs: every run decodes at the context it is labelled with."""
    from benchmarks.host_overhead import _rewound, filled_cache

    model = tiny_llama()
    cache = filled_cache(model, "npu", 7)
    assert cache.get_seq_length() == 7
    cache.update(*(torch.zeros(1, 2, 3, 16, dtype=torch.bfloat16),) * 2, 0)
    assert _rewound(cache, 7).get_seq_length(0) == 7


def test_timer_wrappers_are_removed(report):
    from torch_npu2.patch_llama import layer
    from torch_npu2.ops import rms_gemv_rope

    assert layer.rms_gemv_rope is rms_gemv_rope


def test_grouped_layers_are_timed_and_the_timer_leaves_no_wrapper():
    """Layers a decode group computed return from the top of their call; the timer, around each layer's whole call,
    still times them (and keeps them in groups: it wraps the NpuDecoderLayer class, not the modules' forwards)."""
    import torch_npu2
    from torch_npu2.patch_llama.layer import NpuDecoderLayer

    call = NpuDecoderLayer.__call__
    model = tiny_llama(num_hidden_layers=4)
    with common.emulated_runtime(compute=False) as runtime:
        torch_npu2.patch_llama(model)
        with host_overhead.OpTimer(model, runtime) as timer:
            common.timed_generate(model, common.random_prompt(6, model.config.vocab_size), 3)
    assert timer.calls("decode_layers4_qkv_final_packed_lm_into") == 3  # layers 0-3 and the head: one run per decode step
    assert [timer.calls(f"layer{i}") for i in range(4)] == [4] * 4  # the prefill and the 3 decode steps
    assert NpuDecoderLayer.__call__ is call


def test_write_result_adds_machine_and_mode(tmp_path, report):
    path = common.write_result("host_overhead", {"contexts": report["contexts"]}, tmp_path, "quick", 0.0)
    data = json.loads(path.read_text())
    assert data["mode"] == "quick" and data["machine"]["cores"] >= 1 and data["contexts"]


@pytest.mark.filterwarnings("ignore:patch_llama. Qwen2ForCausalLM runs here on the emulated NPU2:UserWarning")
def test_a_model_with_qkv_biases_is_timed_under_its_ops_names():
    """A Qwen2 layer swaps each Q/K/V-projecting op for its biased twin by looking the op up (ops.QKV_BIASED): the
    timer's wrappers must find their twins, and the twins' calls count under the ops' names."""
    from tests.patch_llama.tiny import tiny_qwen2

    model = tiny_qwen2()
    with common.torch_threads(1), common.emulated_runtime(compute=False) as runtime:
        import torch_npu2

        torch_npu2.patch_llama(model, decode_layers_per_dispatch=1)  # the biased layer ops, not a group's
        [context] = host_overhead.measure(model, runtime, (8,), decode_steps=4, repeats=1, log=lambda _: None)
    # two layers, each one dispatch from its attention on, the first's Q/K/V its own
    ops = context["ops"]
    assert ops["rms_gemv_rope_into"]["calls_per_token"] == 1
    assert ops["decode_attn_o_gemv_ffn_rms_gemv_rope_into"]["calls_per_token"] == 1
    assert ops["decode_attn_o_gemv_ffn"]["calls_per_token"] == 1


def test_rescoring_cost_times_every_tokens_rescoring():
    """Each token's LM head call runs the rescoring (the tiny model's random logits: at least its best token changes
    from the copy's value to the bf16 weight's), timed ``calls`` times on copies before the real call; the wrapper is
    gone afterwards."""
    from torch_npu2.patch_llama.layer import NpuLmHead

    model = tiny_llama()
    cost = host_overhead.rescoring_cost(model, new_tokens=3, calls=2)
    assert cost["tokens"] == 3 and cost["logits_changed_per_token"][0] >= 1 and cost["ms_per_token"] > 0
    assert cost["bound"] > 0 and "_rescored" not in vars(model.lm_head.forward)
    assert type(model.lm_head.forward)._rescored is NpuLmHead._rescored
