"""The long-prompt section's bookkeeping: runs alternate which kind goes first, a row keeps each kind's
shortest time and highest peak, and the targets are judged at the longest prompt. (The runs themselves load
SmolLM2 and take minutes: `python -m benchmarks long`.)"""
import json

from benchmarks import long_prompt


def test_rows_keep_the_shortest_time_and_the_highest_peak(monkeypatch, tmp_path):
    order = []
    # (seconds, peak GiB) per call, in call order: 2048 (hf, patched, patched, hf), then 8026 the same way
    runs = iter([(10, 1.0), (12, 1.2), (11, 1.1), (9, 1.05), (100, 1.0), (125, 1.4), (110, 1.2), (95, 1.1)])

    def measure(kind, length, new_tokens):
        order.append((kind, length))
        seconds, peak = next(runs)
        return {"kind": kind, "seconds": seconds, "process_peak_bytes": int(peak * 2 ** 30),
                "generate_extra_bytes": int(peak * 2 ** 29)}

    monkeypatch.setattr(long_prompt, "measure", measure)
    monkeypatch.setitem(long_prompt.SETTINGS, "full", dict(lengths=(2048, 8026), new_tokens=4, repeats=2))
    data = long_prompt.run("full", tmp_path, log=lambda line: None)
    assert order == [("hf", 2048), ("patched", 2048), ("patched", 2048), ("hf", 2048),
                     ("hf", 8026), ("patched", 8026), ("patched", 8026), ("hf", 8026)]
    first, last = data["rows"]
    assert (first["hf"]["seconds"], first["patched"]["seconds"]) == (9, 11)
    assert first["hf"]["seconds_each"] == [10, 9]
    assert last["patched"]["process_peak_bytes"] == int(1.4 * 2 ** 30)
    assert last["time_ratio"] == 110 / 95 and round(last["peak_ratio"], 6) == round(1.4 / 1.1, 6)
    assert [t["met"] for t in data["targets"]] == [True, True]  # 1.27 ≤ 1.3, 1.16 ≤ 1.2
    assert json.loads((tmp_path / "long_prompt.json").read_text())["rows"][1]["prompt_tokens"] == 8026
