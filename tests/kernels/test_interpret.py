"""The AIR interpreter (kernels/interpret.py): its semantics on small handwritten modules, every Program's IR
against the emulated NPU2 at small dims, and broken modules that must fail.

The Program tests read each module as the real air-opt prints it (the ``air_tools`` fixture), run it with the
kernels' host builds, and compare every argument a launch writes with the emulator (the op tests' tolerances,
torch_npu2/emulator/ir_check.py). Measured: about 40 s for the whole file on this machine (2 shared cores, host
kernels already built).
"""
import dataclasses
import re
import subprocess

import pytest
import torch

from torch_npu2.emulator.ir_check import compare, emulate, random_inputs
from torch_npu2.emulator.ir_check import ArgComparison, check_program_ir
from torch_npu2.emulator.launches import LAUNCH_KINDS
from torch_npu2.kernels import ModelDims, host_build, programs_for_model
from torch_npu2.kernels.interpret import run_program_ir
from torch_npu2.kernels.program import TORCH_DTYPES
from torch_npu2.kernels.interpret import (Interpreter, KernelOverrun, OutOfBounds,
                                          TileAliasing, TileRace, UninitializedRead, UnsupportedOp,
                                          UnwrittenOutput, canonical_text)
from torch_npu2.kernels.catalog import (decode_layers_program, dequantize_rows_program, flash_attn_program,
                                        lm_head_gemv_program, o_ffn_program, o_ffn_w8x2_program, o_gemv_ffn_program,
                                        o_gemv_ffn_rms_gemv_rope_program, rms_gemms_rope_program,
                                        rms_gemms_rope_w8x2_program, rms_gemv_rope_program)
from torch_npu2.kernels.stitch import ObjectBuild, stitch

needs_host_compiler = pytest.mark.skipif(host_build.host_compiler() is None,
                                         reason="no host C++ compiler (g++): the kernels' host builds are needed")

# Small dims that satisfy every builder: GEMM M, N multiples of 16 dividing their herds, head_dim a multiple
# of 32 (RoPE) and 16 (attention), K a multiple of 32 (GEMV).
SMALL = ModelDims(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=2048, eps=1e-5)
EPS = SMALL.eps
SMALL_BIASED = dataclasses.replace(SMALL, qkv_bias=True)


def _label(program, tuning=None) -> str:
    params = dict(program.params)
    size = params.get("rows", params.get("seq", params.get("vocab")))
    return f"{program.name}-{size}" + ("-qkv_bias" if params.get("qkv_bias") or params.get("next_qkv_bias") else "") + ("-tuned" if tuning else "")


