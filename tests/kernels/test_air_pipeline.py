"""aircc's npu2 flow replayed with the real AIR binaries: the pass pipelines, every Program lowered to NPU
instructions for SmolLM2-135M and Llama-3.2-1B dims, and failures that name the pass."""
import concurrent.futures
import dataclasses
import re
import subprocess

import pytest

from torch_npu2.kernels import ModelDims, catalog, programs_for_model
from torch_npu2.kernels import air_pipeline
from torch_npu2.kernels.air_pipeline import (TIMEOUT_VARIABLE, CompileError, air_to_aie_pipeline, lower_to_npu_insts,
                                             npu_pipeline, placement_pipeline)
from torch_npu2.kernels.budgets import program_l1
from torch_npu2.kernels.builders.npu2 import L1_AVAILABLE
from torch_npu2.kernels.device import DEVICE
from torch_npu2.kernels.program import DTYPE_BYTES, Arg, CompileOptions, Launch, Program, Role, View

from .air_text import shift_first_packed_v_bd

# Under pytest-xdist (make test) the whole module runs on one worker: the lowerings fixture below lowers every
# Program the session names, so a second worker running some of its tests would lower them all again.
pytestmark = pytest.mark.xdist_group("air_pipeline")

SMOL = ModelDims(576, 9, 3, 64, 1536, 49152, 1e-5)
LLAMA = ModelDims(2048, 32, 8, 64, 8192, 128256, 1e-5)
BUCKETS = [16, 32, 64, 128, 256, 512, 1024, 2048]
# The slowest Programs (the four-layer decode groups below) spent up to about 5 minutes in one air-opt stage when it
# placed the whole module; a pass that stops making progress fails its test here instead of running into CI's limit.
LOWERING_TIMEOUT = "900"
PROGRAMS = {f"{model}-{p.name}-{dict(p.params).get('rows', dict(p.params).get('seq'))}": p
            for model, dims in (("smol", SMOL), ("llama", LLAMA)) for p in programs_for_model(dims, BUCKETS, "bf16")}
# "bfp16_gate_up" changes only o_ffn (its gate/up GEMM becomes a second, BFP16-built variant of gemm.o); the
# smallest and largest buckets lower with both variants in one Program.
PROGRAMS.update({f"{model}-o_ffn-bfp16_gate_up-{dict(p.params)['rows']}": p
                 for model, dims in (("smol", SMOL), ("llama", LLAMA))
                 for p in programs_for_model(dims, (16, 2048), "bfp16_gate_up") if p.name == "o_ffn"})

# The integer-GEMM prefill Programs ("w8x2a16": quantize_rows, gemm_int, gemm_int_swiglu) at every bucket: the 32
# lowered in 509 s here (2 shared cores), SmolLM2's in about 3 minutes; Llama-3.2-1B's o_ffn_w8x2 at 2048 took 91 s.
PROGRAMS.update({f"{model}-{p.name}-{dict(p.params)['rows']}": p
                 for model, dims in (("smol", SMOL), ("llama", LLAMA))
                 for p in programs_for_model(dims, BUCKETS, "w8x2a16") if p.name.endswith("_w8x2")})

# The decode Programs over packed Q4_1 weights (SmolLM2's LM head in its GGUF's Q8_0): W rows move as bytes; and
# the dequantize_rows Programs that make prefill's bf16 weights of them, one per projection (rows x in features).
PROGRAMS.update({f"{model}-{p.name}-{weights}" + ("-{rows}x{in_features}".format(**dict(p.params))
                                                  if p.name == "dequantize_rows" else ""): p
                 for model, dims, weights, head in (("smol", SMOL, "q4_1", "q8_0"), ("llama", LLAMA, "q4_1", "q4_1"))
                 for p in programs_for_model(dims, (), weights=weights, lm_head_weights=head)})

