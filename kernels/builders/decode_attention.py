"""decode_attention(capacity, heads, kv_heads, head_dim, tile_kv): one decode token's GQA attention over a KV cache.

q and out are one row (heads*head_dim,), every head's columns side by side (rms_gemv_rope's q_roped, the row
o_gemv_ffn reads); k and v are a cache's first ``capacity`` rows (capacity, kv_heads*head_dim), position-major
(one position's row of all KV heads is contiguous), as the NPU cache holds them; ``length`` is one int32, the
number of valid positions (``capacity`` bounds it). Scale 1/sqrt(head_dim).

How the length reaches the cores: as data. Each core copies the ``length`` buffer into its L1 once (the same
four bytes for every tile), keeps it in a two-word cursor (length, next tile's first position) and hands both to
every dattn_tile_bf16 call, which skips the positions at or past the length. So the ELF depends on the capacity
only, and one ELF serves every length of a capacity bucket (kernels/catalog.py's ``decode_attn_capacity``). The
buffer is an ordinary input argument: the runtime syncs it before the run like q (no host-written runtime
parameter, no lock: the stale-parameter hazard of ../shared/design/KERNELS.md does not arise). Every DMA is
static: a run streams all ``capacity`` rows of k and v, the rows past the length included; only the compute
stops at the length.

Schedule: one launch step per ``herd`` KV heads; core x of the herd owns KV head ``step*herd + x`` and the
``heads/kv_heads`` query heads of its group. A compute tile has two input DMA channels, so everything a tile of
the cache needs reaches a core as one buffer, assembled in the memtile:

* an init herd: each core copies the length into L1, sets its cursor and calls dattn_init_f32 on its slabs of
  the segment's state buffers (row max, row sum, f32 accumulator), which live in L1 across the herds;
* per ``tile_kv`` positions (a loop in the segment): the segment copies the herd's key rows, value rows and
  query rows DDR → memtile into one [herd][keys | values | queries] buffer (AIR ping-pongs it, so the next
  tile's copy overlaps this one's compute), then a herd: each core copies its row of that buffer into L1 and
  calls dattn_tile_bf16 with its cursor, then advances the cursor;
* a final herd: dattn_finalize_bf16, and each core's output rows L1 → DDR.

No value derived from a launch or loop index reaches core compute: the tile's first position is the cursor
each core keeps. The query rows ride along with every tile (group*head_dim values per tile_kv*2*head_dim of
keys and values: 3% more bytes at Llama-3.2-1B's shape) because a third input channel does not exist.

Constraints: heads a multiple of kv_heads; head_dim a multiple of 16; tile_kv a multiple of 16 dividing
capacity; herd dividing kv_heads and at most 4 (one memtile feeds the herd's cores; it has 6 MM2S channels);
a tile's buffers fit L1.
"""
from __future__ import annotations

from .ir import L1, L2, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window
from .npu2 import check_budget, check_operands, divisors_descending, nbytes, require

KIND = "decode_attention"
PARAMS = ("capacity", "heads", "kv_heads", "head_dim", "tile_kv")
TUNING = ("herd",)
OBJECT = "decode_attention.o"
HERD_MAX = 4  # cores fed from one memtile buffer (see the module docstring)
TILE_GRANULE = 16  # decode_attention.cc's exponentials run on 16 lanes
HEAD_DIM_GRANULE = 16  # its dot products and P.V on 32 or 16 lanes


