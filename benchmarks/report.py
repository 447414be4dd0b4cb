"""Markdown from the result files: ``summary.md`` next to them, and (``publish``) the README section."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import common, cost_model

SECTIONS = ("speed", "host_overhead", "memory", "work", "cost_model")
README = Path(__file__).resolve().parent / "README.md"
FIGURES = Path(__file__).resolve().parent / "figures"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def load(out_dir: Path) -> dict:
    return {name: json.loads((out_dir / f"{name}.json").read_text())
            for name in SECTIONS if (out_dir / f"{name}.json").exists()}


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def _machine(results: dict) -> list[str]:
    first = next(iter(results.values()))
    m, modes = first["machine"], sorted({r["mode"] for r in results.values()})
    loads = [r["machine"]["load_average"][0] for r in results.values()]
    commits = {name: r["machine"]["git_commit"] for name, r in results.items()}
    commit = (f"commit {m['git_commit']}" if len(set(commits.values())) == 1 else
              "commits " + ", ".join(f"{c} ({name})" for name, c in commits.items()))
    return [f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; Python {m['python']}, torch "
            f"{m['torch']}, transformers {m['transformers']}; {commit}; mode {', '.join(modes)}; "
            f"finished {max(r['finished'] for r in results.values())}. 1-minute load average when each section "
            f"finished: {', '.join(f'{x:.1f}' for x in loads)} (the machine is shared: other jobs ran at the same "
            f"time).", ""]


def _targets(results: dict) -> list[str]:
    rows = [[t["name"], t["target"], t["measured"], "met" if t["met"] else "**missed**"]
            for r in results.values() for t in r.get("targets", [])]
    return ["### Targets", ""] + _table(["what", "target", "measured", ""], rows) + [""]


def _speed(r: dict) -> list[str]:
    rows = []
    for m in r["models"]:
        for x in m["rows"]:
            rows.append([m["model"], x["prompt_tokens"], f"{x['hf_prefill_ms']:.0f}", f"{x['npu2_prefill_ms']:.0f}",
                         f"{x['prefill_ratio']:.2f}", f"{x['hf_decode_ms_per_token']:.1f}",
                         f"{x['npu2_decode_ms_per_token']:.1f}", f"{x['decode_ratio']:.2f}"])
    s = r["settings"]
    return (["### Speed: HF eager (CPU) vs patched on the emulated NPU2 (measured)", "",
             f"Medians over {s['repeats']} repeats, {s['decode_steps']} decode steps per run. {r['method']}", ""]
            + _table(["model", "prompt", "HF prefill ms", "patched prefill ms", "ratio", "HF decode ms/tok",
                      "patched decode ms/tok", "ratio"], rows) + [""])


def _host(r: dict) -> list[str]:
    rows = []
    for c in r["contexts"] + r.get("hf_cache_contexts", []):
        ops = c["ops"]
        head = next((n for n in ("lm_head_gemv_packed", "lm_head_gemv") if n in ops), "lm_head_gemv")
        rows.append([c.get("cache", "hf"), c["context_tokens"], f"{c['token_ms']:.2f}", f"{c['host_attention_ms']:.2f}",
                     f"**{c['host_overhead_ms']:.2f}**",
                     *(f"{ops[n]['us_per_call']:.0f} ({ops[n]['dispatch_and_checks_us_per_call']:.0f})" if n in ops
                       else "–" for n in ("rms_gemv_rope", "o_gemv_ffn_rms_gemv_rope", "o_gemv_ffn", head)),
                     f"{c['mean_layer']['glue_us']:.0f}", f"{c['outside_layers_ms']:.2f}"])
    d = r["dispatch"]
    return (["### Host time per decode token (1B shape, compute=False, measured)", ""]
            + _table(["cache", "context", "token ms", "host attention ms", "overhead ms", "rms_gemv_rope µs (dispatch+checks)",
                      "o_gemv_ffn_rms_gemv_rope µs (…)", "o_gemv_ffn µs (…)", "LM head GEMV µs (…)",
                      "layer glue µs", "outside layers ms"], rows)
            + ["", f"Bare torch.library dispatch per call: Library define/impl {d['library_dispatch_us']:.1f} µs, "
                   f"custom_op {d['custom_op_dispatch_us']:.1f} µs (over a {d['plain_python_call_us']:.1f} µs plain "
                   f"call). HF's own generate() cost per token with {r['hf_framework']['layers']} layers of "
                   f"negligible width: {r['hf_framework']['token_ms']:.2f} ms. Torch threads: {r['torch_threads']}.",
               ""])


def _memory(r: dict) -> list[str]:
    rows = []
    for s in r["scenarios"]:
        phases = ", ".join(f"{p['phase']} {p['rss_bytes'] / common.GIB:.2f}" for p in s["phases"])
        rows.append([s["kind"], s["prompt_tokens"], f"{s['weight_bytes'] / common.GIB:.2f}",
                     f"{s['peak_bytes'] / common.GIB:.2f}", f"{s['peak_over_weights']:.2f}", phases])
    return (["### Memory (1B shape, fresh process per scenario, measured)", ""]
            + _table(["scenario", "prompt", "weights GiB", "peak RSS GiB", "peak / weights",
                      "RSS after each phase, GiB"], rows) + [""])


def _work(r: dict) -> list[str]:
    rows = [[n, f"{v['ours']:.2f}", f"{v['reference']:.1f}"] for n, v in r["summary"].items()]
    return (["### Prefill work: rows processed / prompt rows (computed from the bucket code, cross-checked)", ""]
            + _table(["prompt tokens", "ours", "reference (pad to 2048)"], rows)
            + ["", f"Cross-check on the emulator: {len(r['cross_check']) - r['cross_check_mismatches']}/"
                   f"{len(r['cross_check'])} prompt lengths ran exactly the computed rows.", ""])


def _range(values, digits: int = 2) -> str:
    """A predicted range, or a dash where a Program has no such variant."""
    return "—" if values is None else cost_model.span(values, digits)


def _cost_model(r: dict) -> list[str]:
    programs = []
    for p in r["per_program"]:
        largest = max(p["compute_ms_by_class"].items(), key=lambda kv: kv[1][1])
        programs.append([p["program"], p["seq"] or "decode", _range(p["predicted_ms"]),
                         _range(p["predicted_ms_w8x2a16"]), _range(p["predicted_ms_bfp16_gate_up"]),
                         _range(p["predicted_ms_bfp16"]),
                         p["upstream_published_ms"], p["upstream_against_range"], p["launch_iterations"],
                         f"{p['ddr_mb']:.0f}", f"{largest[0]} {_range(largest[1])}"])
    prefill = [[p["prompt_tokens"], "+".join(map(str, p["buckets"])),
                *(_range(p[f"predicted_ms_{precision}"], 0) for precision in cost_model.PRECISIONS),
                f"{p['upstream_published_ms']:.0f}"] for p in r["predictions"]["prefill"]]
    d, head, ends = r["predictions"]["decode"], r["headline"], r["constants"]["ends"]
    conditions = [(p["program"], p["seq"] or "decode", c) for p in r["per_program"] for c in p.get("conditions", [])]
    evaluated = [f"{name} {seq} `{c['text']}` taken in {c['work_share']:.1%} of executions, {c['time_share']:.1%} "
                 f"for the slowest tile" for name, seq, c in conditions if not c["unevaluated"]]
    unevaluated = [f"{name} {seq} `{c['text']}` ({c['unevaluated']})" for name, seq, c in conditions
                   if c["unevaluated"]]

    def replay(rows, label, extra_header, extra):
        return _table([label, "upstream measured ms", "predicted ms (fast–slow)", "predicted / measured",
                       "measured against the range", *extra_header],
                      [[row_label(g), _range(g["measured_ms"], 3), _range(g["predicted_ms"], 3),
                        _range(g["predicted_over_measured"]) + "×", g["measured_against_range"], *extra(g)]
                       for g in rows])

    def row_label(g):
        if "heads" in g:
            return f"{g['seq']}, {g['heads']}/{g['kv_heads']} heads"
        return "×".join(map(str, g["shape"]))

    return (["### Predicted NPU2 times from our emitted IR and what the core executes — a MODEL, not a measurement",
             "", "Llama-3.2-1B. Every prediction is a range from its fast end to its slow end "
             "(`kernels/timing.py`):", "",
             *(f"- **{name}**: {end['assumption']}." for name, end in ends.items()), "",
             f"Headline, default precision, NPU only: prefill of 2048 tokens {_range(head['prefill_2048_s'])} s, "
             f"decode {_range([s * 1e3 for s in head['decode_token_s']], 1)} ms per token.", "",
             "Upstream: published per-call times on Strix (KERNELS.md), against the like-for-like range (bfp16 "
             "multiplies, upstream's; flash_attn's are exact in ours and BFP16 only in this column).", ""]
            + _table(["program", "seq", "predicted ms (bf16 GEMMs)", "predicted ms (w8x2a16 GEMMs, the default)",
                      "predicted ms (bfp16 gate/up GEMM)", "predicted ms (bfp16 multiplies)",
                      "upstream published ms (bfp16 multiplies)",
                      "upstream against the like-for-like range",
                      "launch iterations", "DDR MB", "largest compute class (ms per tile)"], programs) + [""]
            + _table(["prompt", "our buckets", *(f"predicted prefill ms ({precision})" for precision in
                                                   cost_model.PRECISIONS), "upstream published ms (pad to 2048)"],
                     prefill)
            + ["", "Branches (`scf.if`), counted as the IR executes them: " + ("; ".join(evaluated) or "none")
               + ". Conditions the model could not evaluate (counted as always taken): "
               + ("; ".join(unevaluated) or "none") + "."]
            + ["", cost_model.decode_line(d), ""]
            + ["Upstream's measured kernels (mlir-air kernel registry, NPU2) through the model. Drain GEMMs, BFP16 "
               "multiplies, our gemm builder at upstream's tiling (the fast end's DDR rate comes from "
               "2048×8192×2048):",
               ""]
            + replay(r["upstream_gemm_replay"], "M×K×N", ["upstream tiles m/k_l2/k_l1/n", "predicted ms, our tiling"],
                     lambda g: ["/".join(map(str, g["tiles"])), _range(g["predicted_ours_ms"], 3)])
            + ["", "Flash attention, causal, head_dim 64 (upstream: 32 tiles, BFP16 multiplies), our flash_attn "
               "Program of the same shape with BFP16 multiplies:", ""]
            + replay(r["upstream_attention_replay"], "seq, heads", ["our tiles", "predicted ms, our exact bf16"],
                     lambda g: [g["tiles"], _range(g["predicted_exact_bf16_ms"])])
            + ["", "GEMVs at Llama-3.2-1B's shapes, our gemv builder at upstream's structure (the slow end's DDR rate "
               "comes from upstream's other GEMV shapes):", ""]
            + replay(r["upstream_gemv_replay"], "M×K", ["herd_m/tile_m/m_input"],
                     lambda g: ["/".join(map(str, g["tiles"]))])
            + [""])


RENDER = {"speed": _speed, "host_overhead": _host, "memory": _memory, "work": _work, "cost_model": _cost_model}
PLOTS = {"speed": "speed.png", "host_overhead": "host_overhead.png", "memory": "memory.png", "work": "work.png",
         "cost_model": "cost_model.png"}


def markdown(results: dict, figures: str | None = None) -> str:
    """The results as markdown; ``figures`` is the relative folder of the PNGs to embed (None: none)."""
    lines = _machine(results) + _targets(results)
    for name, render in RENDER.items():
        if name in results:
            lines += render(results[name])
            if figures is not None:
                lines += [f"![{name}]({figures}/{PLOTS[name]})", ""]
    return "\n".join(lines)


def write_summary(out_dir: Path) -> Path:
    path = out_dir / "summary.md"
    path.write_text(markdown(load(out_dir), figures=".") + "\n")
    return path


def publish(out_dir: Path) -> Path:
    """Copy the PNGs to benchmarks/figures/ and replace the README's results block with the latest tables."""
    results = load(out_dir)
    if not results:
        raise FileNotFoundError(f"no result files in {out_dir}: run `python -m benchmarks all` first")
    FIGURES.mkdir(exist_ok=True)
    for name in results:
        shutil.copy(out_dir / PLOTS[name], FIGURES / PLOTS[name])
    text = README.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + markdown(results, figures="figures") + "\n" + text[stop:])
    return README