# Decode attention at the capacity buckets of 256, 2048 and 8192 positions.
PROGRAMS.update({f"{model}-decode_attn-{capacity}": catalog.decode_attn_program(dims.heads, dims.kv_heads,
                                                                                 dims.head_dim, capacity)
                 for model, dims in (("smol", SMOL), ("llama", LLAMA)) for capacity in (256, 2048, 8192)})
# A decode layer from its attention on, in one ELF (decode attention, o_gemv_ffn, the next rms_gemv_rope).
PROGRAMS["llama-decode_attn_o_gemv_ffn_rms_gemv_rope-2048"] = catalog.decode_attn_o_gemv_ffn_rms_gemv_rope_program(
    LLAMA.hidden, LLAMA.q_dim, LLAMA.intermediate, LLAMA.eps, LLAMA.heads, LLAMA.kv_heads, LLAMA.head_dim, 2048,
    LLAMA.eps)
# The last decode layer from its attention on (decode attention, o_gemv_ffn).
PROGRAMS["llama-decode_attn_o_gemv_ffn-2048"] = catalog.decode_attn_o_gemv_ffn_program(
    LLAMA.hidden, LLAMA.q_dim, LLAMA.intermediate, LLAMA.eps, LLAMA.heads, LLAMA.kv_heads, LLAMA.head_dim, 2048)
# The same over packed Q4_1 weights (what the patched layers run with weights="q4_1").
PROGRAMS["llama-decode_attn_o_gemv_ffn_rms_gemv_rope_packed-q4_1-2048"] = \
    catalog.decode_attn_o_gemv_ffn_rms_gemv_rope_packed_program(LLAMA.hidden, LLAMA.q_dim, LLAMA.intermediate,
                                                                LLAMA.eps, LLAMA.heads, LLAMA.kv_heads, LLAMA.head_dim,
                                                                2048, LLAMA.eps, "q4_1")

# A Llama-3.2-1B token's two decode runs, eight layers each, each layer's weights views of its two arenas: over bf16
# weights starting with the first layer's Q/K/V (npu2.decode_layers8_qkv: 59 launches, 58 arguments, its seven
# scratches views of one) and over packed Q4_1 weights ending with the model's last layer, its final norm and LM head
# (npu2.decode_layers8_final_lm_packed: 55 launches, 56 arguments): the slowest Programs here, placed launch by launch
# (376 s and 317 s here with other tests beside them; four layers with the whole module placed at once, as aircc
# places it, took 425 s).
PROGRAMS.update({f"llama-{p.name}-2048": p for p in (
    catalog.decode_layers_program(8, LLAMA.hidden, LLAMA.q_dim, LLAMA.intermediate, LLAMA.eps, LLAMA.heads,
                                  LLAMA.kv_heads, LLAMA.head_dim, 2048, LLAMA.eps, weights, ends_model=final,
                                  lm_head=(catalog.lm_head_rows(LLAMA.vocab), LLAMA.eps, weights) if final else None,
                                  first_qkv=not final)
    for weights, final in (("bf16", False), ("q4_1", True)))})
# A group that ends with the model's last layer and runs its final norm and LM head (npu2.decode_layers<n>_final_lm):
# SmolLM2's 30 layers end with two, run over its GGUF's Q4_1 weights, its LM head the GGUF's Q8_0 embedding (the
# group without the head: 156 s here; Llama-3.2-1B's four-layer bf16 one, 55 arguments, lowered by hand in 253 s at
# c504d68).
PROGRAMS["smol-decode_layers2_final_lm_packed-q4_1-2048"] = catalog.decode_layers_program(
    2, SMOL.hidden, SMOL.q_dim, SMOL.intermediate, SMOL.eps, SMOL.heads, SMOL.kv_heads, SMOL.head_dim, 2048, SMOL.eps,
    "q4_1", ends_model=True, lm_head=(catalog.lm_head_rows(SMOL.vocab), SMOL.eps, "q8_0"))
