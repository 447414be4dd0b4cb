"""Kernels' AIE paths run on the host: gemm.cc, attention.cc, gemm_int8.cc, rope_half_split.cc and gemv.cc
compiled with __AIENGINE__ against a value stand-in of the AIE API (tests/kernels/aie_values: each operation as
aie_api documents it) compute what their scalar paths compute. Bit for bit: the exact bf16 GEMM, attention's scores
(with the causal mask) and P·V (kernels/aie2p/bf16_blocks.h's block products; P·V with bf16-valued accumulators and
rescale factors, which its fp32 rescale keeps exact), the integer GEMM's int16 × int8 mmuls, scale copies and drain,
RoPE, and the packed GEMVs' prepared x, transposed-group sums and dequantized rows in Q4_0, Q4_1 and Q8_0; within
fp32's reordering: the bf16 GEMV and element-order packed rows, whose scalar paths sum in element order. With an
operand's lanes in the wrong order, the wrong weight term or the wrong x they do not. What this cannot see: code
generation, and how the core's own exp2, tanh, invsqrt and emulated fp32 products round (the stand-in's are the
host's), nor whether aie_api's reduction order and 4-bit element order are the ones the stand-in assumes."""
from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch

from torch_npu2.kernels import host_build

STAND_IN = Path(__file__).resolve().parent / "aie_values"
GEMM_TILES = [(64, 32, 128), (16, 32, 48)]  # (GEMM_TILE_M, GEMM_TILE_K, GEMM_TILE_N) the builders use
ATTENTION_TILES = [(32, 64), (8, 16)]        # (ATTN_TQ, ATTN_TK) the builders use, head_dim 64
HEAD_DIM = 64


def aie_path_library(kernel_dir: Path, source: str, defines: dict) -> ctypes.CDLL:
    """``source``'s AIE path built for the host against the value stand-in."""
    path = kernel_dir / source
    arguments = [*host_build.CXX_FLAGS, "-D__AIENGINE__", "-I", str(STAND_IN), "-I", str(kernel_dir),
                 *host_build.define_flags(defines), str(path)]
    inputs = [path.read_bytes(), *(h.read_bytes() for h in sorted(kernel_dir.glob("*.h"))),
              (STAND_IN / "aie_api" / "aie.hpp").read_bytes()]
    return ctypes.CDLL(str(host_build.cached_compile(f"{path.stem}-aie-values.so", arguments, inputs)))