# The model's Programs at buckets 16 and 32, plus tunings that reach what the defaults do not at these dims:
# GEMM launch grids, K loops and drain chunk loops longer than one step, attention rounds and causally skipped blocks, rows cut
# into several chunks, GEMV panels over several launch steps, and the BFP16 GEMM.
CASES = [(p, None) for p in programs_for_model(SMALL, (16, 32)) if not p.name.endswith("_w8x2")] + [
    (rms_gemms_rope_program(256, 4, 2, 64, EPS, 64),
     {1: dict(herd_m=2, herd_n=2, tile_m=16, tile_n=32, tile_k_l2=64, tile_k_l1=32, drain_n=8)}),
    (flash_attn_program(4, 2, 64, 128), {1: dict(herd_q=2, tile_q=16, tile_kv=32)}),
    # heads that no 2 to 4 rows divide among them: the rows take parts of the sequence (2 for multi-head attention,
    # 4 for a group of 7 as Qwen2.5-0.5B's), each column's tiles first in the step's L2 buffers; then two rounds per
    # core, and the stack launch spreading the rows with several blocks per tile
    (flash_attn_program(2, 2, 64, 256), {1: dict(tile_q=16)}),
    (flash_attn_program(7, 1, 64, 512), {1: dict(tile_q=16)}),
    (flash_attn_program(7, 1, 64, 512), {0: dict(herd=2, block=16), 1: dict(tile_q=16, q_rows=2)}),
    # as many KV heads as the array has columns: the stack launch spreads the heads, not the rows (one head per tile
    # in blocks, then two)
    (flash_attn_program(8, 8, 64, 128), {0: dict(block=32)}),
    (flash_attn_program(8, 8, 64, 128), {0: dict(herd=4, block=64)}),
    # o_gemv_ffn: two launch steps and row groups for the residual GEMV, two launch steps of two panels for the
    # normed gate/up one (each panel's SiLU·up values placed by step and panel), and the K-split down projection
    (o_gemv_ffn_program(256, 256, 512, EPS), {0: dict(herd=2, tile_n=64, rows_per_call=16),
                                              1: dict(steps=2, tile_n=32, rows_per_call=8), 2: dict(k_chunk=128)}),
    (o_ffn_program(256, 256, 512, EPS, 16, "bfp16"), {1: dict(chunk=64)}),
    # packed weights: every decode Program in each format, and the K-split down projection over whole groups
    *[(p, None) for weights in ("q4_0", "q4_1", "q8_0")
      for p in programs_for_model(SMALL, (), weights=weights)],
    (o_gemv_ffn_program(256, 256, 2048, EPS, "q4_1"), {2: dict(k_chunk=1024)}),
    # rows of whole 1024-element groups (quants transposed, x transposed in L1 by gemv_q_prepare_x/_vector) in
    # every launch kind: the chained layer step and the LM head
    *[(o_gemv_ffn_rms_gemv_rope_program(1024, 1024, 1024, EPS, 16, 8, 64, EPS, weights), None)
      for weights in ("q4_0", "q4_1", "q8_0")],
    (lm_head_gemv_program(1024, 512, "q4_1"), None),
    # rows of element-order groups past one BD dimension (kernels/quant.py): the K-split down projection of K = 2080
    # a group per chunk (Q8_0: 5 groups of 13 blocks) or the whole row (Q4_1: one group of 65), and dequantized
    *[(o_gemv_ffn_program(256, 256, 2080, EPS, weights), None) for weights in ("q4_1", "q8_0")],
    (dequantize_rows_program(64, 4864, "q8_0"), None),
    # packed rows to bf16 rows: whole 1024-element groups (each transposed back on the core) in every format, and the
    # rows over two launch steps of several panels, their calls double-buffered
    *[(dequantize_rows_program(64, 2048, weights), None) for weights in ("q4_0", "q4_1", "q8_0")],
    (dequantize_rows_program(512, 256, "q4_1"), {0: dict(herd=4, steps=2, tile_n=16, rows_per_call=4)}),
    # Q/K/V biases (Qwen2): the biased Programs' bias_add launches, a bias row loaded once per tile for prefill rows
    # and chunk by chunk for a decode row
    *[(p, None) for p in programs_for_model(SMALL_BIASED, (16,), "bf16")
      if {("qkv_bias", 1), ("next_qkv_bias", 1)} & set(p.params)],
    *[(p, None) for p in programs_for_model(SMALL_BIASED, (), weights="q4_1") if p.name == "rms_gemv_rope_packed"],
    # a decode group: two layers from their attention on in one Program, each layer's scratches reused by the next;
    # one that ends with the model's last layer (_final: no next layer's Q/K/V after it); and one that runs the
    # model's final norm and LM head after it (_final_lm; packed, its LM head in a format of its own; bf16 layers
    # with a packed LM head, _final_packed_lm: the default's Q8_0 copy)
    *[(decode_layers_program(2, 256, 256, 512, EPS, 4, 2, 64, 128, EPS, weights, final), None)
      for weights in ("bf16", "q4_1") for final in (False, True)],
    *[(decode_layers_program(2, 256, 256, 512, EPS, 4, 2, 64, 128, EPS, weights, True, (512, 2 * EPS, head)), None)
      for weights, head in (("bf16", "bf16"), ("q4_1", "q8_0"), ("bf16", "q8_0"))],
    # a group that starts with its first layer's rms_gemv_rope (_qkv), whose attention reads the query it made
    (decode_layers_program(2, 256, 256, 512, EPS, 4, 2, 64, 128, EPS, first_qkv=True), None),
    (decode_layers_program(2, 256, 256, 512, EPS, 4, 2, 64, 128, EPS, "q4_1", True, (512, 2 * EPS, "q8_0"),
                           first_qkv=True), None),
    # groups with Q/K/V biases (Qwen2), read from the layers' norms arenas: bf16 ending with the LM head's Q8_0 copy,
    # packed going on
    (decode_layers_program(2, 256, 256, 512, EPS, 4, 2, 64, 128, EPS, "bf16", True, (512, 2 * EPS, "q8_0"),
                           first_qkv=True, qkv_bias=True), None),
    (decode_layers_program(2, 256, 256, 512, EPS, 4, 2, 64, 128, EPS, "q4_1", qkv_bias=True), None),
]


