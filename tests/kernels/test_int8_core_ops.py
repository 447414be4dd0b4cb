"""The counting stand-in runs the integer GEMMs' AIE path (kernels/aie2p/gemm_int8.cc, quantize_rows.cc): the MAC call
issues one int16 x int8 aie::mmul (8x4x8) per block step and term, each A operand feeding the hi and the lo mmul and
each 512-bit weight load bringing both terms; the drain converts both accumulators and multiplies by the scales;
quantize_rows reads the row twice to prepare it and once more to pack it, three bf16 multiplies per 32 values a pass."""
import pytest

from torch_npu2.kernels import core_ops, timing

TILE = dict(GEMM_TILE_M=64, GEMM_TILE_N=64, GEMM_DRAIN_N=64)  # Llama-3.2-1B's tile at 2048 rows


def defines(**values):
    return tuple(sorted(values.items()))


def cycles(ops_pair):
    cheapest, dearest = ops_pair
    return (timing.core_cycles(core_ops.instructions(cheapest, True), timing.FAST),
            timing.core_cycles(core_ops.instructions(dearest, False), timing.SLOW))


def test_a_mac_call_counts_its_mmuls_and_shares_its_operands():
    ops = core_ops.count_call("gemm_int_w8x2", defines(**TILE), ())
    (use,) = ops.mmul
    groups, steps = (64 // 16) * (64 // 8), 8  # (two row blocks, one 8-column block) groups; 8 K blocks a call
    assert (use.precision, use.shape) == ("int16x8", (8, 4, 8))
    assert use.macs == 64 * 64 * 32 * 2  # 32 K, two weight terms
    assert (use.calls, use.a_operands, use.b_operands) == (4 * groups * steps, 2 * groups * steps, 2 * groups * steps)
    total = core_ops.instructions(ops, share_operands=True)
    # per group four 64-lane int32 accumulators in and out (4 registers each); per step two A loads and one load of
    # both terms; the scale blocks: 64 rows of 2 words (8 loads), 8 column blocks of 8 scales (8 loads)
    assert total["load"] == groups * (16 + 3 * steps) + 8 + 8
    assert total["store"] == groups * 16 + 4 + 4
    assert total["move"] == groups * 2 * 16
    assert total["mac"] == use.calls and total["vector"] == 4  # the row scales' even words, 4 filters
    assert cycles(core_ops.call_ops("gemm_int_w8x2", TILE, {})) == (1028, 3868)  # MAC-bound at the fast end


def test_the_drain_converts_both_terms_and_rescales_every_output():
    ops = core_ops.instructions(core_ops.count_call("gemm_int_drain_bf16", defines(**TILE), ()), True)
    steps = 64 * 64 // 32  # 32 outputs (four rows of an 8-column block) a step
    assert ops["store"] == steps  # 32 bf16 a store
    assert ops["load"] == 2 * 2 * steps + 8  # both terms' 32 int32, and each block's 8 column scales
    # per step: two int32 -> fp32 conversions (7 ops each), their sum, two emulated fp32 products (4 + 5 per 16
    # lanes) and the bf16 rounding
    assert ops["vector"] == steps * (2 * 7 + 1 + 2 * 2 * 4 + 1)
    assert ops["mac"] == steps * 2 * 2 * 5
    assert cycles(core_ops.call_ops("gemm_int_drain_bf16", TILE, {})) == (6656, 9096)


def test_the_swiglu_drain_adds_silu_mul():
    swiglu = dict(TILE, GEMM_DRAIN_N=32)
    plain = core_ops.instructions(core_ops.count_call("gemm_int_drain_bf16", defines(**swiglu), ()), True)
    ops = core_ops.instructions(core_ops.count_call("gemm_int_swiglu_drain_bf16", defines(**swiglu), ()), True)
    outputs = 64 * 32
    assert ops["nonlinear"] == outputs // 16  # one 16-lane tanh per 16 outputs
    assert ops["load"] - plain["load"] == 2 * 2 * outputs // 32 + 4  # the up chunk's accumulators and scales


@pytest.mark.parametrize("K, chunk", [(576, 576), (2048, 512), (8192, 2048)])
def test_quantize_rows_passes(K, chunk):
    """prepare: the row read twice (its max and min, then q and Σ|q|: three bf16 MACs per 32 values); chunk: its
    values once more, three MACs per 32, and per 8 runs nine aligned stores."""
    prepare = core_ops.count_call("quantize_rows_prepare", defines(QUANT_K=K, QUANT_CHUNK=chunk), ())
    pack = core_ops.count_call("quantize_rows_chunk", defines(QUANT_K=K, QUANT_CHUNK=chunk), (0,))
    assert prepare.counts["load"] == 2 * K // 32 and prepare.counts["mac"] == 3 * K // 32
    assert pack.counts["load"] == chunk // 32 and pack.counts["mac"] == 3 * chunk // 32
    runs = chunk // 32
    assert pack.counts["store"] == runs // 8 * 9 + (runs % 8 > 0) * (runs % 8 + (4 * (runs % 8)) // 16
                                                                     + ((4 * (runs % 8)) % 16 > 0))
    assert prepare.counts["scalar_float"] <= 10 and prepare.mmul == pack.mmul == ()
