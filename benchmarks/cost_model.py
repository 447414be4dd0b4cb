"""A predicted-NPU view: a small cost MODEL of NPU2 run times, never a measurement.

time(one ELF run) = dispatch + Σ over its launches (step + bytes moved / DDR bandwidth
                      + GEMM FLOPs / GEMM throughput + attention FLOPs / attention throughput)

- bytes moved by a launch: the bytes of every argument it reads or writes (from the Program's args);
- FLOPs: gemm/gemv/gemv_f32 2·M·K·N (M = 1 for a GEMV), causal attention
  2·heads·seq²·head_dim (half of the full 4·heads·seq²·head_dim); elementwise launches count bytes only;
- constants fitted (least squares on relative error, dispatch and step bounded to the ranges FACTS.md
  gives: 50–110 µs per dispatch, 3–15 µs per step) to the reference implementation's published per-call
  times for Llama-3.2-1B on Strix (FACTS.md), whose Programs have the same launches as ours.
The fitted model is then applied to our Programs (``kernels.programs.programs_for_model``) with our bucket
choices, and to the reference's fixed-2048 prefill.
"""
from __future__ import annotations

import itertools
import json
import time

import numpy as np

from . import common

LLAMA_1B_LAYERS = 16
REFERENCE_SEQ = 2048
# (Program, its sequence length or None for decode programs, published ms per call incl. BO write/read)
CALIBRATION = (
    ("rms_gemms_rope", REFERENCE_SEQ, 7.3),
    ("flash_attn", REFERENCE_SEQ, 21.6),
    ("o_ffn", REFERENCE_SEQ, 41.0),
    ("rms_gemv_rope", None, 0.9),
    ("o_gemv_ffn", None, 3.6),  # the 8-launch version (ours now fuses into 4 launches); the 3-launch one: 2.6 ms
    ("lm_head_gemv", None, 13.6),
)
PUBLISHED_TOTALS = {"prefill_2048_s": 1.27, "decode_ms_per_token": 92.0, "decode_ms_per_token_3_launch_ffn": 78.0,
                    "decode_cpu_attention_ms_per_token": 4.5}
BOUNDS = {"dispatch_s": (50e-6, 110e-6), "step_s": (3e-6, 15e-6)}
FEATURES = ("dispatch_s", "step_s", "s_per_byte", "s_per_gemm_flop", "s_per_attention_flop")
# Largest |relative residual| the fit is allowed on its calibration points (tests hold the model to it).
# The worst point is rms_gemv_rope (model ≈ −36%): its three small GEMVs (12.6 MB) ran at ≈ 16 GB/s effective
# on the reference, half the bandwidth of the large ones, which one bandwidth constant cannot capture.
CALIBRATION_TOLERANCE = 0.40
PROMPTS = (16, 32, 128, 512, 1024, 2048)


def llama_1b_dims():
    from torch_npu2.kernels.programs import ModelDims

    return ModelDims.from_config(common.llama_config(**common.LLAMA_1B_SHAPE))


def launch_flops(launch) -> tuple[float, float]:
    """(GEMM FLOPs, attention FLOPs) of one launch."""
    p = launch.p
    if launch.kind in ("gemm", "gemv", "gemv_f32", "gemv_add", "rms_gemv", "swiglu_gemv_add"):
        return 2.0 * p.get("M", 1) * p["K"] * p["N"], 0.0
    if launch.kind == "attention":
        return 0.0, 2.0 * p["heads"] * p["seq"] ** 2 * p["head_dim"]
    return 0.0, 0.0


def features(program) -> np.ndarray:
    """The model's inputs for one run of ``program``: [runs, launches, bytes, GEMM FLOPs, attention FLOPs]."""
    moved = gemm = attention = 0.0
    for launch in program.launches:
        moved += sum(program.arg(name).nbytes for name in set(launch.reads + launch.writes))
        g, a = launch_flops(launch)
        gemm, attention = gemm + g, attention + a
    return np.array([1.0, len(program.launches), moved, gemm, attention])


def program(name: str, dims, seq: int | None = None):
    from torch_npu2.kernels import programs

    d = dims
    build = {
        "rms_gemms_rope": lambda: programs.rms_gemms_rope(d.hidden, d.heads, d.kv_heads, d.head_dim, d.eps, seq),
        "flash_attn": lambda: programs.flash_attn(d.heads, d.kv_heads, d.head_dim, seq),
        "o_ffn": lambda: programs.o_ffn(d.hidden, d.q_dim, d.intermediate, d.eps, seq),
        "rms_gemv_rope": lambda: programs.rms_gemv_rope(d.hidden, d.heads, d.kv_heads, d.head_dim, d.eps),
        "o_gemv_ffn": lambda: programs.o_gemv_ffn(d.hidden, d.q_dim, d.intermediate, d.eps),
        "lm_head_gemv": lambda: programs.lm_head_gemv(d.hidden, d.vocab),
    }
    return build[name]()


