"""decode_attention(capacity, heads, kv_heads, head_dim, tile_kv): one decode token's GQA attention over a KV cache.

q and out are one row (heads*head_dim,), every head's columns side by side (rms_gemv_rope's q_roped, the row
o_gemv_ffn reads); k and v are a cache's first ``capacity`` rows (capacity, kv_heads*head_dim), position-major
(one position's row of all KV heads is contiguous), as the NPU cache holds them; ``length`` is one int32, the
number of valid positions (``capacity`` bounds it). Scale 1/sqrt(head_dim).

How the length reaches the core: as data. The herd copies the ``length`` buffer into L1 (one broadcast copy, the
same four bytes for every tile) and each core reads it with a ``memref.load``, then hands it to every tile call of
decode_attention.cc, which skips the positions at or past it. The ELF depends on the capacity only, so one ELF
serves every length of a capacity bucket (kernels/catalog.py's ``decode_attn_capacity``). The buffer is an ordinary
input argument: the runtime syncs it before the run like q (no host-written runtime parameter, no lock; the
stale-parameter hazard of ../shared/design/KERNELS.md does not arise). Every DMA is static: a run streams all
``capacity`` rows of k and v, the rows past the length included; only the compute stops at the length.

Schedule: one launch step per ``herd`` KV heads; core x of the herd owns KV head ``step*herd + x`` and the
``heads/kv_heads`` query heads of its group. Per core: its group's query rows (one copy), the length (a
broadcast), then for each ``tile_kv`` positions a copy of its head's key rows and value rows straight from DDR
(``tile_kv`` runs of head_dim values at the cache's row stride, ping-ponged) and one dattn_tile_bf16 call; at the
end dattn_finalize_bf16 and one copy of the group's output rows to DDR. The launch index reaches the herd only in
DMA offsets, never in core compute.

The herd spans at most 4 tiles: each tile streams q, K and V from DDR on shim channels of its own, so 4 tiles
take 12 of the array's 16 shim MM2S channels, plus one for the length broadcast; 8 would need 25.

Constraints: heads a multiple of kv_heads; head_dim a multiple of 16; tile_kv a multiple of 16 dividing
capacity; herd dividing kv_heads and at most 4; a tile's buffers (ping-ponged K and V tiles, q, scores, probs,
accumulator, row state, output) fit L1.
"""
from __future__ import annotations

from .ir import L1, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window
from .npu2 import check_budget, check_operands, divisors_descending, nbytes, pingpong_copies, require

KIND = "decode_attention"
PARAMS = ("capacity", "heads", "kv_heads", "head_dim", "tile_kv")
TUNING = ("herd",)
OBJECT = "decode_attention.o"
HERD_MAX = 4  # tiles that stream q, K and V on shim channels of their own (see the module docstring)
TILE_GRANULE = 16  # decode_attention.cc's exponentials run on 16 lanes
HEAD_DIM_GRANULE = 16  # its dot products and P.V on 32 or 16 lanes


