"""Decode attention over a KV cache (decode_attention.cc, builders/decode_attention.py, npu2.decode_attn): the
kernel's host build against the emulator's launch, both against the host attention the layers run today, the
capacity buckets, one ELF for every length of a bucket, and the IR through the interpreter and the real AIR passes."""
import pytest
import torch

import torch_npu2  # noqa: F401  (registers torch.ops.npu2)
from torch_npu2.emulator.ir_check import check_program_ir, emulate
from torch_npu2.emulator.launches import decode_attention
from torch_npu2.kernels import catalog, host_build
from torch_npu2.kernels.builders import build_launch
from torch_npu2.ops import decode_attn, decode_attn_length, reference
from torch_npu2.patch_llama.layer import _host_attention

needs_host_compiler = pytest.mark.skipif(host_build.host_compiler() is None, reason="no host C++ compiler")

LLAMA = (32, 8, 64)  # heads, KV heads, head_dim of Llama-3.2-1B
# The kernel rounds each unnormalized probability to bf16 and divides by the sum of the rounded values at the end;
# the host attention rounds the normalized ones. Both are within a bf16 rounding of the exact result, so they differ
# by at most about two bf16 ulps of the output's scale (measured: one).
HOST_TOLERANCE = 2 ** -7


def cache(capacity, kv_dim, length, seed):
    """K and V of ``capacity`` rows whose rows past ``length`` are NaN: the kernel must never read them."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(capacity, kv_dim, generator=g) * 2).bfloat16()
    v = torch.randn(capacity, kv_dim, generator=g).bfloat16()
    k[length:], v[length:] = float("nan"), float("nan")
    return k, v


def params(heads, kv_heads, head_dim, capacity):
    return dict(capacity=capacity, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                tile_kv=catalog.decode_attn_tile(head_dim))


def host_attention(q, k, v, length, heads, kv_heads, head_dim):
    """patch_llama's _host_attention over the cache's first ``length`` rows, as one decode row."""
    keys, values = (t[:length].view(1, length, kv_heads, head_dim).transpose(1, 2) for t in (k, v))
    return _host_attention(q.view(1, heads, 1, head_dim), keys, values, None, head_dim ** -0.5).reshape(-1)


@needs_host_compiler
@pytest.mark.parametrize("dims,capacity", [(LLAMA, 512), ((6, 2, 16), 128), ((8, 1, 128), 96)])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 96])
def test_the_kernel_computes_what_the_emulator_computes(dims, capacity, length):
    """The scalar path of decode_attention.cc, walked as the builder walks it, against the emulator's launch: the
    same steps in torch (fp32 sums in another order: at most one bf16 ulp apart, on a few elements)."""
    heads, kv_heads, head_dim = dims
    length = min(length, capacity)
    k, v = cache(capacity, kv_heads * head_dim, length, seed=length)
    q = torch.randn(heads * head_dim, generator=torch.Generator().manual_seed(7)).bfloat16()
    emulated = decode_attention(params(*dims, capacity), q, k, v, decode_attn_length(length))
    built = host_build.decode_attention(q, k, v, length, head_dim, tile_k=catalog.decode_attn_tile(head_dim))
    assert torch.isfinite(emulated.float()).all()
    torch.testing.assert_close(built, emulated, atol=0, rtol=2 ** -7)
    assert (built != emulated).sum() <= max(2, emulated.numel() // 500)


@pytest.mark.parametrize("length", [1, 65, 300, 2048])
def test_the_emulated_kernel_stays_within_two_ulps_of_the_host_attention(length):
    """Against patch_llama's _host_attention (HOST_TOLERANCE of the output's scale), and no further from the exact
    attention than the host attention is (both are one bf16 rounding away from it)."""
    heads, kv_heads, head_dim = LLAMA
    k, v = cache(2048, kv_heads * head_dim, length, seed=length)
    q = torch.randn(heads * head_dim, generator=torch.Generator().manual_seed(length)).bfloat16()
    emulated = decode_attention(params(*LLAMA, 2048), q, k, v, decode_attn_length(length)).float()
    host = host_attention(q, k, v, length, *LLAMA).float()
    scale = host.abs().max()
    assert (emulated - host).abs().max() <= HOST_TOLERANCE * scale
    qh = q.double().view(kv_heads, heads // kv_heads, head_dim)
    kh, vh = (t[:length].double().view(length, kv_heads, head_dim).transpose(0, 1) for t in (k, v))
    exact = torch.softmax(qh @ kh.transpose(1, 2) * head_dim ** -0.5, -1) @ vh
    kernel_error = (emulated.double() - exact.flatten()).abs().max()
    host_error = (host.double() - exact.flatten()).abs().max()
    assert kernel_error <= 2 * host_error + 2 ** -9 * scale


def test_the_length_decides_which_rows_count():
    """A negative control for the length: the same cache at two lengths gives two results, each that of its rows."""
    heads, kv_heads, head_dim = LLAMA
    k, v = cache(256, kv_heads * head_dim, 256, seed=3)
    q = torch.randn(heads * head_dim, generator=torch.Generator().manual_seed(3)).bfloat16()
    short, full = (decode_attention(params(*LLAMA, 256), q, k, v, decode_attn_length(n)) for n in (100, 256))
    assert not torch.equal(short, full)
    torch.testing.assert_close(short, decode_attention(params(*LLAMA, 128), q, k[:128], v[:128],
                                                       decode_attn_length(100)), atol=0, rtol=0)


def test_capacity_buckets():
    cap = catalog.decode_attn_capacity
    assert [cap(n, 8192) for n in (1, 256, 257, 1024, 1025, 1280, 1281, 2048, 2049, 8000)] == \
        [256, 256, 512, 1024, 1280, 1280, 1536, 2048, 2560, 8192]
    assert cap(300, 384) == 384  # clamped to the cache's rows
    buckets = {cap(n, 8192) for n in range(1, 8193)}
    assert len(buckets) == 16
    for n in range(1, 8193, 37):
        c = cap(n, 8192)
        assert n <= c and c % catalog.decode_attn_tile(64) == 0 and c - n < max(256, n // 4 + 1)
    for bad_length, rows in ((0, 256), (257, 256), (10, 100)):
        with pytest.raises(ValueError):
            cap(bad_length, rows)


def test_two_lengths_of_one_bucket_run_one_program(runtime):
    """The length is data: two lengths of one capacity bucket load one Program (one ELF on the NPU), and each
    gives its own rows' attention."""
    heads, kv_heads, head_dim = LLAMA
    max_len = 1024
    k, v = cache(max_len, kv_heads * head_dim, max_len, seed=11)
    q = torch.randn(heads * head_dim, generator=torch.Generator().manual_seed(11)).bfloat16()
    outputs = []
    for length in (300, 470):
        capacity = catalog.decode_attn_capacity(length, max_len)
        assert capacity == 512
        outputs.append(decode_attn(q, k[:capacity], v[:capacity], decode_attn_length(length), head_dim).clone())
    assert runtime.stats["loads"] == 1
    for length, out in zip((300, 470), outputs):
        expected = reference.decode_attn_reference(q, k, v, decode_attn_length(length), head_dim)
        assert (out.float() - expected.float()).abs().max() <= HOST_TOLERANCE * expected.float().abs().max()


