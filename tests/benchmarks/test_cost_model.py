"""Llama-3.2-1B's predictions: ranges from the fast to the slow end, for every Program, prefill, decode and the
headline, following what NpuDecoderLayer runs."""
import pytest

from benchmarks import common, cost_model
from torch_npu2.kernels import timing
from torch_npu2.kernels.catalog import DEFAULT_MATMUL_PRECISION, INTEGER_PRECISION

PROGRAMS = [("rms_gemms_rope", 2048), ("flash_attn", 2048), ("o_ffn", 2048), ("rms_gemv_rope", None),
            ("o_gemv_ffn", None), ("lm_head_gemv", None)]


@pytest.mark.parametrize("name,seq", PROGRAMS, ids=[f"{n}-{s}" for n, s in PROGRAMS])
def test_every_program_calls_our_kernels_and_leaves_no_scalar_matmul(name, seq):
    fast, _ = cost_model.program_range(cost_model.program(name, cost_model.llama_1b_dims(), seq))
    compute = fast.compute_s()
    assert "scalar_mac" not in compute
    assert compute.keys() & {"mmul_bf16", "vector_mac"}


def test_bucketed_prefill_is_predicted_faster_for_short_prompts():
    prefill = cost_model.predictions(prompts=(32, 2048))["prefill"]
    assert prefill[0]["buckets"] == [32] and prefill[1]["buckets"] == [2048]
    for precision in cost_model.PRECISIONS:
        short, long = prefill[0][f"predicted_ms_{precision}"], prefill[1][f"predicted_ms_{precision}"]
        assert short[0] < short[1] and long[0] < long[1]
        assert short[1] < long[0]


def test_decode_adds_the_host_time_the_host_section_measured(tmp_path):
    assert cost_model.host_measurement(tmp_path) is None
    npu_only = cost_model.predictions(prompts=(32,))["decode"]
    assert "NPU only: no host measurement" in cost_model.decode_line(npu_only)
    contexts = [{"context_tokens": 32, "token_ms": 7.0, "host_attention_ms": 2.0, "host_overhead_ms": 5.0},
                {"context_tokens": 512, "token_ms": 9.0, "host_attention_ms": 4.0, "host_overhead_ms": 5.0}]
    common.write_result("host_overhead", {"contexts": contexts}, tmp_path, "quick", 0.0)
    host = cost_model.host_measurement(tmp_path)
    assert (host["token_ms"], host["context_tokens"], host["mode"]) == (7.0, 32, "quick")
    decode = cost_model.predictions(prompts=(32,), host=host)["decode"]
    assert decode["npu_ms_per_token"] == npu_only["npu_ms_per_token"]
    assert decode["total_ms_per_token"] == pytest.approx([ms + 7.0 for ms in npu_only["npu_ms_per_token"]])
    assert decode["tokens_per_s"] == pytest.approx([1e3 / ms for ms in reversed(decode["total_ms_per_token"])])
    line = cost_model.decode_line(decode)
    assert f"predicted NPU {cost_model.span(npu_only['npu_ms_per_token'])} ms + measured host 7.00 ms" in line
    assert "quick mode, context 32" in line


