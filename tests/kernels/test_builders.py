"""Launch-kind builders: hierarchy, external kernels, default tiling on NPU2, and refusals of what cannot fit."""
import re

import pytest
import torch

from torch_npu2.kernels.builders import (BUILDERS, EXTERNAL_KERNELS, KERNEL_OBJECTS, LaunchConstraintError, MemRef,
                                         build_launch)
from torch_npu2.kernels.builders.ir import L1, LaunchBuilder, Window, rows_window
from torch_npu2.kernels.builders.npu2 import L1_AVAILABLE
from torch_npu2.kernels import host_build, int_gemm, quant
from torch_npu2.kernels.compile import KERNEL_SOURCE_DIR
from torch_npu2.kernels.program import Arg, Launch, Program, Role
from torch_npu2.kernels.catalog import o_ffn_program, o_gemv_ffn_program, rms_gemms_rope_program
from torch_npu2.kernels.mlir_text import index_constants

from .air_text import herd_headers, hierarchy

BF16 = "bf16"
KERNEL_OBJECTS_BY_SYMBOL = {s: k.object for k in EXTERNAL_KERNELS for s in k.symbols}


def row(rows, cols):
    return (cols,) if rows == 1 else (rows, cols)


def operand_types(kind, p):
    """The operand types a Program would hand a launch of ``kind`` with params ``p``."""
    bf16 = lambda *shapes: [MemRef(tuple(s), BF16) for s in shapes]  # noqa: E731
    if kind == "rmsnorm":
        return bf16(row(p["rows"], p["cols"]), (p["cols"],), row(p["rows"], p["cols"]))
    if kind == "gemm":
        return bf16((p["M"], p["K"]), (p["N"], p["K"]), (p["M"], p["N"]))
    if kind == "gemm_swiglu":
        return bf16((p["M"], p["K"]), (p["N"], 2 * p["K"]), (p["M"], p["N"]))
    if kind == "gemv":
        return bf16((p["K"],), (p["N"], p["K"]), (p["N"],))
    if kind == "gemv_f32":
        return [*bf16((p["K"],), (p["N"], p["K"])), MemRef((p["N"],), "f32")]
    if kind == "gemv_add":
        return bf16((p["K"],), (p["N"], p["K"]), (p["N"],), (p["N"],))
    if kind == "rms_gemv":  # [w_gate | w_up] rows with gate_up, and SiLU·up of each pair with swiglu
        w = (p["N"] // 2, 2 * p["K"]) if p.get("gate_up") else (p["N"], p["K"])
        return bf16((p["K"],), (p["K"],), w, (p["N"] // 2 if p.get("swiglu") else p["N"],))
    if kind == "rope":
        width = p["heads"] * p["head_dim"]
        return bf16(row(p["rows"], width), row(p["rows"], p["head_dim"]), row(p["rows"], width))
    if kind == "rope_qk":  # the row [q | k], the LUT row, then the rotated Q and K rows
        q, kv = (p["heads"] * p["head_dim"],), (p["kv_heads"] * p["head_dim"],)
        return bf16((q[0] + kv[0],), (p["head_dim"],), q, kv)
    if kind in ("silu_mul", "add"):
        return bf16(*[row(p["rows"], p["cols"])] * 3)
    if kind == "bias_add":
        return bf16(row(p["rows"], p["cols"]), (p["cols"],), row(p["rows"], p["cols"]))
    if kind == "stack":
        return bf16((p["rows"], p["cols"]), (p["rows"], p["cols"]), (2, p["rows"], p["cols"]))
    if kind == "dequant_rows":  # packed rows (int32 words) to bf16 rows
        return [MemRef((p["N"], quant.weight_format(p["weights"]).row_bytes(p["K"]) // 4), "i32"),
                MemRef((p["N"], p["K"]), BF16)]
    words = p.get("K", 0) // int_gemm.CALL_K * int_gemm.CALL_COLS // 2  # a quantized row (K a multiple of 32)
    if kind == "quantize_rows":
        return [MemRef((p["M"], p["K"]), BF16), MemRef((p["M"], words), "i32")]
    if kind in ("gemm_int", "gemm_int_swiglu"):  # the prepared weight cut in tiles of the launch's tile_n
        T = (2 if kind == "gemm_int_swiglu" else 1) * p["tile_n"]
        windows = p["N"] // p["tile_n"] * (p["K"] // int_gemm.CALL_K) if p["N"] % p["tile_n"] == 0 else 1
        return [MemRef((p["M"], words), "i32"),
                MemRef((windows, int_gemm.window_bytes(T) // 4), "i32"), MemRef((p["M"], p["N"]), BF16)]
    if kind == "decode_attention":
        q, kv = (p["heads"] * p["head_dim"],), (p["capacity"], p["kv_heads"] * p["head_dim"])
        return bf16(q, kv, kv, (4,), q)
    q, kv = (p["seq"], p["heads"] * p["head_dim"]), (2, p["seq"], p["kv_heads"] * p["head_dim"])
    return bf16(q, kv, q)


# One representative launch per kind, at Llama-3.2-1B prefill (seq 2048) or decode sizes.
EXAMPLES = {
    "rmsnorm": dict(rows=2048, cols=2048, eps=1e-5),
    "gemm": dict(M=2048, K=2048, N=512),
    "gemm_swiglu": dict(M=2048, K=2048, N=8192),
    "gemv": dict(K=8192, N=2048),
    "gemv_f32": dict(K=2048, N=128256),
    "gemv_add": dict(K=2048, N=2048),
    "rms_gemv": dict(K=2048, N=8192, eps=1e-5),
    "rope": dict(rows=2048, heads=32, head_dim=64),
    "rope_qk": dict(heads=32, kv_heads=8, head_dim=64),
    "silu_mul": dict(rows=1, cols=8192),
    "add": dict(rows=2048, cols=2048),
    "bias_add": dict(rows=2048, cols=896),  # Qwen2.5-0.5B's q projection at 2048 tokens
    "attention": dict(seq=2048, heads=32, kv_heads=8, head_dim=64, causal=True),
    "stack": dict(rows=2048, cols=512, head_dim=64),
    "decode_attention": dict(capacity=2048, heads=32, kv_heads=8, head_dim=64, tile_kv=64),
    # the integer GEMMs' kinds ("w8x2a16"): the down projection's input quantized, the O and gate/up projections
    "quantize_rows": dict(M=2048, K=8192),
    "gemm_int": dict(M=2048, K=2048, N=2048, tile_n=64),
    "gemm_int_swiglu": dict(M=2048, K=2048, N=8192, tile_n=32),
    # a [gate | up] weight's Q4_1 rows (each half packed on its own: 2·F rows) to the bf16 rows prefill's GEMMs read
    "dequant_rows": dict(K=2048, N=16384, weights="q4_1"),
}


# o_gemv_ffn's gate/up launch (its SiLU·up joined in) and its down projection, at Llama-3.2-1B's sizes
SWIGLU = dict(N=16384, gate_up=1, swiglu=1)
DOWN = dict(K=8192, N=2048)


def build(kind, tuning=None, **overrides):
    params = {**EXAMPLES[kind], **overrides}
    return BUILDERS[kind](params, operand_types(kind, params), tuning)


def test_every_launch_kind_has_a_builder_and_an_example():
    assert set(BUILDERS) == set(EXAMPLES)


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_hierarchy_nests_launch_segment_herd(kind):
    ops = hierarchy(build(kind).text)
    depth = {"launch": 0, "segment": 1, "herd": 2}
    for op in ops:
        assert op.depth >= depth[op.op], f"{kind}: air.{op.op} @{op.name} at depth {op.depth}"
    for launch in (op for op in ops if op.op == "launch"):
        inner = hierarchy(launch.body)
        assert inner and inner[0].op == "segment" and all(op.op == "herd" for op in inner[1:]), kind
    assert {"launch", "segment", "herd"} <= {op.op for op in ops}


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_herds_fit_the_array_and_link_the_objects_they_call(kind):
    ir = build(kind)
    for name, (columns, rows), link in herd_headers(ir.text):
        assert columns <= 8 and rows <= 4, (name, columns, rows)
    called_objects = {KERNEL_OBJECTS_BY_SYMBOL[d.symbol] for d in ir.externs}
    linked = {link for _, _, link in herd_headers(ir.text) if link}
    assert linked == called_objects
    for decl in ir.externs:
        assert decl.object == KERNEL_OBJECTS_BY_SYMBOL[decl.symbol]
        assert re.search(rf"func\.call @{decl.symbol}\(", ir.text)


def test_external_kernel_contract_names_and_objects():
    assert set(KERNEL_OBJECTS) == {"rope.o", "silu_mul.o", "gemv.o", "attention.o", "gemm.o", "decode_attention.o",
                                   "quantize_rows.o", "gemm_int8.o"}
    assert {d.symbol for d in build("decode_attention").externs} == set(KERNEL_OBJECTS["decode_attention.o"].symbols)
    assert {"rope_half_split_bf16", "silu_mul_bf16", "gemv_bf16"} <= set(KERNEL_OBJECTS_BY_SYMBOL)
    assert [d.symbol for d in build("rope").externs] == ["rope_half_split_bf16"]
    assert [d.symbol for d in build("silu_mul").externs] == ["silu_mul_bf16"]
    assert [d.symbol for d in build("gemv").externs] == ["gemv_bf16"]
    assert [d.symbol for d in build("gemv_f32").externs] == ["gemv_bf16_f32"]  # f32 logits
    assert {d.symbol for d in build("attention").externs} == set(KERNEL_OBJECTS["attention.o"].symbols)
    assert [d.symbol for d in build("gemm").externs] == ["gemm_zero_f32", "gemm_bf16_f32_wnk", "gemm_f32_to_bf16"]
    assert [d.symbol for d in build("gemm_swiglu").externs] == ["gemm_zero_f32", "gemm_bf16_f32_wnk",
                                                                "gemm_f32_swiglu_to_bf16"]
    assert not any(build(kind).externs for kind in ("rmsnorm", "add", "bias_add", "stack"))
    assert [d.symbol for d in build("gemv_add").externs] == ["gemv_partial_f32", "gemv_add_bf16"]
    assert [d.symbol for d in build("rms_gemv").externs] == ["rmsnorm_bf16", "gemv_rows_bf16"]
    assert [d.symbol for d in build("rms_gemv", **SWIGLU).externs] == ["rmsnorm_bf16", "gemv_rows_bf16",
                                                                        "swiglu_bf16"]
    assert [d.symbol for d in build("quantize_rows").externs] == ["quantize_rows_prepare", "quantize_rows_chunk"]
    assert [d.symbol for d in build("dequant_rows").externs] == ["gemv_q_dequant_bf16"]
    assert [d.symbol for d in build("gemm_int").externs] == ["gemm_int_zero_i32", "gemm_int_w8x2",
                                                             "gemm_int_drain_bf16"]
    assert [d.symbol for d in build("gemm_int_swiglu").externs] == ["gemm_int_zero_i32", "gemm_int_w8x2",
                                                                    "gemm_int_swiglu_drain_bf16"]


def test_calls_state_the_kernel_configuration_they_were_tiled_for():
    assert dict(build("rope").externs[0].defines) == {"ROPE_ROWS": 2, "ROPE_HEADS": 32, "ROPE_HEAD_DIM": 64}
    # rope_qk rotates a token's Q and K heads in one call
    assert dict(build("rope_qk").externs[0].defines) == {"ROPE_ROWS": 1, "ROPE_HEADS": 40, "ROPE_HEAD_DIM": 64}
    assert dict(build("silu_mul").externs[0].defines) == {"SILU_MUL_LEN": 1024}
    assert dict(build("gemv").externs[0].defines) == {"GEMV_ROWS": 1, "GEMV_K": 8192}
    # (tile_kv 32: the largest whose K/V block fits L1 twice, for the kv loop's ping-pong)
    assert {d.defines for d in build("attention").externs} == {
        (("ATTN_HEAD_DIM", 64), ("ATTN_TK", 32), ("ATTN_TQ", 32))}
    assert {d.defines for d in build("gemm").externs} == {
        (("GEMM_DRAIN_N", 16), ("GEMM_TILE_K", 32), ("GEMM_TILE_M", 64), ("GEMM_TILE_N", 128))}
    # the buffers handed to the kernel are exactly the configured tile
    assert "func.call @rope_half_split_bf16(%x_l1, %lut_l1, %out_l1) : (memref<4096xbf16, 2 : i32>, " \
           "memref<128xbf16, 2 : i32>, memref<4096xbf16, 2 : i32>)" in build("rope").text


@pytest.mark.parametrize("kernel,symbol", [(k, s) for k in EXTERNAL_KERNELS for s in k.symbols],
                         ids=lambda v: getattr(v, "object", v))
def test_contract_matches_the_cpp_sources(kernel, symbol):
    source = (KERNEL_SOURCE_DIR / kernel.source).read_text()
    assert re.search(rf'(extern "C"[^;{{]*|^)void {symbol}\(', source, flags=re.M), f"{symbol} in {kernel.source}"
    headers = "".join((KERNEL_SOURCE_DIR / name).read_text() for name in re.findall(r'#include "([^"]+)"', source))
    for macro in kernel.config_macros:  # defaulted in the source or a header of ours it includes
        assert f"#ifndef {macro}" in source + headers, f"{macro} in {kernel.source}"


def test_gemm_defaults_use_the_full_array_and_stage_through_l2():
    ir = build("gemm")
    assert {sizes for _, sizes, _ in herd_headers(ir.text)} == {(8, 4)}
    # zero, accumulate and drain are one physical herd: the accumulator stays in its L1
    assert len({name for name, _, _ in herd_headers(ir.text)}) == 1 and len(herd_headers(ir.text)) == 3
    assert {link for _, _, link in herd_headers(ir.text)} == {"gemm.o"}
    # upstream's drain-method tiles twice as tall, the slab rounded 16 columns at a time to fit L1
    assert "tiles m64 n128 k32 (L1) k256 (L2), drained by n16" in ir.text
    assert "memref<8x1x64x256xbf16, 1 : i32>" in ir.text  # A slice staged in memtiles, one slab per herd column
    # accumulators in the kernel's [n/8][m/8][8][8] blocks, n/8 split into 8 drain chunks of 2
    assert "memref<8x4x8x2x8x8x8xf32, 2 : i32>" in ir.text
    assert "linalg." not in ir.text  # all compute is in the kernel
    accumulate = re.search(r"func\.call @gemm_bf16_f32_wnk\((%\w+), (%\w+), (%\w+)\) : \(([^)]*)\)", ir.text)
    assert accumulate.group(4).startswith("memref<4x8x8x8xbf16, 2 : i32>, memref<4x16x8x8xbf16, 2 : i32>, "
                                          "memref<8x2x8x8x8xf32, strided<")
    drain = re.search(r"func\.call @gemm_f32_to_bf16\((%\w+), (%\w+)\) : \(([^)]*)\)", ir.text)
    assert drain.group(3).startswith("memref<2x8x8x8xf32, strided<") and drain.group(3).endswith(
        "memref<2x8x8x8xbf16, 2 : i32>")  # one chunk in, one chunk out


def test_gemm_precision_selects_the_kernel_build():
    bf16 = build("gemm", precision="bf16")
    bfp16 = build("gemm", precision="bfp16")
    assert bf16.text.replace("bf16 multiplies", "bfp16 multiplies", 1) == bfp16.text  # the same schedule and windows
    assert bf16.externs == build("gemm").externs  # bf16 is the default
    assert {dict(d.defines).get("AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16") for d in bfp16.externs} == {1}
    assert not any("AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16" in dict(d.defines) for d in bf16.externs)
    with pytest.raises(LaunchConstraintError, match=r"gemm launch: precision='fp8': must be one of bf16, bfp16"):
        build("gemm", precision="fp8")


def gather(flat, window, index_values):
    """The elements a DMA window reads from a flat buffer, in transfer order; SSA offsets resolved by the prefix of
    their name (``index_values``: prefix -> value)."""
    if not window.sizes:
        return flat.clone()
    offsets = [o if isinstance(o, int) else next(v for k, v in index_values.items() if o.startswith(k))
               for o in window.offsets]
    index = torch.tensor(sum(o * s for o, s in zip(offsets, window.strides)))
    for size, stride in zip(window.sizes, window.strides):
        index = (index.unsqueeze(-1) + torch.arange(size) * stride)
    return flat[index.flatten()]


def scatter(flat, window, index_values, values):
    positions = gather(torch.arange(flat.numel()), window, index_values)
    flat[positions] = values


def test_gemm_dmas_cut_and_restore_the_kernels_blocked_layouts():
    """The builder's own windows, applied to numbered operands, give each tile exactly the L1 buffers gemm.cc reads
    (host_build pre-tiles the way the kernel expects) and put the kernel's output blocks back in C's rows."""
    M, K, N = 64, 128, 64
    ir = build("gemm", M=M, K=K, N=N, tuning={"drain_n": 8})
    assert "herd 4x4, tiles m16 n16 k32 (L1) k128 (L2), drained by n8, 1x1 launch steps" in ir.text
    tile_m, tile_n, tile_k = 16, 16, 32
    a_to_l2, w_to_l2, a_to_l1, w_to_l1, c_to_l2, c_to_l3 = ir.dmas
    a, w = torch.arange(M * K).reshape(M, K), -torch.arange(N * K).reshape(N, K)
    step0 = {"%row0": 0, "%col0": 0, "%k2": 0}
    a_l2, w_l2 = gather(a.flatten(), a_to_l2.src, step0), gather(w.flatten(), w_to_l2.src, step0)
    a_tiles, w_tiles = host_build._gemm_l1_tiles(a, tile_m, tile_k), host_build._gemm_l1_tiles(w, tile_n, tile_k)
    for herd_index in range(4):
        for k_step in range(K // tile_k):
            at = {"%hx": herd_index, "%hy": herd_index, "%k1": k_step * tile_k}
            assert torch.equal(gather(a_l2, a_to_l1.src, at), a_tiles[herd_index, k_step].flatten())
            assert torch.equal(gather(w_l2, w_to_l1.src, at), w_tiles[herd_index, k_step].flatten())
    # a plain row-major window would not do: the blocks really are rearranged
    assert not torch.equal(a_tiles[0, 0].flatten(), a[:tile_m, :tile_k].flatten())

    c = torch.randn(M, N)
    c_l2, c_out = torch.zeros(M * N), torch.zeros(M * N)
    for tx in range(4):
        for ty in range(4):
            tile = c[tx * tile_m:(tx + 1) * tile_m, ty * tile_n:(ty + 1) * tile_n]
            kernel_layout = tile.reshape(tile_m // 8, 8, tile_n // 8, 8).permute(2, 0, 1, 3)
            for chunk in range(tile_n // 8):  # drained 8 columns (one [m/8][8][8] block row) at a time
                at = {"%hx": tx, "%hy": ty, "%n0": chunk * 8}
                scatter(c_l2, c_to_l2.dst, at, gather(kernel_layout[chunk].flatten(), c_to_l2.src, at))
    scatter(c_out, c_to_l3.dst, step0, c_l2)
    assert torch.equal(c_out.reshape(M, N), c)


def test_gemm_l2_budget_counts_the_pieces_a_memtile_receives():
    """Multi-column herds split their L2 slices over their columns' memtiles (upstream's 256-deep K slices then fit);
    a one-column herd keeps everything in one memtile and takes shallower slices."""
    assert "herd 8x4, tiles m64 n128 k32 (L1) k256 (L2)" in build("gemm", M=2048, K=8192, N=8192).text
    assert "herd 1x4, tiles m16 n128 k32 (L1) k128 (L2)" in build("gemm", M=16, K=2048, N=8192).text


def test_small_prefill_bucket_shrinks_the_gemm_herd():
    ir = build("gemm", M=16, K=576, N=192)
    assert {sizes for _, sizes, _ in herd_headers(ir.text)} == {(1, 4)}
    assert "tiles m16 n48 k32 (L1)" in ir.text


def test_row_parallel_kinds_spread_over_eight_columns():
    for kind in ("rmsnorm", "rope", "add"):
        assert {sizes for _, sizes, _ in herd_headers(build(kind).text)} == {(8, 1)}, kind


def test_decode_row_splits_into_chunks_across_tiles():
    """A 576-wide row: chunks of whole 64-byte L1 runs (32 elements), so the widest herd taking equal counts of
    them is 2 tiles of one 288-element chunk (144-element chunks on 4 tiles would be 288-byte buffers)."""
    ir = build("add", rows=1, cols=1024)
    assert {sizes for _, sizes, _ in herd_headers(ir.text)} == {(8, 1)}
    assert "memref<128xbf16, 2 : i32>" in ir.text
    ir = build("add", rows=1, cols=576)
    assert {sizes for _, sizes, _ in herd_headers(ir.text)} == {(2, 1)}
    assert "memref<288xbf16, 2 : i32>" in ir.text


def test_every_l1_buffer_is_whole_vector_alignment_runs():
    """The builders' guard: an L1 buffer that is not whole 64-byte runs would leave aiecc's next buffer where a
    512-bit load from its start reads from below it, so allocating one is refused; a row of 48 elements has no
    chunk of whole runs."""
    b = LaunchBuilder("add", (), ())
    with pytest.raises(LaunchConstraintError, match=r"add launch: y_l1=32: an L1 buffer is whole 64-byte runs"):
        b.alloc(MemRef((16,), "bf16", L1), "y_l1")
    assert b.alloc(MemRef((32,), "bf16", L1), "y_l1").type == MemRef((32,), "bf16", L1)
    with pytest.raises(LaunchConstraintError, match=r"cols=48: must be a multiple of 32"):
        build("add", rows=1, cols=48)


def _panel_loop(text):
    """The segment's panel loop: the lines of the ``scf.for`` that encloses the herd."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*scf\.for %panel ", line))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next(i for i in range(start + 1, len(lines)) if lines[i] == " " * indent + "}")
    return "\n".join(lines[start:end + 1])


def test_lm_head_gemv_streams_panels_inside_one_launch_step():
    """Llama-3.2-1B's 128256 rows (2^8 * 3 * 167) in one launch step: each tile owns 16032 rows and
    walks them in 334 panels of 48 (384 consecutive rows per panel), the DDR → memtile panel DMA, the herd and the results' DMA in one segment
    loop (so AIR double-buffers the memtile buffers), x staged in the memtile once before the loop."""
    ir = build("gemv_f32")
    assert [op.name for op in hierarchy(ir.text) if op.op == "launch"] == ["gemv_f32"]
    assert "herd 8x1, 1 launch step(s), 16032 rows per tile per step in 334 panels of 48, 4 rows per call" in ir.text
    loop = _panel_loop(ir.text)
    assert "to %c334 step" in loop.splitlines()[0] and "air.herd @gemv_f32_herd" in loop
    w_dma, y_dma = ir.dmas[1], ir.dmas[-1]
    assert w_dma.src.sizes == (8, 48, 2048) and w_dma.src.strides == (48 * 2048, 2048, 1)  # consecutive rows
    assert y_dma.dst.sizes == (8, 48) and y_dma.dst.strides == (48, 1)
    assert "affine_map<()[s0, s1] -> (s0 * 128256 + s1 * 384)>" in loop
    assert ir.dmas[0].src == Window() and ir.dmas[0].dst == Window()  # x → memtile, whole, before the loop
    assert "air.dma_memcpy_nd (%x_l2" not in loop
    assert "memref<48xf32, 2 : i32>" in ir.text  # only tile-sized f32 buffers in L1


def test_gemv_panel_rows_fit_a_memtile_twice():
    """Ping-pong keeps two copies of a tile's panel in its memtile (three for an odd panel count): 48 rows of 2048
    bf16 fit twice, 64 do not, 96 in 167 panels not three times."""
    from torch_npu2.kernels.builders import gemv

    assert sum(gemv._l2_bytes(2048, 48, 334, "f32").values()) <= 512 * 1024
    assert sum(gemv._l2_bytes(2048, 64, 250, "f32").values()) > 512 * 1024
    with pytest.raises(LaunchConstraintError, match=r"gemv_f32 launch: L2 bytes=\d+: exceeds .*x3 \(ping-pong\)"):
        build("gemv_f32", tuning={"tile_n": 96})


def test_gemv_panels_leave_a_steady_state_to_overlap():
    """At least 16 panels per tile where the rows allow (the first panel's DMA is not overlapped), else the
    most there are; the largest panel otherwise."""
    assert "256 rows per tile per step in 16 panels of 16" in build("gemv", K=2048).text
    assert "24 rows per tile per step in 12 panels of 2" in build("gemv", K=576, N=192).text
    assert "16032 rows per tile per step in 334 panels of 48" in build("gemv_f32").text


def test_fused_gemv_takes_launch_steps_beyond_32_panels():
    """The fused kinds read their packed vector from DDR every panel; aiecc rejects that at 64 panels, so a
    plan with more takes launch steps instead."""
    ir = build("rms_gemv", tuning={"tile_n": 4}, K=576, N=2048)
    assert "herd 8x1, 2 launch step(s), 128 rows per tile per step in 32 panels of 4" in ir.text


def test_gemv_steps_tuning_splits_the_rows_over_launch_steps():
    ir = build("gemv", tuning={"steps": 4})
    assert "herd 8x1, 4 launch step(s), 64 rows per tile per step in" in ir.text
    assert "affine_map<()[s0, s1] -> (s0 * 512 + s1 * " in ir.text  # a step's first row: 8 tiles x 64 rows


def test_decode_ffn_launches_plan_llama_sizes():
    """Llama-3.2-1B's decode FFN, one launch step each: whole-K row groups up to K=2048, the K=8192 down
    projection in chunks of all the panel's rows (one loop with a DMA: this AIR cannot ping-pong a DMA in a
    nested loop)."""
    assert ("herd 8x1, 1 launch step(s), 256 rows per tile per step in 16 panels of 16, 4 rows per call, K in "
            "chunks of 2048") in build("gemv_add").text
    assert "herd 8x1, 1 launch step(s), 1024 rows per tile per step in 32 panels of 32, 4 rows per call" in \
        build("rms_gemv").text
    down = build("gemv_add", **DOWN).text
    assert ("herd 8x1, 1 launch step(s), 256 rows per tile per step in 32 panels of 8, 8 rows per call, K in chunks "
            "of 512") in down
    assert "memref<8x512xbf16, 2 : i32>" in down  # a chunk of all 8 rows per call
    assert "memref<8256xbf16, 2 : i32>" in down  # the activation and the panel's 64 residual rows: one L1 vector
    assert dict(build("gemv_add", **DOWN).externs[0].defines) == {"GEMV_ROWS": 8, "GEMV_K": 512}
    for params in ({}, DOWN):  # per-panel residual rows: every DDR → memtile DMA in the loop
        ir = build("gemv_add", **params)
        loop = _panel_loop(ir.text)
        assert loop.count("air.dma_memcpy_nd (%vector_l2") + loop.count("air.dma_memcpy_nd (%w_l2") == \
            sum(1 for line in ir.text.splitlines() if re.match(r"\s*air\.dma_memcpy_nd \(%(vector|w)_l2", line)), params
    for params in ({}, SWIGLU):  # x and the norm weight once, before the loop; only the weight panels stream
        ir = build("rms_gemv", **params)
        loop = _panel_loop(ir.text)
        assert loop.count("air.dma_memcpy_nd (%vector_l2") == 0 and loop.count("air.dma_memcpy_nd (%w_l2") == 1
        assert ir.text.count("air.dma_memcpy_nd (%vector_l2") == 2


def test_decode_ffn_herds_take_two_streams_per_tile():
    """A compute tile has two S2MM channels: the weight rows and one packed vector, never a third stream."""
    for kind, params in (("gemv_add", {}), ("gemv_add", DOWN), ("rms_gemv", {}), ("rms_gemv", SWIGLU)):
        herd = next(op for op in hierarchy(build(kind, **params).text) if op.op == "herd")
        into_l1 = re.findall(r"air\.dma_memcpy_nd \((%[\w$.]+)\[", herd.body)
        l1_buffers = set(re.findall(r"(%[\w$.]+) = memref\.alloc\(\) : memref<[^>]*, 2 : i32>", herd.body))
        assert len({dst for dst in into_l1 if dst in l1_buffers}) == 2, kind


def test_tuning_overrides_reach_the_ir():
    ir = build("gemm", tuning={"herd_m": 4, "tile_m": 16})
    assert {sizes for _, sizes, _ in herd_headers(ir.text)} == {(4, 4)}
    assert "memref<4x4x1x16x2x8x8xf32, 2 : i32>" in ir.text  # drained whole: it fits


def test_builders_are_deterministic():
    for kind in EXAMPLES:
        assert build(kind).text == build(kind).text


@pytest.mark.parametrize("kind,overrides,tuning,message", [
    ("rmsnorm", dict(rows=16, cols=570), None, r"rmsnorm launch: cols=570: must be a multiple of 16"),
    ("rmsnorm", dict(rows=16, cols=2048), {"herd": 3}, r"rmsnorm launch: herd=3: must divide rows=16"),
    ("rmsnorm", dict(rows=1, cols=16384), None, r"rmsnorm launch: L1 bytes=\d+: exceeds 61440 B"),
    ("gemm", dict(M=24, K=64, N=64), None, r"gemm launch: M=24: must be a multiple of 16"),
    ("gemm", dict(w_cols=4096, w_col0=2049), None, r"gemm launch: w_col0=2049: must leave K=2048 columns of w_cols=4096"),
    ("rms_gemv", dict(N=8191, gate_up=1), None, r"rms_gemv launch: N=8191: must be even for a \[w_gate \| w_up\]"),
    ("gemm", dict(M=32, K=60, N=64), None, r"gemm launch: K=60: must be a multiple of 8"),
    ("gemm", {}, {"tile_m": 8}, r"gemm launch: tile_m=8: .*be a multiple of 16"),
    ("gemm", {}, {"tile_n": 40}, r"gemm launch: tile_n=40: must divide N/herd_n=128"),
    ("gemm", {}, {"herd_n": 8}, r"gemm launch: herd_n=8: the herd spans at most 4 rows"),
    ("gemm", {}, {"herd_m": 16}, r"gemm launch: herd_m=16: the herd spans at most 8 columns"),
    ("gemm", dict(M=1024), {"herd_m": 4, "tile_m": 64, "tile_k_l1": 32, "drain_n": 128},
     r"gemm launch: L1 bytes=\d+: exceeds .*bf16 drain chunk x1 16384 B.*lower tile_m, tile_n, tile_k_l1 or drain_n"),
    ("gemm", {}, {"drain_n": 12}, r"gemm launch: drain_n=12: must divide tile_n=128 and be a multiple of 8"),
    ("gemm", {}, {"tile_k_l2": 1024}, r"gemm launch: L2 bytes=\d+: exceeds 524288 B of one memtile .*"
                                       r"W slice x2, 1 of 4 pieces 524288 B"),
    # a herd on one column keeps its whole slices in one memtile
    ("gemm", dict(M=16, N=2048), {"tile_k_l2": 512}, r"gemm launch: L2 bytes=\d+: exceeds .*4 of 4 pieces"),
    ("gemm", {}, {"tile_k_l2": 96}, r"gemm launch: tile_k_l2=96: must divide K=2048"),
    ("gemv", {}, {"rows_per_call": 4}, r"gemv launch: L1 bytes=\d+: exceeds"),
    ("gemv", {}, {"tile_n": 32}, r"gemv launch: L2 bytes=\d+: exceeds"),
    ("gemv", {}, {"tile_n": 48}, r"gemv launch: tile_n=48: must divide the 256 rows a tile owns per step"),
    ("gemv", {}, {"steps": 3}, r"gemv launch: steps=3: must divide N/herd=256"),
    ("gemv", {}, {"herd": 3}, r"gemv launch: herd=3: must divide N=2048"),
    ("gemv_f32", dict(K=2040), None, r"gemv_f32 launch: K=2040: must be a multiple of 32"),
    ("gemv_add", dict(K=8192), {"k_chunk": 2048}, r"gemv_add launch: k_chunk=2048: a split chunk spans at most"),
    ("gemv_add", DOWN, {"k_chunk": 512, "tile_n": 32}, r"gemv_add launch: L1 bytes=\d+: exceeds"),
    ("gemv_add", DOWN, {"k_chunk": 1024},
     r"gemv_add launch: k_chunk=1024: a split chunk spans at most 512 elements \(one DMA dimension\)"),
    ("gemv_add", DOWN, {"rows_per_call": 4, "tile_n": 8}, r"rows_per_call=4: .*must equal tile_n"),
    ("rms_gemv", dict(swiglu=1), None, r"rms_gemv launch: swiglu=1: needs gate_up"),
    ("rms_gemv", SWIGLU, {"tile_n": 16}, r"rms_gemv launch: tile_n=16: must be a multiple of 32 \(whole gate/up pairs"),
    ("rms_gemv", dict(K=8192), None, r"rms_gemv launch: L1 bytes=\d+: exceeds"),
    ("rms_gemv", {}, {"herd": 3}, r"rms_gemv launch: herd=3: must divide N=8192"),
    ("rms_gemv", dict(K=576, N=2048), {"tile_n": 4, "steps": 1},
     r"rms_gemv launch: steps=1: a tile walks its 256 rows per step in 64 panels of 4, more than 32"),
    ("rope", dict(rows=16, heads=2, head_dim=48), None, r"rope launch: head_dim=48: must be a multiple of 32"),
    ("rope", {}, {"tile_rows": 3}, r"rope launch: tile_rows=3: must divide the 256 rows"),
    ("rope_qk", dict(head_dim=48), None, r"rope_qk launch: head_dim=48: must be a multiple of 32"),
    ("rope_qk", dict(heads=512), None, r"rope_qk launch: L1 bytes=\d+: exceeds"),
    ("rope", {}, {"tile_rows": 8}, r"rope launch: L1 bytes=\d+: exceeds"),
    ("silu_mul", {}, {"chunk": 100}, r"silu_mul launch: chunk=100: must be a multiple of 32"),
    ("add", dict(rows=3, cols=32), {"herd": 8}, r"add launch: herd=8: must divide rows=3"),
    ("add", dict(rows=1, cols=96), {"herd": 2}, r"add launch: herd=2: must divide the chunk count of a 96-wide row"),
    ("attention", {}, {"tile_q": 64, "tile_kv": 64}, r"attention launch: L1 bytes=\d+: exceeds"),
    ("attention", {}, {"tile_kv": 24}, r"attention launch: tile_kv=24: must divide seq=2048"),
    ("attention", dict(causal=False), None, r"attention launch: causal=False: .*only causal=True"),
    ("attention", {}, {"herd_heads": 3}, r"attention launch: herd_heads=3: must divide the group of 4"),
    ("attention", {}, {"q_rows": 2}, r"attention launch: q_rows=2: parts of the sequence on the rows need "
                                     r"herd_heads=1"),
    ("attention", dict(heads=7, kv_heads=1, seq=4096), {"herd_q": 1, "q_rows": 4},
     r"attention launch: L2 bytes=1048576: exceeds 524288 B of one memtile .*raise herd_q or lower herd_heads"),
    ("gemm", {}, {"tile_x": 8}, r"gemm launch: tile_x=8: unknown tuning parameter"),
    ("stack", dict(head_dim=48), None, r"stack launch: head_dim=48: must be a multiple of 16 dividing cols=512"),
    ("stack", {}, {"herd": 3}, r"stack launch: herd=3: must divide the 8 heads"),
    ("stack", dict(cols=128), {"herd": 3}, r"stack launch: herd=3: must divide the 32 blocks of 64 rows"),
    ("stack", {}, {"block": 12}, r"stack launch: block=12: must be a multiple of 8 dividing rows=2048"),
    ("stack", dict(rows=7), None, r"stack launch: rows=7: must be a multiple of 8"),
    ("quantize_rows", dict(M=16, K=96), None, r"quantize_rows launch: K=96: must be a multiple of 64"),
    ("quantize_rows", {}, {"herd": 3}, r"quantize_rows launch: herd=3: must divide M=2048"),
    ("quantize_rows", {}, {"herd": 16}, r"quantize_rows launch: herd=16: a row-parallel herd spans at most 8"),
    ("quantize_rows", {}, {"chunk": 96}, r"quantize_rows launch: chunk=96: must be a multiple of 64 dividing K=8192"),
    ("quantize_rows", dict(K=32768), None, r"quantize_rows launch: L1 bytes=\d+: exceeds .*x row 65536 B"),
    ("gemm_int", dict(K=2000), None, r"gemm_int launch: K=2000: must be a multiple of 32"),
    ("gemm_int", dict(M=40), None, r"gemm_int launch: M=40: must be a multiple of 16"),
    ("gemm_int", dict(tile_n=24), None, r"gemm_int launch: tile_n=24: must be a multiple of 16"),
    ("gemm_int", dict(tile_n=48), None, r"gemm_int launch: tile_n=48: must divide N=2048"),
    ("gemm_int", {}, {"herd_n": 3}, r"gemm_int launch: herd_n=3: must divide the 32 column tiles of 64"),
    ("gemm_int", {}, {"herd_m": 16}, r"gemm_int launch: herd_m=16: the herd spans at most 8 columns"),
    ("gemm_int", {}, {"tile_m": 24}, r"gemm_int launch: tile_m=24: must divide M/herd_m=256 and be a multiple of 16"),
    ("gemm_int", {}, {"tile_m": 128}, r"gemm_int launch: L1 bytes=\d+: exceeds .*int32 accumulators \(hi, lo\) "
                                      r"65536 B"),
    ("gemm_int", {}, {"tile_k_l2": 96}, r"gemm_int launch: tile_k_l2=96: must divide K=2048"),
    ("gemm_int", {}, {"tile_k_l2": 2048}, r"gemm_int launch: L2 bytes=\d+: exceeds 524288 B of one memtile"),
    ("gemm_int", {}, {"tile_n": 32}, r"gemm_int launch: tile_n=32: unknown tuning parameter"),
    ("gemm_int_swiglu", {}, {"drain_n": 12}, r"gemm_int_swiglu launch: drain_n=12: must divide tile_n=32"),
])
def test_constraint_violations_raise(kind, overrides, tuning, message):
    with pytest.raises(LaunchConstraintError, match=message) as info:
        build(kind, tuning=tuning, **overrides)
    assert isinstance(info.value, ValueError)


def test_integer_gemm_windows_cut_the_kernels_layouts():
    """gemm_int's DMAs: per column tile one contiguous run of prepared-weight windows (DDR → memtile) and one window a
    call (memtile → L1); per call the A window [9 kb][tile_m m][2 words] read out of the rows' runs of the memtile
    slice (kb strides 2 words, m a row); the drain's un-tiling is gemm.py's."""
    ir = build("gemm_int")  # herd 8x4, m64 n64, tile_k_l2 256: 8 calls a slice
    slice_words = 8 * int_gemm.CALL_COLS // 2
    window_words = int_gemm.window_bytes(64) // 4
    calls = 2048 // int_gemm.CALL_K
    sizes = [(d.dst.sizes, d.dst.strides, d.src.sizes, d.src.strides) for d in ir.dmas]
    row_words = calls * int_gemm.CALL_COLS // 2
    # the block's rows, a slice: per herd row its 64 rows (the memtile buffer's rank, which AIR splits by herd rows)
    assert ((), (), (8, 1, 64, slice_words), (64 * row_words, 64 * row_words, row_words, 1)) in sizes
    assert ((), (), (4, 8, window_words), (calls * window_words, window_words, 1)) in sizes  # 4 column tiles' windows
    assert ((), (), (1, 9, 64, 2), (64 * slice_words, 2, slice_words, 1)) in sizes  # a call's A window
    assert ((), (), (1, 1, window_words), (8 * window_words, window_words, 1)) in sizes  # a call's W window
    text = ir.text
    assert "memref<8x4x1x8192xi32, 2 : i32>" in text  # per tile: [T/8][2 terms][64 rows x 8], one drain chunk
    assert "memref<8x4x64xf32, 2 : i32>" in text and "memref<8x4x1x64xf32, 2 : i32>" in text  # row, column scales


def test_integer_kinds_plan_llama_sizes():
    """Their L1 per tile at Llama-3.2-1B's 2048 rows, AIR's ping-pong copies counted (the lowering tests hold each
    plan to what aiecc places): gemm_int and gemm_int_swiglu fill a tile with 32 KiB of accumulators, doubled A and W
    windows and one drain chunk; quantize_rows keeps an 8192-value row once and streams its runs out in chunks."""
    plans = {kind: dict(build(kind).l1_buffers) for kind in ("quantize_rows", "gemm_int", "gemm_int_swiglu")}
    assert plans["gemm_int"] == {"int32 accumulators (hi, lo)": 32768, "A window x2 (ping-pong)": 9216,
                                 "W window x2": 9216, "row scales": 256, "column scales": 256,
                                 "bf16 drain chunk x1": 8192}
    assert plans["gemm_int_swiglu"] == {"int32 accumulators (hi, lo)": 32768, "A window x2 (ping-pong)": 9216,
                                        "W window x2": 9216, "row scales": 256, "column scales": 256,
                                        "bf16 drain chunk x1": 4096}
    assert plans["quantize_rows"] == {"x row": 16384, "state": 64, "q chunk x2 (ping-pong)": 9216,
                                      "the row loop's q chunk x2": 9216}
    assert all(sum(plan.values()) <= L1_AVAILABLE for plan in plans.values())


def test_operand_shapes_must_match_params():
    transposed_w = operand_types("gemm", EXAMPLES["gemm"])
    transposed_w[1] = MemRef((2048, 512), BF16)
    with pytest.raises(ValueError, match=r"gemm launch: W='memref<2048x512xbf16>': must be memref<512x2048xbf16>"):
        BUILDERS["gemm"](EXAMPLES["gemm"], transposed_w)
    with pytest.raises(ValueError, match=r"add launch: operands=2: expects 3 operands"):
        BUILDERS["add"](EXAMPLES["add"], operand_types("add", EXAMPLES["add"])[:2])
    with pytest.raises(ValueError, match=r"rmsnorm launch: x=.*must be memref<2048x2048xbf16>"):
        BUILDERS["rmsnorm"](EXAMPLES["rmsnorm"], operand_types("rmsnorm", dict(rows=2048, cols=1024)))


def test_build_launch_maps_program_args_to_operands_and_rejects_unknown_kinds():
    program = rms_gemms_rope_program(576, 9, 3, 64, 1e-5, 64)
    ir = build_launch(program, program.launches[4])
    assert [str(v.type) for v in ir.operands] == ["memref<64x576xbf16>", "memref<64x64xbf16>", "memref<64x576xbf16>"]
    args = (Arg("a", (4,), "bf16", Role.INPUT), Arg("o", (4,), "bf16", Role.OUTPUT))
    odd = Program("odd", args, (Launch("conv", (), ("a",), ("o",)),))
    with pytest.raises(ValueError, match="no MLIR builder for launch kind 'conv'"):
        build_launch(odd, odd.launches[0])


@pytest.mark.parametrize("program", [o_ffn_program(2048, 2048, 8192, 1e-5, 2048),
                                     o_gemv_ffn_program(2048, 2048, 8192, 1e-5)],
                         ids=["o_ffn-llama-2048", "o_gemv_ffn-llama"])
def test_default_plans_fit_l1_single_buffered_by_construction(program):
    """Independent of the builders' own bookkeeping: the herd-local L1 allocations of each herd fit."""
    for launch in program.launches:
        text = build_launch(program, launch).text
        for body in (op.body for op in hierarchy(text) if op.op == "herd"):
            l1 = sum(MemRef(tuple(int(d) for d in shape.split("x")), dtype, 2).nbytes
                     for shape, dtype in re.findall(r"memref\.alloc\(\) : memref<([\dx]+)x(bf16|f32), 2 : i32>", body))
            assert l1 <= L1_AVAILABLE, (launch.kind, l1)


@pytest.mark.parametrize("heads,kv_heads,herd", [(32, 8, (8, 4)), (9, 3, (8, 3))])
def test_attention_spans_the_array_with_one_kv_head_per_step(heads, kv_heads, herd):
    ir = build("attention", heads=heads, kv_heads=kv_heads)
    assert herd_headers(ir.text) == [("attention_herd", herd, "attention.o")]
    launch = next(h for h in hierarchy(ir.text) if h.op == "launch")
    sizes = index_constants(ir.text)
    assert tuple(sizes[s] for s in launch.sizes) == (kv_heads, heads // kv_heads // herd[1])


def test_attention_cores_see_no_value_derived_from_a_launch_index():
    """The herd's only scalar operand (the KV head's column) feeds DMAs alone: the causal positions the
    kernels get come from herd coordinates and the cores' own loops, so aircc makes no runtime parameter."""
    text = build("attention").text
    herd = next(h for h in hierarchy(text) if h.op == "herd")
    header_types = re.search(r"air\.herd .* args\(.*\) : (.*) attributes", text).group(1).split(", ")
    assert header_types.count("index") == 1 and header_types[0] == "index"
    kv_col = herd.bindings[0][0]
    uses = [line.strip() for line in herd.body.splitlines() if re.search(rf"{re.escape(kv_col)}\b", line)]
    assert uses and all(line.startswith("air.dma_memcpy_nd") for line in uses), uses


def test_attention_skips_blocks_wholly_in_the_future_of_a_cores_queries():
    body = next(h for h in hierarchy(build("attention").text) if h.op == "herd").body
    guard = re.search(r"(%\w+) = arith\.cmpi sle, (%\w+), (%\w+) : index\n\s*scf\.if \1 \{\n(.*?)\n\s*\} else \{",
                      body, re.S)
    assert guard, "the per-block calls are not guarded"
    assert re.findall(r"func\.call @(\w+)", guard.group(4)) == [
        "attn_qk_tile_bf16", "attn_online_softmax_bf16", "attn_pv_accumulate_bf16"]
    # guarded by the block's first key against the core's last query row: tx * tile_q + round start + tile_q - 1
    last_row = re.search(rf"{re.escape(guard.group(3))} = affine\.apply affine_map<\(\)\[s0, s1\] -> "
                         r"\(s0 \+ s1 \* 32 \+ 31\)>\(\)\[(%\w+), (%\w+)\]", body)
    assert last_row and last_row.group(2) == next(h for h in hierarchy(build("attention").text) if h.op == "herd").ids[0]


def test_emitter_invariants_that_bad_input_can_break_are_value_errors():
    """Not asserts: a caller (the emulator's inspection MLIR, the CLI) catches ValueError, and ``python -O``
    would drop an assert."""
    b = LaunchBuilder("probe", [MemRef((4, 64), "bf16")], ("x",))
    with b.launch("probe", (1, 1), b.operands) as (_, _, (x,)):
        small = b.alloc(MemRef((32,), "bf16", L1), "small")
        wide = b.alloc(MemRef((16,), "f32", L1), "wide")
        with pytest.raises(ValueError, match="probe DMA: moves 64 elements into 32"):
            b.dma(small, Window((), (), ()), x, rows_window(x.type, 0, 1, 0, 64))
        with pytest.raises(ValueError, match="probe DMA: cannot convert bf16 to f32"):
            b.dma(wide, Window((), (), ()), x, rows_window(x.type, 0, 1, 0, 16))
        with pytest.raises(ValueError, match=r"probe loop: \[0, 10\) is not whole steps of 4"):
            with b.loop(0, 10, 4):
                pass
        with pytest.raises(ValueError, match="probe call of silu_mul_bf16: defines"):
            b.call("silu_mul_bf16", [small, small, small], {})
    with pytest.raises(ValueError, match="rows_window: expected a 2-D operand, or a 1-D one with nrows=1"):
        rows_window(MemRef((32,), "bf16"), 0, 2, 0, 16)


def test_a_split_down_projection_chunk_fits_one_memtile_bd_dimension(monkeypatch):
    """Qwen2.5-0.5B's down projection, K = 4864 = 2^8 * 19: its largest divisor under the old 1024-element cap, 608,
    made a memtile BD dimension that air-to-aie refuses ("Size may not exceed 1023": aie.dma_bd holds each dimension to
    512 elements of its memref); the chunk is now the device record's limit at most, and the lint agrees."""
    from torch_npu2.kernels.builders import gemv_fused
    from torch_npu2.kernels.lint import check_windows

    ir = build("gemv_add", K=4864, N=896)
    assert "K in chunks of 256" in ir.text.splitlines()[0]
    assert check_windows(ir.text) == []
    monkeypatch.setattr(gemv_fused, "MAX_SPLIT_K_CHUNK", 1024)  # the old cap
    old = build("gemv_add", K=4864, N=896)
    assert "K in chunks of 608" in old.text.splitlines()[0]
    assert any("size 608 on L2 (memtile) exceeds 512 elements" in p for p in check_windows(old.text))


def test_an_lm_head_of_more_panels_than_a_shim_bd_wraps_is_refused_and_its_padded_rows_are_not():
    """Qwen2's 151936 rows (2^7 * 1187) leave each tile 1187 panels of 16 rows, more than a shim BD's 1023 wraps
    (air-opt-shim-dma-bds did not finish); a patched model pads them to catalog.lm_head_rows' 152064: 132 panels."""
    from torch_npu2.kernels.catalog import lm_head_rows

    with pytest.raises(LaunchConstraintError, match=r"gemv_f32 launch: N=151936: .* 1187 panels of 16, more than a "
                                                    r"shim BD's 1023 wraps"):
        build("gemv_f32", K=896, N=151936)
    assert lm_head_rows(151936) == 152064 and lm_head_rows(128256) == 128256 and lm_head_rows(49152) == 49152
    assert "in 132 panels of 144" in build("gemv_f32", K=896, N=152064).text.splitlines()[0]


def test_stack_lays_each_kv_head_out_whole_and_spreads_heads_or_rows_over_the_herd():
    """Llama-3.2-1B's 8 KV heads: one per tile, all rows in blocks; Qwen2.5-0.5B's 2: every head on each tile, the rows
    spread; either way each output transfer lands a block of one head's rows in that head's run of the buffer."""
    llama = build("stack")
    assert "herd 8x1, 1 heads and 32 blocks of 64 rows per tile" in llama.text.splitlines()[0]
    assert "herd 8x1, 2 heads and 4 blocks of 64 rows per tile" in build("stack", cols=128).text.splitlines()[0]
    assert "herd 8x1, 3 heads and 1 blocks of 8 rows per tile" in build("stack", rows=64, cols=192).text.splitlines()[0]
    # a block sized for an odd trip count's three ping-pong copies: 32 rows of 96 fit with them, 64 would not
    assert "6 blocks of 32 rows" in build("stack", rows=192, cols=768, head_dim=96).text.splitlines()[0]
    # a head too wide for three copies of any block still builds with one copy of the shortest
    assert "1 heads and 1 blocks of 8 rows" in build("stack", rows=16, cols=1024, head_dim=1024).text.splitlines()[0]
    # into out (2, 2048, 512): from head h's run (stride 2*64*2048), input i's half of it (64*2048), 8-column blocks
    # (stride 2048*8) of the block's rows (stride 8)
    to_out = llama.dmas[1].dst
    assert (to_out.sizes, to_out.strides) == ((1, 1, 1, 64, 8, 8), (131072, 262144, 8, 8, 16384, 1))


def test_attention_rows_take_parts_of_the_sequence_when_the_group_gives_them_no_heads():
    """Qwen2.5-0.5B's 14 heads over 2 KV heads (groups of 7): one head per step, its sequence in 4 parts on the rows,
    the whole array, each column's tiles first in the step's L2 buffers (one DDR window of their rank fills them);
    a sequence of one round per core's block takes one row."""
    ir = build("attention", heads=14, kv_heads=2, seq=2048)
    header = ir.text.splitlines()[0]
    assert "herd 8x4 (the sequence in 4 parts), tile_q 32, tile_kv 32, 2 rounds per core, 2x7 launch steps" in header
    assert "memref<8x8x32x64xbf16, 1 : i32>" in ir.text  # [column][round*4 + part][tile_q][head_dim]
    assert "herd 8x1, tile_q 8, tile_kv 64, 1 rounds per core" in build("attention", heads=14, kv_heads=2,
                                                                       seq=64).text.splitlines()[0]
    assert "herd 8x4, tile_q 32" in build("attention").text.splitlines()[0]  # Llama-3.2-1B's groups of 4: heads


def test_dequant_rows_streams_packed_rows_in_and_bf16_rows_out_double_buffered():
    ir = build("dequant_rows")
    # Llama-3.2-1B's [gate | up] as 16384 Q4_1 rows: 8 tiles, each 2048 rows in panels whose calls AIR double-buffers
    assert "herd 8x1, 1 launch step(s), 2048 rows per tile per step in 64 panels of 32, 4 rows per call" in ir.text
    assert sum(size for _, size in ir.l1_buffers) == 2 * 4 * quant.Q4_1.row_bytes(2048) + 2 * 4 * 2048 * 2
    assert [dict(d.defines) for d in ir.externs] == [{"GEMV_ROWS": 4, "GEMV_K": 2048, "GEMV_QUANT": 41}]
    down = build("dequant_rows", K=8192, N=2048)  # a row of 8192 weights: one per call fits L1 twice
    assert "256 rows per tile per step in 32 panels of 8, 1 rows per call" in down.text


def test_dequant_rows_refuses_what_it_cannot_build():
    with pytest.raises(LaunchConstraintError, match="weights='bf16'.*packed format"):
        BUILDERS["dequant_rows"](dict(K=2048, N=64, weights="bf16"),
                                 [MemRef((64, 2048), BF16), MemRef((64, 2048), BF16)])
    with pytest.raises(LaunchConstraintError, match="K=48: must be a multiple of 32"):
        BUILDERS["dequant_rows"](dict(K=48, N=64, weights="q8_0"), [MemRef((64, 16), "i32"), MemRef((64, 48), BF16)])
    with pytest.raises(LaunchConstraintError, match="exceeds 61440 B per compute tile"):
        build("dequant_rows", K=32768, N=64)  # one row's bf16 weights twice over L1
    with pytest.raises(LaunchConstraintError, match="tile_n=48: must divide the 256 rows a tile owns per step"):
        build("dequant_rows", tuning={"tile_n": 48}, K=2048, N=2048)
    # any row count: SmolLM2's 3 KV heads' 192 rows, or 24: in whole 64-byte L1 runs of its 368-byte Q4_1 rows, 4
    # rows a call, so 12 a tile on 2 tiles (not 3 on 8: a call of 1 row would leave the buffer after it 48 bytes off)
    assert "herd 2x1, 1 launch step(s), 12 rows per tile per step" in build("dequant_rows", K=576, N=24).text
    assert "4 rows per call" in build("dequant_rows", K=576, N=24).text


def test_packed_gemv_calls_prefer_an_even_count_per_panel():
    """AIR's ping-pong transform runs an odd count of calls as pairs plus a last call alone (on a third copy of the
    buffers), so packed GEMVs prefer panels of an even count of calls: Llama-3.2-1B's [Wq; Wk] as 2560 Q4_1 rows (320
    a tile) once went in panels of 20 rows, 5 calls of 4; now in 16-row panels of 4 calls (the timing model and AIR
    agree on it: tests/benchmarks/test_cost_model_pingpong.py)."""
    from torch_npu2.kernels.builders import build_launch
    from torch_npu2.kernels.catalog import lm_head_gemv_program, rms_gemv_rope_program

    programs = (rms_gemv_rope_program(2048, 32, 8, 64, 1e-5, "q4_1"), o_gemv_ffn_program(2048, 2048, 8192, 1e-5, "q4_0"),
                lm_head_gemv_program(2048, 128256, "q8_0"))
    headers = [re.search(r"(\d+) rows per tile per step in (\d+) panels of (\d+), (\d+) rows per call",
                         build_launch(p, launch).text) for p in programs for launch in p.launches
               if "weights" in launch.p]
    assert headers[0].group(0) == "320 rows per tile per step in 20 panels of 16, 4 rows per call"
    for header in headers:
        calls = int(header[3]) // int(header[4])
        assert calls % 2 == 0 or calls == 1, header.group(0)


def test_a_views_windows_move_into_its_arena():
    """LaunchBuilder.dma on a view (MemRef.arena): the view's start is added to the innermost dimension whose stride
    divides it (an SSA offset through affine.apply), a whole-view copy becomes an explicit window, a view at the
    arena's start is left as it is, and a static window past the view is refused."""
    from torch_npu2.kernels.builders.ir import L2, LaunchBuilder, MemRef, Value, Window

    b = LaunchBuilder("probe", [MemRef((4, 8), "bf16", arena=(64, 16))], ["x"])
    rows = Value("%buf", MemRef((2, 8), "bf16", L2))
    b.dma(rows, Window(), b.operands[0], Window((1, 0), (2, 8), (8, 1)))
    b.dma(rows, Window(), b.operands[0], Window((0, "%col"), (2, 8), (8, 1)))
    b.dma(Value("%all", MemRef((4, 8), "bf16", L2)), Window(), b.operands[0], Window())
    text = "\n".join(b._lines)
    assert [d.src for d in b._dmas] == [Window((1, 16), (2, 8), (8, 1)), Window((0, "%at"), (2, 8), (8, 1)),
                                        Window((0, 16), (4, 8), (8, 1))]
    assert "%at = affine.apply affine_map<()[s0] -> (s0 + 16)>()[%col]" in text and "memref<64xbf16>" in text
    with pytest.raises(ValueError, match=r"reaches element 39 of a view of 32"):
        b.dma(rows, Window(), b.operands[0], Window((3, 0), (2, 8), (8, 1)))
    at_start = LaunchBuilder("probe", [MemRef((4, 8), "bf16", arena=(64, 0))], ["x"])
    at_start.dma(rows, Window(), at_start.operands[0], Window((0, "%col"), (2, 8), (8, 1)))
    assert at_start._dmas[0].src == Window((0, "%col"), (2, 8), (8, 1)) and "affine" not in "\n".join(at_start._lines)
