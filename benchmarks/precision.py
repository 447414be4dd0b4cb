"""Accuracy of each prefill matmul precision ("bf16", "bfp16", "bfp16_gate_up", "w8x2a16") against an fp32 run of
the same model (measured on the emulated NPU2), and the predicted prefill cost of each (a MODEL, not a measurement).

Per model and precision:
- ``compare_layers`` against the fp32 model on one prompt: the worst decoder layer's and the logits' minimum
  cosine over positions (and, for reference, HF's own bf16 run against the same fp32 model);
- the top-5 gate (tests/patch_llama/gate.py, vLLM's rule) against the fp32 model's greedy tokens, per prompt;
- first-token agreement: the first greedy token equals the fp32 model's, over the gate's prompts;
- on SmolLM2, the answer to "What is the capital of France?".
SmolLM2-135M-Instruct uses the gate's chat and raw prompts; the Llama-3.2-1B shape has random weights (no
tokenizer, so random token prompts) and, in quick mode, only 2 decoder layers, 4 prompts and 4 new tokens (on 2
shared cores a full 16-layer run of every variant takes hours).

Which GEMM's BFP16 conversion costs the accuracy (``sensitivity``): SmolLM2 with one projection at a time built
with BFP16 and the others exact (the catalog's per-projection choice swapped for the study, so the Programs,
their keys and the emulator's numerics are the real ones), ``compare_layers`` against fp32 on the same prompt.

"w8x2a16" (two int8 terms per weight, int16 activations: kernels/int_gemm.py) is a matmul precision with Programs
of its own. The other integer schemes (``STUDIES``), "int8" (W8A8) and "w8a16" (one int8 term per weight), have
the emulator's numerics but no builder, so they are not matmul precisions a user can pick: the catalog's
per-projection choice is swapped for the study (as in ``sensitivity``) and the Programs carry the integer precision
to the emulator, which quantizes the bf16 weights as prepared weights would be; patch_llama warns that the NPU could
not build them. ``integer_distances`` measures SmolLM2's distance to fp32 per integer scheme (and per projection),
and ``gemm_call_cycles`` the core cycles of one GEMM kernel call per precision (counted, at the timing model's
ends).

Predicted prefill cost: the timing model's range (``kernels/timing.py``) of each precision's Programs.
"""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from torch_npu2.kernels import catalog

from . import common, cost_model

PRECISIONS = ("bf16", "bfp16", "bfp16_gate_up", "w8x2a16")
# Study name → the GEMM precision of each projection (kernels/catalog.py's names). "w8a16_v_bf16": the V
# projection, the one whose integer GEMM alone costs SmolLM2 the most (README, "Integer GEMMs"), stays exact bf16;
# "w8a16_v_down_bf16": V and down do.
STUDIES = {"int8": lambda projection: "int8", "w8a16": lambda projection: "w8a16",
           "w8a16_v_bf16": lambda projection: "bf16" if projection == "v" else "w8a16",
           "w8a16_v_down_bf16": lambda projection: "bf16" if projection in ("v", "down") else "w8a16",
           # one int8 term only where the integer GEMMs spend most (gate/up: 55 % of the GEMM MACs at Llama-3.2-1B's
           # shape), the others two terms
           "w8x2a16_gate_up_w8a16": lambda projection: "w8a16" if projection == "gate_up" else "w8x2a16"}
# What a study's model is patched at: a study rewrites the GEMM precisions of the bf16-weight Programs
# (catalog._gemm_precision), so its model must run those; under "auto" a model the integer GEMMs take runs the
# w8x2a16 Programs, which no study reaches, and the study would measure the default instead.
STUDY_BASE_PRECISION = catalog.DEFAULT_BF16_WEIGHT_PRECISION
PROJECTIONS = ("q", "k", "v", "o", "gate_up", "down")  # the prefill GEMMs, as kernels/catalog.py names them
SETTINGS = {
    "quick": dict(new_tokens=16, llama_layers=2, llama_prompts=4, llama_new_tokens=4, buckets=(16, 32, 64)),
    "full": dict(new_tokens=32, llama_layers=16, llama_prompts=9, llama_new_tokens=32, buckets=(16, 32, 64)),
}
CAPITAL = "What is the capital of France?"