def test_prefill_is_predicted_for_every_matmul_precision():
    """BFP16 multiplies run faster than aie_api's exact bf16 emulation at both ends; "bfp16_gate_up" has only the
    gate/up GEMM at BFP16; the integer GEMMs (w8x2a16, their own Programs) faster than exact bf16; flash_attn has no
    GEMM precision, but a BFP16 variant for the comparison with upstream."""
    (row,) = cost_model.predictions(prompts=(128,))["prefill"]
    for end in range(2):
        assert (row["predicted_ms_bfp16"][end] < row["predicted_ms_bfp16_gate_up"][end]
                < row["predicted_ms_bf16"][end])
        assert row["predicted_ms_w8x2a16"][end] < row["predicted_ms_bf16"][end]
    rows = {(r["program"], r["seq"]): r for r in cost_model.per_program(cost_model.llama_1b_dims())}
    o_ffn, qkv, attention = rows[("o_ffn", 2048)], rows[("rms_gemms_rope", 2048)], rows[("flash_attn", 2048)]
    for end in range(2):
        assert o_ffn["predicted_ms_bfp16"][end] < o_ffn["predicted_ms_bfp16_gate_up"][end] < o_ffn["predicted_ms"][end]
        assert attention["predicted_ms_bfp16"][end] < attention["predicted_ms"][end]
    assert qkv["predicted_ms_bfp16_gate_up"] == qkv["predicted_ms"]  # no gate/up GEMM in it
    assert attention["predicted_ms_bfp16_gate_up"] is None and attention["predicted_ms_w8x2a16"] is None
    for program in (o_ffn, qkv):
        assert all(w < b for w, b in zip(program["predicted_ms_w8x2a16"], program["predicted_ms"]))


def test_a_decode_token_pays_one_dispatch_per_layer_plus_the_first_layers_and_the_lm_heads():
    """The chained Program is its two parts' launches in one dispatch (its second part's first launch now entering
    its device inside the run), and a decode token follows NpuDecoderLayer: rms_gemv_rope, then L−1 chained
    Programs, o_gemv_ffn, the LM head: L+2 dispatches, at each end."""
    dims = cost_model.llama_1b_dims()
    cost = {name: cost_model.program_range(cost_model.program(name, dims))
            for name in ("rms_gemv_rope", "o_gemv_ffn", "o_gemv_ffn_rms_gemv_rope", "lm_head_gemv")}
    for index, end in enumerate(timing.ENDS):
        chained, parts = cost["o_gemv_ffn_rms_gemv_rope"][index], (cost["o_gemv_ffn"][index],
                                                                    cost["rms_gemv_rope"][index])
        assert [l.kind for l in chained.launches] == [l.kind for p in parts for l in p.launches]
        assert chained.seconds == pytest.approx(sum(p.seconds for p in parts) - end.dispatch_s + end.configure_s)
        for layers in (1, 16):
            expected_s = sum(c[index].seconds for c in cost.values()) + (layers - 2) * chained.seconds
            assert cost_model.decode_ms(dims, layers, lm_head="bf16")[index] == pytest.approx(expected_s * 1e3)


def test_the_headline_is_the_default_precisions_prefill_and_decode_range():
    dims = cost_model.llama_1b_dims()
    headline = cost_model.headline()
    assert set(headline) == {"prefill_2048_s", "decode_token_s"}
    prefill = cost_model.prefill_ms(dims, 16, [(0, 2048, 2048)], DEFAULT_MATMUL_PRECISION)
    assert headline["prefill_2048_s"] == pytest.approx([ms / 1e3 for ms in prefill])
    assert headline["decode_token_s"] == pytest.approx(
        [ms / 1e3 for ms in cost_model.decode_chained_ms(dims, 16, cost_model.DECODE_CONTEXT)])
    assert all(low < high for low, high in headline.values())


def test_the_decode_token_charges_the_attention_the_patched_model_runs_on_the_npu():
    """Bf16 or packed weights, each layer one dispatch from its attention on: the token costs more than its GEMVs
    alone, and more at a longer context; the chained dispatch costs less than decode_attn run as its own."""
    dims = cost_model.llama_1b_dims()
    gemvs = cost_model.decode_ms(dims, 16)
    bf16 = cost_model.token_ms(dims, 16, 1024)
    assert bf16 == cost_model.decode_chained_ms(dims, 16, 1024)
    assert all(t > g for t, g in zip(bf16, gemvs))
    assert all(long > short for long, short in zip(cost_model.token_ms(dims, 16, 8192), bf16))
    packed = cost_model.token_ms(dims, 16, 1024, "q4_1")
    assert packed == cost_model.decode_chained_ms(dims, 16, 1024, "q4_1")
    assert all(t > g for t, g in zip(packed, cost_model.decode_ms(dims, 16, "q4_1")))
    assert all(t < apart for t, apart in zip(packed, cost_model.decode_with_attention_ms(dims, 16, 1024, "q4_1")))


