"""The core's L1 budget (kernels/budgets.py): every Program of both models fits with the stack aircc is given; a
Program made to overflow is refused by the emulator and by the NPU2 build path, naming the tile, each buffer, the
stack and the limit; the count of what aiecc placed finds buffers its allocator put over the stack."""
import dataclasses

import pytest

from torch_npu2.kernels import ModelDims, programs_for_model
from torch_npu2.kernels.air_pipeline import CompileError, lower_to_npu_insts
from torch_npu2.kernels.budgets import (L1BudgetError, check_fits, check_program_l1, core_stacks, lowered_l1,
                                        program_l1, worst_tile)
from torch_npu2.kernels.builders.npu2 import L1_AVAILABLE, L1_HEADROOM
from torch_npu2.kernels.device import DEVICE
from torch_npu2.kernels.catalog import (ATTENTION_OPTIONS, PREFILL_OPTIONS, decode_attn_program, flash_attn_program,
                                       lm_head_gemv_program, lm_head_rows, o_ffn_program, o_gemv_ffn_program,
                                       rms_gemv_rope_program)
from torch_npu2.kernels.lint import _l1_finding
from torch_npu2.kernels.program import CORE_STACK_BYTES, Arg, CompileOptions, Launch, Program, Role

SMOL = ModelDims(576, 9, 3, 64, 1536, 49152, 1e-5)
LLAMA = ModelDims(2048, 32, 8, 64, 8192, 128256, 1e-5)
BUCKETS = [16, 32, 64, 128, 256, 512, 1024, 2048]
PROGRAMS = [p for dims in (SMOL, LLAMA) for precision in ("bf16", "bfp16_gate_up")
            for p in programs_for_model(dims, BUCKETS, precision)]


def with_stack(program: Program, stack_size: int) -> Program:
    return dataclasses.replace(program, compile_options=dataclasses.replace(program.compile_options,
                                                                            stack_size=stack_size))


def gemm_program(M: int, K: int, N: int, stack_size: int) -> Program:
    args = (Arg("a", (M, K), "bf16", Role.INPUT), Arg("w", (N, K), "bf16", Role.INPUT),
            Arg("c", (M, N), "bf16", Role.OUTPUT))
    launch = Launch("gemm", (("K", K), ("M", M), ("N", N), ("precision", "bf16")), ("a", "w"), ("c",))
    return Program("gemm_alone", args, (launch,), compile_options=dataclasses.replace(PREFILL_OPTIONS,
                                                                                      stack_size=stack_size))


def test_every_program_fits_with_the_stack_aircc_is_given():
    tiles = [tile for program in PROGRAMS for tile in program_l1(program)]
    assert len(tiles) == sum(len(p.launches) for p in PROGRAMS)
    assert all(t.stack == CORE_STACK_BYTES and t.fits for t in tiles), [str(t) for t in tiles if not t.fits]
    fullest = worst_tile(tiles)
    # the prefill GEMM plans its tile up to the budget: a 64x128 f32 accumulator, its windows and drain chunks
    assert fullest.kind in ("gemm", "gemm_swiglu") and fullest.buffer_bytes == L1_AVAILABLE
    assert fullest.total == CORE_STACK_BYTES + L1_AVAILABLE + L1_HEADROOM == DEVICE.l1_bytes


OVERFLOW = ("o_ffn does not fit a core's L1: o_ffn, launch 3 (gemm_swiglu), each tile of herd @gemm_herd (8x4): "
            "buffers 61,440 B (f32 accumulator 32,768 B, A window x2 (ping-pong) 8,192 B, W window x2 16,384 B, bf16 "
            "drain chunk x2 4,096 B) + stack 4,096 B + headroom 1,024 B = 66,560 B of 65,536 B; lower the launch's "
            "tiles or the Program's CompileOptions.stack_size")


def test_a_program_made_to_overflow_is_refused_by_the_emulator(runtime):
    fitting = o_ffn_program(576, 576, 1536, 1e-5, 512)
    overflowing = with_stack(fitting, CORE_STACK_BYTES + 1024)  # a 1 KiB larger stack
    with pytest.raises(L1BudgetError) as info:
        runtime.load(overflowing)
    assert str(info.value) == OVERFLOW
    assert info.value.tile.launch == 3 and not info.value.tile.fits
    assert runtime.load(fitting).program == fitting