def _bounded_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of x·c ≈ y with c[0], c[1] in BOUNDS and c[2:] ≥ 0: the best feasible active set.

    Each coefficient is either free or held at one of its bounds; the constrained optimum is the feasible
    candidate of lowest cost (small enough to enumerate: 3·3·2·2·2 active sets).
    """
    choices = [(None, *BOUNDS["dispatch_s"]), (None, *BOUNDS["step_s"])] + [(None, 0.0)] * 3
    lower = [BOUNDS["dispatch_s"][0], BOUNDS["step_s"][0], 0.0, 0.0, 0.0]
    upper = [BOUNDS["dispatch_s"][1], BOUNDS["step_s"][1], np.inf, np.inf, np.inf]
    best, best_cost = None, np.inf
    for held in itertools.product(*choices):
        coefficients = np.array([0.0 if h is None else h for h in held])
        free = [i for i, h in enumerate(held) if h is None]
        rest = y - x @ coefficients
        if free:
            coefficients[free] = np.linalg.lstsq(x[:, free], rest, rcond=None)[0]
        if any(c < lo - 1e-15 or c > hi + 1e-15 for c, lo, hi in zip(coefficients, lower, upper)):
            continue
        cost = float(np.sum((x @ coefficients - y) ** 2))
        if cost < best_cost:
            best, best_cost = coefficients, cost
    return best


class CostModel:
    def __init__(self, coefficients):
        self.coefficients = np.asarray(coefficients, dtype=float)

    @classmethod
    def calibrated(cls, dims=None) -> "CostModel":
        dims = dims or llama_1b_dims()
        x = np.array([features(program(name, dims, seq)) for name, seq, _ in CALIBRATION])
        y = np.array([ms / 1e3 for _, _, ms in CALIBRATION])
        weights = 1.0 / y  # relative error: a 0.9 ms kernel counts as much as a 41 ms one
        return cls(_bounded_fit(x * weights[:, None], y * weights))

    def seconds(self, program) -> float:
        return float(features(program) @ self.coefficients)

    def constants(self) -> dict:
        d, s, per_byte, per_gemm, per_attention = self.coefficients
        rate = (lambda inverse, unit: 1.0 / inverse / unit if inverse > 0 else float("inf"))
        return {"dispatch_us": float(d * 1e6), "step_us": float(s * 1e6), "ddr_gb_per_s": float(rate(per_byte, 1e9)),
                "gemm_tflop_per_s": float(rate(per_gemm, 1e12)),
                "attention_tflop_per_s": float(rate(per_attention, 1e12))}

    def residuals(self, dims=None) -> list[dict]:
        dims = dims or llama_1b_dims()
        rows = []
        for name, seq, ms in CALIBRATION:
            predicted = self.seconds(program(name, dims, seq)) * 1e3
            rows.append({"program": name, "seq": seq, "published_ms": ms, "model_ms": predicted,
                         "relative_residual": predicted / ms - 1.0})
        return rows

    def decode_ms(self, dims, layers: int) -> float:
        """NPU time of one decode token: per layer rms_gemv_rope + o_gemv_ffn, then the LM head."""
        per_layer = self.seconds(program("rms_gemv_rope", dims)) + self.seconds(program("o_gemv_ffn", dims))
        return (layers * per_layer + self.seconds(program("lm_head_gemv", dims))) * 1e3

    def prefill_ms(self, dims, layers: int, chunks) -> float:
        """NPU time of a prefill over ``chunks`` [(start, stop, padded)], following NpuDecoderLayer: flash_attn
        runs on the NPU only for a single chunk (several chunks attend on the host, not modelled here)."""
        per_layer = 0.0
        for _, _, padded in chunks:
            per_layer += self.seconds(program("rms_gemms_rope", dims, padded))
            per_layer += self.seconds(program("o_ffn", dims, padded))
            if len(chunks) == 1:
                per_layer += self.seconds(program("flash_attn", dims, padded))
        return (layers * per_layer + self.seconds(program("lm_head_gemv", dims))) * 1e3


def predictions(model: CostModel, prompts=PROMPTS, host_ms_per_token: float | None = None) -> dict:
    from .work import shared_state

    dims, layers, state = llama_1b_dims(), LLAMA_1B_LAYERS, shared_state()
    reference_chunks = [(0, REFERENCE_SEQ, REFERENCE_SEQ)]
    prefill = []
    for length in prompts:
        ours = model.prefill_ms(dims, layers, state.chunks(length))
        reference = model.prefill_ms(dims, layers, reference_chunks)
        prefill.append({"prompt_tokens": length, "buckets": [p for _, _, p in state.chunks(length)],
                        "ours_ms": ours, "reference_fixed_2048_ms": reference, "speedup": reference / ours})
    npu_ms = model.decode_ms(dims, layers)
    decode = {"npu_ms_per_token": npu_ms, "host_ms_per_token_measured_here": host_ms_per_token,
              "total_ms_per_token": npu_ms + (host_ms_per_token or 0.0),
              "tokens_per_s": 1e3 / (npu_ms + (host_ms_per_token or 0.0)),
              "reference_published_ms_per_token": PUBLISHED_TOTALS["decode_ms_per_token"]}
    return {"prefill": prefill, "decode": decode}


def _host_ms(out_dir) -> float | None:
    """Host time per decode token measured by the host-overhead benchmark (shortest context), if it ran."""
    path = out_dir / "host_overhead.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())["contexts"][0]["token_ms"]


def plot(data: dict, path) -> None:
    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    rows = data["predictions"]["prefill"]
    lengths = [r["prompt_tokens"] for r in rows]
    left.plot(lengths, [r["reference_fixed_2048_ms"] for r in rows], marker="o", color="tab:red",
              label="reference scheme (pad to 2048)")
    left.plot(lengths, [r["ours_ms"] for r in rows], marker="o", color="tab:blue", label="ours (buckets)")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("prompt tokens")
    left.set_ylabel("predicted prefill, ms")
    left.set_title("MODEL, not a measurement: NPU2 prefill, 1B shape", fontsize=10)
    left.legend(fontsize=8)
    decode = data["predictions"]["decode"]
    host = decode["host_ms_per_token_measured_here"] or 0.0
    bars = {"ours (model + host measured here)": (decode["npu_ms_per_token"], host),
            "reference (published)": (PUBLISHED_TOTALS["decode_ms_per_token"], 0.0)}
    names = list(bars)
    right.bar(names, [v[0] for v in bars.values()], label="NPU kernels (model) / published total")
    right.bar(names, [v[1] for v in bars.values()], bottom=[v[0] for v in bars.values()],
              label="host time (measured, compute=False)")
    right.set_ylabel("ms per decode token")
    right.set_title("MODEL, not a measurement: NPU2 decode, 1B shape", fontsize=10)
    right.legend(fontsize=8)
    common.save_figure(fig, path)


def run(mode: str, out_dir, log=print) -> dict:
    started = time.perf_counter()
    model = CostModel.calibrated()
    residuals = model.residuals()
    worst = max(abs(r["relative_residual"]) for r in residuals)
    dims = llama_1b_dims()
    reference_prefill_model = model.prefill_ms(dims, LLAMA_1B_LAYERS, [(0, REFERENCE_SEQ, REFERENCE_SEQ)])
    data = {
        "label": "MODEL (predicted NPU2 times), not a measurement",
        "method": __doc__.strip(),
        "calibration": {"points": residuals, "worst_relative_residual": worst, "tolerance": CALIBRATION_TOLERANCE,
                        "constants": model.constants(), "coefficients": [float(c) for c in model.coefficients],
                        "features": list(FEATURES)},
        "validation": {"reference_prefill_2048_model_npu_s": reference_prefill_model / 1e3,
                       "reference_prefill_2048_published_s": PUBLISHED_TOTALS["prefill_2048_s"],
                       "reference_decode_model_npu_ms": model.decode_ms(dims, LLAMA_1B_LAYERS),
                       "reference_decode_published_ms": PUBLISHED_TOTALS["decode_ms_per_token"],
                       "note": "published totals include host time (embedding, CPU attention, Python), the "
                               "model covers NPU runs only"},
        "predictions": predictions(model, host_ms_per_token=_host_ms(out_dir)),
    }
    constants = data["calibration"]["constants"]
    log(f"model: dispatch {constants['dispatch_us']:.0f} µs, step {constants['step_us']:.1f} µs, DDR "
        f"{constants['ddr_gb_per_s']:.1f} GB/s, GEMM {constants['gemm_tflop_per_s']:.2f} TFLOP/s, attention "
        f"{constants['attention_tflop_per_s']:.2f} TFLOP/s; worst calibration residual {worst:.1%}")
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(data, out_dir / "cost_model.png")
    common.write_result("cost_model", data, out_dir, mode, started)
    return data
