"""Peak memory of the 1B-shaped model: build, patch, generate — each scenario in a fresh subprocess.

Each worker reads VmRSS and VmHWM (peak RSS) from /proc/self/status after every phase. The bar is the
bf16 weight bytes (each stored tensor once: the tied embedding/LM head counts once).
Targets: VmHWM ≤ 1.15 × weight bytes + 0.5 GiB patched in bf16 with bf16 prefill GEMMs ("patched"); the same plus
the integer GEMMs' prepared weight copies (2.25 bytes a projection weight) with the default prefill precision,
w8x2a16 ("patched_w8x2a16"); ≤ 0.40 × weight bytes + 0.5 GiB patched in Q4_1 (quantized at patch time, the bf16
originals set aside in a mapped file). The bf16 model is built in memory
before patch_llama sees it, so the build sets a floor of 1 × weight bytes under the peak of every scenario: the
patched scenarios also report the peak of patching and generating alone (VmHWM reset after the build).
Scenario loaded_q4_1 has no such floor: the random 1B-shaped checkpoint is first written to a temporary directory
(safetensors, by another process), then the measured process loads it with load_model's packed path
(``load_checkpoint_packed``: meta model, norms read, the bf16 embedding mapped from the file) and patch_llama
quantizes each projection and the LM head as it reads them; its peak is the whole process's, load included.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

from . import common

SETTINGS = {
    "quick": dict(scenarios=(("hf", 32), ("patched", 32), ("patched_w8x2a16", 32), ("patched_q4_1", 32),
                             ("loaded_q4_1", 32)), new_tokens=4),
    "full": dict(scenarios=(("hf", 32), ("patched", 32), ("patched", 2048), ("patched_w8x2a16", 32),
                            ("patched_w8x2a16", 2048), ("patched_q4_1", 32), ("loaded_q4_1", 32)), new_tokens=8),
}
TARGET_EXTRA = 0.5 * common.GIB
# × the bf16 weight bytes (patched_w8x2a16: plus its prepared copies' bytes)
TARGET_FACTORS = {"patched": 1.15, "patched_w8x2a16": 1.15, "patched_q4_1": 0.40, "loaded_q4_1": 0.40}
WEIGHTS = {"patched": "bf16", "patched_w8x2a16": "bf16", "patched_q4_1": "q4_1", "loaded_q4_1": "q4_1"}
PRECISIONS = {"patched": "bf16", "patched_w8x2a16": "w8x2a16"}  # the prefill GEMMs' (else the default's)
FROM_CHECKPOINT = {"loaded_q4_1"}  # loaded packed from a checkpoint on disk instead of built in memory


def _phase(phases: list, name: str) -> None:
    phases.append({"phase": name, "rss_bytes": common.proc_status_bytes("VmRSS"),
                   "hwm_bytes": common.proc_status_bytes("VmHWM")})


def worker(kind: str, prompt_tokens: int, new_tokens: int, shape: dict, checkpoint: str | None = None) -> dict:
    """One scenario, in this (fresh) process: ``kind`` is "hf" (unpatched), "patched" (emulated NPU2, bf16 weights,
    bf16 prefill GEMMs), "patched_w8x2a16" (the same with the default integer prefill GEMMs over prepared copies),
    "patched_q4_1" (Q4_1 weights quantized at patch time) or "loaded_q4_1" (the same, loaded packed from
    ``checkpoint``, a directory ``write_checkpoint`` wrote)."""
    import torch

    import torch_npu2

    phases = []
    _phase(phases, "imports")
    if kind in FROM_CHECKPOINT:
        from torch_npu2.patch_llama.models import load_checkpoint_packed

        model = load_checkpoint_packed(checkpoint, WEIGHTS[kind])
        weights = model.torch_npu2_weights.bf16_bytes  # each stored tensor once, as weight_bytes counts them
        _phase(phases, "loaded packed")
    else:
        model = common.random_llama(common.llama_config(**shape))
        weights = common.weight_bytes(model)
        _phase(phases, "model built")
    build_peak = phases[-1]["hwm_bytes"]
    # VmHWM from here on: the peak of patching and generating alone (a packed load has no bf16 build to leave out)
    reset = kind not in FROM_CHECKPOINT and _reset_peak()
    ids = common.random_prompt(prompt_tokens, model.config.vocab_size)
    with common.emulated_runtime(compute=True):
        if kind in WEIGHTS:
            torch_npu2.patch_llama(model, weights=WEIGHTS[kind], **({"matmul_precision": PRECISIONS[kind]}
                                                                    if kind in PRECISIONS else {}))
            _phase(phases, "patched")
        prepared = _prepared_bytes(model) if kind in WEIGHTS else 0
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0, eos_token_id=common.unreachable_eos(model))
        _phase(phases, f"generated {new_tokens} tokens")
    return {"kind": kind, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "weight_bytes": weights,
            "prepared_bytes": prepared, "phases": phases, "peak_bytes": max(build_peak, phases[-1]["hwm_bytes"]),
            "peak_after_build_bytes": phases[-1]["hwm_bytes"] if reset else None}


def _prepared_bytes(model) -> int:
    """Bytes of the integer prefill GEMMs' prepared weight copies a patched model holds (0 without them)."""
    prepared = [layer.forward.prepared for layer in model.model.layers]
    return sum(t.nbytes for p in prepared if p is not None for t in vars(p).values())


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0: /proc/self/clear_refs, value 5); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def write_checkpoint(directory: str, shape: dict) -> dict:
    """The random model of ``shape`` (``common.random_llama``) saved as a HF checkpoint (config.json, safetensors)."""
    model = common.random_llama(common.llama_config(**shape))
    model.save_pretrained(directory)
    return {"checkpoint": directory, "weight_bytes": common.weight_bytes(model)}