def l1_bytes(group: int, tile_kv: int, head_dim: int, tiles: int) -> dict[str, int]:
    """One core's L1 buffers; ``tiles``: key/value tiles per run (how many copies ping-pong keeps)."""
    copies = pingpong_copies(tiles)
    return {"query rows": nbytes((group, head_dim), "bf16"),
            f"key tile x{copies}": copies * nbytes((tile_kv, head_dim), "bf16"),
            f"value tile x{copies}": copies * nbytes((tile_kv, head_dim), "bf16"),
            "f32 scores": nbytes((group, tile_kv), "f32"),
            "bf16 probabilities": nbytes((group, tile_kv), "bf16"),
            "row max and sum": 2 * nbytes((group,), "f32"),
            "f32 accumulator": nbytes((group, head_dim), "f32"),
            "output rows": nbytes((group, head_dim), "bf16"),
            "length": nbytes((1,), "i32")}


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    capacity, heads, kv_heads, head_dim, tile_kv = (params[n] for n in PARAMS)
    require(heads % kv_heads == 0, KIND, "heads", heads, f"must be a multiple of kv_heads={kv_heads}")
    group = heads // kv_heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    check_operands(KIND, operands, [("q", {(q_dim,)}, "bf16"), ("k", {(capacity, kv_dim)}, "bf16"),
                                    ("v", {(capacity, kv_dim)}, "bf16"), ("length", {(1,)}, "i32"),
                                    ("out", {(q_dim,)}, "bf16")])
    require(head_dim % HEAD_DIM_GRANULE == 0, KIND, "head_dim", head_dim,
            f"must be a multiple of {HEAD_DIM_GRANULE} (decode_attention.cc's vectors)")
    require(tile_kv % TILE_GRANULE == 0 and capacity % tile_kv == 0, KIND, "tile_kv", tile_kv,
            f"must be a multiple of {TILE_GRANULE} dividing capacity={capacity}")
    herd = tuning.get("herd", divisors_descending(kv_heads, HERD_MAX)[0])
    require(herd <= HERD_MAX and kv_heads % herd == 0, KIND, "herd", herd,
            f"must divide kv_heads={kv_heads} and be at most {HERD_MAX} (shim channels)")
    tiles = capacity // tile_kv
    l1 = l1_bytes(group, tile_kv, head_dim, tiles)
    check_budget(KIND, "L1", l1, "lower tile_kv")
    rows = group * head_dim  # a group's query (and output) columns

    b = LaunchBuilder(KIND, operands, ("q", "k", "v", "length", "out"))
    b.comment(f"decode_attention capacity={capacity} heads={heads} kv_heads={kv_heads} head_dim={head_dim}: "
              f"herd {herd}x1, {kv_heads // herd} launch steps, {tiles} tiles of {tile_kv} positions per core")
    with b.launch("decode_attention", (kv_heads // herd, 1), b.operands) as ((step, _), _, launch_args):
        with b.segment("decode_attention_seg", [Value(step, "index"), *launch_args]) as (_, _, segment_args):
            with b.herd("decode_attention_herd", (herd, 1), segment_args, link_with=OBJECT) as \
                    ((tx, _), _, (h_step, q, k, v, length, out)):
                kv_head = b.affine(f"s0 * {herd} + s1", [h_step.ssa, tx], "kv_head")
                q_col = b.affine(f"s0 * {rows}", [kv_head], "q_col")
                kv_col = b.affine(f"s0 * {head_dim}", [kv_head], "kv_col")
                q_buf = b.alloc(MemRef((rows,), "bf16", L1), "q_l1")
                k_buf = b.alloc(MemRef((tile_kv * head_dim,), "bf16", L1), "k_l1")
                v_buf = b.alloc(MemRef((tile_kv * head_dim,), "bf16", L1), "v_l1")
                scores = b.alloc(MemRef((group * tile_kv,), "f32", L1), "scores_l1")
                probs = b.alloc(MemRef((group * tile_kv,), "bf16", L1), "probs_l1")
                row_max, row_sum = (b.alloc(MemRef((group,), "f32", L1), n) for n in ("row_max_l1", "row_sum_l1"))
                acc = b.alloc(MemRef((rows,), "f32", L1), "acc_l1")
                out_buf = b.alloc(MemRef((rows,), "bf16", L1), "out_l1")
                length_buf = b.alloc(MemRef((1,), "i32", L1), "length_l1")
                config = {"DATTN_GROUP": group, "DATTN_TK": tile_kv, "DATTN_HEAD_DIM": head_dim}
                b.broadcast_dma(length_buf, WHOLE, length, WHOLE)
                b.dma(q_buf, WHOLE, q, Window((q_col,), (rows,), (1,)))
                valid = b.assign("length", f"memref.load {length_buf.ssa}[{b.const(0)}] : {length_buf.type}", "i32")
                b.call("dattn_init_f32", [row_max, row_sum, acc], config)
                with b.loop(0, capacity, tile_kv, "kv") as first:
                    window = Window((first, kv_col), (tile_kv, head_dim), (kv_dim, 1))
                    b.dma(k_buf, WHOLE, k, window)
                    b.dma(v_buf, WHOLE, v, window)
                    k_start = b.index_to_i32(first, "k_start")
                    b.call("dattn_tile_bf16", [q_buf, k_buf, v_buf, scores, probs, row_max, row_sum, acc, valid,
                                               k_start], config)
                b.call("dattn_finalize_bf16", [acc, row_sum, out_buf], config)
                b.dma(out, Window((q_col,), (rows,), (1,)), out_buf, WHOLE)
                b.dealloc(q_buf, k_buf, v_buf, scores, probs, row_max, row_sum, acc, out_buf, length_buf)
    return b.finish(l1)
