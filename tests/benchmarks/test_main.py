"""The benchmark dispatcher: several sections per call, run in SECTIONS' order; lone commands stay alone."""
import time

import pytest

from benchmarks import __main__ as dispatcher
from benchmarks import common


RESULT_NAMES = {"host": "host_overhead", "model": "cost_model", "long": "long_prompt"}


@pytest.fixture
def recorded(monkeypatch):
    ran = []

    def section(name):
        def run(mode, out, log):
            ran.append((name, mode))
            common.write_result(RESULT_NAMES.get(name, name), {}, out, mode, time.perf_counter())
        return run

    fake = {name: section(name) for name in dispatcher.SECTIONS}
    monkeypatch.setattr(dispatcher, "SECTIONS", fake)
    # the sections' results here are empty: the summary only has to be asked for
    monkeypatch.setattr(dispatcher.report, "write_summary", lambda out: out / "summary.md")
    return ran


def test_several_sections_run_in_section_order(recorded, tmp_path, capsys):
    assert dispatcher.main(["model", "host", "--quick", "--out", str(tmp_path)]) == 0
    assert recorded == [("host", "quick"), ("model", "quick")]
    assert f"summary: {tmp_path / 'summary.md'}" in capsys.readouterr().out


def test_all_runs_every_section_but_precision_and_long_once(recorded, tmp_path):
    assert dispatcher.main(["all", "--out", str(tmp_path)]) == 0
    assert [name for name, _ in recorded] == [name for name in dispatcher.SECTIONS if name not in ("precision", "long")]
    assert {mode for _, mode in recorded} == {"full"}


@pytest.mark.parametrize("alone", ["all", "report", "publish"])
def test_lone_commands_are_refused_in_company(recorded, tmp_path, capsys, alone):
    with pytest.raises(SystemExit) as exit_info:
        dispatcher.main([alone, "model", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"{alone} cannot be combined" in capsys.readouterr().err
    assert recorded == []


def test_report_without_results_names_the_folder(recorded, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        dispatcher.main(["report", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"no results in {tmp_path}" in capsys.readouterr().err


def test_a_section_without_summary_table_ends_cleanly(recorded, tmp_path, capsys):
    assert dispatcher.main(["precision", "--quick", "--out", str(tmp_path)]) == 0
    assert recorded == [("precision", "quick")]
    assert "summary: none" in capsys.readouterr().out


def test_the_machine_line_names_each_sections_commit_when_they_differ():
    machine = {"cpu": "x", "cores": 2, "memory_gib": 1, "python": "3", "torch": "t", "transformers": "5",
               "load_average": [0.5, 0.5, 0.5]}
    same = {"speed": {"machine": {**machine, "git_commit": "aaa"}, "mode": "full", "finished": "1"},
            "cost_model": {"machine": {**machine, "git_commit": "aaa"}, "mode": "full", "finished": "2"}}
    line = dispatcher.report._machine(same)[0]
    assert "commit aaa;" in line and "finished 2." in line
    differ = {**same, "cost_model": {**same["cost_model"], "machine": {**machine, "git_commit": "bbb"}}}
    assert "commits aaa (speed), bbb (cost_model);" in dispatcher.report._machine(differ)[0]


def test_the_cost_model_table_renders_every_prediction_as_a_range():
    """`report` renders the model's JSON: each Program's range per precision (a dash where it has no such
    variant), the ends' assumptions, the headline, and the three replays."""
    from benchmarks import cost_model

    rows = cost_model.per_program(cost_model.llama_1b_dims())
    result = {"per_program": rows, "predictions": cost_model.predictions(prompts=(128,)),
              "headline": cost_model.headline(), "constants": cost_model.constants(),
              "upstream_gemm_replay": [], "upstream_attention_replay": [], "upstream_gemv_replay": []}
    text = "\n".join(dispatcher.report._cost_model(result))
    o_ffn = next(r for r in rows if r["program"] == "o_ffn")
    gemv = next(r for r in rows if r["program"] == "lm_head_gemv")
    keys = ("predicted_ms", "predicted_ms_w8x2a16", "predicted_ms_bfp16_gate_up", "predicted_ms_bfp16")
    spans = [cost_model.span(o_ffn[key], 2) for key in keys]
    assert "| " + " | ".join(spans) + " |" in text
    assert f"| {cost_model.span(gemv['predicted_ms'], 2)} | — | — | — |" in text
    assert f"prefill of 2048 tokens {cost_model.span(result['headline']['prefill_2048_s'], 2)} s" in text
    for end in ("fast", "slow"):
        assert f"- **{end}**: {result['constants']['ends'][end]['assumption']}." in text