# ---- handwritten modules ----------------------------------------------------------------------------------
def copy_module(read="[%0, %c0] [%c2, %c16] [%c16, %c1]", write="[%0, %c0] [%c2, %c16] [%c16, %c1]",
                read_dma=True, body="") -> str:
    """A 2x1 herd: each tile copies its two rows of a (4, 16) input to the output through L1."""
    load = f"air.dma_memcpy_nd (%alloc[] [] [], %arg14{read}) : (memref<32xbf16, 2 : i32>, memref<4x16xbf16>)"
    return f"""#map = affine_map<()[s0] -> (s0 * 2)>
module {{
  func.func @copy(%arg0: memref<4x16xbf16>, %arg1: memref<4x16xbf16>) {{
    %c1 = arith.constant 1 : index
    air.launch @launch (%arg2, %arg3) in (%arg4=%c1, %arg5=%c1) args(%arg6=%arg0, %arg7=%arg1) : memref<4x16xbf16>, memref<4x16xbf16> {{
      air.segment @seg  args(%arg8=%arg6, %arg9=%arg7) : memref<4x16xbf16>, memref<4x16xbf16> {{
        %c2 = arith.constant 2 : index
        %c1_0 = arith.constant 1 : index
        air.herd @herd  tile (%arg10, %arg11) in (%arg12=%c2, %arg13=%c1_0) args(%arg14=%arg8, %arg15=%arg9) : memref<4x16xbf16>, memref<4x16xbf16> {{
          %c0 = arith.constant 0 : index
          %c1 = arith.constant 1 : index
          %c2 = arith.constant 2 : index
          %c16 = arith.constant 16 : index
          %alloc = memref.alloc() : memref<32xbf16, 2 : i32>
          %0 = affine.apply #map()[%arg10]
          {load if read_dma else ""}
          {body}
          air.dma_memcpy_nd (%arg15{write}, %alloc[] [] []) : (memref<4x16xbf16>, memref<32xbf16, 2 : i32>)
          memref.dealloc %alloc : memref<32xbf16, 2 : i32>
        }}
      }}
    }}
    return
  }}
}}
"""


def run_copy(text, objects=()):
    x = torch.arange(64, dtype=torch.float32).reshape(4, 16).to(torch.bfloat16)
    buffers = Interpreter(text, objects).run("copy", [x, None])
    return x, buffers[1]


def test_copy_through_l1_moves_every_element():
    x, out = run_copy(copy_module())
    assert bool(out.written.all())
    assert torch.equal(out.data.reshape(4, 16), x)


def test_a_window_is_read_in_the_order_of_its_dims():
    # Each tile reads its (2, 16) block column by column: sizes [16, 2], strides [1, 16]; each offset counts
    # in its own dimension's stride, so the row offset is the second one.
    x, out = run_copy(copy_module(read="[%c0, %0] [%c16, %c2] [%c1, %c16]"))
    expected = x.reshape(2, 2, 16).transpose(1, 2).reshape(4, 16)
    assert torch.equal(out.data.reshape(4, 16), expected)


def test_a_window_outside_its_buffer_is_an_error():
    with pytest.raises(OutOfBounds, match="arg14"):
        run_copy(copy_module(read="[%0, %c1] [%c2, %c16] [%c16, %c1]"))  # one element past the end for tile 1


def test_reading_what_no_dma_wrote_is_reported():
    with pytest.raises(UninitializedRead, match="alloc"):
        run_copy(copy_module(read_dma=False))


def test_two_tiles_writing_the_same_shared_elements_race():
    with pytest.raises(TileRace, match=r"tile \(1, 0\)"):
        run_copy(copy_module(write="[%c0, %c0] [%c2, %c16] [%c16, %c1]"))


def test_an_unknown_op_is_named():
    with pytest.raises(UnsupportedOp, match="linalg.fill"):
        run_copy(copy_module(body="linalg.fill ins(%c0 : index) outs(%alloc : memref<32xbf16, 2 : i32>)"))


