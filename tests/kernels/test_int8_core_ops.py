"""The counting stand-in runs the integer GEMM's AIE path (kernels/aie2p/gemm_int8.cc): one aie::mmul per 8x8x8
(int8) or 8x4x8 (int16 x int8) block step, each one MAC instruction per aie_api's AIE2P headers, and no operand
preparation (the weights arrive in the mmul's (k, n) order); with two weight terms ("w8x2a16") every A operand
feeds two mmuls (hi and lo) and the call moves two accumulator tiles."""
import pytest

from torch_npu2.kernels import core_ops

TILE = dict(GEMM_TILE_M=64, GEMM_TILE_K=32, GEMM_TILE_N=128, GEMM_DRAIN_N=32)


@pytest.mark.parametrize("bits, precision, shape", [(8, "int8", (8, 8, 8)), (16, "int16x8", (8, 4, 8))])
def test_a_gemm_call_counts_its_mmuls(bits, precision, shape):
    defines = tuple(sorted(dict(TILE, GEMM_ACT_BITS=bits).items()))
    ops = core_ops.count_call("gemm_int_i32_wkn", defines, (), source="gemm_int8.cc")
    (use,) = ops.mmul
    assert (use.precision, use.shape) == (precision, shape)
    assert use.macs == 64 * 32 * 128
    total = core_ops.instructions(ops, share_operands=False)
    assert total["mac"] == use.calls and total["vector"] == 0
    # the int32 accumulator tile is loaded and stored once per call: 64 x 128 x 4 bytes in 512-bit registers
    assert total["store"] == 64 * 128 * 4 // 64


def test_the_drain_rescales_every_output():
    defines = tuple(sorted(dict(TILE, GEMM_ACT_BITS=8).items()))
    ops = core_ops.instructions(core_ops.count_call("gemm_i32_to_bf16", defines, (), source="gemm_int8.cc"), True)
    chunk = 64 * 32  # GEMM_TILE_M x GEMM_DRAIN_N outputs
    assert ops["store"] == chunk // 16       # 16 bf16 outputs a store
    assert ops["vector"] >= 7 * chunk // 16  # an int32 -> fp32 conversion per 16 outputs (at 32 lanes)



def test_two_weight_terms_share_each_activation_operand():
    one, two = (core_ops.count_call("gemm_int_i32_wkn", tuple(sorted(dict(TILE, GEMM_ACT_BITS=16, **terms).items())),
                                    (), source="gemm_int8.cc") for terms in ({}, {"GEMM_WEIGHT_TERMS": 2}))
    (use_one,), (use_two,) = one.mmul, two.mmul
    assert use_two.macs == 2 * use_one.macs and use_two.calls == 2 * use_one.calls
    # each loaded A operand feeds the hi and the lo mmul, each weight operand two row blocks (the one-term loop's 2 x 2
    # blocks become 2 row blocks x 2 terms: four accumulators live either way)
    assert use_two.a_operands == use_two.calls // 2 and use_two.b_operands == use_two.calls // 2
    total_one, total_two = (core_ops.instructions(ops, share_operands=True) for ops in (one, two))
    assert total_two["store"] == 2 * total_one["store"] == 2 * 64 * 128 * 4 // 64  # two int32 accumulator tiles


def test_the_two_term_drain_converts_both_accumulators():
    ops = [core_ops.instructions(core_ops.count_call("gemm_i32_to_bf16", tuple(sorted(dict(
        TILE, GEMM_ACT_BITS=16, **terms).items())), (), source="gemm_int8.cc"), True)
        for terms in ({}, {"GEMM_WEIGHT_TERMS": 2})]
    chunk = 64 * 32
    assert ops[1]["load"] - ops[0]["load"] == chunk // 16  # the lo accumulator, 16 int32 a load
    assert ops[1]["vector"] - ops[0]["vector"] >= 7 * chunk // 16  # its int32 -> fp32 conversion