# The same over SmolLM2 in bf16 with its LM head's Q8_0 copy (npu2.decode_layers2_final_packed_lm: what a bf16
# model's last group runs by default).
PROGRAMS["smol-decode_layers2_final_packed_lm-q8_0-2048"] = catalog.decode_layers_program(
    2, SMOL.hidden, SMOL.q_dim, SMOL.intermediate, SMOL.eps, SMOL.heads, SMOL.kv_heads, SMOL.head_dim, 2048, SMOL.eps,
    "bf16", ends_model=True, lm_head=(catalog.lm_head_rows(SMOL.vocab), SMOL.eps, "q8_0"))

# Qwen2.5-0.5B's dims with its q/k/v biases (every Q/K/V Program adds them with bias_add launches): the default
# prefill Programs at the smallest and largest buckets, the bf16-weight prefill GEMMs at the smallest, decode (its
# down projection's K = 4864 in chunks that fit a memtile BD dimension), the LM head at lm_head_rows(151936), and a
# decode layer from its attention on, and a decode group (the biases parts of the layers' norms arenas).
QWEN = ModelDims(896, 14, 2, 64, 4864, 151936, 1e-6, qkv_bias=True)
PROGRAMS.update({f"qwen2-{p.name}-{dict(p.params).get('rows', dict(p.params).get('seq'))}": p
                 for p in programs_for_model(QWEN, (16, 2048))})
PROGRAMS["qwen2-rms_gemms_rope-bf16-16"] = catalog.rms_gemms_rope_program(
    QWEN.hidden, QWEN.heads, QWEN.kv_heads, QWEN.head_dim, QWEN.eps, 16, "bf16", qkv_bias=True)
PROGRAMS["qwen2-decode_attn_o_gemv_ffn_rms_gemv_rope-2048"] = catalog.decode_attn_o_gemv_ffn_rms_gemv_rope_program(
    QWEN.hidden, QWEN.q_dim, QWEN.intermediate, QWEN.eps, QWEN.heads, QWEN.kv_heads, QWEN.head_dim, 2048, QWEN.eps,
    qkv_bias=True)
# Its packed decode FFN and the down projection's dequantize_rows: rows of K = 4864 in element-order groups
# (kernels/quant.py: 2 x 76 blocks in Q4_1, 4 x 38 in Q8_0), a group per K-split chunk.
PROGRAMS.update({f"qwen2-{p.name}-{weights}" + ("-{rows}x{in_features}".format(**dict(p.params))
                                                if p.name == "dequantize_rows" else ""): p
                 for weights in ("q4_1", "q8_0") for p in programs_for_model(QWEN, (), weights=weights)
                 if p.name == "o_gemv_ffn_packed" or dict(p.params).get("in_features") == QWEN.intermediate})
PROGRAMS["qwen2-decode_layers2_qkv-2048"] = catalog.decode_layers_program(
    2, QWEN.hidden, QWEN.q_dim, QWEN.intermediate, QWEN.eps, QWEN.heads, QWEN.kv_heads, QWEN.head_dim, 2048, QWEN.eps,
    first_qkv=True, qkv_bias=True)

# Flash attention past the default buckets (a prefill bucket of 4096): the key/value stream of every round is one
# shim task per launch step (each KV head's keys and values one run of the stacked buffer), where the rounds' own
# tasks ran out of shim buffer descriptors.
PROGRAMS.update({f"{model}-flash_attn-4096": catalog.flash_attn_program(dims.heads, dims.kv_heads, dims.head_dim, 4096)
                 for model, dims in (("llama", LLAMA), ("qwen2", QWEN))})
# upstream's longest flash attention (2 heads, 16384 positions: benchmarks' replay), each memtile full with its share
PROGRAMS["upstream-flash_attn-16384"] = catalog.flash_attn_program(2, 2, 64, 16384)

