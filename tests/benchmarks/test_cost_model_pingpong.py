"""The loops the timing model overlaps are the loops the real AIR double-buffers.

air-opt (mlir-air 0e3df89d) runs aircc's placement passes on each Program up to ``air-ping-pong-transform``; the
loops ``air-label-scf-for-to-ping-pong`` labels (read from its print, with the memory space of every buffer it
marks for hoisting) must be the loops the model's rule double-buffers, launch by launch, and the transform must
unroll each of them over a ping and a pong copy. A hand-made loop whose buffers are also used after it is the case
the rule keeps sequential, where a rule that overlapped any loop with DMAs and compute would be wrong.
Every buffer the label pass marks must be filled before it is read in each trip (that AIR does not check).
"""
import dataclasses
import math
import re
import subprocess

import pytest

from benchmarks import cost_model
from torch_npu2.kernels import catalog
from torch_npu2.kernels import timing
from torch_npu2.kernels.timing import L1, PingPongBuffer
from torch_npu2.kernels.air_pipeline import _module, _optimization_passes
from torch_npu2.kernels.builders import build_launch
from torch_npu2.kernels.builders.ir import WHOLE, LaunchBuilder, MemRef, Window
from torch_npu2.kernels.interpret import KERNEL_ARGUMENT_ACCESS
from torch_npu2.kernels.mlir_text import split_top
from torch_npu2.kernels.program import CompileOptions
from torch_npu2.kernels.stitch import stitch

LABEL_PASS, TRANSFORM_PASS = "air-label-scf-for-to-ping-pong", "air-ping-pong-transform"
DIMS, PACKED = cost_model.llama_1b_dims(), "q4_1"
PROGRAMS = [("o_ffn", 16), ("o_ffn", 2048), ("rms_gemms_rope", 2048), ("flash_attn", 2048),
            ("o_ffn_w8x2", 16), ("o_ffn_w8x2", 2048), ("rms_gemms_rope_w8x2", 2048),
            ("rms_gemv_rope", None), ("o_gemv_ffn", None), ("lm_head_gemv", None),
            ("decode_attn", 2048), ("decode_attn_o_gemv_ffn_rms_gemv_rope", 2048),
            # packed weights (Q4_1): the decode GEMVs and the dequantize Programs prefill runs
            ("rms_gemv_rope_packed", None), ("o_gemv_ffn_packed", None), ("lm_head_gemv_packed", None),
            *((f"dequantize_rows_{i}", None) for i in range(len(catalog.dequantize_programs(DIMS, PACKED))))]
# Buffers the label pass marks that the check below cannot prove filled first, and why each is safe: decode
# attention's per-call scratch, which dattn_tile_bf16 writes before it reads it in every call that touches it
# (kernels/aie2p/decode_attention.cc); its access letter "p" says only that a call past the length skips it.
SCRATCH = {name: ["memref<256xf32, 2 : i32>", "memref<256xbf16, 2 : i32>"]
           for name in ("decode_attn", "decode_attn_o_gemv_ffn_rms_gemv_rope")}


def _program(name: str, seq):
    """The Program the parametrization names: Llama-3.2-1B's, its GEMMs at matmul precision w8x2a16 (``_w8x2``), its
    projection weights packed (``_packed``), or its i-th dequantize Program (``dequantize_rows_<i>``)."""
    if name.startswith("dequantize_rows_"):
        return catalog.dequantize_programs(DIMS, PACKED)[int(name.rsplit("_", 1)[1])]
    integer = name.endswith("_w8x2")  # the prefill Programs at matmul precision w8x2a16
    packed = name.endswith("_packed")
    program = cost_model.program(name.removesuffix("_w8x2").removesuffix("_packed"), DIMS, seq,
                                 "w8x2a16" if integer else "bf16", PACKED if packed else "bf16")
    assert program.name == name
    return program


_CONSTANT = re.compile(r"(%\w+) = arith\.constant (-?\d+) : index")
_FOR = re.compile(r"scf\.for %\w+ = %\w+ to (%\w+) step (%\w+)(?: iter_args\(([^)]*)\))?")
_HOISTED = re.compile(r"memref\.alloc\(\) \{hoist_alloc = true\} : memref<[^>]*, (\d) : i32>")
_LAUNCH = re.compile(r"air\.launch @(\w+)")


