"""Work executed by prefill: rows the kernels process over the prompt's rows, for prompts of 1…4096 tokens.

Ours: the bucket logic of ``patch_llama`` itself (``PrefillSettings.chunks`` with the default buckets): a
prompt pads to the next bucket, longer prompts split into chunks of the largest bucket; a 1-token prompt
takes the decode path (one GEMV row). Reference (mlir-air llama32_1b): every prompt padded to 2048
(beyond 2048 it has no path; counted here as 2048-row chunks).
Cross-check: a tiny patched model runs real prompts on the emulated NPU2 and the rows are read from
the launch parameters of every run the driver starts.
"""
from __future__ import annotations

import time
from collections import Counter

import torch

from . import common

MAX_PROMPT = 4096
REFERENCE_SEQ = 2048
TARGET_RATIO, TARGET_FROM = 2.0, 16
CROSS_CHECK = {"quick": (1, 5, 16, 17, 100, 2049), "full": (1, 5, 16, 17, 33, 100, 513, 1500, 2048, 2049, 3000)}
PREFILL_PROGRAMS = ("rms_gemms_rope", "rms_gemv_rope")


def prefill_settings(buckets=None):
    from torch_npu2.patch_llama.layer import PrefillSettings
    from torch_npu2.patch_llama.patch import DEFAULT_BUCKETS

    return PrefillSettings(tuple(sorted(set(buckets or DEFAULT_BUCKETS))))


def our_rows(prompt_tokens: int, state) -> int:
    """Rows one layer's kernels process for a prompt, following ``NpuDecoderLayer``'s choices."""
    if prompt_tokens == 1:
        return 1  # one new token: the decode path (rms_gemv_rope / o_gemv_ffn), no padding
    return sum(padded for _, _, padded in state.chunks(prompt_tokens))


def reference_rows(prompt_tokens: int, seq: int = REFERENCE_SEQ) -> int:
    return -(-prompt_tokens // seq) * seq


def ratios(max_prompt: int = MAX_PROMPT, buckets=None) -> dict:
    state = prefill_settings(buckets)
    lengths = list(range(1, max_prompt + 1))
    ours = [our_rows(n, state) / n for n in lengths]
    reference = [reference_rows(n) / n for n in lengths]
    return {"buckets": list(state.buckets), "lengths": lengths, "ours": ours, "reference": reference}


class LaunchRecorder:
    """Wraps a pyxrt-shaped driver's ``run`` so every started run's Program is recorded (name, rows)."""

    def __init__(self, driver):
        self.started: Counter = Counter()
        make_run = driver.run

        def recording_run(kernel):
            handle = make_run(kernel)
            start, program = handle.start, kernel.program

            def recorded_start():
                params = dict(program.params)
                self.started[program.name, params.get("rows", params.get("seq"))] += 1
                return start()
            handle.start = recorded_start
            return handle
        driver.run = recording_run

    def rows(self, name: str) -> int:
        return sum(rows * count for (program, rows), count in self.started.items() if program == name)


def cross_check(lengths, log=print) -> list[dict]:
    """Runs a tiny patched model's forward on each prompt length; rows per layer from the launches run."""
    import torch_npu2
    from tests.patch_llama.tiny import tiny_llama

    model = tiny_llama()
    layers, state = model.config.num_hidden_layers, prefill_settings()
    rows = []
    with common.emulated_runtime(compute=True) as runtime:
        recorder = LaunchRecorder(runtime.xrt)
        torch_npu2.patch_llama(model)
        for length in lengths:
            recorder.started.clear()
            with torch.no_grad():
                model(common.random_prompt(length, model.config.vocab_size), logits_to_keep=1)
            measured = sum(recorder.rows(name) for name in PREFILL_PROGRAMS) / layers
            rows.append({"prompt_tokens": length, "rows_per_layer_measured": measured,
                         "rows_per_layer_computed": our_rows(length, state),
                         "runs": {f"{name}[{r}]": c for (name, r), c in sorted(recorder.started.items(), key=str)}})
            log(f"  work cross-check prompt {length:5d}: {measured:7.1f} rows/layer run, "
                f"{our_rows(length, state):5d} computed")
    return rows


def plot(data: dict, path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(data["lengths"], data["reference"], label="reference: every prompt padded to 2048", color="tab:red")
    ax.plot(data["lengths"], data["ours"], label=f"ours: buckets {data['buckets'][0]}…{data['buckets'][-1]}, "
            f"chunks of {data['buckets'][-1]}", color="tab:blue")
    ax.axhline(TARGET_RATIO, color="k", ls="--", lw=1,
               label=f"target ≤ {TARGET_RATIO:g}× (prompts ≥ {TARGET_FROM})")
    checks = data["cross_check"]
    ax.scatter([c["prompt_tokens"] for c in checks],
               [c["rows_per_layer_measured"] / c["prompt_tokens"] for c in checks],
               color="k", zorder=3, s=18, label="measured on the emulator (tiny model)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("rows processed / prompt rows")
    ax.set_title("Prefill work executed over work needed", fontsize=10)
    ax.legend(fontsize=8)
    common.save_figure(fig, path)


def run(mode: str, out_dir, log=print) -> dict:
    started = time.perf_counter()
    data = ratios()
    data["cross_check"] = cross_check(CROSS_CHECK[mode], log)
    mismatches = [c for c in data["cross_check"] if c["rows_per_layer_measured"] != c["rows_per_layer_computed"]]
    eligible = [(n, r) for n, r in zip(data["lengths"], data["ours"]) if n >= TARGET_FROM]
    worst_length, worst = max(eligible, key=lambda item: item[1])
    reference_worst = max(r for n, r in zip(data["lengths"], data["reference"]) if n >= TARGET_FROM)
    summary = {n: {"ours": data["ours"][n - 1], "reference": data["reference"][n - 1]}
               for n in (1, 8, 16, 17, 30, 100, 1000, 2048, 2049, 3000, 4096)}
    data.update(summary=summary, worst_from_16={"prompt_tokens": worst_length, "ours": worst,
                                                "reference": reference_worst},
                cross_check_mismatches=len(mismatches))
    data["targets"] = [
        common.target("prefill rows / prompt rows, prompts ≥ 16 tokens", f"≤ {TARGET_RATIO:g}×",
                      f"worst {worst:.2f}× (at {worst_length} tokens; reference worst {reference_worst:.0f}×)",
                      worst <= TARGET_RATIO),
        common.target("computed rows match the rows the emulator ran", "all cross-checked lengths",
                      f"{len(data['cross_check']) - len(mismatches)}/{len(data['cross_check'])}", not mismatches),
    ]
    log(f"work: worst ratio from 16 tokens {worst:.2f}× at {worst_length}; reference {reference_worst:.0f}×; "
        f"cross-check mismatches {len(mismatches)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(data, out_dir / "work.png")
    data["method"] = __doc__.strip()
    common.write_result("work", data, out_dir, mode, started)
    return data
