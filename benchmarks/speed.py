"""Decode and prefill, side by side: HF eager on the CPU vs the patched model on the emulated NPU2.

Both run in this process on the same weights. Memory choice: two models (the HF reference and a deep
copy that gets patched) are kept side by side, so HF and patched runs can alternate within every repeat
and machine noise hits both. For the 1B shape that is 2 × 2.5 GB of 24 GB; the alternative
(unpatch/re-patch one model between runs) copies all weights twice per switch.
"""
from __future__ import annotations

import copy
import cProfile
import time

import torch

from . import common
from .host_overhead import hot_functions

SETTINGS = {
    "quick": dict(lengths=(32, 128), decode_steps=8, repeats=3),
    "full": dict(lengths=(32, 128, 512, 2048), decode_steps=32, repeats=3),
}
MODELS = {
    "llama-3.2-1b-shape (random)": common.llama_1b,
    "smollm2-135m-instruct": common.load_smollm2,
}


def preload_programs(model, runtime, lengths) -> None:
    """Write and load every Program the runs will use, so that one-time costs stay out of the timings."""
    from torch_npu2.kernels.catalog import programs_for_model
    from torch_npu2.patch_llama.families import model_dims
    from torch_npu2.patch_llama.patch import STATE_ATTR

    state = getattr(model, STATE_ATTR)
    settings, (weights, head_weights) = state.shared.settings, state.weights
    buckets = sorted({padded for length in lengths for _, _, padded in settings.chunks(length)})
    for program in programs_for_model(model_dims(model.config), buckets, settings.matmul_precision,
                                      weights, head_weights):
        runtime.load(program)


def compare_model(name: str, build, lengths, decode_steps: int, repeats: int, log=print) -> dict:
    import torch_npu2

    started = time.perf_counter()
    reference = build()
    patched = copy.deepcopy(reference)
    build_s = time.perf_counter() - started
    runs = {(kind, length): [] for kind in ("hf", "npu2") for length in lengths}
    runs_per_generate = {}
    with common.emulated_runtime(compute=True) as runtime:
        torch_npu2.patch_llama(patched)
        preload_programs(patched, runtime, lengths)
        vocab = reference.config.vocab_size
        warm = common.random_prompt(8, vocab)
        for model in (reference, patched):
            common.timed_generate(model, warm, 2)
        for repeat in range(repeats):
            # Alternate which side goes first, so a slow spell of the machine does not always hit one side.
            order = ("hf", "npu2") if repeat % 2 == 0 else ("npu2", "hf")
            for length in lengths:
                ids = common.random_prompt(length, vocab)
                for kind in order:
                    model = reference if kind == "hf" else patched
                    before = runtime.xrt.counters["runs"]
                    prefill, steps = common.timed_generate(model, ids, decode_steps)
                    runs[kind, length].append((prefill, common.median(steps)))
                    if kind == "npu2":
                        runs_per_generate[length] = runtime.xrt.counters["runs"] - before
                    log(f"  {name} repeat {repeat + 1}/{repeats} prompt {length:5d} {kind:4s}: prefill "
                        f"{prefill * 1e3:9.1f} ms, decode {common.median(steps) * 1e3:8.1f} ms/token")
        profile = cProfile.Profile()
        common.timed_generate(patched, common.random_prompt(lengths[0], vocab), decode_steps,
                              on_first_step=profile.enable)
        profile.disable()
    rows = []
    for length in lengths:
        hf, npu = runs["hf", length], runs["npu2", length]
        hf_prefill, npu_prefill = common.median(p for p, _ in hf), common.median(p for p, _ in npu)
        hf_decode, npu_decode = common.median(d for _, d in hf), common.median(d for _, d in npu)
        rows.append({
            "prompt_tokens": length,
            "hf_prefill_ms": hf_prefill * 1e3, "npu2_prefill_ms": npu_prefill * 1e3,
            "prefill_ratio": npu_prefill / hf_prefill,
            "hf_decode_ms_per_token": hf_decode * 1e3, "npu2_decode_ms_per_token": npu_decode * 1e3,
            "decode_ratio": npu_decode / hf_decode,
            "npu_runs_per_generate": runs_per_generate[length],
            "raw_seconds": {"hf": hf, "npu2": npu},
        })
    result = {"model": name, "layers": reference.config.num_hidden_layers,
              "weight_bytes": common.weight_bytes(reference),
              "attn_implementation": reference.config._attn_implementation,
              "build_seconds": build_s, "rows": rows,
              "patched_decode_hot_functions": {"prompt_tokens": lengths[0],
                                               "functions": hot_functions(profile, decode_steps)}}
    return result


def plot(models: list[dict], path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.6 * len(models)), squeeze=False)
    for row, entry in zip(axes, models):
        lengths = [r["prompt_tokens"] for r in entry["rows"]]
        for ax, what, unit in ((row[0], "prefill", "ms"), (row[1], "decode", "ms / token")):
            key = "prefill_ms" if what == "prefill" else "decode_ms_per_token"
            x = range(len(lengths))
            ax.bar([i - 0.2 for i in x], [r[f"hf_{key}"] for r in entry["rows"]], 0.4, label="HF eager (CPU)")
            ax.bar([i + 0.2 for i in x], [r[f"npu2_{key}"] for r in entry["rows"]], 0.4,
                   label="patched (emulated NPU2)")
            for i, r in zip(x, entry["rows"]):
                ax.annotate(f"{r[f'{what}_ratio']:.2f}×", (i + 0.2, r[f"npu2_{key}"]), ha="center",
                            va="bottom", fontsize=8)
            ax.set_xticks(list(x), [str(n) for n in lengths])
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(unit)
            ax.set_title(f"{entry['model']}: {what} (median)", fontsize=9)
            ax.legend(fontsize=8)
    fig.suptitle("Measured on this CPU: HF eager vs patched model on the emulated NPU2 (ratio = patched / HF)",
                 fontsize=10)
    common.save_figure(fig, path)


def run(mode: str, out_dir, log=print) -> dict:
    started = time.perf_counter()
    settings = SETTINGS[mode]
    torch.manual_seed(0)
    models = []  # one model at a time: the 1B pair is freed before SmolLM2 loads
    for name, build in MODELS.items():
        log(f"speed: {name}")
        models.append(compare_model(name, build, **settings, log=log))
    worst_decode = max(r["decode_ratio"] for m in models for r in m["rows"])
    worst_prefill = max(r["prefill_ratio"] for m in models for r in m["rows"])
    targets = [
        common.target("decode: patched / HF", "≤ 1.0", f"worst {worst_decode:.2f}", worst_decode <= 1.0),
        common.target("prefill: patched / HF", "≤ 1.0", f"worst {worst_prefill:.2f}", worst_prefill <= 1.0),
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(models, out_dir / "speed.png")
    data = {"settings": settings,
            "method": ("generate() greedy, one call per (model, prompt, repeat): prefill = generate start to the "
                       "first logits-processor call; decode = median gap between later calls. Medians over repeats; "
                       "HF and patched alternate within each repeat. Two models in memory (HF reference + patched "
                       "deep copy). Patched side: EmulatedXrt(coherency='fast', compute=True)."),
            "models": models, "targets": targets}
    common.write_result("speed", data, out_dir, mode, started)
    return data
