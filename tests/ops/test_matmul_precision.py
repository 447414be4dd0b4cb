"""The prefill GEMMs' precision: a Program built for "bf16" multiplies bf16 operands exactly (fp32 sums), one
built for "bfp16" first converts both operands to bfp16ebs8 as AIE2P's BFP16 emulation does; decode and the
LM head have no precision and stay bf16. Expected values are worked out by hand below."""
import pytest
import torch

from torch_npu2.kernels import ModelDims, programs_for_model
from torch_npu2.kernels.catalog import o_ffn_program, rms_gemms_rope_program
from torch_npu2.ops import rms_gemms_rope as rms_gemms_rope_op
from torch_npu2.ops import rms_gemv_rope as rms_gemv_rope_op

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ = 16, 2, 1, 8, 2
SMALL = 0.01  # bf16(0.01) = 0.010009765625: below a bfp16 step of 2^-6 next to 1.0 in its block


def hand_made_qkv(rows):
    """x = 1 everywhere and RMSNorm's weight = [1 × 8 | 1, 0.01 × 7]: ``normed`` is exactly that weight
    (rms 1). wv's rows: row 0 = [0 × 8 | 1 × 8] (only the activation's conversion matters), row 1 =
    [1, 0.01 × 7 | 0 × 8] and row 2 = [1, -0.01 × 7 | 0 × 8] (only the weight's conversion matters); the rest 0."""
    x = torch.ones(*rows, HIDDEN, dtype=torch.bfloat16)
    norm_w = torch.tensor([1.0] * 8 + [1.0] + [SMALL] * 7).bfloat16()
    wq = torch.zeros(HEADS * HEAD_DIM, HIDDEN, dtype=torch.bfloat16)
    wk = torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN, dtype=torch.bfloat16)
    wv = torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN, dtype=torch.bfloat16)
    wv[0, 8:] = 1.0
    wv[1, :8] = torch.tensor([1.0] + [SMALL] * 7)
    wv[2, :8] = torch.tensor([1.0] + [-SMALL] * 7)
    lut = torch.ones(*rows, HEAD_DIM, dtype=torch.bfloat16)
    return x, norm_w, wq, wk, wv, lut


# v[:, :3] per precision.
# bf16: 1 ± 7·bf16(0.01) = 1.0700684 → bf16 1.0703125, 0.9299316 → 0.9296875.
# bfp16: the 0.01s truncate to 0 (rows 0, 1: 1.0); -0.01 truncates down to -2^-6 (row 2: 1 - 7/64 = 0.890625).
EXPECTED = {"bf16": [1.0703125, 1.0703125, 0.9296875], "bfp16": [1.0, 1.0, 1.0 - 7 / 64]}


@pytest.mark.parametrize("precision", ["bf16", "bfp16"])
def test_prefill_gemm_runs_the_programs_precision(runtime, precision):
    v, _, _ = rms_gemms_rope_op(*hand_made_qkv((SEQ,)), 1e-5, precision)
    assert v[:, :3].float().tolist() == [EXPECTED[precision]] * SEQ


def test_prefill_default_precision_is_bf16_numerics(runtime):
    v, _, _ = rms_gemms_rope_op(*hand_made_qkv((SEQ,)), 1e-5)
    assert v[0, :3].float().tolist() == EXPECTED["bf16"]


def test_decode_gemv_stays_bf16(runtime):
    x, norm_w, wq, wk, wv, lut = hand_made_qkv(())
    v, _, _ = rms_gemv_rope_op(x, norm_w, torch.cat((wq, wk)), wv, lut, 1e-5)
    assert v[:3].float().tolist() == EXPECTED["bf16"]


def test_precision_is_part_of_each_prefill_program_and_its_key():
    dims = ModelDims(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256, eps=1e-5)
    by_precision = {p: programs_for_model(dims, (16, 32), p) for p in ("bf16", "bfp16", "bfp16_gate_up")}
    for mode, programs in by_precision.items():
        gemms = [l for prog in programs for l in prog.launches if l.kind in ("gemm", "gemm_swiglu")]
        # rms_gemms_rope: 3 GEMMs per bucket; o_ffn: 4 at 16 rows (gate and up apart), 3 at 32 (gemm_swiglu)
        assert len(gemms) == 2 * 3 + 4 + 3
        gate_up = [l for l in gemms if l.writes[0] in ("gate", "up", "act")]
        assert len(gate_up) == 3  # the gate and up GEMMs at 16 rows, gemm_swiglu at 32
        for launch in gemms:
            expected = ("bfp16" if launch in gate_up else "bf16") if mode == "bfp16_gate_up" else mode
            assert launch.p["precision"] == expected, (mode, launch.kind, launch.writes)
        assert all("precision" not in l.p for prog in programs for l in prog.launches if l not in gemms)
    keys = {p: {prog.name + str(prog.params): prog.key for prog in programs} for p, programs in by_precision.items()}
    for label, key in keys["bf16"].items():
        prefill = label.startswith(("rms_gemms_rope", "o_ffn"))
        assert (key != keys["bfp16"][label]) == prefill, label
        # only o_ffn has a gate/up GEMM: the mixed mode's rms_gemms_rope is the bf16 one
        assert (key != keys["bfp16_gate_up"][label]) == label.startswith("o_ffn"), label