@pytest.mark.parametrize("weights", ["bf16", "q4_1"])
def test_a_decode_group_costs_its_layers_launches_in_one_dispatch(weights):
    """Up to eight layers per dispatch, the first group starting with the first layer's rms_gemv_rope, the last
    ending with the model's last layer and running the final norm and the LM head (2 dispatches per token of 16
    layers, decode_dispatches): the token costs what its layers and the LM head cost one dispatch each (18) less the
    16 dispatches saved, each leaving a launch to enter its device inside a run, plus the final norm's launch (HF's
    host norm before) and its device, at each end."""
    from torch_npu2.kernels import catalog

    d, head_weights = cost_model.llama_1b_dims(), catalog.default_lm_head_weights(weights)
    capacity = catalog.decode_attn_capacity(1024, cost_model.DECODE_ATTN_MAX_LEN)
    last_group = cost_model.program_range(catalog.decode_layers_program(
        8, d.hidden, d.q_dim, d.intermediate, d.eps, d.heads, d.kv_heads, d.head_dim, capacity, d.eps, weights, True,
        (catalog.lm_head_rows(d.vocab), d.eps, head_weights)))
    assert [launch.kind for launch in last_group[0].launches[-2:]] == ["rmsnorm", "gemv_f32"]
    chained = cost_model.program_range(catalog.decode_attn_o_gemv_ffn_rms_gemv_rope_program(
        d.hidden, d.q_dim, d.intermediate, d.eps, d.heads, d.kv_heads, d.head_dim, capacity, d.eps, weights))
    last = cost_model.program_range(catalog.decode_attn_o_gemv_ffn_program(
        d.hidden, d.q_dim, d.intermediate, d.eps, d.heads, d.kv_heads, d.head_dim, capacity, weights))
    first, head = (cost_model.program_range(cost_model.program(name, d, None, "bf16", w))
                   for name, w in (("rms_gemv_rope", weights), ("lm_head_gemv", head_weights)))
    assert cost_model.decode_group_runs(16) == [8, 8] and cost_model.decode_dispatches(16) == 2
    assert cost_model.decode_group_runs(17) == [8, 8, 1] and cost_model.decode_dispatches(17) == 4
    assert cost_model.decode_group_runs(1) == [1] and cost_model.decode_dispatches(1) == 3
    for end, grouped in enumerate(cost_model.token_ms(d, 16, 1024, weights)):
        one_each = 15 * chained[end].seconds + last[end].seconds + first[end].seconds + head[end].seconds
        saved = (18 - 2) * (cost_model.ENDS[end].dispatch_s - cost_model.ENDS[end].configure_s)
        final_norm = last_group[end].launches[-2].seconds + cost_model.ENDS[end].configure_s
        assert grouped == pytest.approx((one_each - saved + final_norm) * 1e3, rel=1e-9)
        assert cost_model.decode_per_layer_ms(d, 16, 1024, weights)[end] == pytest.approx(one_each * 1e3, rel=1e-9)


def test_qwen2s_decode_groups_charge_its_bias_launches():
    """Qwen2.5-0.5B's q/k/v biases are launches in every group (bias_add), so its token costs more than the same
    dims without them, grouped and one dispatch per layer; its 24 layers take 3 dispatches instead of 26."""
    import dataclasses

    d = cost_model.QWEN25_05B_DIMS
    unbiased = dataclasses.replace(d, qkv_bias=False)
    for cost in (cost_model.token_ms, cost_model.decode_per_layer_ms):
        assert all(b > u for b, u in zip(cost(d, 24, 1024), cost(unbiased, 24, 1024)))
    section = cost_model.qwen2_predictions()
    assert section["dispatches_per_token"] == {"grouped": 3, "per_layer": 26}
    assert list(section["decode"]) == ["bf16", "q4_0", "q4_1", "q8_0"]  # its packed rows build (kernels/quant.py)
    for row in section["decode"].values():
        assert all(g < p for g, p in zip(row["grouped_ms"], row["per_layer_dispatch_ms"]))
    assert section["decode"]["q4_1"]["weight_bytes_per_token"] < section["decode"]["bf16"]["weight_bytes_per_token"]
    assert set(section["prefill_2048_ms"]) == set(cost_model.PRECISIONS)


