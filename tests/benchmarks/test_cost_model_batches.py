"""Launch steps in batches, DDR shared by a herd, and the model against upstream's measured GEMMs.

The model lets the steps of one batch of launch steps overlap at their edges because aircc's runtime sequence
starts every shim DMA task of a batch before it awaits the batch (counted here in the real lowering); it charges a
herd's DDR copies at no more than the DDR rate together; its GEMM rate and DDR bandwidth are what upstream's
measured GEMMs prove, and replayed on those GEMMs at their published tiling, it lands near their measured times.
"""
import re

import pytest

from benchmarks import cost_model
from torch_npu2.kernels.air_pipeline import lower_to_npu_insts
from torch_npu2.kernels.builders import build_launch
from torch_npu2.kernels.lint import launch_tiles
from torch_npu2.kernels.program import CompileOptions

_SEQUENCE_OP = re.compile(r"aiex\.dma_(start|await)_task")


def batches_in_runtime_sequence(npu_module: str) -> list[tuple[int, int]]:
    """(DMA tasks started, tasks awaited) of each run of starts followed by awaits in the segment's sequence."""
    sequence = npu_module[npu_module.index("aie.runtime_sequence @l0_gemm_seg_sequence"):]
    runs: list[list[int]] = []
    for op in _SEQUENCE_OP.findall(sequence):
        if op == "start" and (not runs or runs[-1][1]):
            runs.append([0, 0])
        runs[-1][op == "await"] += 1
    return [tuple(r) for r in runs]


@pytest.mark.parametrize("tiling", [(2, 2), (1, 1)])
def test_the_runtime_sequence_starts_a_whole_batch_before_awaiting_it(air_tools, tmp_path, tiling):
    """A 2×4-step GEMM: the sequence has one start-then-await run per batch the model counts, 4 steps per batch at
    tiling (2, 2) and 1 at (1, 1)."""
    options = CompileOptions(runtime_loop_tiling_sizes=tiling)
    program = cost_model.gemm_program(1024, 512, 2048, compile_options=options)
    steps = (1024 // 512, 2048 // 512)
    lower_to_npu_insts(program, keep_dir=tmp_path)
    runs = batches_in_runtime_sequence((tmp_path / "npu.mlir").read_text())
    batch = launch_tiles(steps, tiling)
    assert len(runs) == steps[0] * steps[1] // (batch[0] * batch[1])
    assert all(started > 0 and awaited > 0 for started, awaited in runs)
    assert len({runs[0]} | set(runs)) == 1  # every batch alike


def test_batched_steps_share_their_first_copy_and_last_write_and_no_more():
    """Llama-3.2-1B's gate and up projections (gemm_swiglu) at 2048 rows: 128 steps, in batches of 4 at tiling
    (2, 2). Against one step per batch, each step after the first of its batch saves the same time, no more than
    DDR leaves idle."""
    program = cost_model.program("o_ffn", cost_model.llama_1b_dims(), 2048, "bfp16")
    launch = next(l for l in program.launches if l.kind == "gemm_swiglu")
    ir = build_launch(program, launch)
    batched = cost_model.launch_cost(ir, CompileOptions(runtime_loop_tiling_sizes=(2, 2)), "bfp16")
    single = cost_model.launch_cost(ir, CompileOptions(runtime_loop_tiling_sizes=(1, 1)), "bfp16")
    steps = batched.iterations
    assert steps == 128
    saved_per_step = (single.seconds - batched.seconds) / (steps - steps // 4)
    step_s = (single.seconds - cost_model.LAUNCH_S) / steps - cost_model.LAUNCH_ITERATION_S
    step_ddr_s = batched.ddr_bytes / steps / cost_model.DDR_BYTES_PER_S
    assert 0 < saved_per_step <= step_s - step_ddr_s
    assert batched.seconds >= steps * step_ddr_s  # never faster than DDR moves the bytes


def test_a_herds_ddr_copies_share_the_ddr_rate():
    """An elementwise launch whose tiles each stream their own rows from DDR (the residual add, 2048 × 2048)
    takes at least its DDR bytes over the DDR rate, however many tiles and channels it spreads them over."""
    program = cost_model.program("o_ffn", cost_model.llama_1b_dims(), 2048, "bfp16")
    launch = next(l for l in program.launches if l.kind == "add")
    cost = cost_model.launch_cost(build_launch(program, launch), program.compile_options)
    assert cost.ddr_bytes == 3 * 2048 * 2048 * 2
    assert cost.seconds >= cost.ddr_bytes / cost_model.DDR_BYTES_PER_S


def test_the_calibration_is_what_upstreams_measurements_prove():
    """The BFP16 mmul rate and the DDR bandwidth are the tightest lower bounds upstream's measured GEMMs prove:
    all of the fastest one's time charged to its MACs, and the most bytes per second any of them moved (the bytes
    the model counts when it builds that GEMM at upstream's tiling, which the closed form matches), or the LM
    head's, if higher."""
    rows = cost_model.upstream_gemm_replay()
    for row in rows:
        tile_m, _, _, tile_n = row["tiles"]
        assert row["ddr_mb"] * 1e6 == cost_model.drain_gemm_ddr_bytes(row["shape"], tile_m, tile_n)
    macs = [row["shape"][0] * row["shape"][1] * row["shape"][2] for row in rows]
    tile_rate = max(m / (r["measured_ms"] / 1e3) / (32 * cost_model.CLOCK_HZ) for m, r in zip(macs, rows))
    assert cost_model.THROUGHPUT["mmul_bfp16"].per_cycle == pytest.approx(tile_rate)
    assert cost_model.THROUGHPUT["mmul_bf16"].per_cycle == pytest.approx(tile_rate / 2)
    ddr = max(r["ddr_mb"] * 1e6 / (r["measured_ms"] / 1e3) for r in rows)
    assert cost_model.DDR_BYTES_PER_S == pytest.approx(max(ddr, 128256 * 2048 * 2 / 13.6e-3))


def test_the_model_lands_near_upstreams_measured_gemms():
    """Upstream's standalone drain GEMMs, measured on NPU2, replayed through the model with our builder at their
    tiling: within 5 % faster and 25 % slower than silicon, on shapes from 512³ to 4096³ (0.99–1.16 when this
    was written). In the same model our own tiling is no slower than theirs."""
    rows = cost_model.upstream_gemm_replay()
    assert len(rows) == len(cost_model.UPSTREAM_DRAIN_GEMMS)
    for row in rows:
        assert 0.95 <= row["ratio"] <= 1.25, row
        assert row["predicted_ours_ms"] <= row["predicted_ms"], row