def _subprocess(spec: dict, what: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory", json.dumps(spec)], cwd=common.REPO_ROOT,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory worker {what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(kind: str, prompt_tokens: int, new_tokens: int, shape: dict) -> dict:
    spec = {"kind": kind, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "shape": shape}
    if kind not in FROM_CHECKPOINT:
        return _subprocess(spec, f"{kind}/{prompt_tokens}")
    with tempfile.TemporaryDirectory(prefix="torch_npu2_checkpoint_") as directory:
        _subprocess({"write_checkpoint": {"directory": directory, "shape": shape}}, "writing the checkpoint")
        return _subprocess({**spec, "checkpoint": directory}, f"{kind}/{prompt_tokens}")


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
    for factor, kind in {f: k for k, f in TARGET_FACTORS.items()}.items():  # one line per factor
        ax.axhline((factor * weights + TARGET_EXTRA) / common.GIB, color="k", ls="--" if kind == "patched" else ":",
                   lw=1, label=f"target ({WEIGHTS[kind]}) {factor:.2f} × weights + 0.5 GiB")
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
        if kind in TARGET_FACTORS:
            entry["target_bytes"] = (TARGET_FACTORS[kind] * entry["weight_bytes"] + TARGET_EXTRA
                                     + entry["prepared_bytes"])
        scenarios.append(entry)
        after = entry["peak_after_build_bytes"] if kind in TARGET_FACTORS else None
        patched = next((p["rss_bytes"] for p in entry["phases"] if p["phase"] == "patched"), None)
        log(f"memory: {kind:12s} prompt {prompt_tokens:5d}: peak {entry['peak_bytes'] / common.GIB:.2f} GiB "
            f"({entry['peak_over_weights']:.2f} × weights of {entry['weight_bytes'] / common.GIB:.2f} GiB)"
            + (f"; peak after the build (patch, generate) {after / common.GIB:.2f} GiB "
               f"({after / entry['weight_bytes']:.2f} × weights)" if after else "")
            + (f"; RSS after patching {patched / common.GIB:.2f} GiB" if patched else ""))
    targets = []
    for s in (s for s in scenarios if s["kind"] in TARGET_FACTORS):
        copies = f" + prepared copies {s['prepared_bytes'] / common.GIB:.2f} GiB" if s["prepared_bytes"] else ""
        goal = (f"≤ {TARGET_FACTORS[s['kind']]:.2f} × weights + 0.5 GiB{copies} = "
                f"{s['target_bytes'] / common.GIB:.2f} GiB")
        label = f"{s['kind']} ({WEIGHTS[s['kind']]}), prompt {s['prompt_tokens']}"
        targets.append(common.target(f"peak RSS, {label}", goal, f"{s['peak_bytes'] / common.GIB:.2f} GiB",
                                     s["peak_bytes"] <= s["target_bytes"]))
        if s["peak_after_build_bytes"] is not None:
            targets.append(common.target(f"peak RSS after the bf16 build (patch, generate), {label}", goal,
                                         f"{s['peak_after_build_bytes'] / common.GIB:.2f} GiB",
                                         s["peak_after_build_bytes"] <= s["target_bytes"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(scenarios, out_dir / "memory.png")
    data = {"settings": {**settings, "scenarios": [list(s) for s in settings["scenarios"]]},
            "method": __doc__.strip(), "scenarios": scenarios, "targets": targets}
    common.write_result("memory", data, out_dir, mode, started)
    return data


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    if "write_checkpoint" in request:
        print(json.dumps(write_checkpoint(**request["write_checkpoint"])))
    else:
        print(json.dumps(worker(**request)))