# What aircc (mlir-air python/air/compiler/aircc/main.py at 0e3df89d) runs for `--device npu2` with its
# defaults: written out here from that file, so a change to our replay has to be a deliberate one.
AIRCC_PLACEMENT = (
    "builtin.module(air-insert-launch-around-herd{insert-segment=true},func.func(air-lower-herd-parallel),"
    "scf-forall-to-parallel,air-dependency,air-hoist-dma-in-accum-pattern,air-broadcast-detection,"
    "air-specialize-dma-broadcast,air-dma-to-channel,canonicalize,cse,air-dependency-canonicalize,canonicalize,cse,"
    "air-isolate-async-dma-loop-nests,canonicalize,cse,air-fuse-channels,canonicalize,cse,"
    "func.func(air-split-l2-memref),canonicalize,cse,air-isolate-async-dma-loop-nests,canonicalize,cse,"
    "func.func(air-fuse-alloc-dealloc),func.func(air-shrink-memref-sizes-by-access),"
    "air-label-scf-for-to-ping-pong,air-ping-pong-transform,canonicalize,cse,func.func(convert-linalg-to-loops),"
    "func.func(air-opt-memtile-dma-bds{device=npu2}),canonicalize,cse,func.func(air-collapse-herd{max-col-size=4 }),"
    "canonicalize,cse,air-place-herds{num-rows=6 num-cols=8 row-anchor=2 col-anchor=0},canonicalize,cse,"
    "func.func(air-renumber-dma))")
AIRCC_AIR_TO_AIE = ("builtin.module(air-to-aie{emit-while-loop=true row-offset=2 col-offset=0 device=npu2 "
                    "use-lock-race-condition-fix=false},air-merge-unrolled-devices)")
AIRCC_NPU = ("builtin.module(func.func(air-opt-shim-dma-bds{device=npu2 shim-dma-tile-sizes=4,4}),canonicalize,cse,"
             "air-to-std,symbol-dce,affine-expand-index-ops,canonicalize,cse,"
             "airrt-to-npu{ trace-size=0 trace-offset=0 output-elf=true},canonicalize,cse)")


def test_default_pipelines_are_aircc_npu2():
    options = CompileOptions()
    assert placement_pipeline(options) == AIRCC_PLACEMENT
    assert air_to_aie_pipeline(options) == AIRCC_AIR_TO_AIE
    assert npu_pipeline(options) == AIRCC_NPU


def test_options_change_the_passes_aircc_changes():
    options = CompileOptions(runtime_loop_tiling_sizes=(2, 2), omit_pingpong="all", omit_while_true_loop=True,
                             omit_auto_broadcast=True, use_lock_race_condition_fix=True)
    placement = placement_pipeline(options)
    assert "air-broadcast-detection" not in placement and "air-specialize-dma-broadcast" not in placement
    assert "air-ping-pong-transform" not in placement
    assert "emit-while-loop=false" in air_to_aie_pipeline(options)
    assert "use-lock-race-condition-fix=true}" in air_to_aie_pipeline(options)
    assert "shim-dma-tile-sizes=2,2}" in npu_pipeline(options)
    l1_only = placement_pipeline(CompileOptions(omit_pingpong="L1"))
    assert "air-label-scf-for-to-ping-pong{omit-memory-space=L1},air-ping-pong-transform{omit-memory-space=L1}" \
        in l1_only
    assert options.aircc_flags() == ["--air-runtime-loop-tiling-sizes", "2", "2", "--stack-size", "3072",
                                     "--omit-ping-pong-transform=all", "--omit-while-true-loop", "--omit-auto-broadcast",
                                     "--use-lock-race-condition-fix"]
    assert CompileOptions(stack_size=4096).aircc_flags()[3:5] == ["--stack-size", "4096"]
    with pytest.raises(ValueError, match="stack_size must be a positive int of bytes"):
        CompileOptions(stack_size=0)
    with pytest.raises(ValueError, match="omit_pingpong must be one of"):
        CompileOptions(omit_pingpong="L3")
    with pytest.raises(ValueError, match="runtime_loop_tiling_sizes must be a tuple of positive ints"):
        CompileOptions(runtime_loop_tiling_sizes=[4, 4])


