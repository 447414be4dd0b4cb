"""benchmarks/memory.py's worker on a small shape: both weight formats patch and generate, and the Q4_1 patch
leaves less resident than the bf16 one (its bf16 originals are set aside in a mapped file)."""
import pytest

from benchmarks import memory

SHAPE = dict(num_hidden_layers=2, hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
             num_key_value_heads=2, head_dim=128, vocab_size=8192, tie_word_embeddings=True,
             max_position_embeddings=2048, rms_norm_eps=1e-5)


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
def test_the_q4_1_scenario_keeps_less_resident_than_the_bf16_one():
    """... and the default integer prefill GEMMs hold their prepared copies beside the bf16 weights: 2.25 bytes a
    projection weight more after patching, and nothing prepared in the other scenarios."""
    results = {kind: memory.measure(kind, 16, 2, SHAPE) for kind in ("patched", "patched_q4_1", "patched_w8x2a16")}
    for kind, result in results.items():
        assert [p["phase"] for p in result["phases"]] == ["imports", "model built", "patched", "generated 2 tokens"]
        assert result["peak_after_build_bytes"] is not None and result["peak_bytes"] >= result["peak_after_build_bytes"]
    weights = results["patched"]["weight_bytes"]
    after = {kind: result["phases"][2]["rss_bytes"] for kind, result in results.items()}
    # bf16: the weights stay (now in NPU buffers); Q4_1: about 0.31 of the projections' bytes stay
    assert after["patched"] - after["patched_q4_1"] > 0.4 * weights, (after, weights)
    prepared = results["patched_w8x2a16"]["prepared_bytes"]
    projections = SHAPE["num_hidden_layers"] * (2 * 1024 * 1024 + 2 * 256 * 1024 + 3 * 4096 * 1024)  # q o, k v, mlp
    assert prepared == 2.25 * projections and results["patched"]["prepared_bytes"] == 0
    assert 0.9 * prepared < after["patched_w8x2a16"] - after["patched"] < 1.1 * prepared + 0.05 * weights


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
def test_the_packed_checkpoint_load_never_holds_the_bf16_weights():
    """loaded_q4_1: the checkpoint is written by another process, then loaded packed: the load adds less than the
    in-memory build by most of the weights (only norms are read; the embedding is a mapping, untouched yet)."""
    results = {kind: memory.measure(kind, 16, 2, SHAPE) for kind in ("patched_q4_1", "loaded_q4_1")}
    loaded, built = results["loaded_q4_1"], results["patched_q4_1"]
    assert [p["phase"] for p in loaded["phases"]] == ["imports", "loaded packed", "patched", "generated 2 tokens"]
    assert loaded["weight_bytes"] == built["weight_bytes"]  # the same model, each stored tensor once
    assert loaded["peak_after_build_bytes"] is None and loaded["peak_bytes"] == loaded["phases"][-1]["hwm_bytes"]
    grown = {kind: r["phases"][1]["rss_bytes"] - r["phases"][0]["rss_bytes"] for kind, r in results.items()}
    assert grown["loaded_q4_1"] < grown["patched_q4_1"] - 0.5 * built["weight_bytes"], grown
