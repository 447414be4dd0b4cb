"""Every kernel's AIE path run on the host: each kernels/aie2p source compiled with __AIENGINE__ against a value
stand-in of the AIE API (tests/kernels/aie_values: each operation as aie_api documents it), every entry point
called and held to its scalar path. Bit for bit: the exact bf16 GEMM and attention's scores (causal mask included)
and P·V (kernels/aie2p/bf16_blocks.h's block products), the integer GEMM's int16 × int8 mmuls, scale copies and
drain, activation quantization, RoPE, the drains, and the packed GEMVs' prepared x, transposed-group sums and
dequantized rows in Q4_0, Q4_1 and Q8_0. Within fp32's reordering (a bf16 unit): the bf16 GEMVs, element-order
packed rows, RMSNorm, flash and decode attention's whole walks (their softmax folds sums in another order and forms
fp32 scalings from bf16 parts). Within silu_mul.h's documented error: SiLU·up (a bf16 tanh). Kept mutations (an
operand's lanes transposed, the wrong weight term, the wrong x) fail. What this cannot see: code generation, how the
core's own exp2, tanh, invsqrt and emulated fp32 products round (the stand-in's are the host's), and whether
aie_api's reduction order and 4-bit element order are the ones the stand-in assumes."""
from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch

from torch_npu2.kernels import host_build

pytestmark = pytest.mark.skipif(host_build.host_compiler() is None,
                                reason="no host C++ compiler (g++): the kernels' AIE path cannot be built for the host")
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
# on the diagonal, partly masked, nothing masked, all masked
@pytest.mark.parametrize("q_start, k_start", [(0, 0), (40, 32), (200, 0), (0, 64)])
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


def decode_attention_walk(library: ctypes.CDLL, widened: bool, q, k, v, length: int, head_dim: int, tile_k: int):
    """decode_attention.cc's three calls walked as host_build.decode_attention walks them, over ``library``; with
    ``widened`` its bf16 buffers are the stand-in's (float-held) bfloat16. Returns the attention row as floats."""
    from torch_npu2.kernels import catalog

    bf16 = torch.float32 if widened else torch.bfloat16
    raw = (lambda t: t) if widened else (lambda t: t.view(torch.int16))
    heads, kv_heads, capacity = q.shape[0] // head_dim, k.shape[1] // head_dim, k.shape[0]
    group = heads // kv_heads
    digits = torch.tensor(catalog.decode_attn_length_digits(length), dtype=torch.bfloat16)
    queries = torch.cat((q.flatten(), digits)).to(bf16)
    out = torch.zeros(kv_heads, group * head_dim, dtype=bf16)
    query, cursor = torch.zeros(group * head_dim, dtype=bf16), torch.zeros(2, dtype=torch.int32)
    row_max, row_sum, acc = torch.zeros(group), torch.zeros(group), torch.zeros(group, head_dim)
    scores, probs = torch.zeros(group, tile_k), torch.zeros(group, tile_k, dtype=bf16)
    for h in range(kv_heads):
        keys, values = (t[:, h * head_dim:(h + 1) * head_dim] for t in (k, v))
        library.dattn_init_f32(pointer(raw(queries)), kv_heads, h, pointer(raw(query)), pointer(row_max),
                               pointer(row_sum), pointer(acc), pointer(cursor))
        for first in range(0, capacity, tile_k):
            kv = torch.cat((keys[first:first + tile_k].flatten(), values[first:first + tile_k].flatten())).to(bf16)
            library.dattn_tile_bf16(pointer(raw(query)), pointer(raw(kv)), pointer(scores), pointer(raw(probs)),
                                    pointer(row_max), pointer(row_sum), pointer(acc), int(cursor[0]), int(cursor[1]))
            cursor[1] += tile_k
        library.dattn_finalize_bf16(pointer(acc), pointer(row_sum), pointer(raw(out[h])))
    return out.float().reshape(-1)


