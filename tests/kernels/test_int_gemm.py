"""The integer GEMMs' numerics and layouts (kernels/int_gemm.py): hand-worked quantizations, the int16 activation
scale that keeps every int32 sum exact, the packed activation rows and tiled weights, and the emulator's launches
(the studies' gemm over bf16 weights, and the w8x2a16 Programs' quantize_rows / gemm_int / gemm_int_swiglu)
against the definition written out again."""
from __future__ import annotations

import pytest
import torch

from torch_npu2.kernels import catalog
from torch_npu2.kernels.program import TORCH_DTYPES
from torch_npu2.kernels import int_gemm as g
from torch_npu2.emulator.launches import LAUNCH_KINDS, matmul, silu_mul


def test_activations_round_half_to_even_with_the_inverse_scale():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0, 0.0], [0.0] * 6])
    q, scale = g.quantize_activations(x, 127)
    assert q.tolist() == [[127, 0, 2, -2, -127, 0], [0] * 6]  # rint: 0.5 → 0, 1.5 → 2, −2.5 → −2
    assert scale.tolist() == [[1.0], [0.0]]
    x = torch.tensor([[3.0, -1.0, 1e-3]], dtype=torch.bfloat16)
    q, scale = g.quantize_activations(x, 32767)
    inv = torch.tensor(32767.0) / torch.tensor(3.0)  # fp32(32767 / absmax)
    assert q.tolist() == [[32767, -10922, 11]] and scale.item() == (1 / inv).item()


@pytest.mark.parametrize("K", [64, 576, 2048, 8192])
def test_int16_activations_keep_every_int32_sum_exact(K):
    """Rows spread evenly over K (the worst case for the bound) are rescaled so that 127 · Σ|q| fits int32; rows
    with a few large values keep the full int16 range."""
    gen = torch.Generator().manual_seed(K)
    flat = torch.ones(1, K) + 0.01 * torch.rand(1, K, generator=gen)
    spiky = torch.randn(1, K, generator=gen) * 0.01
    spiky[0, :4] = 5.0
    q, scale = g.quantize_activations(torch.cat([flat, spiky]), 32767)
    assert int(q.abs().sum(1).max()) * g.WEIGHT_QMAX <= g.INT32_MAX
    assert int(q[1].abs().max()) == 32767  # untouched
    if 32767 * K * g.WEIGHT_QMAX > g.INT32_MAX:
        assert int(q[0].abs().max()) < 32767  # rescaled, and no further than the bound asks:
        assert int(q[0].abs().sum()) * g.WEIGHT_QMAX > 0.99 * g.INT32_MAX
    # the worst weights (±127 with the row's signs) sum exactly: the fp64 sum equals the int64 one
    worst = torch.sign(q.float()) * 127
    assert torch.equal((q.double() * worst.double()).sum(1), (q.long() * worst.long()).sum(1).double())


def test_weight_terms_hold_the_int8_rounding_residual():
    w = torch.tensor([[127.0, 1.25, -0.3, 2.5, -126.5], [0.0] * 5])
    hi, lo, scale = g.quantize_weight_terms(w)
    assert hi.tolist() == [[127, 1, 0, 2, -126], [0] * 5]  # rint, half to even
    assert lo.tolist() == [[0, 64, -77, 127, -127], [0] * 5]  # 256 · residual; ±0.5 (a halfway x) clamps to ±127
    assert scale.tolist() == [1.0, 0.0]
    one, s = g.quantize_weight_terms(w, terms=1)
    assert torch.equal(hi, one) and torch.equal(scale, s)


def _definition(a, w, terms):
    """The GEMM of the module's docstring written out again: fp32 roundings explicit, integer sums in float64."""
    x = a.float()
    absmax = x.abs().amax(1, keepdim=True)
    inv = torch.where(absmax > 0, torch.tensor(32767.0) / absmax, 0 * absmax)  # (32767 / t is t's reciprocal × 32767)
    qa = torch.round(x * inv)
    assert float(qa.abs().sum(1).max()) * 127 <= 2 ** 31 - 1  # these inputs take the common branch
    sa = torch.where(inv > 0, 1 / inv, 0 * inv)
    ws = w.float().abs().amax(1, keepdim=True)
    xw = w.float() * (torch.tensor(127.0) / ws)
    hi = torch.clamp(torch.round(xw), -127, 127)
    acc = (qa.double() @ hi.double().T).float()
    if terms == 2:
        lo = torch.clamp(torch.round((xw - hi) * 256), -127, 127)
        acc = acc + (qa.double() @ lo.double().T).float() / 256
    return (acc * (sa * (ws / 127).T)).bfloat16()


def _operands(M, K, N, seed):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=gen) * torch.exp2(torch.randint(-4, 4, (M, 1), generator=gen).float())).bfloat16()
    a[3] = 0  # a zero row: scale 0, output 0
    return a, (torch.randn(N, K, generator=gen) * 0.05).bfloat16()


def test_studied_gemm_launch_is_the_definition():
    a, w = _operands(16, 64, 32, 4)
    out = matmul(dict(M=16, K=64, N=32, precision="w8x2a16"), a, w)
    assert torch.equal(out.view(torch.int16), _definition(a, w, 2).view(torch.int16))
    assert torch.all(out[3] == 0)
    # the second term brings the GEMM to within a few bf16 roundings of the exact one; one term is far from it
    exact = torch.nn.functional.linear(a.float(), w.float())
    rel = {p: ((matmul(dict(M=16, K=64, N=32, precision=p), a, w).float() - exact).norm() / exact.norm()).item()
           for p in ("w8a16", "w8x2a16")}
    assert rel["w8x2a16"] < 0.004 and rel["w8x2a16"] * 3 < rel["w8a16"], rel


