"""aircc's npu2 flow, replayed with the AIR binaries (``air-opt`` and the C++ ``aiecc``), no Python bindings.

The pass pipelines are those of mlir-air ``python/air/compiler/aircc/main.py`` at 0e3df89d for
``--device npu2`` with aircc's defaults (8 columns from column 0, placement rows anchored at row 2; the device
record, kernels/device.py, holds them),
parametrized by a Program's :class:`CompileOptions`:

1. placement: ``air-insert-launch-around-herd`` … dependency analysis, broadcast detection, DMA → channel
   conversion, L2 splitting, ping-pong … ``air-place-herds``, run on each launch alone and the placed launches
   joined into one module (``place_launches``: the stage's time over a whole module explodes with its launches;
   the joined module lowers to the same devices);
2. ``air-to-aie{device=npu2 …}`` + ``air-merge-unrolled-devices``: one ``aie.device`` per launch segment,
   plus the main device whose runtime sequence configures and runs them in order; every core gets the Program's
   ``stack_size`` (this air-opt predates air-to-aie's ``stack-size`` option, mlir-air #1547, which sets the
   same ``aie.core`` attribute);
3. ``air-opt-shim-dma-bds`` (runtime loop tiling), ``air-to-std``, ``airrt-to-npu{output-elf=true}``;
4. ``aiecc``: NPU instructions for each segment device (``--no-compile --no-link
   --aie-generate-npu-insts``), or with Peano the full ELF (``--generate-full-elf --expand-load-pdis``). The
   buffer addresses aiecc assigns each segment's tiles are read back and checked against the core's L1
   (kernels/budgets.py).

Before step 1 every DMA window is read back from ``air-opt``'s own print of the module and compared with
what the builders meant (:func:`window_mismatches`): an AIR that drops or reads windows differently stops
the build here. A failing pass is named (``--mlir-print-ir-after-failure``) with the error it printed.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .budgets import L1BudgetError, TileL1, check_fits, lowered_l1
from .builders.ir import ELEMENT_BYTES, Dma, Window
from .device import DEVICE
from .lint import lint_lowered
from .mlir_text import MlirTextError, dma_copies, index_constants
from .program import CompileOptions, Program
from .stitch import LAUNCH_PREFIX, StitchedModule, stitch
from .toolchain import Toolchain, ToolchainMissing, find_toolchain, missing_lowering_tools

TIMEOUT_VARIABLE = "TORCH_NPU2_AIR_TIMEOUT"
DEFAULT_PROCESS_TIMEOUT = 3600  # seconds for one air-opt or aiecc run


def process_timeout() -> float:
    """Seconds one air-opt or aiecc run may take: ``$TORCH_NPU2_AIR_TIMEOUT``, else an hour."""
    value = os.environ.get(TIMEOUT_VARIABLE)
    if value is None:
        return DEFAULT_PROCESS_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"${TIMEOUT_VARIABLE} must be a positive number of seconds, got {value!r}")
    return seconds


def _optimization_passes(o: CompileOptions) -> list[str]:
    passes = ["air-dependency", "air-hoist-dma-in-accum-pattern"]
    if not o.omit_auto_broadcast:
        passes += ["air-broadcast-detection", "air-specialize-dma-broadcast"]
    passes += ["air-dma-to-channel", "canonicalize", "cse", "air-dependency-canonicalize", "canonicalize", "cse",
               "air-isolate-async-dma-loop-nests", "canonicalize", "cse", "air-fuse-channels", "canonicalize", "cse",
               # L2 splitting (every device but npu*_1col)
               "func.func(air-split-l2-memref)", "canonicalize", "cse", "air-isolate-async-dma-loop-nests",
               "canonicalize", "cse",
               "func.func(air-fuse-alloc-dealloc)", "func.func(air-shrink-memref-sizes-by-access)"]
    if o.omit_pingpong != "all":
        omit = f"{{omit-memory-space={o.omit_pingpong}}}" if o.omit_pingpong else ""
        passes += [f"air-label-scf-for-to-ping-pong{omit}", f"air-ping-pong-transform{omit}", "canonicalize", "cse"]
    passes += ["func.func(convert-linalg-to-loops)", f"func.func(air-opt-memtile-dma-bds{{device={DEVICE.name}}})",
               "canonicalize", "cse"]
    return passes


def _module(passes: list[str]) -> str:
    return f"builtin.module({','.join(passes)})"


def placement_pipeline(o: CompileOptions) -> str:
    return _module(["air-insert-launch-around-herd{insert-segment=true}", "func.func(air-lower-herd-parallel)",
                    "scf-forall-to-parallel", *_optimization_passes(o),
                    "func.func(air-collapse-herd{max-col-size=4 })", "canonicalize", "cse",
                    f"air-place-herds{{num-rows={DEVICE.placement_rows} num-cols={DEVICE.placement_columns} "
                    f"row-anchor={DEVICE.row_offset} col-anchor={DEVICE.column_offset}}}",
                    "canonicalize", "cse", "func.func(air-renumber-dma)"])


def air_to_aie_pipeline(o: CompileOptions) -> str:
    flag = lambda value: str(value).lower()  # noqa: E731
    return _module([f"air-to-aie{{emit-while-loop={flag(not o.omit_while_true_loop)} row-offset={DEVICE.row_offset} "
                    f"col-offset={DEVICE.column_offset} device={DEVICE.name} "
                    f"use-lock-race-condition-fix={flag(o.use_lock_race_condition_fix)}}}",
                    "air-merge-unrolled-devices"])


def npu_pipeline(o: CompileOptions) -> str:
    tiling = f" shim-dma-tile-sizes={','.join(map(str, o.runtime_loop_tiling_sizes))}"
    return _module([f"func.func(air-opt-shim-dma-bds{{device={DEVICE.name}{tiling}}})", "canonicalize", "cse",
                    "air-to-std", "symbol-dce", "affine-expand-index-ops", "canonicalize", "cse",
                    "airrt-to-npu{ trace-size=0 trace-offset=0 output-elf=true}", "canonicalize", "cse"])


PASS_STAGES = (("placement", placement_pipeline), ("air-to-aie", air_to_aie_pipeline), ("npu", npu_pipeline))


class CompileError(RuntimeError):
    """A stage of the build rejected a Program: the stage (and the pass, when air-opt names one), what the
    tool printed, and the kept build directory with the stitched ``air.mlir`` and every intermediate."""

    def __init__(self, program: str, stage: str, message: str, build_dir: Path, *, pass_name: str | None = None,
                 command: list[str] | None = None, returncode: int | None = None):
        self.program, self.stage, self.message, self.build_dir = program, stage, message, build_dir
        self.pass_name, self.command, self.returncode = pass_name, command, returncode
        self.mlir_path = build_dir / "air.mlir"
        where = f"{stage} ({pass_name})" if pass_name else stage
        exit_code = f" (exit {returncode})" if returncode is not None else ""
        ran = f"\ncommand: {' '.join(command)}" if command else ""
        super().__init__(f"{program}: {where} failed{exit_code}; MLIR kept at {self.mlir_path}{ran}\n{message}")


# ---- DMA windows read back from air-opt's print ------------------------------------------------------
DYNAMIC = "dynamic"  # an offset that is not a constant (a loop or launch index)


def read_back_windows(printed: str) -> list[tuple[tuple, tuple]]:
    """Every ``air.dma_memcpy_nd`` in ``printed`` (air-opt's custom-form print), in text order, as
    ((offsets, sizes, strides) of dst, same of src): constants resolved to ints, other offsets DYNAMIC.

    Sizes and strides must be constants: our builders only emit static ones.
    """
    try:
        constants = index_constants(printed, distinct=True)
    except MlirTextError as error:
        raise ValueError(f"{error}; cannot read windows back") from None
    windows = []
    for dma in dma_copies(printed):
        sides = []
        for side in (dma.dst, dma.src):
            static = []
            for names in (side.sizes, side.strides):
                unknown = [n for n in names if n not in constants]
                if unknown:
                    raise ValueError(f"DMA size/stride {unknown[0]} is not a constant in: {dma.text}")
                static.append(tuple(constants[n] for n in names))
            sides.append((tuple(constants.get(v, DYNAMIC) for v in side.offsets), *static))
        windows.append(tuple(sides))
    return windows


def _meant(window: Window) -> tuple:
    return (tuple(DYNAMIC if isinstance(o, str) else o for o in window.offsets), tuple(window.sizes),
            tuple(window.strides))


def window_mismatches(dmas: tuple[Dma, ...], printed: str) -> list[str]:
    """How the DMAs of air-opt's print differ from what the builders meant; empty when every window
    survived the round trip."""
    found = read_back_windows(printed)
    if len(found) != len(dmas):
        return [f"the builders emitted {len(dmas)} DMAs, air-opt printed {len(found)}"]
    problems = []
    for index, (dma, (dst, src)) in enumerate(zip(dmas, found)):
        for side, meant, got in (("dst", _meant(dma.dst), dst), ("src", _meant(dma.src), src)):
            if meant != got:
                problems.append(f"DMA {index} {side}: meant offsets/sizes/strides {meant}, air-opt printed {got}")
    return problems


# ---- what a lowered device uses ----------------------------------------------------------------------
_DEVICE = re.compile(r"^  aie\.device\(\w+\)(?: @(\w+))? \{$", re.M)


@dataclass(frozen=True)
class DeviceReport:
    """One segment's device as air-to-aie placed and routed it, and its NPU instruction stream."""

    name: str
    compute_tiles: int
    memtiles: int
    shim_tiles: int
    dma_channels: int      # tile and memtile DMA channels started, plus shim channels allocated
    bds: int               # buffer descriptors in compute tiles and memtiles
    shim_bd_tasks: int     # shim DMA tasks the runtime sequence configures
    runtime_parameters: int  # host-written scalars a core reads (herd operands derived from launch indices)
    l1_bytes: int          # buffers allocated in the fullest compute tile
    l2_bytes: int          # buffers allocated in the fullest memtile
    instruction_words: int  # 32-bit words of the NPU instruction stream


@dataclass(frozen=True)
class Lowering:
    program: str
    devices: tuple[DeviceReport, ...]
    seconds: float
    l1: tuple[TileL1, ...]  # every compute tile at the addresses aiecc assigned
    configures: int  # devices the main runtime sequence enters (aiex.configure), one per launch: kernels/timing.py

    def total(self, field: str) -> int:
        return sum(getattr(d, field) for d in self.devices)

    def most(self, field: str) -> int:
        return max(getattr(d, field) for d in self.devices)


def _device_bodies(npu_module: str, main: bool = False) -> dict[str | None, str]:
    """Each named ``aie.device`` body of an npu-stage module, and with ``main`` the unnamed main device's (key None)."""
    starts = list(_DEVICE.finditer(npu_module))
    bodies = {}
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(npu_module)
        if match.group(1) or main:
            bodies[match.group(1)] = npu_module[match.end():end]
    return bodies


_BUFFER = re.compile(r"aie\.buffer\(%(tile|mem_tile)_(\d+_\d+)\)[^:]*: memref<([\dx]*)x?([a-z]+\d+)\b")


def _fullest(config: str, kind: str) -> int:
    """Bytes of aie.buffer allocations in the fullest tile of a kind ("tile": compute, "mem_tile")."""
    used: dict[str, int] = {}
    for tile_kind, tile, shape, dtype in _BUFFER.findall(config):
        if tile_kind == kind:
            used[tile] = used.get(tile, 0) + math.prod(int(d) for d in shape.split("x") if d) * ELEMENT_BYTES[dtype]
    return max(used.values(), default=0)


_CORE_END = re.compile(r"^    \}(?: \{(.*)\})?$")


def set_stack_size(module: str, stack_size: int) -> tuple[str, int]:
    """``module`` with ``stack_size`` on every ``aie.core``, and how many cores it found."""
    lines, cores, in_core = module.split("\n"), 0, False
    for number, line in enumerate(lines):
        if re.match(r"^    %\w+ = aie\.core\(", line):
            in_core = True
            continue
        closed = _CORE_END.match(line) if in_core else None
        if closed:
            attributes = [a for a in (closed.group(1) or "").split(", ") if a and not a.startswith("stack_size =")]
            lines[number] = "    } {" + ", ".join([*attributes, f"stack_size = {stack_size} : i32"]) + "}"
            cores += 1
            in_core = False
    return "\n".join(lines), cores


def _resources(name: str, body: str, instruction_words: int) -> DeviceReport:
    config, _, sequence = body.partition("aie.runtime_sequence")
    return DeviceReport(
        name=name,
        compute_tiles=len(re.findall(r"\baie\.core\(", config)),
        memtiles=len(re.findall(r"\baie\.memtile_dma\(", config)),
        shim_tiles=len(set(re.findall(r"aie\.shim_dma_allocation @\w+\((%\w+),", config))),
        dma_channels=(len(re.findall(r"\baie\.dma_start\(", config))
                      + len(re.findall(r"aie\.shim_dma_allocation", config))),
        bds=len(re.findall(r"\baie\.dma_bd\(", config)),
        shim_bd_tasks=len(re.findall(r"aiex\.dma_configure_task_for", sequence)),
        runtime_parameters=len(re.findall(r"= aie\.buffer\([^)]*\) \{sym_name = \"__air_herd_rtp_", config)),
        l1_bytes=_fullest(config, "tile"),
        l2_bytes=_fullest(config, "mem_tile"),
        instruction_words=instruction_words,
    )


# ---- running the tools --------------------------------------------------------------------------------
def _failed_pass(stderr_path: Path) -> str | None:
    with open(stderr_path, errors="replace") as f:
        for line in f:
            match = re.search(r"IR Dump After \S+ Failed \(([^)]*)\)", line)
            if match:
                return match.group(1)
    return None


def _errors(text: str, limit: int = 4000) -> str:
    """The errors of a failed run with the lines that follow each (source, notes), without warnings or the
    IR dump after them; the last lines when no line says error."""
    lines = text.split("\n// -----// IR Dump", 1)[0].splitlines()
    starts = [i for i, line in enumerate(lines) if ": error" in line or line.startswith("error")]
    picked, seen = [], set()
    for start in starts:
        for i in range(start, min(start + 6, len(lines))):
            if i not in seen and (i == start or ": error" not in lines[i]) and ": warning" not in lines[i]:
                picked.append(lines[i])
                seen.add(i)
    text = "\n".join(picked or lines[-20:])
    return text if len(text) <= limit else text[:limit] + "\n…"


def _run(program: str, stage: str, command: list[str], build_dir: Path, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` under :func:`process_timeout`; a tool that does not finish is a CompileError."""
    timeout = process_timeout()
    try:
        return subprocess.run(command, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired:
        raise CompileError(program, stage, f"{Path(command[0]).name} did not finish within {timeout:g} s "
                           f"(${TIMEOUT_VARIABLE} sets the limit)", build_dir, command=command) from None


def _air_opt(tc: Toolchain, program: str, stage: str, source: Path, output: Path, pipeline: str | None,
             build_dir: Path) -> None:
    command = [str(tc.air_opt), str(source), "-o", str(output)]
    if pipeline:
        command += [f"--pass-pipeline={pipeline}", "--mlir-print-ir-after-failure"]
    stderr = build_dir / f"{stage}.stderr"
    with open(stderr, "w") as err:
        result = _run(program, stage, command, build_dir, stdout=subprocess.DEVNULL, stderr=err)
    if result.returncode != 0:
        with open(stderr, errors="replace") as f:
            diagnostics = f.read(1 << 20)
        raise CompileError(program, stage, _errors(diagnostics), build_dir, pass_name=_failed_pass(stderr),
                           command=command, returncode=result.returncode)


def _aiecc(tc: Toolchain, program: str, stage: str, arguments: list[str], build_dir: Path) -> None:
    command = [str(tc.aiecc), *arguments]
    result = _run(program, stage, command, build_dir, cwd=build_dir, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(program, stage, _errors(result.stderr + result.stdout), build_dir, command=command,
                           returncode=result.returncode)


def check_windows(program: str, stitched: StitchedModule, build_dir: Path, tc: Toolchain) -> None:
    """Parse the stitched module with air-opt and compare every DMA window it prints with the builders'."""
    source, printed = build_dir / "air.mlir", build_dir / "parsed.mlir"
    source.write_text(stitched.text)
    _air_opt(tc, program, "parse", source, printed, None, build_dir)
    problems = window_mismatches(stitched.dmas, printed.read_text())
    if problems:
        raise CompileError(program, "DMA window round trip",
                           f"air-opt at {tc.air_opt} does not read the windows the builders wrote:\n"
                           + "\n".join(problems[:20]), build_dir)


SHIM_BD_STAGE = "shim BD bounds"


# What aircc's placement stage leaves at module level and in the function, per launch placed alone: attribute
# aliases (affine maps and sets), channels, the kernels' declarations, the function's top-level values, DMA ids.
_ALIAS = re.compile(r"^#([A-Za-z_][\w$.]*) = ", re.M)
_CHANNEL = re.compile(r"@channel_(\d+)\b")
_DMA_ID = re.compile(r"\bid = (\d+) : i32")
_TOP_VALUE = re.compile(r"^    (%[\w$.-]+)(?::\d+)? = ", re.M)


def join_placed(program: Program, placed: list[str]) -> str:
    """One module of ``placed``, the placement stage's output for each launch of ``program`` placed alone (in a
    module with the Program's whole signature): each launch's aliases, channels and function-level values renamed
    apart (``l<index>``), its DMA ids moved past the launches before it, the kernels declared once, the launches in
    order in one function. An ``air.launch`` region is isolated from above, so nothing inside one names anything
    of another; the launches' async tokens no longer order them, and need not: the main runtime sequence configures
    and runs each launch's device in turn (``tests/kernels/test_air_pipeline.py`` lowers Programs both ways and
    finds the same devices and runtime sequences)."""
    aliases, channels, declarations, body = [], [], {}, []
    signature, next_id = None, 0
    for index, text in enumerate(placed):
        prefix = LAUNCH_PREFIX.format(index=index)
        defined = _ALIAS.findall(text)
        if defined:
            uses = re.compile(r"#(" + "|".join(map(re.escape, defined)) + r")(?![\w$.])")
            text = uses.sub(lambda m: f"#{prefix}{m.group(1)}", text)
        text = _CHANNEL.sub(lambda m: f"@{prefix}channel_{m.group(1)}", text)
        ids = [int(i) for i in _DMA_ID.findall(text)]
        text = _DMA_ID.sub(lambda m, base=next_id: f"id = {int(m.group(1)) + base} : i32", text)
        next_id += max(ids, default=0)
        lines = text.splitlines()
        opening = next(i for i, line in enumerate(lines) if line.startswith(f"  func.func @{program.name}("))
        closing = next(i for i in range(opening, len(lines)) if lines[i] == "    return")
        if signature not in (None, lines[opening]):
            raise ValueError(f"launch {index} was placed with another signature:\n{lines[opening]}")
        signature = lines[opening]
        for line in lines[:opening]:
            if line.startswith("#"):
                aliases.append(line)
            elif line.startswith("  air.channel "):
                channels.append(line)
            elif line.startswith("  func.func private "):
                declarations.setdefault(line)
            elif line.strip() and line != "module {":
                raise ValueError(f"launch {index} placed alone left an op at module level that cannot be joined: "
                                 f"{line.strip()[:200]}")
        own = set(_TOP_VALUE.findall("\n".join(lines[opening + 1:closing])))
        rename = lambda m: f"%{prefix}{m.group(0)[1:]}" if m.group(0) in own else m.group(0)  # noqa: E731
        body += [re.sub(r"%[\w$.-]+", rename, line) if not line.startswith("     ") else line
                 for line in lines[opening + 1:closing]]
    return "\n".join([*aliases, "module {", *channels, *declarations, signature, *body, "    return", "  }", "}", ""])


def place_launches(program: Program, stitched: StitchedModule, build_dir: Path, tc: Toolchain) -> Path:
    """aircc's placement stage, run on each launch alone and the results joined (``join_placed``) into
    ``<build_dir>/placement.mlir``. Over a whole multi-launch module the stage's time grows far faster than the
    launches (Llama-3.2-1B's 31-launch decode group: 331 s whole, 3.5 s launch by launch); each launch becomes a
    device of its own either way."""
    placed = []
    for index in range(len(stitched.launch_texts)):
        source, output = build_dir / f"air.l{index}.mlir", build_dir / f"placement.l{index}.mlir"
        source.write_text(stitched.launch_module(index))
        _air_opt(tc, program.name, "placement", source, output, placement_pipeline(program.compile_options),
                 build_dir)
        placed.append(output.read_text())
    joined = build_dir / "placement.mlir"
    try:
        joined.write_text(join_placed(program, placed))
    except ValueError as exc:
        raise CompileError(program.name, "placement", str(exc), build_dir) from None
    return joined


def prepare(program: Program, build_dir: Path, tc: Toolchain | None = None) -> Path:
    """Stitch ``program``, check its DMA windows through air-opt, run the three pass stages (placement launch by
    launch: ``place_launches``) and check that every shim BD they made stays inside its argument (lint rule
    shim-bd-bounds); returns the npu-stage module (``<build_dir>/npu.mlir``) that aiecc takes."""
    tc = tc or find_toolchain()
    stitched = stitch(program)
    check_windows(program.name, stitched, build_dir, tc)
    return lower_placed(program, place_launches(program, stitched, build_dir, tc), build_dir, tc)


def lower_placed(program: Program, placed: Path, build_dir: Path, tc: Toolchain) -> Path:
    """The stages after placement on ``placed``, the shim BD check, and the npu-stage module's path."""
    current = placed
    for stage, pipeline in PASS_STAGES[1:]:
        output = build_dir / f"{stage}.mlir"
        _air_opt(tc, program.name, stage, current, output, pipeline(program.compile_options), build_dir)
        if stage == "air-to-aie":
            text, cores = set_stack_size(output.read_text(), program.compile_options.stack_size)
            if not cores:
                raise CompileError(program.name, "stack size", "air-to-aie made no aie.core to give the stack to",
                                   build_dir)
            output.write_text(text)
        current = output
    overruns = [f"{f.where}: {f.message}" for f in lint_lowered(program, current.read_text())
                if f.rule == "shim-bd-bounds"]
    if overruns:  # placement accepted it, but on the NPU these DMAs would move bytes outside their arguments
        raise CompileError(program.name, SHIM_BD_STAGE, "\n".join(overruns[:8]), build_dir)
    return current


def lower_to_npu_insts(program: Program, keep_dir: Path | None = None) -> Lowering:
    """Every segment of ``program`` lowered to an NPU instruction stream, with what each uses.

    Needs only the AIR binaries (no Peano: cores are not compiled). The build happens in a private
    temporary directory, removed on success and kept (named in the error) on failure; ``keep_dir``
    keeps it in a directory of the caller's instead.
    """
    missing = missing_lowering_tools()
    if missing:
        raise ToolchainMissing(f"cannot lower {program.name} to NPU instructions; missing:\n  " + "\n  ".join(missing))
    tc = find_toolchain()
    started = time.perf_counter()
    build_dir = Path(keep_dir) if keep_dir else Path(tempfile.mkdtemp(prefix=f"torch_npu2-{program.name}-"))
    build_dir.mkdir(parents=True, exist_ok=True)
    npu_module = prepare(program, build_dir, tc)
    reports, tiles = [], []
    bodies = _device_bodies(npu_module.read_text(), main=True)
    configures = len(re.findall(r"\baiex\.configure @", bodies.pop(None, "")))
    for name, body in bodies.items():
        sequence = f"{name}_sequence"
        if f"aie.runtime_sequence @{sequence}(" not in body:
            continue  # a *_reset device: loaded by another segment's sequence, no sequence of its own
        insts, aiecc_dir = build_dir / f"{name}.insts.bin", build_dir / f"aiecc_{name}"
        _aiecc(tc, program.name, f"aiecc {name}",
               ["--no-compile", "--no-link", "--aie-generate-npu-insts", "--dump-intermediates",
                f"--tmpdir={aiecc_dir}", f"--device-name={name}", f"--sequence-name={sequence}",
                f"--npu-insts-name={insts}", str(npu_module)], build_dir)
        reports.append(_resources(name, body, insts.stat().st_size // 4))
        launch = int(re.match(r"l(\d+)_", name).group(1))
        placed = _device_bodies((aiecc_dir / "input_physical.mlir").read_text())[name]
        tiles += lowered_l1(program.name, launch, program.launches[launch].kind, name, placed)
    if not reports:
        raise CompileError(program.name, "aiecc", "air-to-aie produced no segment device", build_dir)
    lowering = Lowering(program.name, tuple(reports), time.perf_counter() - started, tuple(tiles), configures)
    try:
        check_fits(lowering.l1)
    except L1BudgetError as exc:
        raise CompileError(program.name, "L1 budget", str(exc), build_dir) from exc
    if keep_dir is None:
        shutil.rmtree(build_dir, ignore_errors=True)
    return lowering