def test_a_launch_its_builder_cannot_fit_is_refused_with_its_buffers(runtime):
    """A 16384-wide RMSNorm row does not fit a tile: the builder finds no plan, and the emulator refuses the
    Program as the NPU2 build would, rather than running a shape that cannot be built for lack of L1."""
    cols = 16384
    args = (Arg("x", (cols,), "bf16", Role.INPUT), Arg("w", (cols,), "bf16", Role.WEIGHT),
            Arg("y", (cols,), "bf16", Role.OUTPUT))
    program = Program("wide_norm", args, (Launch("rmsnorm", (("cols", cols), ("eps", 1e-5), ("rows", 1)),
                                                 ("x", "w"), ("y",)),))
    with pytest.raises(L1BudgetError) as info:
        runtime.load(program)
    assert str(info.value).startswith(
        "wide_norm does not fit a core's L1: wide_norm, launch 0 (rmsnorm), each tile of its herd: buffers 98,368 B "
        "(x row x1 (ping-pong) 32,768 B, out row x1 32,768 B, weight 32,768 B, f32 accumulator x1 64 B) + stack "
        "3,072 B + headroom 1,024 B = 102,464 B of 65,536 B (its builder plans a tile within 61,440 B")


# ---- the count of what aiecc placed ---------------------------------------------------------------------------
PLACED = """
    %tile_0_1 = aie.tile(0, 1)
    %tile_0_2 = aie.tile(0, 2)
    %buf2 = aie.buffer(%tile_0_1) {address = 0 : i32, mem_bank = 0 : i32, sym_name = "buf2"} : memref<4096xbf16, 1 : i32>
    %buf1 = aie.buffer(%tile_0_2) {address = 1024 : i32, mem_bank = 0 : i32, sym_name = "buf1"} : memref<256xf32, 2 : i32>
    %buf0 = aie.buffer(%tile_0_2) {address = 2048 : i32, mem_bank = 0 : i32, sym_name = "buf0"} : memref<8xbf16, 2 : i32>
    %core_0_2 = aie.core(%tile_0_2) {
      aie.end
    }ATTRIBUTES
"""


def placed(attributes: str = "") -> str:
    return PLACED.replace("ATTRIBUTES", attributes)


def test_the_lowered_count_reads_addresses_and_the_cores_stack():
    (tile,) = lowered_l1("p", 0, "gemm", "l0_gemm_seg", placed(' {link_with = "gemm.o"}'))
    assert core_stacks(placed()) == {(0, 2): 1024}  # aie.core's own default when no stack_size is set
    assert tile.tile == "tile (0, 2) of device @l0_gemm_seg" and tile.stack == 1024  # the memtile's buffer left out
    assert tile.buffers == (("buf1", 1024), ("buf0", 16)) and tile.used == 2064 and tile.overlaps == ()
    assert tile.fits


def test_the_lowered_count_refuses_buffers_placed_over_the_stack():
    (tile,) = lowered_l1("p", 0, "gemm", "l0_gemm_seg", placed(' {link_with = "gemm.o", stack_size = 2048 : i32}'))
    assert tile.stack == 2048 and tile.used == 2064 and tile.total < DEVICE.l1_bytes
    assert tile.overlaps == ("buf1 at 1024 under the stack (ends at 2048)",) and not tile.fits
    with pytest.raises(ValueError, match="has no address"):
        lowered_l1("p", 0, "gemm", "l0_gemm_seg", placed().replace("address = 2048 : i32, ", ""))


def test_a_stack_larger_than_a_bank_is_refused_where_aiecc_is_not(air_tools):
    """With a 20 KiB stack, aiecc's bank-aware allocator fills banks 1-3 from 16 KiB up, fails on bank 0 without
    undoing its placement, and the sequential fallback keeps it: aiecc exits 0 with buffers over the stack. The
    planned count fits (the buffers are small); the placed one sees the overlap."""
    program = with_stack(flash_attn_program(4, 2, 64, 64), 20 * 1024)
    assert all(tile.fits for tile in program_l1(program))
    with pytest.raises(CompileError) as info:
        lower_to_npu_insts(program)
    error = info.value
    assert error.stage == "L1 budget" and isinstance(error.__cause__, L1BudgetError)
    tile = error.__cause__.tile
    assert tile.kind == "attention" and tile.stack == 20 * 1024 and tile.tile.endswith("of device @l1_attention_seg")
    assert tile.overlaps and all("under the stack (ends at 20480)" in o for o in tile.overlaps[:1])
    assert lower_to_npu_insts(with_stack(program, ATTENTION_OPTIONS.stack_size)).l1  # the default stack lowers