def gemm_operands(tile_m: int, tile_k: int, tile_n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(tile_m * tile_k, generator=generator).to(torch.bfloat16)
    w = torch.randn(tile_n * tile_k, generator=generator).to(torch.bfloat16)
    acc = torch.randn(tile_m * tile_n, generator=generator) * 4
    return a, w, acc


def pointer(tensor: torch.Tensor) -> ctypes.c_void_p:
    """The tensor's storage: the caller keeps the tensor alive through the call."""
    return ctypes.c_void_p(tensor.data_ptr())


def aie_path_gemm(library: ctypes.CDLL, a, w, acc) -> torch.Tensor:
    """The stand-in's bfloat16 holds its value as a float: the operands go in widened."""
    out = acc.clone()
    a32, w32 = a.float(), w.float()
    library.gemm_bf16_f32_wnk(pointer(a32), pointer(w32), pointer(out))
    return out


def host_path_gemm(defines: dict, a, w, acc) -> torch.Tensor:
    out = acc.clone()
    host_build.load("gemm.cc", defines).gemm_bf16_f32_wnk(pointer(a.view(torch.int16)), pointer(w.view(torch.int16)),
                                                         pointer(out))
    return out


@pytest.mark.parametrize("tiles", GEMM_TILES)
def test_the_exact_gemm_aie_path_computes_what_its_scalar_path_does(tiles):
    tile_m, tile_k, tile_n = tiles
    defines = {"GEMM_TILE_M": tile_m, "GEMM_TILE_K": tile_k, "GEMM_TILE_N": tile_n}
    a, w, acc = gemm_operands(*tiles)
    aie = aie_path_gemm(aie_path_library(host_build.KERNEL_DIR, "gemm.cc", defines), a, w, acc)
    host = host_path_gemm(defines, a, w, acc)
    assert not torch.equal(host, acc)  # the call did the work
    assert torch.equal(aie.view(torch.int32), host.view(torch.int32))


def test_an_operand_spread_in_the_wrong_lane_order_is_caught(tmp_path):
    """bf16_blocks.h with the A column left untransposed (lane k * 8 + r where r * 8 + c is meant)."""
    kernel_dir = tmp_path / "aie2p"
    shutil.copytree(host_build.KERNEL_DIR, kernel_dir)
    header = kernel_dir / "bf16_blocks.h"
    spread = "return aie::transpose(transposed.extract<kSide>(k).grow_replicate<kLanes>(), kSide, kSide);"
    text = header.read_text()
    assert spread in text
    header.write_text(text.replace(spread, "return transposed.extract<kSide>(k).grow_replicate<kLanes>();"))
    tile_m, tile_k, tile_n = GEMM_TILES[0]
    defines = {"GEMM_TILE_M": tile_m, "GEMM_TILE_K": tile_k, "GEMM_TILE_N": tile_n}
    a, w, acc = gemm_operands(*GEMM_TILES[0])
    wrong = aie_path_gemm(aie_path_library(kernel_dir, "gemm.cc", defines), a, w, acc)
    assert not torch.equal(wrong, host_path_gemm(defines, a, w, acc))


def attention_defines(tq: int, tk: int) -> dict:
    return {"ATTN_TQ": tq, "ATTN_TK": tk, "ATTN_HEAD_DIM": HEAD_DIM}


@pytest.mark.parametrize("tiles", ATTENTION_TILES)
@pytest.mark.parametrize("q_start, k_start", [(0, 0), (40, 32), (200, 0), (0, 64)])  # diagonal, partly, none, all masked
def test_the_attention_scores_aie_path_computes_what_its_scalar_path_does(tiles, q_start, k_start):
    tq, tk = tiles
    defines = attention_defines(tq, tk)
    generator = torch.Generator().manual_seed(q_start + k_start)
    q = torch.randn(tq * HEAD_DIM, generator=generator).to(torch.bfloat16)
    kv = torch.randn(2 * tk * HEAD_DIM, generator=generator).to(torch.bfloat16)
    aie, host = torch.zeros(tq * tk), torch.zeros(tq * tk)
    q32, kv32 = q.float(), kv.float()  # the stand-in's bfloat16 holds its value as a float
    library = aie_path_library(host_build.KERNEL_DIR, "attention.cc", defines)
    library.attn_qk_tile_bf16(pointer(q32), pointer(kv32), pointer(aie), q_start, k_start)
    host_build.load("attention.cc", defines).attn_qk_tile_bf16(
        pointer(q.view(torch.int16)), pointer(kv.view(torch.int16)), pointer(host), q_start, k_start)
    assert torch.equal(aie.view(torch.int32), host.view(torch.int32))
    assert bool((host > -1e29).any()) == (k_start <= q_start + tq - 1)  # the visible keys were scored


@pytest.mark.parametrize("tiles", ATTENTION_TILES)
def test_the_attention_pv_aie_path_computes_what_its_scalar_path_does(tiles):
    tq, tk = tiles
    defines = attention_defines(tq, tk)
    generator = torch.Generator().manual_seed(tq)
    probs = torch.rand(tq * tk, generator=generator).to(torch.bfloat16)
    kv = torch.randn(2 * tk * HEAD_DIM, generator=generator).to(torch.bfloat16)
    row_scale = torch.rand(tq, generator=generator).to(torch.bfloat16).float()  # exp2's results are bf16
    acc = (torch.randn(tq * HEAD_DIM, generator=generator) * 8).to(torch.bfloat16).float()
    aie, host = acc.clone(), acc.clone()
    probs32, kv32 = probs.float(), kv.float()
    library = aie_path_library(host_build.KERNEL_DIR, "attention.cc", defines)
    library.attn_pv_accumulate_bf16(pointer(probs32), pointer(kv32), pointer(row_scale), pointer(aie))
    host_build.load("attention.cc", defines).attn_pv_accumulate_bf16(
        pointer(probs.view(torch.int16)), pointer(kv.view(torch.int16)), pointer(row_scale), pointer(host))
    assert not torch.equal(host, acc)
    assert torch.equal(aie.view(torch.int32), host.view(torch.int32))


INT_TILES = [(64, 64, 64), (32, 32, 16)]  # (GEMM_TILE_M, GEMM_TILE_N, GEMM_DRAIN_N)


def int_gemm_call_operands(tile_m: int, tile_n: int, seed: int = 0):
    """One gemm_int_w8x2 call's A and W windows (int_gemm's layouts, scale blocks of random bits: both paths copy
    them) and an accumulator start."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randint(-32767, 32768, (9 * tile_m * 4,), generator=generator, dtype=torch.int16)
    w = torch.randint(-127, 128, (9 * (tile_n // 8) * 2 * 4 * 8,), generator=generator, dtype=torch.int8)
    acc = torch.randint(-2 ** 20, 2 ** 20, (2 * tile_m * tile_n,), generator=generator, dtype=torch.int32)
    return a, w, acc


@pytest.mark.parametrize("tiles", INT_TILES)
def test_the_integer_gemm_aie_path_computes_what_its_scalar_path_does(tiles):
    """gemm_int8.cc: a call's int16 x int8 mmuls over both weight terms and its scale copies, then the drain's
    rescale to bf16 (its fp32 products IEEE's here: the stand-in's one assumption about the core)."""
    tile_m, tile_n, drain_n = tiles
    defines = {"GEMM_TILE_M": tile_m, "GEMM_TILE_N": tile_n, "GEMM_DRAIN_N": drain_n}
    a, w, acc = int_gemm_call_operands(tile_m, tile_n)
    libraries = {"aie": aie_path_library(host_build.KERNEL_DIR, "gemm_int8.cc", defines),
                 "host": host_build.load("gemm_int8.cc", defines)}
    results = {}
    for path, library in libraries.items():
        sums, rows, columns = acc.clone(), torch.zeros(tile_m), torch.zeros(tile_n)
        library.gemm_int_w8x2(pointer(a), pointer(w), pointer(sums), pointer(rows), pointer(columns))
        results[path] = (sums, rows.view(torch.int32), columns.view(torch.int32))
    for aie, host in zip(results["aie"], results["host"]):
        assert torch.equal(aie, host)
    assert not torch.equal(results["host"][0], acc)
    # the drain, on the host path's sums and on scales both paths would have copied (fp32, not random bits)
    sums = results["host"][0]
    rows = torch.rand(tile_m) * 1e-3
    columns = torch.rand(tile_n) * 1e-2
    aie_out, host_out = torch.zeros(tile_m * drain_n), torch.zeros(tile_m * drain_n, dtype=torch.int16)
    libraries["aie"].gemm_int_drain_bf16(pointer(sums), pointer(rows), pointer(columns), pointer(aie_out))
    libraries["host"].gemm_int_drain_bf16(pointer(sums), pointer(rows), pointer(columns), pointer(host_out))
    assert torch.equal(aie_out, host_out.view(torch.bfloat16).float())
    assert bool((aie_out != 0).all())


def test_an_integer_gemm_reading_the_wrong_weight_term_is_caught(tmp_path):
    """gemm_int8.cc with the lo term's B operand taken from the hi half of the loaded pair."""
    kernel_dir = tmp_path / "aie2p"
    shutil.copytree(host_build.KERNEL_DIR, kernel_dir)
    source = kernel_dir / "gemm_int8.cc"
    lo = "terms.template extract<Mmul::size_B>(1)"
    assert lo in source.read_text()
    source.write_text(source.read_text().replace(lo, "terms.template extract<Mmul::size_B>(0)"))
    tile_m, tile_n, drain_n = INT_TILES[0]
    defines = {"GEMM_TILE_M": tile_m, "GEMM_TILE_N": tile_n, "GEMM_DRAIN_N": drain_n}
    a, w, acc = int_gemm_call_operands(tile_m, tile_n)
    sums = {}
    for path, library in (("aie", aie_path_library(kernel_dir, "gemm_int8.cc", defines)),
                          ("host", host_build.load("gemm_int8.cc", defines))):
        sums[path], rows, columns = acc.clone(), torch.zeros(tile_m), torch.zeros(tile_n)
        library.gemm_int_w8x2(pointer(a), pointer(w), pointer(sums[path]), pointer(rows), pointer(columns))
    assert not torch.equal(sums["aie"], sums["host"])


@pytest.mark.parametrize("rows, heads, head_dim", [(1, 4, 64), (2, 3, 64), (1, 2, 32)])
def test_the_rope_aie_path_computes_what_its_scalar_path_does(rows, heads, head_dim):
    defines = {"ROPE_ROWS": rows, "ROPE_HEADS": heads, "ROPE_HEAD_DIM": head_dim}
    generator = torch.Generator().manual_seed(rows * heads)
    x = torch.randn(rows * heads * head_dim, generator=generator).to(torch.bfloat16)
    angles = torch.rand(rows, head_dim // 2, generator=generator) * 6.3
    lut = torch.cat([angles.cos(), angles.sin()], dim=1).reshape(-1).to(torch.bfloat16)
    x32, lut32, aie = x.float(), lut.float(), torch.zeros(rows * heads * head_dim)
    aie_path_library(host_build.KERNEL_DIR, "rope_half_split.cc", defines).rope_half_split_bf16(
        pointer(x32), pointer(lut32), pointer(aie))
    host = torch.zeros(rows * heads * head_dim, dtype=torch.bfloat16)
    host_build.load("rope_half_split.cc", defines).rope_half_split_bf16(
        pointer(x.view(torch.int16)), pointer(lut.view(torch.int16)), pointer(host.view(torch.int16)))
    assert torch.equal(aie, host.float())
    assert not torch.equal(host, x)


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("K", [2048, 576])  # groups of 32 blocks with transposed quants; element-order groups
def test_the_packed_gemv_aie_path_computes_what_its_scalar_path_does(name, K):
    """gemv.cc's packed rows (kernels/quant.py's layout, GGUF-quantized random weights): x prepared (groups
    transposed) and the dequantized rows bit for bit; every row's fp32 sum bit for bit where the groups are
    transposed (the host path sums lane by lane in the core's order), within fp32's reordering (2^-16 of the sum of
    |w x|) where they are in element order (the host path sums the products in element order)."""
    gguf = pytest.importorskip("gguf", reason="the gguf package quantizes the test weights as GGUF does")
    from torch_npu2.kernels import quant

    rows = 8
    generator = torch.Generator().manual_seed(K)
    w = torch.randn(rows, K, generator=generator) * torch.logspace(-2, 1, rows).reshape(rows, 1)
    raw = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, name.upper()))
    packed = quant.from_gguf_blocks(quant.weight_format(name), torch.from_numpy(raw), K).contiguous()
    defines = {"GEMV_ROWS": rows, "GEMV_K": K, "GEMV_QUANT": quant.GEMV_QUANT[name]}
    aie, host = aie_path_library(host_build.KERNEL_DIR, "gemv.cc", defines), host_build.load("gemv.cc", defines)
    x = torch.randn(K, generator=generator).to(torch.bfloat16)
    x_aie, x_host = x.float(), x.clone()
    aie.gemv_q_prepare_x(pointer(x_aie), K)
    host.gemv_q_prepare_x(pointer(x_host.view(torch.int16)), K)
    assert torch.equal(x_aie, x_host.float())
    y_aie, y_host = torch.zeros(rows), torch.zeros(rows)
    aie.gemv_q_bf16_f32(pointer(packed), pointer(x_aie), pointer(y_aie))
    host.gemv_q_bf16_f32(pointer(packed), pointer(x_host.view(torch.int16)), pointer(y_host))
    if K % 1024 == 0:
        assert torch.equal(y_aie.view(torch.int32), y_host.view(torch.int32))
    else:
        exact = quant.dequantize(quant.weight_format(name), packed, K)
        bound = 2.0 ** -16 * (exact.abs() @ x.float().abs())
        assert bool(((y_aie - y_host).abs() <= bound).all())
    assert bool((y_host != 0).all())
    out_aie, out_host = torch.zeros(rows * K), torch.zeros(rows * K, dtype=torch.bfloat16)
    aie.gemv_q_dequant_bf16(pointer(packed), pointer(out_aie))
    host.gemv_q_dequant_bf16(pointer(packed), pointer(out_host.view(torch.int16)))
    assert torch.equal(out_aie, out_host.float())


