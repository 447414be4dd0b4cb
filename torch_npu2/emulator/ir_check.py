"""A Program's MLIR-AIR, run by the interpreter (kernels/interpret.py), against the emulated NPU2's launches.

The emulator checks the plan (what each launch computes); the interpreter runs the IR the compiler would get
(tiling, DMA windows, herd indexing, the C++ kernels). Every argument a launch writes, scratch included, is
compared, so a wrong launch is named even when a later one hides it.

Tolerances are the op tests' (tests/ops/test_fused_ops.py), by dtype: the largest absolute difference as a
fraction of the reference's largest magnitude, and the cosine similarity. An fp32 argument is compared with what its
launch's emulation gives on the values the interpreted launch read: a bf16 input a rounding apart (one launch after
another of a chain, each within the bf16 tolerance) moves an fp32 sum past the fp32 tolerance, as it moves a
decode group's logits, computed after its layers. So is an integer argument (an integer GEMM's quantized input
rows), which must equal it exactly: the quantization is exact integer arithmetic on the values read.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..kernels import int_gemm, quant
from ..kernels.catalog import decode_attn_length_digits
from ..kernels.interpret import run_program_ir
from ..kernels.program import TORCH_DTYPES, Program, Role
from ..kernels.stitch import stitch
from .launches import run_launch

TOLERANCE = {torch.bfloat16: dict(max_rel=2.5e-2, min_cosine=0.9995),
             torch.float32: dict(max_rel=1e-4, min_cosine=0.99999)}


def random_inputs(program: Program, seed: int = 0) -> dict[str, torch.Tensor]:
    """Normal bf16 values for every host argument; 2-D weights scaled by 1/sqrt(in_features), as a Linear's; a
    packed weight holds such a weight quantized in the format of the launch that reads it, an integer GEMM's weight
    such a weight prepared (int_gemm.prepare_weight); a weight arena holds each of its views' weights so."""
    generator = torch.Generator().manual_seed(seed)
    packed = {name: launch.p for launch in program.launches if "weights" in launch.p for name in launch.reads
              if program.arg(name).dtype == "i32"}
    prepared = {launch.reads[1]: launch for launch in program.launches if launch.kind in INTEGER_GEMM_HALVES}
    # a decode attention's valid length (its 4th input, as digits): a position within the launch's capacity
    lengths = {launch.reads[3]: launch.p["capacity"] for launch in program.launches
               if launch.kind == "decode_attention"}

    def drawn(arg) -> torch.Tensor:
        if arg.name in lengths:
            length = int(torch.randint(1, lengths[arg.name] + 1, (), generator=generator))
            return torch.tensor(decode_attn_length_digits(length), dtype=torch.bfloat16)
        if arg.name in packed:
            return _random_packed(packed[arg.name], arg, generator)
        if arg.name in prepared:
            return _random_prepared(prepared[arg.name], generator)
        scale = arg.shape[-1] ** -0.5 if arg.role is Role.WEIGHT and len(arg.shape) == 2 else 1.0
        return (torch.randn(arg.shape, generator=generator) * scale).to(TORCH_DTYPES[arg.dtype])

    inputs = {}
    for arg in program.host_args:
        views = [v for v in program.views if v.arena == arg.name]
        if not views:
            inputs[arg.name] = drawn(arg)
            continue
        arena = inputs[arg.name] = torch.zeros(arg.shape, dtype=TORCH_DTYPES[arg.dtype])  # (a weight arena)
        for view in views:  # each part as the weight it is, the gaps between them zero
            view.of(arena).copy_(drawn(program.arg(view.name)))
    return inputs


# the integer GEMM kinds, and the weights (halves) each one's prepared weight holds
INTEGER_GEMM_HALVES = {"gemm_int": 1, "gemm_int_swiglu": 2}


def _random_prepared(launch, generator) -> torch.Tensor:
    """An integer GEMM's prepared weight, from a normal bf16 weight of a Linear's size ([gate | up] for a pair)."""
    halves, N, K = INTEGER_GEMM_HALVES[launch.kind], launch.p["N"], launch.p["K"]
    weight = (torch.randn(halves * N, K, generator=generator) * K ** -0.5).bfloat16()
    return int_gemm.prepare_weight(weight, halves)


