"""The quick host-overhead path on a tiny model: runs, and its JSON is well formed."""
import json

import pytest

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
    for context in data["contexts"]:
        assert context["token_ms"] > 0 and context["host_attention_ms"] > 0
        assert context["host_overhead_ms"] == pytest.approx(context["token_ms"] - context["host_attention_ms"])
        assert len(context["per_layer_ms"]) == 2
        assert set(context["ops"]) == set(host_overhead.LAYER_DECODE_OPS) | {"lm_head_gemv"}  # decode only
        for name in host_overhead.LAYER_DECODE_OPS + ("lm_head_gemv",):  # 2 layers: the first one chains
            assert context["ops"][name]["calls_per_token"] == 1
        assert context["per_generate_counts"]["runs"] == 1 + 2 * 3 + 4 * (2 + 2)  # prefill + 4 decode steps
        assert context["hot_functions"] and {"function", "own_us_per_token"} <= set(context["hot_functions"][0])
    dispatch = data["dispatch"]
    assert dispatch["library_define_impl_us"] > 0 and dispatch["custom_op_us"] > 0
    assert data["hf_framework"]["token_ms"] > 0


def test_timer_wrappers_are_removed(report):
    from torch_npu2.patch_llama import layer
    from torch_npu2.ops import rms_gemv_rope

    assert layer.rms_gemv_rope is rms_gemv_rope


def test_write_result_adds_machine_and_mode(tmp_path, report):
    path = common.write_result("host_overhead", {"contexts": report["contexts"]}, tmp_path, "quick", 0.0)
    data = json.loads(path.read_text())
    assert data["mode"] == "quick" and data["machine"]["cores"] >= 1 and data["contexts"]