def test_activation_rows_pack_runs_of_32_with_their_scale():
    q = torch.arange(-64, 64, dtype=torch.int32).reshape(2, 64)
    scale = torch.tensor([[0.5], [3.25]])
    words = g.pack_activations(q, scale)
    assert words.dtype == torch.int32 and words.shape == (2, g.activation_words(64)) == (2, 36)
    runs = words.view(torch.int16).reshape(2, 2, 36)
    assert runs[1, 1, :32].tolist() == list(range(32, 64))
    assert runs[0, 1, 32:34].contiguous().view(torch.float32).item() == 0.5 and runs[1, 0, 34:].tolist() == [0, 0]
    back = g.unpack_activations(words, 64)
    assert torch.equal(back[0], q) and torch.equal(back[1], scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        g.activation_cols(48)


@pytest.mark.parametrize("halves, N, K", [(1, 128, 96), (2, 64, 64), (1, 576, 64)])
def test_weights_tile_as_the_kernel_reads_them_and_back(halves, N, K):
    w = (torch.randn(halves * N, K, generator=torch.Generator().manual_seed(N)) * 0.1).bfloat16()
    hi, lo, scale = g.quantize_weight_terms(w)
    tile_n = g.weight_tile_n(N, halves)
    words = g.prepare_weight(w, halves)
    assert tuple(words.shape) == g.prepared_weight_shape(N, K, halves)
    window = words.view(torch.int8).reshape(N // tile_n, K // 32, 9, halves * tile_n // 8, 2, 4, 8)
    # [tile][call][kb][nb][t][k][n]: tile 1, call 1, kb 3, column block 1, the lo term, k 2, n 5
    assert window[1, 1, 3, 1, 1, 2, 5] == lo[tile_n + 8 + 5, 32 + 12 + 2]  # (in a pair's gate half: tile_n ≥ 16)
    assert window[0, 0, 8, 1, 0].reshape(-1).contiguous().view(torch.float32).tolist() == scale[8:16].tolist()
    assert torch.all(window[:, :, 8, :, 1] == 0)
    if halves == 2:  # the up half of tile 0: the up rows' first columns
        assert window[0, 0, 0, tile_n // 8, 0, 0, 0] == hi[N, 0]
    back = g.untile_weights(words, halves * N, K, tile_n, halves)
    assert all(torch.equal(x, y) for x, y in zip(back, (hi, lo, scale)))


def test_weight_tiles_are_the_builders_and_refuse_misfits():
    assert [g.weight_tile_n(n) for n in (2048, 512, 576, 192)] == [64, 64, 48, 48]
    assert g.weight_tile_n(8192, 2) == 32
    with pytest.raises(ValueError, match="multiple of 16"):
        g.weight_tile_n(100)


def test_w8x2_programs_compute_the_definition_launch_by_launch():
    """o_ffn_w8x2's launches on the emulator (quantize_rows → gemm_int → … → gemm_int_swiglu → …) give what the
    definition gives for each GEMM, with o_ffn's rounding points between them."""
    M, H, Q, F = 32, 64, 64, 128
    gen = torch.Generator().manual_seed(1)
    attn, x = (torch.randn(M, n, generator=gen).bfloat16() for n in (Q, H))
    norm_w = (torch.rand(H, generator=gen) + 0.5).bfloat16()
    wo, wg, wu, wd = ((torch.randn(*s, generator=gen) * 0.1).bfloat16() for s in ((H, Q), (F, H), (F, H), (H, F)))
    values = dict(attn=attn, x=x, norm_w=norm_w, wo=g.prepare_weight(wo),
                  w_gate_up=g.prepare_weight(torch.cat([wg, wu]), halves=2), w_down=g.prepare_weight(wd))
    program = catalog.o_ffn_w8x2_program(H, Q, F, 1e-5, M)
    for arg in program.host_args:
        assert tuple(values[arg.name].shape) == arg.shape and values[arg.name].dtype == TORCH_DTYPES[arg.dtype]
    dtypes = {arg.name: TORCH_DTYPES[arg.dtype] for arg in program.args}
    for launch in program.launches:  # each result stored in its buffer's dtype, as the emulated driver does
        out = launch.writes[0]
        values[out] = LAUNCH_KINDS[launch.kind](launch.p, *(values[n] for n in launch.reads)).to(dtypes[out])
    res1 = (x.float() + _definition(attn, wo, 2).float()).bfloat16()
    assert torch.equal(values["res1"].reshape(M, H), res1)
    normed = values["normed"].reshape(M, H)
    act = silu_mul({}, _definition(normed, wg, 2), _definition(normed, wu, 2))
    assert torch.equal(values["act"].reshape(M, F), act)
    expected = (res1.float() + _definition(act, wd, 2).float()).bfloat16()
    assert torch.equal(values["out"].reshape(M, H).view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("M, K, N", [(64, 2048, 512), (17, 576, 192), (300, 8192, 64), (16, 64, 32), (40, 100, 12)])
def test_integer_sums_are_exact_on_either_path(M, K, N):
    """The emulator's integer sums (torch's int8 GEMM over two digits of q above 16 rows and K, N multiples of 8,
    fp64 otherwise) equal the exact int64 sums, at the extremes the quantization allows."""
    gen = torch.Generator().manual_seed(M + K)
    q = torch.randint(-32767, 32768, (M, K), generator=gen, dtype=torch.int32)
    q[0], q[1] = 32767, -32767
    w = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
    w[0], w[1] = 127, -127
    exact = q.long() @ w.long().T
    assert torch.equal(g._integer_sum(q, w), exact.double())