def test_an_overflow_the_check_refuses_the_real_allocator_refuses_too(air_tools):
    """A 512x576x512 GEMM tile holds 61,440 B; with a 5 KiB stack that is over 64 KiB even without headroom:
    the build path refuses it first, and aiecc's own allocation fails on it."""
    program = gemm_program(512, 576, 512, 5 * 1024)
    with pytest.raises(L1BudgetError, match=r"gemm_alone, launch 0 \(gemm\), each tile of herd @gemm_herd \(8x4\): "
                                            r"buffers 61,440 B .* \+ stack 5,120 B \+ headroom 1,024 B = 67,584 B"):
        check_program_l1(program)
    with pytest.raises(CompileError) as info:
        lower_to_npu_insts(program)
    assert info.value.stage == "aiecc l0_gemm_seg" and "allocated buffers exceeded available memory" in str(info.value)


def test_a_buffer_placed_off_a_64_byte_boundary_is_refused():
    """aiecc packs a tile's buffers end to end: after a 16-byte buffer the next starts 16 bytes past a boundary,
    where a kernel's 512-bit load from its start would read from the boundary below (AIE2P drops the low bits): a
    wrong answer, not a failed build, so the placed check refuses it and names the buffer."""
    shifted = placed(' {link_with = "gemm.o"}').replace(
        'address = 2048 : i32, mem_bank = 0 : i32, sym_name = "buf0"} : memref<8xbf16',
        'address = 2048 : i32, mem_bank = 0 : i32, sym_name = "buf0"} : memref<8xbf16, 2 : i32>\n'
        '    %buf3 = aie.buffer(%tile_0_2) {address = 2064 : i32, mem_bank = 0 : i32, sym_name = "buf3"} : '
        'memref<32xbf16')
    (tile,) = lowered_l1("p", 0, "gemm", "l0_gemm_seg", shifted)
    assert tile.misaligned == ("buf3 at 2064",) and tile.overlaps == () and tile.total <= DEVICE.l1_bytes
    assert not tile.fits
    with pytest.raises(L1BudgetError, match=r"p places a core's L1 buffer off a vector load's boundary: .*off a "
                                            r"64-byte boundary, .*: buf3 at 2064; pad the buffers before it"):
        check_fits([tile])
    assert "a buffer placed where a vector load cannot read it" in _l1_finding(tile).message  # the lint's finding
    (aligned,) = lowered_l1("p", 0, "gemm", "l0_gemm_seg", placed(' {link_with = "gemm.o"}'))
    assert aligned.misaligned == () and aligned.fits


def test_a_stack_that_would_shift_every_buffer_is_refused():
    with pytest.raises(ValueError, match="stack_size must be a multiple of 64 bytes"):
        CompileOptions(stack_size=3072 + 32)


def test_the_real_allocator_places_every_decode_buffer_on_a_vector_boundary(air_tools):
    """The decode GEMVs' small buffers (a call's f32 partial sums and y, a panel's y), decode attention's per-core
    state and query rows, quantize_rows' chunks and packed rows of K = 576 once took their own sizes, which aiecc
    packed end to end: Llama-3.2-1B's o_gemv_ffn had a buffer 32 bytes off in both gemv_add launches, SmolLM2's
    decode attention 8 bytes off. Every L1 buffer is now whole 64-byte runs, so aiecc places each on the boundary
    (lower_to_npu_insts would refuse one that is not)."""
    smol = ModelDims(576, 9, 3, 64, 1536, 49152, 1e-5)
    programs = [decode_attn_program(9, 3, 64, 256), o_gemv_ffn_program(2048, 2048, 8192, 1e-5),
                lm_head_gemv_program(2048, lm_head_rows(128256), "q8_0"), rms_gemv_rope_program(576, 9, 3, 64, 1e-5, "q4_1"),
                *(p for p in programs_for_model(smol, (16,), "w8x2a16") if p.name == "o_ffn_w8x2")]
    for program in programs:
        assert all(tile.fits and not tile.misaligned for tile in lower_to_npu_insts(program).l1), program.name