def assert_views_patched_in_place(program: Program, build_dir) -> None:
    """Each launch's shim BDs on an arena argument (a Program's views: kernels/program.py, View) are address-patched
    at a byte inside a view that launch touches, and each view it touches has its first byte among them. A view
    addressed from the arena's start (what a memref.reinterpret_cast's offset becomes in this mlir-aie's lowering)
    would patch byte 0 of the arena."""
    arenas = {program.index(v.arena) for v in program.views}
    for index, launch in enumerate(program.launches):
        (lowered,) = build_dir.glob(f"aiecc_l{index}_*_seg/*_npu_lowered.mlir")
        patched = {(int(arg), int(plus)) for arg, plus in
                   re.findall(r"arg_idx = (\d+) : i32, arg_plus = (\d+)", lowered.read_text()) if int(arg) in arenas}
        touched: dict[int, list[range]] = {}
        for view in filter(None, map(program.view, launch.reads + launch.writes)):
            size = DTYPE_BYTES[view.dtype]
            touched.setdefault(program.index(view.arena), []).append(
                range(view.offset * size, (view.offset + program.arg(view.name).numel) * size))
        assert all(any(plus in span for span in touched.get(arg, ())) for arg, plus in patched), (index, patched)
        assert {(arg, span.start) for arg, spans in touched.items() for span in spans} <= patched, (index, patched)