def run_to_pingpong(tools, module: str, options: CompileOptions) -> tuple[str, str]:
    """aircc's placement passes up to the ping-pong transform: (the print after the label pass, the final one)."""
    passes = _optimization_passes(options)
    last = max((i for i, p in enumerate(passes) if p.startswith(TRANSFORM_PASS)), default=len(passes) - 1)
    pipeline = _module(["air-insert-launch-around-herd{insert-segment=true}", "func.func(air-lower-herd-parallel)",
                        "scf-forall-to-parallel", *passes[:last + 1]])
    result = subprocess.run([str(tools.air_opt), "-", f"--pass-pipeline={pipeline}",
                             f"--mlir-print-ir-after={LABEL_PASS}"],
                            input=module, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr, result.stdout


def _loops(printed: str):
    """Every scf.for of ``printed`` when it closes: (launch symbol, "herd"/"segment", trips, step, iter_args,
    memory spaces of the allocs labelled for hoisting directly in it, its closing line)."""
    constants, stack = {}, []
    for raw in printed.splitlines():
        line = raw.strip()
        constants.update((n, int(v)) for n, v in _CONSTANT.findall(line))
        if line.startswith("}"):
            frame = stack.pop()
            if frame[0] == "for":
                yield (*frame[1:], line)
            if line.endswith("{"):  # "} else {"
                stack.append(("other",))
            continue
        if m := _HOISTED.search(line):
            next(f for f in reversed(stack) if f[0] == "for")[6].append(int(m.group(1)))
        if not line.endswith("{"):
            continue
        if m := _FOR.search(line):
            launch = next((f[1] for f in stack if f[0] == "launch"), None)
            level = "herd" if any(f[0] == "herd" for f in stack) else "segment"
            iter_args = m.group(3).count("=") if m.group(3) else 0
            stack.append(("for", launch, level, constants[m.group(1)], constants[m.group(2)], iter_args, []))
        elif m := _LAUNCH.search(line):
            stack.append(("launch", m.group(1)))
        else:
            stack.append(("herd",) if "air.herd @" in line else ("other",))


def air_pingpong(after_label: str) -> dict[str, set[PingPongBuffer]]:
    """Per launch symbol: the buffers the label pass marks, with their loop's level and trips, in the loops the
    transform keeps as a loop (unrolling two trips by two leaves none: the pong copy then waits for the ping)."""
    found: dict[str, set] = {}
    for launch, level, trips, _, _, spaces, closing in _loops(after_label):
        if "unroll = 2" in closing and trips > 2:
            found.setdefault(launch, set()).update(PingPongBuffer(level, trips, s) for s in spaces)
    return found


def air_transformed_loops(final: str) -> dict[str, int]:
    """Per launch symbol: loops the transform unrolled by two with ping and pong dependency tokens."""
    found: dict[str, int] = {}
    for launch, _, _, step, iter_args, _, _ in _loops(final):
        if step == 2 and iter_args == 4:
            found[launch] = found.get(launch, 0) + 1
    return found


def labelled_loop_count(after_label: str) -> dict[str, int]:
    """Per launch symbol: labelled loops of more than two trips."""
    found: dict[str, int] = {}
    for launch, _, trips, *_, closing in _loops(after_label):
        if "unroll = 2" in closing and trips > 2:
            found[launch] = found.get(launch, 0) + 1
    return found


_ZERO_I32 = re.compile(r"(%\w+) = arith\.constant 0 : i32")
_CALL = re.compile(r"func\.call @(\w+)\(([^)]*)\) : \((.*)\) ->")


def _filled_by_gets(uses: list[str], alias: str, numel: int, constants: dict[str, int]) -> bool:
    """Whether the leading channel gets of ``uses`` fill all ``numel`` elements of the buffer before anything else
    touches it (whole-buffer gets, or 1-D windows with stride 1)."""
    filled = set()
    for use in uses:
        get = re.search(r"air\.channel\.get .*\(" + re.escape(alias) + r"\[([^]]*)\] \[([^]]*)\] \[([^]]*)\]\)", use)
        if not get:
            break
        window = [[constants.get(name) for name in g.split(", ")] if g else [] for g in get.groups()]
        if window == [[], [], []]:
            return True
        offsets, sizes, strides = window
        if None in offsets + sizes + strides or not len(offsets) == len(sizes) == len(strides):
            break
        # the buffer's row-major element offsets the window covers (a buffer of this shape: strides in elements)
        start = sum(o * s for o, s in zip(offsets, strides))
        covered = {start}
        for size, stride in zip(sizes, strides):
            covered = {c + i * stride for c in covered for i in range(size)}
        filled.update(c for c in covered if 0 <= c < numel)
    return len(filled) == numel


def _written_whole_by_call(use: str, alias: str, zeros: set[str]) -> bool:
    """Whether ``use`` is a kernel call that only writes the buffer (interpret.KERNEL_ARGUMENT_ACCESS: "w" at each
    of its positions), or gemv_partial_f32 (or its packed twin) starting its sum there (k0 = 0)."""
    if not (call := _CALL.search(use)):
        return False
    symbol, args, types = re.sub(r"_v\d+$", "", call.group(1)), split_top(call.group(2)), split_top(call.group(3))
    memrefs = [a for a, t in zip(args, types) if t.startswith("memref")]
    access = [KERNEL_ARGUMENT_ACCESS[symbol][i] for i, a in enumerate(memrefs) if a == alias]
    starts_sum = symbol in ("gemv_partial_f32", "gemv_q_partial_f32") and args[3] in zeros
    return bool(access) and all(a == "w" or (a == "p" and starts_sum) for a in access)


def carried_buffers(after_label: str) -> list[str]:
    """Buffers the label pass marks for ping and pong copies whose first use in their loop may read them.

    The label pass of mlir-air 0e3df89d marks every alloc directly in a loop, and air-fuse-alloc-dealloc sinks
    a buffer into the loop when every use is inside it, so a value carried from one trip to the next would be
    split between the two copies (later AIR refuses such loops). Safe first uses fill the whole buffer: channel
    gets, a vector write, or a kernel call that only writes it."""
    lines = after_label.splitlines()
    constants = {name: int(value) for name, value in _CONSTANT.findall(after_label)}
    zeros = set(_ZERO_I32.findall(after_label))
    carried = []
    for index, line in enumerate(lines):
        if "hoist_alloc = true" not in line:
            continue
        alias = re.search(r"(%results(?:_\d+)?)\b", lines[index - 1]).group(1)
        shape = re.search(r"memref<((?:\d+x)*)\w+, \d : i32>", line).group(1)
        use = re.compile(re.escape(alias) + r"(?!\w)")
        uses = [x.strip() for x in lines[index + 2:] if use.search(x) and "memref.dealloc" not in x]
        numel = math.prod(int(d) for d in shape.split("x") if d)
        if (not uses or _filled_by_gets(uses, alias, numel, constants)
                or uses[0].startswith("vector.transfer_write") or _written_whole_by_call(uses[0], alias, zeros)):
            continue
        carried.append(f"{line.strip()} first used by: {uses[0][:160]}")
    return carried


def model_pingpong(program) -> dict[str, set[PingPongBuffer]]:
    found = {}
    for index, launch in enumerate(program.launches):
        buffers = timing.pingpong_buffers(build_launch(program, launch), program.compile_options)
        if buffers:
            found[f"l{index}_{launch.kind}"] = buffers
    return found


@pytest.mark.parametrize("name,seq", PROGRAMS)
def test_the_model_double_buffers_exactly_what_air_does(air_tools, name, seq):
    program = _program(name, seq)
    after_label, final = run_to_pingpong(air_tools, stitch(program).text, program.compile_options)
    air = air_pingpong(after_label)
    assert model_pingpong(program) == air
    assert air_transformed_loops(final) == labelled_loop_count(after_label)
    carried = [re.search(r"memref<[^>]*>", line).group(0) for line in carried_buffers(after_label)]
    assert carried == SCRATCH.get(name, []), carried_buffers(after_label)
    assert air, "every Program double-buffers a loop (attention its key/value blocks)"


# ---- a loop AIR leaves single-buffered ------------------------------------------------------------------
TRIPS, TILE, K = 4, 32, 128
MATMUL = ("linalg.matmul indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>, affine_map<(d0, d1, d2) -> (d1, d2)>, "
          "affine_map<(d0, d1, d2) -> (d0, d1)>]")


def streamed_launch(reuse_after_loop: bool, drain_each_trip: bool = False):
    """One tile streams A and W windows DDR → L1 over K and multiplies them; with ``reuse_after_loop`` it multiplies
    the last windows once more after the loop, so its buffers are used outside the loop too; with
    ``drain_each_trip`` it writes the running sum out every trip instead of once after the loop."""
    b = LaunchBuilder("streamed", [MemRef((TILE, K), "bf16"), MemRef((TILE, K), "bf16"), MemRef((TILE, TILE), "f32")],
                      "awc")
    step = K // TRIPS
    a_type, w_type, acc_type = (MemRef((TILE, step), "bf16", L1), MemRef((TILE, step), "bf16", L1),
                                MemRef((TILE, TILE), "f32", L1))
    with b.launch("streamed", (1, 1), b.operands) as (_, _, (a, w, c)):
        with b.segment("streamed_seg", [a, w, c]) as (_, _, (sa, sw, sc)):
            with b.herd("streamed_herd", (1, 1), [sa, sw, sc]) as (_, _, (ha, hw, hc)):
                a_buf, w_buf, acc = b.alloc(a_type, "a_l1"), b.alloc(w_type, "w_l1"), b.alloc(acc_type, "acc")
                multiply = (f"{MATMUL} ins({a_buf.ssa}, {w_buf.ssa} : {a_type}, {w_type}) "
                            f"outs({acc.ssa} : {acc_type})")
                with b.loop(0, K, step, "k") as k:
                    b.dma(a_buf, WHOLE, ha, Window((0, k), (TILE, step), (K, 1)))
                    b.dma(w_buf, WHOLE, hw, Window((0, k), (TILE, step), (K, 1)))
                    b.emit(multiply)
                    if drain_each_trip:
                        b.dma(hc, WHOLE, acc, WHOLE)
                if reuse_after_loop:
                    b.emit(multiply)
                if not drain_each_trip:
                    b.dma(hc, WHOLE, acc, WHOLE)
    return b.finish({name: value.type.nbytes
                     for name, value in (("A window", a_buf), ("W window", w_buf), ("acc", acc))})


def as_module(ir) -> str:
    signature = ", ".join(f"{v.ssa}: {v.type}" for v in ir.operands)
    body = "\n".join("    " + line for line in ir.text.splitlines())
    return f"module {{\n  func.func @streamed({signature}) {{\n{body}\n    return\n  }}\n}}\n"


def overlap_anywhere_with_dma_and_compute(ir) -> set[PingPongBuffer]:
    """The rule the model had before: any multi-trip loop with DMAs and compute is double-buffered."""
    region = timing._Parser(ir.externs, None).parse(ir.text)
    while region.kind != "for":
        region = next(item for item in region.body if isinstance(item, timing.Region))
    return {PingPongBuffer("herd", region.sizes[0], t.dst_space)
            for t in region.body if isinstance(t, timing.Transfer)}


@pytest.mark.parametrize("reuse_after_loop", [False, True])
def test_a_loop_whose_buffers_outlive_it_is_not_double_buffered(air_tools, reuse_after_loop):
    ir = streamed_launch(reuse_after_loop)
    options = CompileOptions()
    after_label, final = run_to_pingpong(air_tools, as_module(ir), options)
    air = air_pingpong(after_label).get("streamed", set())
    model = timing.pingpong_buffers(ir, options)
    assert model == air
    assert air_transformed_loops(final).get("streamed", 0) == labelled_loop_count(after_label).get("streamed", 0)
    predicted = timing.launch_cost(ir, options, timing.FAST).seconds
    sequential = timing.launch_cost(ir, dataclasses.replace(options, omit_pingpong="all"), timing.FAST).seconds
    if reuse_after_loop:
        # AIR cannot move the buffers into the loop, so it labels nothing: the old rule disagreed here.
        assert air == set() and predicted == sequential
        assert overlap_anywhere_with_dma_and_compute(ir) != air
    else:
        assert air == {PingPongBuffer("herd", TRIPS, L1)} and predicted < sequential


def test_a_sum_carried_from_trip_to_trip_is_caught(air_tools):
    """Drained every trip, the accumulator has no use after the loop: AIR sinks it into the loop and labels it for
    ping and pong copies, which would give each copy half of the sum; drained after the loop, it stays single."""
    carried = carried_buffers(run_to_pingpong(air_tools, as_module(streamed_launch(False, True)), CompileOptions())[0])
    assert len(carried) == 1 and "memref<32x32xf32, 2 : i32>" in carried[0] and "linalg.matmul" in carried[0]
    assert carried_buffers(run_to_pingpong(air_tools, as_module(streamed_launch(False)), CompileOptions())[0]) == []