def slab_module(slab_offsets: str) -> str:
    """A segment-scope L1 buffer (2, 32) handed to a 2x1 herd: each tile copies its rows through its slab."""
    return f"""#map = affine_map<()[s0] -> (s0 * 2)>
module {{
  func.func @copy(%arg0: memref<4x16xbf16>, %arg1: memref<4x16xbf16>) {{
    %c1 = arith.constant 1 : index
    air.launch @launch (%arg2, %arg3) in (%arg4=%c1, %arg5=%c1) args(%arg6=%arg0, %arg7=%arg1) : memref<4x16xbf16>, memref<4x16xbf16> {{
      air.segment @seg  args(%arg8=%arg6, %arg9=%arg7) : memref<4x16xbf16>, memref<4x16xbf16> {{
        %c2 = arith.constant 2 : index
        %c1_0 = arith.constant 1 : index
        %alloc = memref.alloc() : memref<2x32xbf16, 2 : i32>
        air.herd @herd  tile (%arg10, %arg11) in (%arg12=%c2, %arg13=%c1_0) args(%arg14=%arg8, %arg15=%arg9, %arg16=%alloc) : memref<4x16xbf16>, memref<4x16xbf16>, memref<2x32xbf16, 2 : i32> {{
          %c0 = arith.constant 0 : index
          %c1 = arith.constant 1 : index
          %c2 = arith.constant 2 : index
          %c16 = arith.constant 16 : index
          %subview = memref.subview %arg16[{slab_offsets}] [1, 32] [1, 1] : memref<2x32xbf16, 2 : i32> to memref<32xbf16, strided<[1], offset: ?>, 2 : i32>
          %0 = affine.apply #map()[%arg10]
          air.dma_memcpy_nd (%subview[] [] [], %arg14[%0, %c0] [%c2, %c16] [%c16, %c1]) : (memref<32xbf16, strided<[1], offset: ?>, 2 : i32>, memref<4x16xbf16>)
          air.dma_memcpy_nd (%arg15[%0, %c0] [%c2, %c16] [%c16, %c1], %subview[] [] []) : (memref<4x16xbf16>, memref<32xbf16, strided<[1], offset: ?>, 2 : i32>)
        }}
        memref.dealloc %alloc : memref<2x32xbf16, 2 : i32>
      }}
    }}
    return
  }}
}}
"""


def test_a_segment_scope_l1_buffer_is_one_slab_per_tile():
    x, out = run_copy(slab_module("%arg10, 0"))
    assert torch.equal(out.data.reshape(4, 16), x)
    with pytest.raises(TileAliasing, match=r"tile \(1, 0\) of herd touches"):
        run_copy(slab_module("0, 0"))


SILU_OBJECT = "silu_mul.o"


def silu_module(length: int) -> str:
    """One tile: silu(x) * x over 32 elements through silu_mul_bf16 (built with SILU_MUL_LEN=``length``)."""
    ref = "memref<32xbf16, 2 : i32>"
    return copy_module(body=f"""%alloc_1 = memref.alloc() : {ref}
          func.call @silu_mul_bf16(%alloc, %alloc, %alloc_1) : ({ref}, {ref}, {ref}) -> ()
          air.dma_memcpy_nd (%alloc[] [] [], %alloc_1[] [] []) : ({ref}, {ref})""").replace(
        "module {", f'module {{\n  func.func private @silu_mul_bf16({ref}, {ref}, {ref}) attributes '
                    f'{{link_with = "{SILU_OBJECT}", llvm.emit_c_interface}}', 1)


@needs_host_compiler
def test_a_kernel_call_runs_the_host_build_of_its_configuration():
    x, out = run_copy(silu_module(32), (ObjectBuild(SILU_OBJECT, "silu_mul.cc", (("SILU_MUL_LEN", 32),)),))
    assert torch.equal(out.data.reshape(4, 16), host_build.silu_mul(x, x, tile=32))


@needs_host_compiler
def test_a_kernel_writing_past_its_argument_is_caught():
    with pytest.raises(KernelOverrun, match="silu_mul_bf16 wrote past the end of argument 2"):
        run_copy(silu_module(64), (ObjectBuild(SILU_OBJECT, "silu_mul.cc", (("SILU_MUL_LEN", 64),)),))


# ---- every Program's IR ----------------------------------------------------------------------------------
@needs_host_compiler
@pytest.mark.parametrize("program,tuning", CASES, ids=[_label(p, t) for p, t in CASES])
def test_program_ir_matches_the_emulator(air_tools, program, tuning):
    check = check_program_ir(program, seed=1, tuning=tuning)
    assert check.passed, check.failures()
    assert {c.name for c in check.comparisons} == {n for l in program.launches for n in l.writes}


