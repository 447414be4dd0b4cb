"""Benchmarks of torch_npu2: `python -m benchmarks <subcommand> [--quick | --full]`.

Sections: speed (HF eager vs patched, decode and prefill), host (host overhead per decode token),
memory (peak RSS vs weight bytes), work (prefill padding), model (predicted NPU2 times: a cost model).
Results (JSON, PNG, summary.md) go to benchmarks/results/.
"""