def test_each_replay_row_says_where_the_measurement_lies():
    """A measurement inside the predicted range, below its fast end or above its slow end, and by how much."""
    assert cost_model._replay_row((2.0, 2.0), (1.0, 3.0))["measured_against_range"] == "inside"
    assert cost_model._replay_row((1.0, 1.0), (2.0, 3.0))["measured_against_range"] == "50.0% below the fast end"
    row = cost_model._replay_row((6.0, 6.0), (2.0, 3.0))
    assert row["measured_against_range"] == "100.0% above the slow end"
    assert row["predicted_over_measured"] == pytest.approx([2 / 6, 3 / 6])


def test_upstreams_flash_attention_replay_uses_our_herd_and_names_its_tiles():
    """Llama-3.2-1B's shape (32 query heads, 8 KV heads) fills our 8×4 herd as upstream's does, with heads on the
    rows; a group of one query head per KV head fills it with parts of the sequence on the rows (it took one row of 8
    tiles before)."""
    rows = {(r["seq"], r["heads"], r["kv_heads"]): r for r in cost_model.upstream_attention_replay()}
    assert rows[(2048, 32, 8)]["tiles"] == 32 and rows[(2048, 32, 32)]["tiles"] == 32
    for row in rows.values():
        assert row["predicted_ms"][0] < row["predicted_exact_bf16_ms"][0]


def test_packed_prefill_charges_the_dequantize_runs_only_where_they_run():
    """A layer with packed projections dequantizes them once per prefill for the bf16 GEMMs (npu2.dequantize_rows,
    charged per layer), not for the integer GEMMs, which read copies prepared at patch time: the same Programs as
    bf16 weights."""
    dims, chunks = cost_model.llama_1b_dims(), [(0, 2048, 2048)]
    dequantize = cost_model.dequantize_ms(dims, "q4_1")
    bf16 = cost_model.prefill_ms(dims, 16, chunks, "bf16", lm_head="q4_1")  # the LM head alike in each pair
    assert cost_model.prefill_ms(dims, 16, chunks, "bf16", "q4_1") == pytest.approx(
        [ms + 16 * d for ms, d in zip(bf16, dequantize)])
    assert cost_model.prefill_ms(dims, 16, chunks, INTEGER_PRECISION, "q4_1") == pytest.approx(
        cost_model.prefill_ms(dims, 16, chunks, INTEGER_PRECISION, lm_head="q4_1"))


def test_a_bf16_models_decode_token_streams_the_lm_heads_q8_0_copy():
    """A patched bf16 model's LM head GEMV reads its Q8_0 copy by default (lm_head="auto"): a token streams the
    copy's bytes in place of the bf16 rows', and costs less at each end than with lm_head="bf16"."""
    from torch_npu2.kernels import catalog, quant

    d = cost_model.llama_1b_dims()
    rows = catalog.lm_head_rows(d.vocab)
    saved = rows * d.hidden * 2 - rows * quant.weight_format("q8_0").row_bytes(d.hidden)
    assert cost_model.decode_weight_bytes(d, 16, "bf16", "bf16") - cost_model.decode_weight_bytes(d, 16) == saved
    assert cost_model.token_ms(d, 16, 1024) == cost_model.token_ms(d, 16, 1024, "bf16", "q8_0")
    assert all(copy < exact for copy, exact in zip(cost_model.token_ms(d, 16, 1024),
                                                   cost_model.token_ms(d, 16, 1024, "bf16", "bf16")))