def _greedy(model, ids, new_tokens):
    from tests.patch_llama.gate import greedy_with_topk

    with torch.no_grad():
        return greedy_with_topk(model, ids, new_tokens)


def _gate(reference, candidate) -> dict:
    """The top-5 gate of ``candidate`` against ``reference`` (tokens, logits): first divergence and verdict."""
    from tests.patch_llama.gate import check_topk_gate

    try:
        first = check_topk_gate(*reference, *candidate)[0]
        passed = True
    except AssertionError:
        ref_tokens, out_tokens = reference[0][0], candidate[0][0]
        first = next(i for i, (a, b) in enumerate(zip(ref_tokens.tolist(), out_tokens.tolist())) if a != b)
        passed = False
    return {"first_divergence": first, "gate_passed": passed,
            "first_token_agrees": int(reference[0][0, 0]) == int(candidate[0][0, 0])}


def _distance(reference, model, ids) -> dict:
    from torch_npu2 import compare_layers

    report = compare_layers(reference, model, ids)
    layers, logits = report[:-1], report[-1]
    worst = min(layers, key=lambda r: r.min_cosine)
    return {"worst_layer": worst.name, "worst_layer_min_cosine": worst.min_cosine,
            "last_layer_min_cosine": layers[-1].min_cosine, "logits_min_cosine": logits.min_cosine,
            "per_layer_min_cosine": [r.min_cosine for r in layers]}


def _evaluate(name, model, prompts, compare_ids, new_tokens, buckets, tokenizer, log) -> dict:
    """fp32 reference, HF bf16, each patched precision and each integer study on one model."""
    # nn.Module's own cast: HF refuses .float() on a GGUF-loaded model (dequantized bf16, flagged quantized)
    fp32 = torch.nn.Module.float(copy.deepcopy(model))
    reference = [_greedy(fp32, ids, new_tokens) for _, _, ids in prompts]
    rows = {}
    candidates = ([("HF bf16 (CPU)", None, None)] + [(f"NPU2 {p}", p, None) for p in PRECISIONS]
                  + [(f"NPU2 {name} (emulator study)", None, name) for name in STUDIES])
    for label, precision, study in candidates:
        with _studied(study):
            rows[label] = _evaluate_one(label, precision, study, model, prompts, compare_ids, reference, fp32,
                                        new_tokens, buckets, tokenizer, name, log)
    if tokenizer is not None:
        from tests.patch_llama.test_smollm2 import chat_ids

        ids = chat_ids(tokenizer, CAPITAL)
        with torch.no_grad():
            out = fp32.generate(ids, max_new_tokens=12, do_sample=False)
        rows["fp32"] = {"label": "fp32 (CPU)", "capital_answer": tokenizer.decode(out[0, ids.shape[1]:],
                                                                                   skip_special_tokens=True)}
    return rows


def _evaluate_one(label, precision, study, model, prompts, compare_ids, reference, fp32, new_tokens, buckets,
                  tokenizer, name, log) -> dict:
    started = time.perf_counter()
    candidate = copy.deepcopy(model)
    if precision is not None or study is not None:  # a study: inside _studied
        _patch(candidate, buckets, precision)
    gates = []
    for (kind, text, ids), ref in zip(prompts, reference):
        gates.append({"kind": kind, "prompt": text, **_gate(ref, _greedy(candidate, ids, new_tokens))})
    row = {"label": label, "precision": precision or study, **_distance(fp32, candidate, compare_ids), "prompts": gates,
           "gate_passed": sum(g["gate_passed"] for g in gates),
           "first_token_agreement": sum(g["first_token_agrees"] for g in gates),
           "identical": sum(g["first_divergence"] is None for g in gates), "count": len(gates)}
    if tokenizer is not None:
        from tests.patch_llama.test_smollm2 import chat_ids

        ids = chat_ids(tokenizer, CAPITAL)
        with torch.no_grad():
            out = candidate.generate(ids, max_new_tokens=12, do_sample=False)
        row["capital_answer"] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        log(f"  {name} {label}: {CAPITAL!r} -> {row['capital_answer']!r}")
    log(f"  {name} {label}: worst layer {row['worst_layer_min_cosine']:.5f}, logits "
        f"{row['logits_min_cosine']:.5f}, gate {row['gate_passed']}/{row['count']}, first token "
        f"{row['first_token_agreement']}/{row['count']} ({time.perf_counter() - started:.0f} s)")
    return row