@pytest.mark.parametrize("rows", [16, 32])  # gate and up as two gemm launches; one gemm_swiglu
def test_bfp16_gate_up_calls_a_bfp16_build_of_the_gemm_kernel_from_the_gate_up_launches_only(rows):
    import re

    from torch_npu2.kernels.stitch import LAUNCH_PREFIX, stitch

    program = o_ffn_program(64, 64, 128, 1e-5, rows, "bfp16_gate_up")
    stitched = stitch(program)
    gemm_builds = [b for b in stitched.objects if b.object.startswith("gemm")]
    emulated = [b for b in gemm_builds if ("AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16", 1) in b.defines]
    assert len(gemm_builds) == 2 and len(emulated) == 1  # the exact build and one BFP16 build
    bfp16_symbols = {new for _, new in emulated[0].renames}
    for index, launch in enumerate(program.launches):
        if launch.kind not in ("gemm", "gemm_swiglu"):
            continue
        body = stitched.text.split(f"air.launch @{LAUNCH_PREFIX.format(index=index)}")[1].split("air.launch @")[0]
        called = set(re.findall(r"func\.call @(\w+)", body))
        gate_up = launch.writes[0] in ("gate", "up", "act")
        assert called and (called <= bfp16_symbols if gate_up else not called & bfp16_symbols), (index, called)


def test_bfp16_gate_up_converts_the_gate_up_projection_and_nothing_else(runtime):
    """o_ffn with hand-made weights where each GEMM's BFP16 conversion shows: under "bfp16_gate_up" the output
    equals the reference with only the gate/up operands converted, and differs from both uniform modes."""
    from torch_npu2.emulator.bfp16 import quantize_bf16_to_bfp16
    from torch_npu2.ops import o_ffn as o_ffn_op
    from torch_npu2.ops.reference import o_ffn_reference

    hidden, inter, rows = 16, 32, 2
    torch.manual_seed(0)
    # 1 with seven small companions per block of 8: the small ones truncate to 0 or -2^-6 in bfp16
    block = torch.tensor([1.0] + [SMALL] * 7)
    attn = block.repeat(rows, hidden // 8).bfloat16()
    wo = (torch.randn(hidden, hidden) * 0.3).bfloat16()
    x = torch.randn(rows, hidden).bfloat16()
    norm_w = torch.ones(hidden, dtype=torch.bfloat16)
    w_gate_up = (torch.randn(inter, 2 * hidden) * 0.3).bfloat16()
    w_down = (torch.randn(hidden, inter) * 0.3).bfloat16()
    out = {mode: o_ffn_op(attn, wo, x, norm_w, w_gate_up, w_down, 1e-5, mode)
           for mode in ("bf16", "bfp16", "bfp16_gate_up")}

    def reference(convert):
        """o_ffn_reference with the operands of the GEMMs named in ``convert`` put through bfp16 first."""
        linear = torch.nn.functional.linear
        names = {(hidden, hidden): "o", (inter, hidden): "gate_up", (hidden, inter): "down"}

        def converting_linear(a, w):
            if names[tuple(w.shape)] in convert:
                a, w = quantize_bf16_to_bfp16(a), quantize_bf16_to_bfp16(w)
            return linear(a, w)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.nn.functional, "linear", converting_linear)
            return o_ffn_reference(attn, wo, x, norm_w, w_gate_up, w_down, 1e-5)

    assert torch.equal(out["bf16"], reference(()))
    assert torch.equal(out["bfp16"], reference(("o", "gate_up", "down")))
    assert torch.equal(out["bfp16_gate_up"], reference(("gate_up",)))
    assert not torch.equal(out["bfp16_gate_up"], out["bf16"]) and not torch.equal(out["bfp16_gate_up"], out["bfp16"])


@pytest.mark.parametrize("make", [
    lambda: rms_gemms_rope_program(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, 1e-5, SEQ, "fp8"),
    lambda: o_ffn_program(HIDDEN, HIDDEN, 32, 1e-5, SEQ, "BF16"),
    lambda: programs_for_model(ModelDims(16, 2, 1, 8, 32, 64, 1e-5), (16,), None),
])
def test_unknown_precision_is_refused(make):
    with pytest.raises(ValueError, match="matmul precision must be one of 'bf16', 'bfp16', 'bfp16_gate_up'"):
        make()


def test_op_refuses_an_unknown_precision(runtime):
    for precision in ("fp8", "w8x2a16"):  # the integer GEMMs have ops of their own, over prepared weights
        with pytest.raises(ValueError, match=r"npu2.rms_gemms_rope: argument 'precision' expected one of 'bf16', "
                                             r"'bfp16', 'bfp16_gate_up' \(for 'w8x2a16': the \*_w8x2 ops, over prepared "
                                             rf"weights\), got '{precision}'"):
            rms_gemms_rope_op(*hand_made_qkv((SEQ,)), 1e-5, precision)