def test_the_op_names_the_argument_at_fault(runtime):
    heads, kv_heads, head_dim = LLAMA
    k, v = cache(256, kv_heads * head_dim, 256, seed=1)
    q = torch.randn(heads * head_dim).bfloat16()
    length = decode_attn_length(10)
    with pytest.raises(ValueError, match=r"npu2.decode_attn: argument 'k_cache' expected rows a multiple of 128"):
        decode_attn(q, k[:100], v[:100], length, head_dim)
    with pytest.raises(ValueError, match=r"argument 'v_cache' expected shape \(256, 512\)"):
        decode_attn(q, k, v[:128], length, head_dim)
    with pytest.raises(ValueError, match=r"argument 'length' expected dtype torch.bfloat16"):
        decode_attn(q, k, v, torch.tensor([10], dtype=torch.int32), head_dim)
    with pytest.raises(ValueError, match=r"argument 'q' expected a width that is a multiple of head_dim 48"):
        decode_attn(q[:-8], k, v, length, 48)


def test_the_builder_refuses_what_the_kernel_cannot_run():
    from torch_npu2.kernels.builders.npu2 import LaunchConstraintError

    program = catalog.decode_attn_program(4, 2, 64, 128)
    with pytest.raises(LaunchConstraintError, match="herd"):
        build_launch(program, program.launches[0], {"herd": 3})
    with pytest.raises(ValueError, match="capacity"):
        catalog.decode_attn_program(4, 2, 64, 100)
    with pytest.raises(ValueError, match="an even number of 64-position tiles"):
        catalog.decode_attn_program(4, 2, 64, 192)  # a third ping-pong copy: no L1 headroom once placed at 1B


@pytest.mark.parametrize("dims,capacity", [((6, 2, 16), 128), (LLAMA, 256)])
def test_the_ir_matches_the_emulator_at_two_lengths(air_tools, dims, capacity):
    """The stitched IR as air-opt prints it, run by the interpreter with the kernels' host builds (the two seeds
    draw two lengths), launch by launch against the emulator."""
    program = catalog.decode_attn_program(*dims, capacity)
    for seed in (1, 2):
        check = check_program_ir(program, seed=seed)
        assert check.passed, check.failures()


def test_the_emulator_reads_the_length_from_its_digits():
    program = catalog.decode_attn_program(6, 2, 16, 128)
    k, v = cache(128, 32, 128, seed=5)
    inputs = {"q": torch.randn(96).bfloat16(), "k_cache": k, "v_cache": v}
    results = [emulate(program, {**inputs, "length": decode_attn_length(n)})["out"] for n in (70, 300)]
    assert torch.equal(results[1], emulate(program, {**inputs, "length": decode_attn_length(128)})["out"])
    assert not torch.equal(results[0], results[1])