def _smollm2_inputs(settings) -> tuple:
    """SmolLM2-135M-Instruct, the gate's prompts, the chat prompt compare_layers runs, the tokens to generate and the
    tokenizer."""
    from tests.patch_llama.test_smollm2 import all_prompts, chat_ids
    from torch_npu2.patch_llama.models import load_model

    model, tokenizer = load_model()
    compare_ids = chat_ids(tokenizer, "Explain what a neural network is in one sentence.")
    return model, all_prompts(tokenizer), compare_ids, settings["new_tokens"], tokenizer


def _smollm2(settings, log) -> dict:
    model, prompts, compare_ids, new_tokens, tokenizer = _smollm2_inputs(settings)
    return _evaluate("SmolLM2-135M", model, prompts, compare_ids, new_tokens, settings["buckets"], tokenizer, log)


@contextmanager
def _only_projection_bfp16(projection: str):
    """Prefill Programs built while inside have ``projection``'s GEMM at bfp16 and the others at bf16 (the op
    registry's Program memo is emptied on entry and exit, so no Program crosses the boundary)."""
    from unittest import mock

    from torch_npu2.ops import registry

    registry._program.cache_clear()
    try:
        with mock.patch.object(catalog, "_gemm_precision",
                               lambda mode, which: "bfp16" if which == projection else "bf16"):
            yield
    finally:
        registry._program.cache_clear()


def _patch(model, buckets, precision: str | None) -> None:
    """Patch ``model`` at matmul precision ``precision``, or (None: inside a study, whose GEMM precisions rewrite the
    catalog's) at STUDY_BASE_PRECISION."""
    import torch_npu2

    torch_npu2.patch_llama(model, prefill_buckets=buckets, matmul_precision=precision or STUDY_BASE_PRECISION)


@contextmanager
def _studied(study: str | None):
    """Prefill Programs built inside carry study ``study``'s GEMM precisions (nothing changes for None)."""
    if study is None:
        yield
        return
    with _studied_scheme(STUDIES[study]):
        yield


@contextmanager
def _studied_scheme(scheme):
    """Prefill Programs built inside give projection p's GEMM precision ``scheme(p)``; the op registry's Program memo
    is emptied on entry and exit."""
    from unittest import mock

    from torch_npu2.ops import registry

    registry._program.cache_clear()
    try:
        with mock.patch.object(catalog, "_gemm_precision", lambda mode, projection: scheme(projection)):
            yield
    finally:
        registry._program.cache_clear()


def _sensitivity(settings, log) -> dict:
    """SmolLM2's distance to fp32 with only one projection's GEMM at bfp16, per projection."""
    from tests.patch_llama.test_smollm2 import chat_ids
    from torch_npu2.patch_llama.models import load_model

    model, tokenizer = load_model()
    compare_ids = chat_ids(tokenizer, "Explain what a neural network is in one sentence.")
    fp32 = torch.nn.Module.float(copy.deepcopy(model))
    rows = {}
    for projection in PROJECTIONS:
        candidate = copy.deepcopy(model)
        with _only_projection_bfp16(projection):
            _patch(candidate, settings["buckets"], None)
            rows[projection] = _distance(fp32, candidate, compare_ids)
        log(f"  SmolLM2-135M, only {projection} at bfp16: worst layer "
            f"{rows[projection]['worst_layer_min_cosine']:.5f}, logits {rows[projection]['logits_min_cosine']:.5f}")
        del candidate
    return rows


