"""Per-layer comparison of a patched model against a reference model (notebooks, tests)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerDiff:
    name: str
    min_cosine: float   # over positions (and batch rows), cosine along the hidden/vocab dim
    mean_cosine: float
    max_abs_diff: float


class LayerReport(list):
    """Rows of ``LayerDiff``; prints as a table, ``plot(path)`` writes a PNG (needs matplotlib)."""

    def __str__(self) -> str:
        lines = [f"{'layer':<10} {'min cos':>10} {'mean cos':>10} {'max |diff|':>11}"]
        lines += [f"{r.name:<10} {r.min_cosine:>10.6f} {r.mean_cosine:>10.6f} {r.max_abs_diff:>11.4g}" for r in self]
        return "\n".join(lines)

    def worst(self) -> LayerDiff:
        return min(self, key=lambda r: r.min_cosine)

    def plot(self, path) -> None:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError("LayerReport.plot needs matplotlib: pip install 'torch_npu2[plot]'") from exc
        fig, ax = plt.subplots(figsize=(8, 3.5))
        xs = range(len(self))
        ax.plot(xs, [r.min_cosine for r in self], marker="o", label="min cosine")
        ax.plot(xs, [r.mean_cosine for r in self], marker=".", label="mean cosine")
        ax.set_xticks(list(xs), [r.name for r in self], rotation=90, fontsize=7)
        ax.set_ylabel("cosine vs reference")
        ax.set_title("torch_npu2: per-layer agreement with the reference model")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _diff(name: str, ref: torch.Tensor, out: torch.Tensor, keep) -> LayerDiff:
    r, o = ref.float().reshape(-1, ref.shape[-1]), out.float().reshape(-1, out.shape[-1])
    if keep is not None:  # padding positions hold unspecified values in both models
        r, o = r[keep], o[keep]
    cos = F.cosine_similarity(r, o, dim=-1)
    return LayerDiff(name, cos.min().item(), cos.mean().item(), (r - o).abs().max().item())


def _layer_outputs_and_logits(model, input_ids, attention_mask):
    outputs = []
    hooks = [layer.register_forward_hook(lambda module, args, out: outputs.append(out))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, logits


def _stepwise_outputs_and_logits(model, input_ids, attention_mask):
    """The same, one token per forward through a KV cache: every position of a patched model runs its decode ops."""
    from transformers import DynamicCache

    steps, cache = [], DynamicCache()
    for t in range(input_ids.shape[1]):
        outputs = []
        hooks = [layer.register_forward_hook(lambda module, args, out: outputs.append(out))
                 for layer in model.model.layers]
        try:
            with torch.no_grad():
                mask = None if attention_mask is None else attention_mask[:, :t + 1]
                result = model(input_ids=input_ids[:, t:t + 1], attention_mask=mask, past_key_values=cache,
                               use_cache=True)
        finally:
            for hook in hooks:
                hook.remove()
        cache = result.past_key_values
        steps.append((outputs, result.logits))
    layers = [torch.cat([outputs[i] for outputs, _ in steps], dim=1) for i in range(len(steps[0][0]))]
    return layers, torch.cat([logits for _, logits in steps], dim=1)


def compare_layers(reference_model, patched_model, input_ids, attention_mask=None, decode: bool = False) -> LayerReport:
    """Cosine (min/mean over positions) and max |diff| of every decoder layer's output and of the logits.

    Padding positions (``attention_mask == 0``) are left out. ``decode``: feed the tokens one at a time through a
    KV cache, so that a patched model runs its decode ops (the GEMVs, packed ones included) at every position
    rather than its prefill; both models run that way.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"compare_layers: input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    run = _stepwise_outputs_and_logits if decode else _layer_outputs_and_logits
    ref_layers, ref_logits = run(reference_model, input_ids, attention_mask)
    out_layers, out_logits = run(patched_model, input_ids, attention_mask)
    if len(ref_layers) != len(out_layers):
        raise ValueError(f"compare_layers: the models ran {len(ref_layers)} and {len(out_layers)} decoder layers")
    keep = None if attention_mask is None else attention_mask.reshape(-1).bool()
    report = LayerReport(_diff(f"layer {i}", r, o, keep) for i, (r, o) in enumerate(zip(ref_layers, out_layers)))
    report.append(_diff("logits", ref_logits, out_logits, keep))
    return report
