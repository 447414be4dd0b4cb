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


def test_the_cost_model_table_renders_results_from_before_the_bfp16_gate_up_column():
    """`report` re-renders whatever JSON is in results/: rows without the gate/up variant get a dash."""
    from benchmarks import cost_model

    rows = cost_model.per_program(cost_model.llama_1b_dims())
    result = {"per_program": rows, "predictions": cost_model.predictions(prompts=(128,))}
    current = "\n".join(dispatcher.report._cost_model(result))
    o_ffn = next(r for r in rows if r["program"] == "o_ffn")
    assert f"| {o_ffn['predicted_ms_bfp16_gate_up']:.2f} |" in current
    for row in [*result["per_program"], *result["predictions"]["prefill"]]:
        row.pop("predicted_ms_bfp16_gate_up")
    older = "\n".join(dispatcher.report._cost_model(result))
    assert f"| {o_ffn['predicted_ms']:.2f} | — | {o_ffn['predicted_ms_bfp16']:.2f} |" in older
