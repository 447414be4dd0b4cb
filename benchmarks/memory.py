"""Peak memory of the 1B-shaped model: build, patch, generate — each scenario in a fresh subprocess.

Each worker reads VmRSS and VmHWM (peak RSS) from /proc/self/status after every phase. The bar is the
bf16 weight bytes (each stored tensor once: the tied embedding/LM head counts once).
Target: VmHWM ≤ 1.15 × weight bytes + 0.5 GiB for the patched scenario.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

from . import common

SETTINGS = {
    "quick": dict(scenarios=(("hf", 32), ("patched", 32)), new_tokens=4),
    "full": dict(scenarios=(("hf", 32), ("patched", 32), ("patched", 2048)), new_tokens=8),
}
TARGET_FACTOR, TARGET_EXTRA = 1.15, 0.5 * common.GIB


def _phase(phases: list, name: str) -> None:
    phases.append({"phase": name, "rss_bytes": common.proc_status_bytes("VmRSS"),
                   "hwm_bytes": common.proc_status_bytes("VmHWM")})


def worker(kind: str, prompt_tokens: int, new_tokens: int, shape: dict) -> dict:
    """One scenario, in this (fresh) process: ``kind`` is "hf" (unpatched) or "patched" (emulated NPU2)."""
    import torch

    import torch_npu2

    phases = []
    _phase(phases, "imports")
    model = common.random_llama(common.llama_config(**shape))
    weights = common.weight_bytes(model)
    _phase(phases, "model built")
    ids = common.random_prompt(prompt_tokens, model.config.vocab_size)
    with common.emulated_runtime(compute=True):
        if kind == "patched":
            torch_npu2.patch_llama(model)
            _phase(phases, "patched")
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0, eos_token_id=common.unreachable_eos(model))
        _phase(phases, f"generated {new_tokens} tokens")
    return {"kind": kind, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "weight_bytes": weights,
            "phases": phases, "peak_bytes": phases[-1]["hwm_bytes"]}


def measure(kind: str, prompt_tokens: int, new_tokens: int, shape: dict) -> dict:
    spec = json.dumps({"kind": kind, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "shape": shape})
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory", spec], cwd=common.REPO_ROOT,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory worker {kind}/{prompt_tokens} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(scenarios: list[dict], path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for entry in scenarios:
        label = f"{entry['kind']}, prompt {entry['prompt_tokens']}"
        ax.plot([p["phase"] for p in entry["phases"]], [p["rss_bytes"] / common.GIB for p in entry["phases"]],
                marker="o", label=f"{label}: RSS")
        ax.plot([p["phase"] for p in entry["phases"]], [p["hwm_bytes"] / common.GIB for p in entry["phases"]],
                ls=":", marker=".", label=f"{label}: peak (VmHWM)")
    weights = scenarios[0]["weight_bytes"]
    ax.axhline(weights / common.GIB, color="gray", lw=1, label="bf16 weight bytes")
    ax.axhline((TARGET_FACTOR * weights + TARGET_EXTRA) / common.GIB, color="k", ls="--", lw=1,
               label="target 1.15 × weights + 0.5 GiB")
    ax.set_ylabel("GiB")
    ax.set_title("Memory per phase, 1B-shaped model (fresh process per scenario)", fontsize=10)
    ax.legend(fontsize=7)
    common.save_figure(fig, path)


def run(mode: str, out_dir, log=print) -> dict:
    started = time.perf_counter()
    settings = SETTINGS[mode]
    scenarios = []
    for kind, prompt_tokens in settings["scenarios"]:
        entry = measure(kind, prompt_tokens, settings["new_tokens"], common.LLAMA_1B_SHAPE)
        entry["peak_over_weights"] = entry["peak_bytes"] / entry["weight_bytes"]
        entry["target_bytes"] = TARGET_FACTOR * entry["weight_bytes"] + TARGET_EXTRA
        scenarios.append(entry)
        log(f"memory: {kind:8s} prompt {prompt_tokens:5d}: peak {entry['peak_bytes'] / common.GIB:.2f} GiB "
            f"({entry['peak_over_weights']:.2f} × weights of {entry['weight_bytes'] / common.GIB:.2f} GiB)")
    targets = [common.target(
        f"peak RSS, patched, prompt {s['prompt_tokens']}", "≤ 1.15 × weights + 0.5 GiB "
        f"= {s['target_bytes'] / common.GIB:.2f} GiB", f"{s['peak_bytes'] / common.GIB:.2f} GiB",
        s["peak_bytes"] <= s["target_bytes"]) for s in scenarios if s["kind"] == "patched"]
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(scenarios, out_dir / "memory.png")
    data = {"settings": {**settings, "scenarios": [list(s) for s in settings["scenarios"]]},
            "method": __doc__.strip(), "scenarios": scenarios, "targets": targets}
    common.write_result("memory", data, out_dir, mode, started)
    return data


if __name__ == "__main__":
    print(json.dumps(worker(**json.loads(sys.argv[1]))))
