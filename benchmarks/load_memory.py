"""Peak RSS of loading the default SmolLM2 GGUF and patching it from its own blocks, in this (fresh) process.

    python -m benchmarks.load_memory native   # Q4_1 projections never dequantized (load_model(weights="native"))
    python -m benchmarks.load_memory bf16     # transformers' dequantizing loader, then patch_llama(gguf=…)

VmRSS and VmHWM (peak RSS) from /proc/self/status after each phase, on a fast-coherency emulated NPU2.
"""
from __future__ import annotations

import sys

from . import common


def main(weights: str) -> None:
    import torch_npu2
    from torch_npu2.patch_llama.models import default_model_path, load_model

    phases = [("imports", common.proc_status_bytes("VmRSS"), common.proc_status_bytes("VmHWM"))]

    def phase(name):
        phases.append((name, common.proc_status_bytes("VmRSS"), common.proc_status_bytes("VmHWM")))

    model, tokenizer = load_model(weights=weights)
    phase("loaded")
    with common.emulated_runtime():
        torch_npu2.patch_llama(model, gguf=default_model_path())
        phase("patched")
        ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
        model.generate(ids, max_new_tokens=8, do_sample=False)
        phase("generated 8 tokens")
    print(model.torch_npu2_weights.note())
    for name, rss, hwm in phases:
        print(f"{name:20s} RSS {rss / 2**20:7.1f} MiB  peak {hwm / 2**20:7.1f} MiB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "native")