def integer_distances(log=print, names: tuple[str, ...] | None = None) -> dict:
    """SmolLM2's distance to fp32 (``compare_layers`` on the chat prompt ``sensitivity`` uses) with integer GEMMs:
    exact bf16 GEMMs for reference, the "w8x2a16" matmul precision, each study of ``STUDIES``, the integer W8A8 GEMM
    with V and down exact, and W8A16 in one projection at a time (the others exact bf16); ``names``: just these
    schemes, by name. Runs on the emulated NPU2."""
    from tests.patch_llama.test_smollm2 import chat_ids
    from torch_npu2.patch_llama.models import load_model

    # None: a matmul precision of its own name; else each projection's precision in a study
    schemes = {"bf16": None, "w8x2a16": None, **STUDIES,
               "int8_v_down_bf16": lambda projection: "bf16" if projection in ("v", "down") else "int8",
               **{f"w8a16_{only}_only": (lambda only: lambda projection: "w8a16" if projection == only else "bf16")(
                   only) for only in PROJECTIONS}}
    if names is not None:
        schemes = {name: schemes[name] for name in names}
    rows = {}
    with common.emulated_runtime(compute=True):
        model, tokenizer = load_model()
        compare_ids = chat_ids(tokenizer, "Explain what a neural network is in one sentence.")
        fp32 = torch.nn.Module.float(copy.deepcopy(model))
        for name, scheme in schemes.items():
            candidate = copy.deepcopy(model)
            buckets = SETTINGS["quick"]["buckets"]
            # a study's Programs are built while it is in force: patching and the run both inside
            with nullcontext() if scheme is None else _studied_scheme(scheme):
                _patch(candidate, buckets, name if scheme is None else None)
                rows[name] = _distance(fp32, candidate, compare_ids)
            log(f"  SmolLM2-135M, {name}: worst layer {rows[name]['worst_layer_min_cosine']:.5f}, logits "
                f"{rows[name]['logits_min_cosine']:.5f}")
    return rows


def _bfp16_rows(x: torch.Tensor) -> torch.Tensor:
    """``x``'s rows through bfp16ebs8 (blocks of 8 along the last dimension, zero-padded to whole blocks: a zero
    leaves a block's shared exponent as it is)."""
    from torch_npu2.emulator.bfp16 import quantize_bf16_to_bfp16

    width = x.shape[-1]
    padded = torch.nn.functional.pad(x.to(torch.bfloat16), (0, -width % 8))
    return quantize_bf16_to_bfp16(padded.contiguous())[..., :width]