# The integer-GEMM Programs ("w8x2a16") at buckets 16 and 32, and tunings that reach what the defaults do not at these
# dims: gemm_int launch grids of several steps along M and N, K loops of several slices (of 2 and 4 calls), drain
# chunk loops; quantize_rows with several rows per tile in chunks (the last row peeled) and in one chunk a row.
INTEGER_KINDS = ("quantize_rows", "gemm_int", "gemm_int_swiglu")
W8X2_CASES = [(p, None) for p in programs_for_model(SMALL, (16, 32), "w8x2a16") if p.name.endswith("_w8x2")] + [
    (rms_gemms_rope_w8x2_program(256, 4, 2, 64, EPS, 16, qkv_bias=True), None),
    (rms_gemms_rope_w8x2_program(256, 4, 2, 64, EPS, 64),
     {1: dict(herd=2, chunk=64), 2: dict(herd_m=2, herd_n=2, tile_m=16, tile_k_l2=64, drain_n=16),
      3: dict(herd_m=2, herd_n=1, tile_m=32, tile_k_l2=128)}),
    (o_ffn_w8x2_program(256, 256, 512, EPS, 64),
     {0: dict(herd=4, chunk=256), 5: dict(herd_m=1, herd_n=2, tile_m=32, tile_k_l2=64, drain_n=16),
      6: dict(herd=8, chunk=128)}),
]


@needs_host_compiler
def test_an_integer_programs_quantized_rows_are_checked_exactly(air_tools):
    """check_program_ir (torch-npu2 check-kernels) on the default precision's integer Programs: their weights are
    prepared ones, and the int32 quantized rows must equal the emulation of their launch exactly."""
    program = W8X2_CASES[0][0]
    check = check_program_ir(program, seed=1)
    assert check.passed, check.failures()
    quantized = [c for c in check.comparisons if program.arg(c.name).dtype == "i32"]
    assert quantized and all(c.max_rel == 0 for c in quantized)
    assert not ArgComparison("normed_q", 1e-9, 1.0).within(torch.int32)


@needs_host_compiler
@pytest.mark.parametrize("program,tuning", W8X2_CASES, ids=[_label(p, t) for p, t in W8X2_CASES])
def test_integer_program_ir_matches_the_emulator_bit_for_bit(air_tools, program, tuning):
    """Each integer launch's output, as the IR computes it, equals the emulator's launch on the same inputs (what the
    IR's own earlier launches wrote) bit for bit; every written argument is within the op tests' tolerances of the
    emulated Program (the IR's RMSNorm rounds its statistic to bf16, the emulator's does not)."""
    inputs = random_inputs(program, seed=1)  # integer GEMM weights prepared from normal ones
    interpreted = run_program_ir(program, inputs, stitched=stitch(program, tuning))
    for launch in program.launches:
        if launch.kind not in INTEGER_KINDS:
            continue
        out = program.arg(launch.writes[0])
        expected = LAUNCH_KINDS[launch.kind](launch.p, *(interpreted[n] for n in launch.reads))
        expected = expected.reshape(out.shape).to(TORCH_DTYPES[out.dtype])
        got = interpreted[out.name]
        if out.dtype == "bf16":
            got, expected = got.view(torch.int16), expected.view(torch.int16)
        assert torch.equal(got, expected), f"{launch.kind} → {out.name}"
    emulated = emulate(program, inputs)
    for arg in program.args:
        if arg.role.value in ("scratch", "output") and arg.dtype == "bf16":
            assert compare(arg.name, interpreted[arg.name], emulated[arg.name]).within(torch.bfloat16), arg.name


@needs_host_compiler
def test_weights_read_from_another_layers_arena_fail(air_tools):
    """The check sees where a group reads its weights: IR that reads each layer's weights from the other layer's arenas
    (the same layout, so the same windows in the wrong argument) fails against the Program it stands for."""
    program = decode_layers_program(2, 256, 256, 512, EPS, 4, 2, 64, 128, EPS, first_qkv=True)
    swap = {"weights_0": "weights_1", "weights_1": "weights_0", "norms_0": "norms_1", "norms_1": "norms_0"}
    swapped = dataclasses.replace(program, views=tuple(dataclasses.replace(v, arena=swap.get(v.arena, v.arena))
                                                       for v in program.views))
    assert check_program_ir(program, seed=1).passed
    check = check_program_ir(program, seed=1, text=canonical_text(swapped))
    assert not check.passed and "out" in {f.split(":")[0] for f in check.failures()}


# ---- broken modules ---------------------------------------------------------------------------------------
MUTATED = rms_gemms_rope_program(256, 4, 2, 64, EPS, 16)


@pytest.fixture(scope="module")
def printed(air_tools) -> str:
    return canonical_text(MUTATED)