def l1_bytes(group: int, tile_kv: int, head_dim: int) -> dict[str, int]:
    """One core's L1 buffers: the state it keeps across the herds, and a tile's."""
    rows = group * head_dim
    return {"keys, values and query rows": nbytes((2 * tile_kv * head_dim + rows,), "bf16"),
            "f32 scores": nbytes((group, tile_kv), "f32"),
            "bf16 probabilities": nbytes((group, tile_kv), "bf16"),
            "row max and sum": 2 * nbytes((group,), "f32"),
            "f32 accumulator": nbytes((rows,), "f32"),
            "output rows": nbytes((rows,), "bf16"),
            "length and cursor": nbytes((3,), "i32")}


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
            f"must divide kv_heads={kv_heads} and be at most {HERD_MAX}")
    l1 = l1_bytes(group, tile_kv, head_dim)
    check_budget(KIND, "L1", l1, "lower tile_kv")
    rows = group * head_dim  # a group's query (and output) columns
    part = tile_kv * head_dim  # a tile's keys (or values) of one KV head
    width = 2 * part + rows  # a core's row of the memtile buffer: keys, values, query rows
    check_budget(KIND, "L2", {"keys, values and query rows x2 (ping-pong)": 2 * nbytes((herd, width), "bf16")},
                 "lower tile_kv or herd")

    b = LaunchBuilder(KIND, operands, ("q", "k", "v", "length", "out"))
    b.comment(f"decode_attention capacity={capacity} heads={heads} kv_heads={kv_heads} head_dim={head_dim}: "
              f"herd {herd}x1, {kv_heads // herd} launch steps, {capacity // tile_kv} tiles of {tile_kv} positions")
    config = {"DATTN_GROUP": group, "DATTN_TK": tile_kv, "DATTN_HEAD_DIM": head_dim}
    with b.launch("decode_attention", (kv_heads // herd, 1), b.operands) as ((step, _), _, launch_args):
        with b.segment("decode_attention_seg", [Value(step, "index"), *launch_args]) as \
                (_, _, (s_step, sq, sk, sv, slength, sout)):
            first_kv_head = b.affine(f"s0 * {herd}", [s_step.ssa], "first_kv_head")
            q_col = b.affine(f"s0 * {herd * rows}", [s_step.ssa], "q_col")
            # the state each core keeps across the herds: one slab per core
            row_max, row_sum = (b.alloc(MemRef((herd, group), "f32", L1), n) for n in ("row_max", "row_sum"))
            acc = b.alloc(MemRef((herd, rows), "f32", L1), "acc")
            cursor = b.alloc(MemRef((herd, 2), "i32", L1), "cursor")  # (length, the next tile's first position)
            kvq = b.alloc(MemRef((herd, width), "bf16", L2), "kvq_l2")
            herd_name = "decode_attention_herd"
            with b.herd(herd_name, (herd, 1), [slength, row_max, row_sum, acc, cursor], link_with=OBJECT) as \
                    ((tx, _), _, (h_length, h_max, h_sum, h_acc, h_cursor)):
                length_buf = b.alloc(MemRef((1,), "i32", L1), "length_l1")
                b.dma(length_buf, WHOLE, h_length, WHOLE)
                zero = b.const(0)
                length = b.assign("length", f"memref.load {length_buf.ssa}[{zero}] : {length_buf.type}", "i32")
                b.emit(f"memref.store {length.ssa}, {h_cursor.ssa}[{tx}, {zero}] : {h_cursor.type}")
                b.emit(f"memref.store {b.const(0, 'i32')}, {h_cursor.ssa}[{tx}, {b.const(1)}] : {h_cursor.type}")
                b.call("dattn_init_f32", [b.slab(h_max, [tx]), b.slab(h_sum, [tx]), b.slab(h_acc, [tx])], config)
                b.dealloc(length_buf)
            with b.loop(0, capacity, tile_kv, "kv") as first:
                # the herd's keys, then values, then query rows into each core's row of the memtile buffer; from
                # DDR each position's keys (values) of the herd's KV heads are one run of herd*head_dim values
                for offset, cache in ((0, sk), (part, sv)):
                    b.dma(kvq, Window((0, 0, offset), (tile_kv, herd, head_dim), (head_dim, width, 1)), cache,
                          Window((first, first_kv_head, 0), (tile_kv, herd, head_dim), (kv_dim, head_dim, 1)))
                b.dma(kvq, Window((0, 2 * part), (herd, rows), (width, 1)), sq, Window((q_col,), (herd * rows,), (1,)))
                with b.herd(herd_name, (herd, 1), [kvq, row_max, row_sum, acc, cursor], link_with=OBJECT) as \
                        ((tx, _), _, (h_kvq, h_max, h_sum, h_acc, h_cursor)):
                    tile = b.alloc(MemRef((width,), "bf16", L1), "kvq_l1")
                    scores = b.alloc(MemRef((group * tile_kv,), "f32", L1), "scores_l1")
                    probs = b.alloc(MemRef((group * tile_kv,), "bf16", L1), "probs_l1")
                    b.dma(tile, WHOLE, h_kvq, Window((tx, 0), (1, width), (width, 1)))
                    zero, one = b.const(0), b.const(1)
                    length = b.assign("length", f"memref.load {h_cursor.ssa}[{tx}, {zero}] : {h_cursor.type}", "i32")
                    k_start = b.assign("k_start", f"memref.load {h_cursor.ssa}[{tx}, {one}] : {h_cursor.type}", "i32")
                    b.call("dattn_tile_bf16", [tile, scores, probs, b.slab(h_max, [tx]), b.slab(h_sum, [tx]),
                                               b.slab(h_acc, [tx]), length, k_start], config)
                    following = b.assign("next_start", f"arith.addi {k_start.ssa}, {b.const(tile_kv, 'i32')} : i32",
                                         "i32")
                    b.emit(f"memref.store {following.ssa}, {h_cursor.ssa}[{tx}, {one}] : {h_cursor.type}")
                    b.dealloc(tile, scores, probs)
            with b.herd(herd_name, (herd, 1), [row_sum, acc, sout, Value(q_col, "index")], link_with=OBJECT) as \
                    ((tx, _), _, (h_sum, h_acc, h_out, h_q_col)):
                out_buf = b.alloc(MemRef((rows,), "bf16", L1), "out_l1")
                b.call("dattn_finalize_bf16", [b.slab(h_acc, [tx]), b.slab(h_sum, [tx]), out_buf], config)
                col = b.affine(f"s0 + s1 * {rows}", [h_q_col.ssa, tx], "out_col")
                b.dma(h_out, Window((col,), (rows,), (1,)), out_buf, WHOLE)
                b.dealloc(out_buf)
            b.dealloc(row_max, row_sum, acc, cursor, kvq)
    return b.finish(l1)
