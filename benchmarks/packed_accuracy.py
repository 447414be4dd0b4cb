"""Per-layer cosine of SmolLM2's packed decode (its GGUF's own Q4_1, on the emulated NPU2) next to HF bf16's own
distance, both against an fp32 run of the same GGUF weights dequantized exactly.

    python -m benchmarks.packed_accuracy

Every position runs as a decode step (``compare_layers(..., decode=True)``): the packed GEMVs, not prefill.
"""
from __future__ import annotations

import torch

PROMPT = "What is the capital of France? Answer in one word."


def main() -> None:
    from torch_npu2 import patch_llama
    from torch_npu2.patch_llama import compare_layers
    from torch_npu2.patch_llama.models import load_model

    from . import common

    hf, tokenizer = load_model()                          # transformers' dequantized model, bf16
    fp32, _ = load_model(dtype=torch.float32)             # the same GGUF values, exact in fp32, fp32 compute
    packed, _ = load_model(weights="native")              # Q4_1 projections packed from the file
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    bf16_report = compare_layers(fp32, hf, ids, decode=True)
    with common.emulated_runtime():
        patch_llama(packed)
        packed_report = compare_layers(fp32, packed, ids, decode=True)
    print(f"{ids.shape[1]} tokens, each a decode step; cosine against fp32")
    print(f"{'layer':<10} {'HF bf16 min':>12} {'HF bf16 mean':>12} {'packed min':>12} {'packed mean':>12}")
    for a, b in zip(bf16_report, packed_report):
        print(f"{a.name:<10} {a.min_cosine:>12.6f} {a.mean_cosine:>12.6f} {b.min_cosine:>12.6f} {b.mean_cosine:>12.6f}")


if __name__ == "__main__":
    main()