@pytest.fixture(scope="module")
def lowerings(request, air_tools, tmp_path_factory):
    """The Programs the session's lowering tests name, lowered in the background two at a time (a lowering is one
    single-threaded tool run after another, so two use both of CI's cores): name → (future Lowering, the build
    directory kept for a Program with views, else None). Each test waits for its own."""
    names = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "originalname", None) == "test_program_lowers_to_npu_instructions"]
    environment = pytest.MonkeyPatch()
    environment.setenv(TIMEOUT_VARIABLE, LOWERING_TIMEOUT)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    lowered = {}
    for name in names:
        keep = tmp_path_factory.mktemp("lowered") if PROGRAMS[name].views else None
        lowered[name] = (pool.submit(lower_to_npu_insts, PROGRAMS[name], keep), keep)
    yield lowered
    pool.shutdown(wait=True, cancel_futures=True)
    environment.undo()


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_lowers_to_npu_instructions(lowerings, name):
    program = PROGRAMS[name]
    # (which refuses a shim BD outside its argument: the test below)
    future, kept = lowerings[name]
    lowering = future.result()
    if program.views:  # a decode group's scratches and its layers' weights, each in its place in its arena
        assert_views_patched_in_place(program, kept)
    assert len(lowering.devices) == len(program.launches)  # one aie.device per launch segment
    assert lowering.configures == len(program.launches)  # each entered in turn: the timing model's CONFIGURE_S
    for device in lowering.devices:
        assert 1 <= device.compute_tiles <= 32 and device.memtiles <= 8 and 1 <= device.shim_tiles <= 8
        assert device.bds > 0 and device.dma_channels > 0 and device.instruction_words > 0
        assert 0 < device.l1_bytes <= L1_AVAILABLE and device.l2_bytes <= DEVICE.l2_bytes
    # Every core's L1 as aiecc placed it: the Program's stack, nothing over it, and on every tile the bytes its
    # builder planned, AIR's ping-pong copies included (the count the emulator and the build path check without a
    # compiler).
    planned = {tile.launch: tile.buffer_bytes for tile in program_l1(program)}
    assert all(tile.stack == program.compile_options.stack_size and tile.fits for tile in lowering.l1)
    assert {(tile.launch, tile.buffer_bytes) for tile in lowering.l1} == set(planned.items())
    # No core reads a host-written scalar (a launch index turned into a runtime parameter): attention's causal
    # positions come from herd coordinates and the cores' own loops.
    assert [d.name for d in lowering.devices if d.runtime_parameters] == []
    if program.name == "flash_attn" and dict(program.params)["seq"] >= 64:
        # a step's herd: 8 query tiles x the largest divisor of the KV head's group that the 4 rows hold (the whole
        # array for groups of 4 or 8), or x 4 parts of the sequence where only 1 divides (Qwen2.5-0.5B's 7)
        group = dict(program.params)["heads"] // dict(program.params)["kv_heads"]
        attention = next(d for d in lowering.devices if d.name.endswith("attention_seg"))
        rows = max(rows for rows in range(1, 5) if group % rows == 0)
        assert attention.compute_tiles == 8 * (rows if rows > 1 else 4)
        # AIR gave each column's memtile its own share of the step's queries and outputs: seq / 8 positions of the
        # row's heads, or of the one head whose sequence the rows take in parts (their DDR window of the L2 rank)
        seq, head_dim = dict(program.params)["seq"], dict(program.params)["head_dim"]
        assert attention.l2_bytes == 2 * (seq // 8) * rows * head_dim * 2


def _views_probe(role: Role) -> Program:
    """Three launches over two views of one arena: a scratch arena's written and read back (a decode group's
    scratches), or a weight arena's only read (a decode layer's weights)."""
    cols = 1024
    views = (View("s", "arena", 256, (cols,), "bf16"), View("t", "arena", 2048, (cols,), "bf16"))
    add = (("rows", 1), ("cols", cols))
    if role is Role.SCRATCH:
        outputs = (Arg("out", (cols,), "bf16", Role.OUTPUT),)
        launches = (Launch("add", add, ("x", "x"), ("s",)), Launch("add", add, ("s", "x"), ("t",)),
                    Launch("add", add, ("t", "s"), ("out",)))
    else:
        outputs = tuple(Arg(f"out{i}", (cols,), "bf16", Role.OUTPUT) for i in range(3))
        launches = (Launch("add", add, ("x", "s"), ("out0",)), Launch("add", add, ("t", "x"), ("out1",)),
                    Launch("add", add, ("t", "s"), ("out2",)))
    args = (Arg("x", (cols,), "bf16", Role.INPUT), Arg("arena", (4096,), "bf16", role), *outputs)
    return Program(f"views_probe_{role.value}", args, launches, views=views)


@pytest.mark.parametrize("role", [Role.SCRATCH, Role.WEIGHT])
def test_views_reach_the_npu_instructions_at_their_place_in_the_arena(air_tools, tmp_path, role):
    """A Program's views (a decode group's scratches, or a decode layer's weights) are DMA windows inside one arena
    argument: every shim BD a launch makes of its views is address-patched onto that argument at a byte inside a
    view it touches, and each view's first byte is one of them. A view addressed from the arena's start (what a
    memref.reinterpret_cast's offset becomes in this mlir-aie's lowering) would patch byte 0, which no view here
    holds."""
    program = _views_probe(role)
    lower_to_npu_insts(program, keep_dir=tmp_path)
    assert_views_patched_in_place(program, tmp_path)
    # the check is not blind: the same instructions against a view declared 1 KiB further into the arena fail it
    first, second = program.views
    moved = dataclasses.replace(program, views=(dataclasses.replace(first, offset=first.offset + 512), second))
    with pytest.raises(AssertionError):
        assert_views_patched_in_place(moved, tmp_path)


# Programs lowered both ways below: a decode chain (6 launches), the integer-GEMM prefill projections (7: broadcast
# streams), flash attention (its K/V blocks double-buffered: 8 trips of its kv loop at 256 positions) and a two-layer
# _qkv decode group over scratch views (17).
JOINED = {
    "smol-o_gemv_ffn_rms_gemv_rope": catalog.o_gemv_ffn_rms_gemv_rope_program(
        SMOL.hidden, SMOL.q_dim, SMOL.intermediate, SMOL.eps, SMOL.heads, SMOL.kv_heads, SMOL.head_dim, SMOL.eps),
    "smol-rms_gemms_rope_w8x2-16": catalog.rms_gemms_rope_w8x2_program(SMOL.hidden, SMOL.heads, SMOL.kv_heads,
                                                                       SMOL.head_dim, SMOL.eps, 16),
    "smol-flash_attn-256": catalog.flash_attn_program(SMOL.heads, SMOL.kv_heads, SMOL.head_dim, 256),
    "smol-decode_layers2_qkv-256": catalog.decode_layers_program(
        2, SMOL.hidden, SMOL.q_dim, SMOL.intermediate, SMOL.eps, SMOL.heads, SMOL.kv_heads, SMOL.head_dim, 256,
        SMOL.eps, first_qkv=True),
}


def _canonical(npu_module: str) -> str:
    """An npu-stage module with its channels numbered in order of first mention (joining renames them apart)."""
    names: dict[str, str] = {}
    return re.sub(r"(?:l\d+_)?channel_\d+", lambda m: names.setdefault(m.group(0), f"channel#{len(names)}"),
                  npu_module)


def _lowered_whole(program: Program, build_dir, tc) -> str:
    """The npu-stage module with aircc's placement stage run over the whole stitched module, as aircc runs it."""
    build_dir.mkdir()
    air_pipeline.check_windows(program.name, air_pipeline.stitch(program), build_dir, tc)
    placed = build_dir / "placement.mlir"
    subprocess.run([str(tc.air_opt), str(build_dir / "air.mlir"), "-o", str(placed),
                    f"--pass-pipeline={placement_pipeline(program.compile_options)}"], check=True,
                   capture_output=True)
    return air_pipeline.lower_placed(program, placed, build_dir, tc).read_text()


@pytest.mark.parametrize("name", list(JOINED))
def test_launches_placed_one_by_one_lower_to_the_whole_modules_devices(air_tools, tmp_path, name):
    """prepare() places each launch alone and joins them (placement over a whole multi-launch module takes time far
    out of proportion to its launches): the npu-stage module, every device and the main runtime sequence, is the
    one aircc's whole-module placement gives, but for the channels' names."""
    program = JOINED[name]
    (tmp_path / "apart").mkdir()
    apart = air_pipeline.prepare(program, tmp_path / "apart", air_tools).read_text()
    assert _canonical(apart) == _canonical(_lowered_whole(program, tmp_path / "whole", air_tools))


def test_the_joined_module_comparison_sees_launches_out_of_order(air_tools, tmp_path, monkeypatch):
    """The comparison above is not blind: joining the same placed launches in reverse order gives another module."""
    program = JOINED["smol-o_gemv_ffn_rms_gemv_rope"]
    join = air_pipeline.join_placed
    monkeypatch.setattr(air_pipeline, "join_placed", lambda p, placed: join(p, placed[::-1]))
    (tmp_path / "apart").mkdir()
    apart = air_pipeline.prepare(program, tmp_path / "apart", air_tools).read_text()
    assert _canonical(apart) != _canonical(_lowered_whole(program, tmp_path / "whole", air_tools))


def test_joining_refuses_what_it_cannot_join():
    program = JOINED["smol-o_gemv_ffn_rms_gemv_rope"]
    head = f"module {{\n  func.func @{program.name}(%arg0: memref<4xbf16>) {{\n    return\n  }}\n}}\n"
    with pytest.raises(ValueError, match="launch 1 placed alone left an op at module level that cannot be joined: "
                                         "memref.global"):
        air_pipeline.join_placed(program, [head, head.replace("module {", 'module {\n  memref.global "private" @g')])
    other = head.replace("memref<4xbf16>", "memref<8xbf16>")
    with pytest.raises(ValueError, match="launch 1 was placed with another signature"):
        air_pipeline.join_placed(program, [head, other])


def test_a_shim_bd_past_its_argument_is_refused_after_the_passes(air_tools, monkeypatch):
    """The passes' module is checked before aiecc takes it: a shim BD that walks past its argument (what this AIR's
    L2 split made of the decode GEMVs and prefill GEMMs before their DDR windows took the memtile buffers' rank; here
    a packed V projection's first weight BD moved a tile further on) stops the build, naming the launch and the BD."""
    program = catalog.rms_gemv_rope_program(LLAMA.hidden, LLAMA.heads, LLAMA.kv_heads, LLAMA.head_dim, LLAMA.eps,
                                            "q4_1")
    shift_first_packed_v_bd(monkeypatch, 153600)
    with pytest.raises(CompileError, match=r"shim BD bounds failed.*\n.*launch 1 \(rms_gemv\).*memref<512x320xi32> "
                                           r"walks to element 281599, but the argument has 163840"):
        lower_to_npu_insts(program)


def test_a_failing_stage_names_the_pass_and_the_op(air_tools):
    """Without broadcast detection, a 4x4 GEMM herd reads its A and W windows as 32 separate streams: air-to-aie
    runs out of memtile buffer descriptors, and the error says so."""
    M, K, N = 64, 576, 192  # herd 4x4
    args = (Arg("a", (M, K), "bf16", Role.INPUT), Arg("w", (N, K), "bf16", Role.INPUT),
            Arg("c", (M, N), "bf16", Role.OUTPUT))
    program = Program("gemm_probe", args, (Launch("gemm", (("K", K), ("M", M), ("N", N)), ("a", "w"), ("c",)),),
                      compile_options=CompileOptions(omit_auto_broadcast=True))
    with pytest.raises(CompileError) as info:
        lower_to_npu_insts(program)
    error = info.value
    assert error.stage == "air-to-aie" and error.pass_name == "air-to-aie"
    assert "'aie.memtile_dma' op has more than 48 blocks" in error.message
    assert error.mlir_path.exists() and (error.build_dir / "placement.mlir").exists()
    # with AIR's broadcast detection (the Program default) the same GEMM lowers
    assert lower_to_npu_insts(dataclasses.replace(program, compile_options=CompileOptions())).devices


def test_a_tool_that_does_not_finish_is_a_compile_error(air_tools, monkeypatch, tmp_path):
    monkeypatch.setenv(TIMEOUT_VARIABLE, "0.001")
    with pytest.raises(CompileError, match=rf"air-opt did not finish within 0.001 s \(\${TIMEOUT_VARIABLE}"):
        lower_to_npu_insts(PROGRAMS["smol-o_ffn-16"], keep_dir=tmp_path)
    monkeypatch.setenv(TIMEOUT_VARIABLE, "soon")
    with pytest.raises(ValueError, match=rf"\${TIMEOUT_VARIABLE} must be a positive number of seconds, got 'soon'"):
        lower_to_npu_insts(PROGRAMS["smol-o_ffn-16"], keep_dir=tmp_path)


def gemm_probe(M: int, K: int, N: int, options: CompileOptions) -> Program:
    args = (Arg("a", (M, K), "bf16", Role.INPUT), Arg("w", (N, K), "bf16", Role.INPUT),
            Arg("c", (M, N), "bf16", Role.OUTPUT))
    return Program("gemm_probe", args, (Launch("gemm", (("K", K), ("M", M), ("N", N)), ("a", "w"), ("c",)),),
                   compile_options=options)


def test_gemm_l2_budget_is_what_the_fullest_memtile_holds(air_tools):
    """The builder's memtile budget against placement by the real passes: on 8 columns AIR splits the L2 slices
    into per-column pieces and the fullest memtile holds exactly one A, W and C piece; on one column it holds at
    most the whole budget."""
    from torch_npu2.kernels.builders import gemm

    (spread,) = lower_to_npu_insts(gemm_probe(256, 512, 512, CompileOptions())).devices  # herd 8x4, m32 n128 k256
    assert spread.compute_tiles == 32 and spread.memtiles == 8
    assert spread.l2_bytes == sum(gemm._l2_bytes(8, 4, 32, 128, 256, 512).values()) == 192 * 1024
    (one_column,) = lower_to_npu_insts(gemm_probe(16, 512, 512, CompileOptions())).devices  # herd 1x4, m16 n128 k128
    assert one_column.compute_tiles == 4
    assert 0 < one_column.l2_bytes <= sum(gemm._l2_bytes(1, 4, 16, 128, 128, 512).values()) <= DEVICE.l2_bytes