def test_the_bf16_gemv_aie_path_sums_within_fp32_reordering():
    """gemv_bf16_f32: 32 lanes, then aie_api's reduction, where the scalar path sums in order: equal within fp32's
    reordering (2^-16 of the sum of |w x|), not bit for bit."""
    rows, K = 8, 2048
    defines = {"GEMV_ROWS": rows, "GEMV_K": K}
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(rows * K, generator=generator).to(torch.bfloat16)
    x = torch.randn(K, generator=generator).to(torch.bfloat16)
    w32, x32, y_aie, y_host = w.float(), x.float(), torch.zeros(rows), torch.zeros(rows)
    aie_path_library(host_build.KERNEL_DIR, "gemv.cc", defines).gemv_bf16_f32(pointer(w32), pointer(x32),
                                                                               pointer(y_aie))
    host_build.load("gemv.cc", defines).gemv_bf16_f32(pointer(w.view(torch.int16)), pointer(x.view(torch.int16)),
                                                      pointer(y_host))
    bound = 2.0 ** -16 * (w32.reshape(rows, K).abs() @ x32.abs())
    assert bool(((y_aie - y_host).abs() <= bound).all())
    assert bool(((y_host - w32.reshape(rows, K) @ x32).abs() <= bound).all())


def test_a_packed_gemv_reading_the_wrong_x_is_caught(tmp_path):
    """gemv.cc with a block's odd elements multiplied by its even elements' x."""
    gguf = pytest.importorskip("gguf", reason="the gguf package quantizes the test weights as GGUF does")
    from torch_npu2.kernels import quant

    kernel_dir = tmp_path / "aie2p"
    shutil.copytree(host_build.KERNEL_DIR, kernel_dir)
    source = kernel_dir / "gemv.cc"
    odd = "dot = aie::mac(dot, odd, aie::load_v<kBlock>(xt + 2 * kBlock * t + kBlock));"
    assert odd in source.read_text()
    source.write_text(source.read_text().replace(odd, odd.replace(" + kBlock));", "));")))
    rows, K = 8, 2048
    generator = torch.Generator().manual_seed(5)
    raw = gguf.quants.quantize(torch.randn(rows, K, generator=generator).numpy(), gguf.GGMLQuantizationType.Q4_1)
    packed = quant.from_gguf_blocks(quant.Q4_1, torch.from_numpy(raw), K).contiguous()
    defines = {"GEMV_ROWS": rows, "GEMV_K": K, "GEMV_QUANT": quant.GEMV_QUANT["q4_1"]}
    x = torch.randn(K, generator=generator).to(torch.bfloat16)
    x_aie, x_host = x.float(), x.clone()
    aie, host = aie_path_library(kernel_dir, "gemv.cc", defines), host_build.load("gemv.cc", defines)
    aie.gemv_q_prepare_x(pointer(x_aie), K)
    host.gemv_q_prepare_x(pointer(x_host.view(torch.int16)), K)
    y_aie, y_host = torch.zeros(rows), torch.zeros(rows)
    aie.gemv_q_bf16_f32(pointer(packed), pointer(x_aie), pointer(y_aie))
    host.gemv_q_bf16_f32(pointer(packed), pointer(x_host.view(torch.int16)), pointer(y_host))
    assert not torch.equal(y_aie, y_host)