def mutate(air_tools, text: str, pattern: str, replacement: str) -> str:
    """``text`` with the first match of ``pattern`` replaced, re-read through air-opt: the broken module is
    still one the compiler accepts."""
    broken, count = re.subn(pattern, replacement, text, count=1)
    assert count == 1, f"the mutation {pattern!r} does not apply to the printed module"
    result = subprocess.run([str(air_tools.air_opt), "-"], input=broken, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def run_mutated(text: str):
    return check_program_ir(MUTATED, seed=1, text=text)


@needs_host_compiler
def test_the_unbroken_module_passes(printed):
    assert run_mutated(printed).passed


@needs_host_compiler
def test_a_shifted_dma_offset_fails(air_tools, printed):
    # RMSNorm reads each row one element late: the last row's window leaves the input.
    broken = mutate(air_tools, printed,
                    r"(air\.dma_memcpy_nd \(%\w+\[\] \[\] \[\], %\w+\[%\w+, )%c0(\] \[[^\]]*\] \[%\w+, (%\w+)\])",
                    r"\1\3\2")
    with pytest.raises(OutOfBounds, match="DMA source"):
        run_mutated(broken)


@needs_host_compiler
def test_a_swapped_stride_fails(air_tools, printed):
    # The Q GEMM's W blocks reach L1 with the block-row and row strides swapped: rows of W permuted.
    broken = mutate(air_tools, printed, r"(\[%c16384\w*, %c8\w*, )(%c2048\w*), (%c256\w*)", r"\1\3, \2")
    check = run_mutated(broken)
    assert sorted(f.split(":")[0] for f in check.failures()) == ["q", "q_roped"]


@needs_host_compiler
def test_a_dropped_input_dma_fails(air_tools, printed):
    # The Q GEMM's A rows never reach the memtile.
    broken = mutate(air_tools, printed,
                    r"\n[ ]*air\.dma_memcpy_nd [^\n]*: \(memref<[\dx]+xbf16, 1 : i32>, memref<16x256xbf16>\)", "")
    with pytest.raises(UninitializedRead, match="nothing wrote"):
        run_mutated(broken)


@needs_host_compiler
def test_a_dropped_output_dma_fails(air_tools, printed):
    # The last RoPE never writes its result back.
    broken = mutate(air_tools, printed, r"\n[ ]*air\.dma_memcpy_nd [^\n]*(?![\s\S]*air\.dma_memcpy_nd)", "")
    with pytest.raises(UnwrittenOutput, match="k_roped"):
        run_mutated(broken)


@needs_host_compiler
def test_a_launchs_second_output_from_the_wrong_place_fails(air_tools):
    # rope_qk writes two arguments; here its K rows leave from the start of the rotated Q instead of after it.
    program = rms_gemv_rope_program(576, 9, 3, 64, EPS)
    broken = mutate(air_tools, stitch(program).text, r"(%l2_k_out_3\[\] \[\] \[\], %l2_out_l1\[)%l2_c576\]",
                    r"\1%l2_c0]")
    assert [f.split(":")[0] for f in check_program_ir(program, seed=1, text=broken).failures()] == ["k_roped"]


@needs_host_compiler
def test_tiles_sharing_an_l1_slab_fail(air_tools, printed):
    # The Q GEMM's accumulator zeroing indexes the slab by the herd's column only.
    broken = mutate(air_tools, printed, r"(memref\.subview %\w+\[%\w+, )%\w+(, 0, 0, 0, 0, 0\])", r"\g<1>0\2")
    with pytest.raises(TileAliasing, match="L1 memory is private to a tile"):
        run_mutated(broken)


@needs_host_compiler
def test_tiles_writing_one_memtile_block_fail(air_tools, printed):
    # Every tile of the Q GEMM drains its output tile to the same place of the memtile's C block (at the chunk's
    # column).
    broken = mutate(air_tools, printed, r"(air\.dma_memcpy_nd \(%\w+\[%\w+, )%\w+(, (%c0_\d+), %\w+\])",
                    r"\1\3\2")
    with pytest.raises(TileRace, match="another tile of the herd wrote"):
        run_mutated(broken)


@needs_host_compiler
def test_a_float_kernel_argument_reaches_the_kernel_as_a_float(air_tools):
    """rmsnorm_bf16's eps is a float (its record says "f"): passed as an int32 the kernel would read another
    register. An eps as large as the mean square moves every normed value, so the emulator's eps must be the one."""
    program = o_gemv_ffn_program(256, 256, 512, 4.0)
    check = check_program_ir(program, seed=1)
    assert check.passed, check.failures()