def _integer_products(rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """fp32 rows · columnsᵀ as the integer GEMMs multiply (kernels/int_gemm.py): each row of ``rows`` quantized to
    int16 under its own scale, each row of ``columns`` as two int8 terms under its own."""
    from torch_npu2.kernels import int_gemm

    q, row_scale = int_gemm.quantize_activations(rows, int_gemm.ACTIVATION_QMAX["w8x2a16"])
    hi, lo, column_scale = int_gemm.quantize_weight_terms(columns, 2)
    sums = (torch.matmul(q.double(), hi.double().T).float()
            + torch.matmul(q.double(), lo.double().T).float() * 2.0 ** -int_gemm.LO_SHIFT)  # exact integer sums
    return sums * (row_scale * column_scale.reshape(1, -1))


# Attention's two products as a faster kernel would multiply them (an emulator study: attention.cc has no such
# path), scores then P·V: "bfp16", every operand through bfp16ebs8 along each product's K (upstream's mode);
# "w8x2a16", as the integer GEMMs: queries and probability rows in int16 per row, keys per key and values per head
# dimension as two int8 terms.
ATTENTION_STUDIES = {
    "bfp16": (lambda q, k: torch.matmul(_bfp16_rows(q).float(), _bfp16_rows(k).float().T),
              lambda probs, v: torch.matmul(_bfp16_rows(probs), _bfp16_rows(v.T).T)),
    "w8x2a16": (_integer_products,
                lambda probs, v: _integer_products(probs, v.T.float()).to(torch.bfloat16)),
}


@contextmanager
def _studied_attention(study: str):
    """The emulator's attention launches inside multiply as ATTENTION_STUDIES[study] does."""
    import functools
    from unittest import mock

    from torch_npu2.emulator import launches

    scores_of, mix_of = ATTENTION_STUDIES[study]
    studied = functools.partial(launches.attention, scores_of=scores_of, mix_of=mix_of)
    with mock.patch.dict(launches.LAUNCH_KINDS, {"attention": studied}):
        yield


def attention_distances(log=print, layers: int = 2, smollm2: bool = True) -> dict:
    """Each attention study (and exact attention for reference) under the default matmul precision, on SmolLM2 (unless
    not ``smollm2``) and on the Llama-3.2-1B shape with ``layers`` layers, as ``run``'s quick rows measure them. Runs on
    the emulated NPU2."""
    rows = {}
    with common.emulated_runtime(compute=True):
        for label, inputs, buckets, tokenizer in _study_models(layers, smollm2):
            for study in (None, *ATTENTION_STUDIES):
                name = f"attention {study or 'exact'}"
                with nullcontext() if study is None else _studied_attention(study):
                    rows[(label, name)] = _evaluate_one(name, "auto", None, *inputs, buckets, tokenizer, label, log)
    return rows


def study_distances(log=print, names: tuple[str, ...] | None = None, layers: int = 2, smollm2: bool = True) -> dict:
    """The default matmul precision and each GEMM study of ``STUDIES`` (``names``: just these), on SmolLM2 (unless not
    ``smollm2``) and on the Llama-3.2-1B shape with ``layers`` layers, as ``run``'s quick rows measure them. Runs on the
    emulated NPU2."""
    rows = {}
    with common.emulated_runtime(compute=True):
        for label, inputs, buckets, tokenizer in _study_models(layers, smollm2):
            rows[(label, "default")] = _evaluate_one("default", "auto", None, *inputs, buckets, tokenizer, label, log)
            for study in names or tuple(STUDIES):
                with _studied(study):
                    rows[(label, study)] = _evaluate_one(study, None, study, *inputs, buckets, tokenizer, label, log)
    return rows


def _study_models(layers: int, smollm2: bool):
    """Per model a study measures (SmolLM2 unless not ``smollm2``, the Llama-3.2-1B shape with ``layers`` layers):
    its label, ``_evaluate_one``'s inputs up to the buckets (model, prompts, compare_ids, fp32 greedy references,
    fp32 model, new tokens), the buckets and the tokenizer."""
    settings = {**SETTINGS["quick"], "llama_layers": layers}
    models = ([("SmolLM2-135M", _smollm2_inputs)] if smollm2 else []) + [
        (f"Llama-3.2-1B shape, {layers} layers", _llama_1b_inputs)]
    for label, build in models:
        model, prompts, compare_ids, new_tokens, tokenizer = build(settings)
        fp32 = torch.nn.Module.float(copy.deepcopy(model))
        reference = [_greedy(fp32, ids, new_tokens) for _, _, ids in prompts]
        yield label, (model, prompts, compare_ids, reference, fp32, new_tokens), settings["buckets"], tokenizer


def _llama_1b_inputs(settings) -> tuple:
    """The Llama-3.2-1B shape with random weights and ``llama_layers`` layers, random-token prompts, a random prompt
    for compare_layers, the tokens to generate and no tokenizer."""
    shape = {**common.LLAMA_1B_SHAPE, "num_hidden_layers": settings["llama_layers"]}
    model = common.random_llama(common.llama_config(**shape))
    prompts = [("random", f"{length} random tokens", common.random_prompt(length, shape["vocab_size"], seed=i))
               for i, length in enumerate((12, 20, 28, 36, 44, 52, 60, 9, 17)[:settings["llama_prompts"]])]
    compare_ids = common.random_prompt(40, shape["vocab_size"], seed=99)
    return model, prompts, compare_ids, settings["llama_new_tokens"], None


def _llama_1b(settings, log) -> dict:
    model, prompts, compare_ids, new_tokens, _ = _llama_1b_inputs(settings)
    return _evaluate("Llama-3.2-1B shape", model, prompts, compare_ids, new_tokens, settings["buckets"], None, log)


def predicted_prefill_ms(seq: int) -> dict:
    """Predicted ms of a Llama-3.2-1B prefill of ``seq`` tokens in one bucket (16 layers' rms_gemms_rope +
    flash_attn + o_ffn, then the LM head) per precision, from the timing model: [fast end, slow end]."""
    dims = cost_model.llama_1b_dims()
    return {precision: list(cost_model.prefill_ms(dims, cost_model.LLAMA_1B_LAYERS, [(0, seq, seq)], precision))
            for precision in PRECISIONS}


def gemm_call_cycles(tile_m: int = 64, tile_k: int = 32, tile_n: int = 128) -> dict:
    """Core cycles of one prefill GEMM kernel call, [fast end, slow end], per matmul precision that has a kernel, from
    what the call executes (kernels/core_ops.py's count of its AIE path, kernels/timing.py's ends): gemm.cc's exact
    bf16 and BFP16 builds on a (tile_m × tile_k) · (tile_k × tile_n) tile, the one the GEMM builder picks for
    Llama-3.2-1B's prefill GEMMs at 2048 rows, and gemm_int8.cc's "w8x2a16" call (``gemm_int_w8x2``) on the tile its
    builder picks there: tile_m rows of 64 accumulator columns, 32 K, two int8 weight terms, so the same MACs as the
    bf16 call at the defaults (the int8 and w8a16 studies have the emulator's numerics only, no kernel)."""
    from torch_npu2.kernels import core_ops, int_gemm, timing

    tile = {"GEMM_TILE_M": tile_m, "GEMM_TILE_K": tile_k, "GEMM_TILE_N": tile_n, "GEMM_DRAIN_N": 32}
    integer_tile = {"GEMM_TILE_M": tile_m, "GEMM_TILE_N": int_gemm.MAX_TILE_N, "GEMM_DRAIN_N": int_gemm.MAX_TILE_N}
    calls = {"bf16": ("gemm_bf16_f32_wnk", tile),
             "bfp16": ("gemm_bf16_f32_wnk", {**tile, core_ops.BFP16_DEFINE: 1}),
             "w8x2a16": ("gemm_int_w8x2", integer_tile)}
    cycles = {}
    for precision, (symbol, defines) in calls.items():
        ops = core_ops.count_call(symbol, tuple(sorted(defines.items())), ())
        cycles[precision] = [timing.core_cycles(core_ops.instructions(ops, end.share_operands), end)
                             for end in timing.ENDS]
    return cycles


def table(result: dict) -> str:
    lines = ["| model | run | worst layer min cos | last layer min cos | logits min cos | top-5 gate passed | "
             "identical tokens | first token = fp32 |", "|---|---|---|---|---|---|---|---|"]
    for model, rows in result["models"].items():
        for row in rows.values():
            if "worst_layer_min_cosine" not in row:
                continue
            lines.append(f"| {model} | {row['label']} | {row['worst_layer_min_cosine']:.5f} ({row['worst_layer']}) | "
                         f"{row['last_layer_min_cosine']:.5f} | {row['logits_min_cosine']:.5f} | "
                         f"{row['gate_passed']}/{row['count']} | {row['identical']}/{row['count']} | "
                         f"{row['first_token_agreement']}/{row['count']} |")
    answers = [(row["label"], row["capital_answer"]) for row in result["models"].get("SmolLM2-135M", {}).values()
               if "capital_answer" in row]
    if answers:
        lines += ["", f"SmolLM2, \"{CAPITAL}\" (greedy, 12 tokens):", ""]
        lines += [f"- {label}: {answer!r}" for label, answer in answers]
    if result.get("sensitivity_smollm2"):
        lines += ["", "SmolLM2-135M with one projection's GEMM at bfp16, the others bf16 (against fp32):", "",
                  "| bfp16 GEMM | worst layer min cos | logits min cos |", "|---|---|---|"]
        lines += [f"| {projection} | {row['worst_layer_min_cosine']:.5f} ({row['worst_layer']}) | "
                  f"{row['logits_min_cosine']:.5f} |" for projection, row in result["sensitivity_smollm2"].items()]
    lines += ["", "Predicted Llama-3.2-1B prefill (16 layers, cost MODEL, not measured): " + ", ".join(
        f"seq {seq}: " + " / ".join(f"{p} {cost_model.span(ms, 0)} ms" for p, ms in by_precision.items())
        for seq, by_precision in result["predicted_prefill_ms"].items())]
    return "\n".join(lines) + "\n"


def run(mode: str, out_dir: Path, log=print) -> dict:
    settings = SETTINGS[mode]
    started = time.perf_counter()
    with common.emulated_runtime(compute=True):
        models = {"SmolLM2-135M": _smollm2(settings, log), "Llama-3.2-1B shape": _llama_1b(settings, log)}
        sensitivity = _sensitivity(settings, log)
    result = {"settings": {**settings, "llama_1b_layers": settings["llama_layers"]}, "models": models,
              "sensitivity_smollm2": sensitivity,
              "predicted_prefill_ms": {seq: predicted_prefill_ms(seq) for seq in (128, 2048)},
              "method": __doc__}
    common.write_result("precision", result, out_dir, mode, started)
    (out_dir / "precision.md").write_text(table(result))
    log(table(result))
    return result