@pytest.mark.parametrize("length", [1, 70, 128])
def test_the_decode_attention_aie_path_computes_what_its_scalar_path_does(length):
    """decode_attention.cc over a 128-position cache, 4 query heads per KV head: within two bf16 units in the last
    place of the largest output (its AIE path forms fp32 products from bf16 head/tail splits and reduces the scores'
    lanes in another order, which moves a rounded probability or output by a unit now and then; the stand-in's exp2
    is the host's). A wrong lane or row would be off by the outputs' own size."""
    heads, kv_heads, head_dim, tile_k, capacity = 8, 2, 64, 64, 128
    defines = {"DATTN_GROUP": heads // kv_heads, "DATTN_TK": tile_k, "DATTN_HEAD_DIM": head_dim}
    generator = torch.Generator().manual_seed(length)
    q = torch.randn(heads * head_dim, generator=generator).to(torch.bfloat16)
    k, v = (torch.randn(capacity, kv_heads * head_dim, generator=generator).to(torch.bfloat16) for _ in range(2))
    aie = decode_attention_walk(aie_path_library(host_build.KERNEL_DIR, "decode_attention.cc", defines), True, q, k,
                                v, length, head_dim, tile_k)
    host = decode_attention_walk(host_build.load("decode_attention.cc", defines), False, q, k, v, length, head_dim,
                                 tile_k)
    ulp = 2.0 ** (torch.floor(torch.log2(host.abs().max())) - 7)
    assert float((aie - host).abs().max()) <= 2 * ulp
    assert bool((host != 0).any())


@pytest.mark.parametrize("row", ["gaussian", "spread evenly", "zeros"])  # the last two: the rescale and zero branches
def test_the_quantize_rows_aie_path_computes_what_its_scalar_path_does(row):
    """quantize_rows.cc: a row's scale state and its packed int16 runs, chunk by chunk, bit for bit (its AIE path
    forms fp32(x · inv) from three bf16 parts of inv; the stand-in's multiply-accumulate rounds as IEEE does)."""
    K, chunk = 2048, 1024
    defines = {"QUANT_K": K, "QUANT_CHUNK": chunk}
    generator = torch.Generator().manual_seed(K)
    x = {"gaussian": torch.randn(K, generator=generator) * 3,
         "spread evenly": torch.where(torch.rand(K, generator=generator) < 0.5, -1.5, 1.5),
         "zeros": torch.zeros(K)}[row].to(torch.bfloat16)
    x32 = x.float()
    results = {}
    for path, library, operand in (("aie", aie_path_library(host_build.KERNEL_DIR, "quantize_rows.cc", defines), x32),
                                   ("host", host_build.load("quantize_rows.cc", defines), x.view(torch.int16))):
        state = torch.zeros(16)
        library.quantize_rows_prepare(pointer(operand), pointer(state))
        words = torch.zeros(K // chunk, chunk // 32 * 18, dtype=torch.int32)
        for c in range(K // chunk):
            library.quantize_rows_chunk(pointer(operand), pointer(state), pointer(words[c]), c)
        results[path] = (state.view(torch.int32), words)
    assert torch.equal(results["aie"][0], results["host"][0])
    assert torch.equal(results["aie"][1], results["host"][1])
    assert bool((results["host"][1] != 0).any()) == (row != "zeros")


def attention_walk(library: ctypes.CDLL, widened: bool, q, k, v, q_start: int, tile_k: int) -> torch.Tensor:
    """attention.cc's five calls over one query tile (row-major q: tile_q × head_dim) against every key tile up to
    its causal frontier, as host_build.flash_attention walks them; with ``widened`` the bf16 buffers are the
    stand-in's. Returns the tile's output, row-major floats."""
    bf16 = torch.float32 if widened else torch.bfloat16
    raw = (lambda t: t) if widened else (lambda t: t.view(torch.int16))
    tile_q, head_dim = q.shape
    row_max, row_sum, row_scale = torch.zeros(tile_q), torch.zeros(tile_q), torch.zeros(tile_q)
    acc, scores = torch.zeros(tile_q * head_dim), torch.zeros(tile_q * tile_k)
    probs, out = torch.zeros(tile_q * tile_k, dtype=bf16), torch.zeros(tile_q * head_dim, dtype=bf16)
    q_blocks = host_build.attention_head_blocks(q).to(bf16)
    library.attn_init_f32(pointer(row_max), pointer(row_sum), pointer(acc))
    for k_first in range(0, min(k.shape[0], q_start + tile_q), tile_k):
        kv = host_build.attention_kv_blocks(k[k_first:k_first + tile_k], v[k_first:k_first + tile_k]).to(bf16)
        library.attn_qk_tile_bf16(pointer(raw(q_blocks)), pointer(raw(kv)), pointer(scores), q_start, k_first)
        library.attn_online_softmax_bf16(pointer(scores), pointer(raw(probs)), pointer(row_max), pointer(row_sum),
                                         pointer(row_scale))
        library.attn_pv_accumulate_bf16(pointer(raw(probs)), pointer(raw(kv)), pointer(row_scale), pointer(acc))
    library.attn_finalize_bf16(pointer(acc), pointer(row_sum), pointer(raw(out)))
    return host_build.attention_head_unblocks(out.to(torch.bfloat16).reshape(-1, head_dim)).float()


@pytest.mark.parametrize("tiles", ATTENTION_TILES)
@pytest.mark.parametrize("q_start", [0, 96])
def test_the_flash_attention_aie_path_computes_what_its_scalar_path_does(tiles, q_start):
    """attention.cc's whole tile walk (scores, online softmax over several key tiles, P·V, the normalization):
    within two bf16 units in the last place of the largest output (its softmax folds each row's max and sum out of
    transposed blocks and forms the fp32 scalings from bf16 parts; the stand-in's exp2 is the host's)."""
    tq, tk = tiles
    defines = attention_defines(tq, tk)
    generator = torch.Generator().manual_seed(q_start + tq)
    q = torch.randn(tq, HEAD_DIM, generator=generator).to(torch.bfloat16)
    positions = -(-(q_start + tq) // tk) * tk  # whole key tiles: the last one's future keys are masked
    k, v = (torch.randn(positions, HEAD_DIM, generator=generator).to(torch.bfloat16) for _ in range(2))
    aie = attention_walk(aie_path_library(host_build.KERNEL_DIR, "attention.cc", defines), True, q, k, v, q_start, tk)
    host = attention_walk(host_build.load("attention.cc", defines), False, q, k, v, q_start, tk)
    ulp = 2.0 ** (torch.floor(torch.log2(host.abs().max())) - 7)
    assert float((aie - host).abs().max()) <= 2 * ulp, float((aie - host).abs().max() / ulp)
    assert bool((host != 0).all())


def bf16_units(aie: torch.Tensor, host: torch.Tensor) -> float:
    """The largest difference, in bf16 units in the last place of each host value."""
    ulp = 2.0 ** (torch.floor(torch.log2(host.abs().clamp(min=2.0 ** -100))) - 7)
    return float(((aie - host).abs() / ulp).max())


def within_silu_mul_bound(aie: torch.Tensor, host: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """silu_mul.h's AIE path takes silu(g) as h + h · t, h = g / 2, t the core's tanh(h) rounded to bf16 (at most
    2^-9 off, |t| < 1): |g| · 2^-10 from silu(g), which both paths round to bf16 (a unit, 2^-7 of it at most, apart
    more) before the product with u, rounded once more (another unit of the output)."""
    g, u = gate.float(), up.float()
    silu = g * torch.sigmoid(g)
    bound = (g.abs() * 2.0 ** -10 + 2.0 ** -7 * silu.abs()) * u.abs() + 2.0 ** -7 * host.abs()
    return bool(((aie - host).abs() <= bound).all())


def test_the_fused_decode_gemv_stages_aie_path_computes_what_its_scalar_path_does():
    """gemv.cc's other entry points: gemv_partial_f32 chunk by chunk and gemv_add_bf16 (the gemv_add launch),
    gemv_rows_bf16, rmsnorm_bf16 and swiglu_bf16. The residual add exactly; the others' sums within fp32's reordering
    (a bf16 output at most a unit off); rmsnorm within a unit (its rstd is an invsqrt: the stand-in's is the host's
    1 / sqrt); swiglu within silu_mul.h's documented error (``within_silu_mul_bound``)."""
    rows, K, chunk = 8, 2048, 1024
    generator = torch.Generator().manual_seed(9)
    w = torch.randn(rows, K, generator=generator).to(torch.bfloat16)
    x = torch.randn(K, generator=generator).to(torch.bfloat16)
    residual = torch.randn(2 * rows, generator=generator).to(torch.bfloat16)
    norm_weight = (1 + torch.randn(K, generator=generator) / 4).to(torch.bfloat16)
    gate_up = (torch.randn(2 * K, generator=generator) * 3).to(torch.bfloat16)
    outputs = {}
    for path in ("aie", "host"):
        widened = path == "aie"

        def build(defines):
            return aie_path_library(host_build.KERNEL_DIR, "gemv.cc", defines) if widened else \
                host_build.load("gemv.cc", defines)

        def bf16(t):  # a buffer the kernel reads or writes as bf16, and the argument that passes it
            held = t.float().clone() if widened else t.clone()
            return held, pointer(held if widened else held.view(torch.int16))

        chunked = build({"GEMV_ROWS": rows, "GEMV_K": chunk})
        whole = build({"GEMV_ROWS": rows, "GEMV_K": K})
        acc = torch.zeros(rows)
        w_chunks = [w[:, c:c + chunk].contiguous() for c in range(0, K, chunk)]
        (x_held, x_arg), (res_held, res_arg) = bf16(x), bf16(residual)
        for c, piece in enumerate(w_chunks):
            piece_held, piece_arg = bf16(piece)
            chunked.gemv_partial_f32(piece_arg, x_arg, pointer(acc), c * chunk)
        y_held, y_arg = bf16(torch.zeros(2 * rows, dtype=torch.bfloat16))
        chunked.gemv_add_bf16(pointer(acc), res_arg, y_arg, rows, rows)  # the residual's and y's second rows
        (w_held, w_arg), (rows_held, rows_arg) = bf16(w), bf16(torch.zeros(2 * rows, dtype=torch.bfloat16))
        whole.gemv_rows_bf16(w_arg, x_arg, rows_arg, rows)
        xw_held, xw_arg = bf16(torch.cat((x, norm_weight)))
        normed_held, normed_arg = bf16(torch.zeros(K, dtype=torch.bfloat16))
        whole.rmsnorm_bf16(xw_arg, normed_arg, ctypes.c_float(1e-5))
        pairs_held, pairs_arg = bf16(gate_up)
        whole.swiglu_bf16(pairs_arg, K)
        outputs[path] = {"partial sums": acc, "gemv_add": y_held.float(), "gemv_rows": rows_held.float(),
                         "rmsnorm": normed_held.float(), "swiglu": pairs_held.float()[:K]}
    aie, host = outputs["aie"], outputs["host"]
    assert bool(((aie["partial sums"] - host["partial sums"]).abs()
                 <= 2.0 ** -16 * (w.float().abs() @ x.float().abs())).all())
    assert torch.equal(host["gemv_add"][:rows], torch.zeros(rows)) and bool((host["gemv_add"][rows:] != 0).all())
    for name in ("gemv_add", "gemv_rows", "rmsnorm"):
        assert bf16_units(aie[name], host[name]) <= 1, name
    assert within_silu_mul_bound(aie["swiglu"], host["swiglu"], gate_up[0::2], gate_up[1::2])
    # gemv_add's rounding points are elementwise: equal whenever the partial sums are
    same = aie["partial sums"] == host["partial sums"]
    assert torch.equal(aie["gemv_add"][rows:][same], host["gemv_add"][rows:][same])


def test_the_silu_mul_aie_path_computes_what_its_scalar_path_does():
    """silu_mul.cc: within silu_mul.h's documented error (``within_silu_mul_bound``)."""
    generator = torch.Generator().manual_seed(2)
    gate, up = ((torch.randn(256, generator=generator) * 3).to(torch.bfloat16) for _ in range(2))
    defines = {"SILU_MUL_LEN": 256}
    results = {}
    for path, library in (("aie", aie_path_library(host_build.KERNEL_DIR, "silu_mul.cc", defines)),
                          ("host", host_build.load("silu_mul.cc", defines))):
        if path == "aie":
            g, u, out = gate.float(), up.float(), torch.zeros(256)
            library.silu_mul_bf16(pointer(g), pointer(u), pointer(out))
        else:
            out = torch.zeros(256, dtype=torch.bfloat16)
            library.silu_mul_bf16(pointer(gate.view(torch.int16)), pointer(up.view(torch.int16)),
                                  pointer(out.view(torch.int16)))
        results[path] = out.float()
    assert within_silu_mul_bound(results["aie"], results["host"], gate, up)
    assert bool((results["host"] != 0).any())


def test_the_drains_and_remaining_entry_points_compute_what_their_scalar_paths_do():
    """The zeroing calls, gemm.cc's drains (bf16 bit for bit; SwiGLU within ``within_silu_mul_bound``),
    gemm_int8.cc's SwiGLU drain (within the same bound of the gate and up its plain drain gives), and gemv.cc's other
    packed entry points on transposed groups (bit for bit) and gemv_bf16 (within a unit)."""
    from torch_npu2.kernels import quant

    generator = torch.Generator().manual_seed(13)
    tile_m, tile_n = 64, 64
    gemm_defines = {"GEMM_TILE_M": tile_m, "GEMM_TILE_K": 32, "GEMM_TILE_N": tile_n, "GEMM_DRAIN_N": tile_n}
    int_defines = {"GEMM_TILE_M": tile_m, "GEMM_TILE_N": 2 * tile_n, "GEMM_DRAIN_N": tile_n}
    acc = torch.randn(2 * tile_m * tile_n, generator=generator) * 3
    sums = torch.randint(-2 ** 24, 2 ** 24, (2 * 2 * tile_m * tile_n,), generator=generator, dtype=torch.int32)
    row_scale, col_scale = torch.rand(tile_m, generator=generator) * 1e-3, torch.rand(2 * tile_n, generator=generator)
    rows, K = 8, 2048
    gguf = pytest.importorskip("gguf", reason="the gguf package quantizes the test weights as GGUF does")
    raw = gguf.quants.quantize(torch.randn(rows, K, generator=generator).numpy(), gguf.GGMLQuantizationType.Q4_0)
    packed = quant.from_gguf_blocks(quant.Q4_0, torch.from_numpy(raw), K).contiguous()
    w = torch.randn(rows * K, generator=generator).to(torch.bfloat16)
    x = torch.randn(K, generator=generator).to(torch.bfloat16)
    out = {}
    for path in ("aie", "host"):
        widened = path == "aie"

        def build(source, defines):
            return aie_path_library(host_build.KERNEL_DIR, source, defines) if widened else \
                host_build.load(source, defines)

        def bf16(t):
            held = t.float().clone() if widened else t.clone()
            return held, pointer(held if widened else held.view(torch.int16))

        gemm, gemm_int = build("gemm.cc", gemm_defines), build("gemm_int8.cc", int_defines)
        zeroed, zeroed_int = torch.ones(tile_m * tile_n), torch.ones(2 * tile_m * 2 * tile_n, dtype=torch.int32)
        gemm.gemm_zero_f32(pointer(zeroed))
        gemm_int.gemm_int_zero_i32(pointer(zeroed_int))
        rounded_held, rounded_arg = bf16(torch.zeros(tile_m * tile_n, dtype=torch.bfloat16))
        gemm.gemm_f32_to_bf16(pointer(acc), rounded_arg)
        swiglu_held, swiglu_arg = bf16(torch.zeros(tile_m * tile_n, dtype=torch.bfloat16))
        gemm.gemm_f32_swiglu_to_bf16(pointer(acc), pointer(acc[tile_m * tile_n:]), swiglu_arg)
        # gemm_int: the gate chunk is the first tile_n accumulator columns, the up chunk the next
        up_sums = sums[2 * tile_m * tile_n:]
        int_swiglu_held, int_swiglu_arg = bf16(torch.zeros(tile_m * tile_n, dtype=torch.bfloat16))
        gemm_int.gemm_int_swiglu_drain_bf16(pointer(sums), pointer(up_sums), pointer(row_scale), pointer(col_scale),
                                            pointer(col_scale[tile_n:]), int_swiglu_arg)
        gate_held, gate_arg = bf16(torch.zeros(tile_m * tile_n, dtype=torch.bfloat16))
        up_held, up_arg = bf16(torch.zeros(tile_m * tile_n, dtype=torch.bfloat16))
        gemm_int.gemm_int_drain_bf16(pointer(sums), pointer(row_scale), pointer(col_scale), gate_arg)
        gemm_int.gemm_int_drain_bf16(pointer(up_sums), pointer(row_scale), pointer(col_scale[tile_n:]), up_arg)
        gemv_q = build("gemv.cc", {"GEMV_ROWS": rows, "GEMV_K": K, "GEMV_QUANT": quant.GEMV_QUANT["q4_0"]})
        half = build("gemv.cc", {"GEMV_ROWS": rows, "GEMV_K": K // 2, "GEMV_QUANT": quant.GEMV_QUANT["q4_0"]})
        gemv = build("gemv.cc", {"GEMV_ROWS": rows, "GEMV_K": K})
        x_held, x_arg = bf16(x)
        gemv_q.gemv_q_prepare_x(x_arg, K)
        y_held, y_arg = bf16(torch.zeros(rows, dtype=torch.bfloat16))
        gemv_q.gemv_q_bf16(pointer(packed), x_arg, y_arg)
        y_rows_held, y_rows_arg = bf16(torch.zeros(2 * rows, dtype=torch.bfloat16))
        gemv_q.gemv_q_rows_bf16(pointer(packed), x_arg, y_rows_arg, rows)
        partial = torch.zeros(rows)
        chunk_bytes = quant.Q4_0.row_bytes(K // 2)
        pieces = [packed[:, c * chunk_bytes:(c + 1) * chunk_bytes].contiguous() for c in range(2)]
        for c, piece in enumerate(pieces):
            half.gemv_q_partial_f32(pointer(piece), x_arg, pointer(partial), c * K // 2)
        raw_x_held, raw_x_arg = bf16(x)
        w_held, w_arg = bf16(w)
        plain_held, plain_arg = bf16(torch.zeros(rows, dtype=torch.bfloat16))
        gemv.gemv_bf16(w_arg, raw_x_arg, plain_arg)
        out[path] = {"zeroed": zeroed, "zeroed_int": zeroed_int, "rounded": rounded_held.float(),
                     "swiglu": swiglu_held.float(), "int_swiglu": int_swiglu_held.float(), "gate": gate_held.float(),
                     "up": up_held.float(), "gemv_q": y_held.float(), "gemv_q_rows": y_rows_held.float(),
                     "partial": partial, "gemv": plain_held.float()}
    aie, host = out["aie"], out["host"]
    for name in ("zeroed", "zeroed_int", "rounded", "gate", "up", "gemv_q", "gemv_q_rows", "partial"):
        assert torch.equal(aie[name], host[name]), name
    assert not bool(host["zeroed"].any()) and not bool(host["zeroed_int"].any())
    gate = (acc[:tile_m * tile_n]).to(torch.bfloat16)
    assert within_silu_mul_bound(aie["swiglu"], host["swiglu"], gate, acc[tile_m * tile_n:].to(torch.bfloat16))
    assert within_silu_mul_bound(aie["int_swiglu"], host["int_swiglu"], host["gate"], host["up"])
    assert bf16_units(aie["gemv"], host["gemv"]) <= 1


def test_every_entry_point_of_every_kernel_runs_here():
    """Each kernel's entry points (its top-level functions, extern "C") are called by a test of this file, its AIE
    path against its scalar path; bfp16_convert.cc is a host-only harness (it has no AIE path)."""
    import re

    text = Path(__file__).read_text()
    symbols = {source.name: re.findall(r'^(?:extern "C" )?void (\w+)\(', source.read_text(), re.M)
               for source in sorted(host_build.KERNEL_DIR.glob("*.cc")) if source.name != "bfp16_convert.cc"}
    assert len(symbols["attention.cc"]) == 5 and len(symbols["gemv.cc"]) > 10  # the pattern finds them
    missing = [f"{name}: {symbol}" for name, found in symbols.items() for symbol in found if f".{symbol}(" not in text]
    assert not missing, missing
