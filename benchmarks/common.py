"""Shared pieces of the benchmarks: models, timed generation, machine description, result files."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
GIB = 1024 ** 3

# Llama-3.2-1B's shape (random weights: the benchmarks measure time and memory, not answers).
LLAMA_1B_SHAPE = dict(
    num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
    max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
)
def llama_config(**shape):
    from transformers import LlamaConfig

    return LlamaConfig(**shape)


def random_llama(config, seed: int = 0, std: float = 0.02):
    """A bf16 LlamaForCausalLM with random weights, built in seconds even at 1B parameters.

    The modules are created on the meta device (no init cost) and materialised once; matrices are
    filled from a shared pool of normal values at random offsets (a plain memcpy) instead of drawing
    a billion fresh samples, which takes minutes on two cores. Norm weights are 1, as HF initialises them.
    """
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives every parameter its own storage, untying lm_head from the embedding
    generator = torch.Generator().manual_seed(seed)
    pool = (torch.randn(1 << 22, generator=generator) * std).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)
                continue
            flat, filled = param.view(-1), 0
            offset = int(torch.randint(0, pool.numel(), (1,), generator=generator))
            while filled < flat.numel():
                take = min(flat.numel() - filled, pool.numel() - offset)
                flat[filled:filled + take].copy_(pool[offset:offset + take])
                filled, offset = filled + take, 0
    # Non-persistent buffers (the RoPE inverse frequencies) are garbage after to_empty: rebuild them.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()


def llama_1b(seed: int = 0):
    return random_llama(llama_config(**LLAMA_1B_SHAPE), seed)


def load_smollm2():
    from torch_npu2.patch_llama.models import load_model

    model, _ = load_model()
    return model


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, each stored tensor once (tied embeddings count once)."""
    seen, total = set(), 0
    for param in model.parameters():
        if param.untyped_storage().data_ptr() not in seen:
            seen.add(param.untyped_storage().data_ptr())
            total += param.numel() * param.element_size()
    return total


def random_prompt(length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed + length))


class StepClock:
    """A logits processor that timestamps every generation step.

    generate() calls it once after the prefill forward and once after each decode forward, so the gap
    from generate()'s start to the first call is the prefill, and the gaps between calls are decode steps.
    ``on_first_step`` runs after the prefill (used to reset per-op timers so they cover decode only).
    """

    def __init__(self, on_first_step=None):
        self.stamps: list[float] = []
        self.on_first_step = on_first_step

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == 1 and self.on_first_step is not None:
            self.on_first_step()
        return scores


def unreachable_eos(model) -> int:
    """An EOS id no logit can produce, so every run generates all its tokens. (``min_new_tokens`` would do
    it too, but its processor scans the whole vocabulary every step: +2.7 ms/token at 128k vocab.)"""
    return model.config.vocab_size


def timed_generate(model, ids: torch.Tensor, decode_steps: int, on_first_step=None, attention_mask=None,
                   **generate_kwargs) -> tuple[float, list[float]]:
    """Greedy generate() of ``decode_steps + 1`` tokens (every token real unless ``attention_mask`` says otherwise);
    returns (prefill seconds, per decode step seconds)."""
    from transformers import LogitsProcessorList

    clock = StepClock(on_first_step)
    new_tokens = decode_steps + 1
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids) if attention_mask is None else attention_mask,
                       max_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0, eos_token_id=unreachable_eos(model),
                       logits_processor=LogitsProcessorList([clock]), **generate_kwargs)
    stamps = [start] + clock.stamps
    return stamps[1] - stamps[0], [b - a for a, b in zip(stamps[1:], stamps[2:])]


def median(values) -> float:
    return float(statistics.median(values))


@contextmanager
def emulated_runtime(compute: bool = True):
    """A fresh fast-coherency emulated NPU2 with a private artifact cache, current inside the block."""
    import torch_npu2
    from torch_npu2.emulator import EmulatedXrt

    with tempfile.TemporaryDirectory(prefix="torch_npu2_bench_") as cache:
        runtime = torch_npu2.create_runtime(driver=EmulatedXrt(coherency="fast", compute=compute), cache_root=cache)
        with torch_npu2.use_runtime(runtime):
            yield runtime
        runtime.close()


@contextmanager
def torch_threads(count: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM, …) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def machine() -> dict:
    import transformers

    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": commit,
        "load_average": os.getloadavg(),
    }


def target(name: str, goal: str, measured: str, met: bool) -> dict:
    return {"name": name, "target": goal, "measured": measured, "met": bool(met)}


def write_result(name: str, data: dict, out_dir: Path, mode: str, started: float) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "mode": mode, "seconds": round(time.perf_counter() - started, 1),
               "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **data}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path) -> None:
    """Write a benchmark figure as PNG and free it (every section's plots go through here)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