def _random_packed(params: dict, arg, generator) -> torch.Tensor:
    """Packed rows of K = params["K"] weights each: random quants, fp16 scales (and mins) of a Linear's size."""
    fmt, K = quant.weight_format(params["weights"]), params["K"]
    rows, blocks = arg.nbytes // fmt.row_bytes(K), K // quant.BLOCK
    quants = torch.randint(0, 256, (rows, blocks, fmt.quant_bytes), dtype=torch.uint8, generator=generator)
    scale = K ** -0.5 / 8
    heads = [(torch.rand(rows, blocks, 1, generator=generator) * scale).half().view(torch.uint8)]
    if fmt.has_min:
        heads.append((-torch.rand(rows, blocks, 1, generator=generator) * 8 * scale).half().view(torch.uint8))
    return quant.from_gguf_blocks(fmt, torch.cat(heads + [quants], dim=-1), K).view(torch.int32).reshape(arg.shape)


def emulate(program: Program, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every argument after the emulator's launches ran on ``inputs``."""
    values = dict(inputs)
    for view in program.views:  # a weight arena's parts, as the launches read them
        if view.arena in inputs:
            values[view.name] = view.of(inputs[view.arena])
    for launch in program.launches:
        values.update(emulate_launch(program, launch, values))
    return values


def emulate_launch(program: Program, launch, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``launch`` writes, by argument name, emulated on ``values`` of the arguments it reads."""
    results = run_launch(launch, [values[n] for n in launch.reads])
    return {name: result.reshape(program.arg(name).shape).to(TORCH_DTYPES[program.arg(name).dtype])
            for name, result in zip(launch.writes, results)}


@dataclass(frozen=True)
class ArgComparison:
    name: str
    max_rel: float  # max |interpreted - emulated| / max |emulated|
    cosine: float

    def within(self, dtype: torch.dtype) -> bool:
        if not dtype.is_floating_point:  # integer results are exact
            return self.max_rel == 0
        tolerance = TOLERANCE[dtype]
        return self.max_rel <= tolerance["max_rel"] and self.cosine >= tolerance["min_cosine"]


@dataclass(frozen=True)
class ProgramCheck:
    program: Program
    comparisons: tuple[ArgComparison, ...]
    seconds: float  # interpreting the IR (air-opt's print included)

    def failures(self) -> list[str]:
        return [f"{c.name}: max_rel {c.max_rel:.3g}, cosine {c.cosine:.6f}" for c in self.comparisons
                if not c.within(TORCH_DTYPES[self.program.arg(c.name).dtype])]

    @property
    def passed(self) -> bool:
        return not self.failures()

    @property
    def worst(self) -> ArgComparison:
        return max(self.comparisons, key=lambda c: (c.max_rel != c.max_rel, c.max_rel))


def compare(name: str, interpreted: torch.Tensor, emulated: torch.Tensor) -> ArgComparison:
    got, want = interpreted.double().flatten(), emulated.double().flatten()
    scale = want.abs().max().item()
    max_rel = (got - want).abs().max().item() / scale if scale else (got - want).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=0).item()
    return ArgComparison(name, max_rel, cosine)


def check_program_ir(program: Program, seed: int = 0, text: str | None = None,
                     tuning: dict[int, dict] | None = None) -> ProgramCheck:
    """Interprets ``program``'s IR (built with the builders' ``tuning`` per launch index, or ``text``, a printed
    module standing in for it) on random inputs and compares every argument a launch writes with the
    emulator's."""
    inputs = random_inputs(program, seed)
    started = time.perf_counter()
    interpreted = run_program_ir(program, inputs, text=text, stitched=stitch(program, tuning))
    seconds = time.perf_counter() - started
    emulated = emulate(program, inputs)
    for launch in program.launches:  # fp32 and integer results: emulated on what the interpreted launch read
        if any(program.arg(n).dtype != "bf16" for n in launch.writes):
            emulated.update(emulate_launch(program, launch, {**inputs, **interpreted}))
    written = [a.name for a in program.buffers if a.role in (Role.SCRATCH, Role.OUTPUT)]
    return ProgramCheck(program, tuple(compare(n, interpreted[n], emulated[n]) for n in written), seconds)
