"""decode_attention(capacity, heads, kv_heads, head_dim, tile_kv): one decode token's GQA attention over a KV cache.

q and out are one row (heads*head_dim,), every head's columns side by side (rms_gemv_rope's q_roped, the row
o_gemv_ffn reads); k and v are a cache's first ``capacity`` rows (capacity, kv_heads*head_dim), position-major
(one position's row of all KV heads is contiguous), as the NPU cache holds them; ``length`` holds the number of
valid positions (``capacity`` bounds it) as 4 bf16 base-256 digits. Scale 1/sqrt(head_dim).

How the length reaches the cores: as data. It travels with the query rows, each core decodes it once into a
two-word cursor (length, next tile's first position) it keeps in L1, and hands both to every dattn_tile_bf16
call, which skips the positions at or past the length. So the ELF depends on the capacity only, and one ELF
serves every length of a capacity bucket (kernels/catalog.py's ``decode_attn_capacity``). The buffer is an
ordinary input argument: the runtime syncs it before the run like q (no host-written runtime parameter, no
lock: the stale-parameter hazard of ../shared/design/KERNELS.md does not arise). Every DMA is static: a run
streams all ``capacity`` rows of k and v, the rows past the length included; only the compute stops.

Schedule: one launch step per ``herd`` KV heads; core x of the herd owns KV head ``step*herd + x`` and the
``heads/kv_heads`` query heads of its group. A compute tile has two input DMA channels (a third input fails
aiecc's routing), and a DMA that repeats the same DDR window on every trip of a loop past 48 trips does not
lower (air-opt-shim-dma-bds folds the repeats into a stride-0 BD dimension, which aie.dma_bd refuses), so:

* before the tiles, the segment copies the herd's query rows and the length digits DDR → memtile into one
  buffer; an init herd copies it whole to every core (one broadcast), and dattn_init_f32 takes the core's
  group's rows into an L1 slab, decodes the length into the cursor and zeroes its state (row max, row sum, f32
  accumulator): segment-scope L1 slabs that live across the herds;
* per ``tile_kv`` positions (a loop in the segment): the segment copies the herd's key rows, then value rows,
  DDR → memtile into one [herd][keys | values] buffer (AIR ping-pongs it, so the next tile's copy overlaps this
  one's compute; from DDR each position's rows of the herd's KV heads are one run), then a herd: each core
  copies its row of that buffer into L1, calls dattn_tile_bf16 with its cursor and advances the cursor;
* a final herd: dattn_finalize_bf16, and each core's output rows L1 → DDR.

No value derived from a launch or loop index reaches core compute: the tile's first position is the cursor
each core keeps, its group the herd coordinate.

Constraints: heads a multiple of kv_heads; head_dim a multiple of 16; tile_kv a multiple of 16 dividing
capacity; herd dividing kv_heads and at most 8 (AIR splits the memtile buffers by the herd's columns: at 8
cores, lowered, no memtile uses more than its 6 channels); a tile's buffers fit L1, the ping-ponged key/value
buffer a memtile.
"""
from __future__ import annotations

from .ir import L1, L2, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window
from .npu2 import check_budget, check_operands, divisors_descending, l1_elements, nbytes, pingpong_copies, require

KIND = "decode_attention"
PARAMS = ("capacity", "heads", "kv_heads", "head_dim", "tile_kv")
TUNING = ("herd",)
OBJECT = "decode_attention.o"
HERD_MAX = 8  # one row of the array (Llama-3.2-1B: its 8 KV heads in one launch step)
TILE_GRANULE = 16  # decode_attention.cc's exponentials run on 16 lanes
HEAD_DIM_GRANULE = 16  # its dot products and P.V on 32 or 16 lanes
LENGTH_DIGITS = 4  # catalog.DECODE_ATTN_LENGTH_DIGITS (builders import nothing from the catalog)
# Per core, the small state buffers (row max, row sum, cursor) and the herd's query rows and length take whole
# 64-byte runs (npu2.l1_elements): aie-assign-buffer-addresses packs a tile's buffers end to end, so one of another
# size would leave every buffer after it off the 64-byte boundary a 512-bit vector load needs (kernels/budgets.py).
# The kernels take whole buffers (AIR shrinks an L1 buffer to what is accessed), so the query-and-length buffer's
# padding is filled too, with the herd's first query values, which dattn_init_f32 never reads.


def l1_bytes(group: int, tile_kv: int, head_dim: int, herd: int, tiles: int) -> dict[str, int]:
    """One core's L1 buffers: the state it keeps across the herds, and its herds' own; the tile herd's, inside the
    segment's loop of ``tiles`` trips, are ping-ponged by AIR (lowered, Llama-3.2-1B's tile holds them twice)."""
    rows = group * head_dim
    copies = pingpong_copies(tiles)
    return {f"key and value rows x{copies}": copies * nbytes((2 * tile_kv * head_dim,), "bf16"),
            f"f32 scores x{copies}": copies * nbytes((group, tile_kv), "f32"),
            f"bf16 probabilities x{copies}": copies * nbytes((group, tile_kv), "bf16"),
            "output rows": nbytes((l1_elements(rows, "bf16"),), "bf16"),
            "query rows": nbytes((rows,), "bf16"),
            "row max and sum": 2 * nbytes((l1_elements(group, "f32"),), "f32"),
            "f32 accumulator": nbytes((rows,), "f32"),
            # indexed [core][word] by scalar loads and stores, which AIR does not shrink to a core's slab
            "cursor (every core's)": nbytes((herd, l1_elements(2, "i32")), "i32"),
            # the init herd's copy of every group's rows (freed before the tiles; counted as if it stayed)
            "the herd's query rows and length": nbytes((l1_elements(herd * rows + LENGTH_DIGITS, "bf16"),), "bf16")}


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    capacity, heads, kv_heads, head_dim, tile_kv = (params[n] for n in PARAMS)
    require(heads % kv_heads == 0, KIND, "heads", heads, f"must be a multiple of kv_heads={kv_heads}")
    group = heads // kv_heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    check_operands(KIND, operands, [("q", {(q_dim,)}, "bf16"), ("k", {(capacity, kv_dim)}, "bf16"),
                                    ("v", {(capacity, kv_dim)}, "bf16"), ("length", {(LENGTH_DIGITS,)}, "bf16"),
                                    ("out", {(q_dim,)}, "bf16")])
    require(head_dim % HEAD_DIM_GRANULE == 0, KIND, "head_dim", head_dim,
            f"must be a multiple of {HEAD_DIM_GRANULE} (decode_attention.cc's vectors)")
    require(tile_kv % TILE_GRANULE == 0 and capacity % tile_kv == 0, KIND, "tile_kv", tile_kv,
            f"must be a multiple of {TILE_GRANULE} dividing capacity={capacity}")
    herd = tuning.get("herd", divisors_descending(kv_heads, HERD_MAX)[0])
    require(herd <= HERD_MAX and kv_heads % herd == 0, KIND, "herd", herd,
            f"must divide kv_heads={kv_heads} and be at most {HERD_MAX}")
    l1 = l1_bytes(group, tile_kv, head_dim, herd, capacity // tile_kv)
    check_budget(KIND, "L1", l1, "lower tile_kv")
    rows = group * head_dim  # a group's query (and output) columns
    part = tile_kv * head_dim  # a tile's keys (or values) of one KV head
    head = herd * rows + LENGTH_DIGITS  # the herd's query rows, then the length digits
    check_budget(KIND, "L2", {"key and value rows x2 (ping-pong)": 2 * nbytes((herd, 2 * part), "bf16"),
                              "query rows and length": nbytes((l1_elements(head, "bf16"),), "bf16")},
                 "lower tile_kv or herd")

    b = LaunchBuilder(KIND, operands, ("q", "k", "v", "length", "out"))
    b.comment(f"decode_attention capacity={capacity} heads={heads} kv_heads={kv_heads} head_dim={head_dim}: "
              f"herd {herd}x1, {kv_heads // herd} launch steps, {capacity // tile_kv} tiles of {tile_kv} positions")
    config = {"DATTN_GROUP": group, "DATTN_TK": tile_kv, "DATTN_HEAD_DIM": head_dim}
    herd_name = "decode_attention_herd"
    with b.launch("decode_attention", (kv_heads // herd, 1), b.operands) as ((step, _), _, launch_args):
        with b.segment("decode_attention_seg", [Value(step, "index"), *launch_args]) as \
                (_, _, (s_step, sq, sk, sv, slength, sout)):
            first_kv_head = b.affine(f"s0 * {herd}", [s_step.ssa], "first_kv_head")
            q_col = b.affine(f"s0 * {herd * rows}", [s_step.ssa], "q_col")
            # the state each core keeps across the herds: one slab per core
            q_rows = b.alloc(MemRef((herd, rows), "bf16", L1), "q_rows")
            row_max, row_sum = (b.alloc(MemRef((herd, l1_elements(group, "f32")), "f32", L1), n)
                                for n in ("row_max", "row_sum"))
            acc = b.alloc(MemRef((herd, rows), "f32", L1), "acc")
            # (length, the next tile's first position), then padding
            cursor = b.alloc(MemRef((herd, l1_elements(2, "i32")), "i32", L1), "cursor")
            padded_head = l1_elements(head, "bf16")
            head_l2 = b.alloc(MemRef((padded_head,), "bf16", L2), "head_l2")
            b.dma(head_l2, Window((0,), (herd * rows,), (1,)), sq, Window((q_col,), (herd * rows,), (1,)))
            b.dma(head_l2, Window((herd * rows,), (LENGTH_DIGITS,), (1,)), slength, WHOLE)
            if padded_head > head:  # the padding: a copy of the first query values (herd * rows >= 64 of them)
                b.dma(head_l2, Window((head,), (padded_head - head,), (1,)), sq,
                      Window((q_col,), (padded_head - head,), (1,)))
            with b.herd(herd_name, (herd, 1), [head_l2, q_rows, row_max, row_sum, acc, cursor], link_with=OBJECT) as \
                    ((tx, _), _, (h_head, h_q, h_max, h_sum, h_acc, h_cursor)):
                head_buf = b.alloc(MemRef((padded_head,), "bf16", L1), "head_l1")
                b.broadcast_dma(head_buf, WHOLE, h_head, WHOLE)
                b.call("dattn_init_f32", [head_buf, Value(b.const(herd, "i32"), "i32"), b.index_to_i32(tx, "group"),
                                          *(b.slab(s, [tx]) for s in (h_q, h_max, h_sum, h_acc, h_cursor))], config)
                b.dealloc(head_buf)
            kv_l2 = b.alloc(MemRef((herd, 2 * part), "bf16", L2), "kv_l2")
            with b.loop(0, capacity, tile_kv, "kv") as first:
                # the herd's keys, then values, into each core's row of the memtile buffer; from DDR each position's
                # rows of the herd's KV heads are one run of herd*head_dim values
                for offset, cache in ((0, sk), (part, sv)):
                    b.dma(kv_l2, Window((0, 0, offset), (tile_kv, herd, head_dim), (head_dim, 2 * part, 1)), cache,
                          Window((first, first_kv_head, 0), (tile_kv, herd, head_dim), (kv_dim, head_dim, 1)))
                with b.herd(herd_name, (herd, 1), [kv_l2, q_rows, row_max, row_sum, acc, cursor], link_with=OBJECT) \
                        as ((tx, _), _, (h_kv, h_q, h_max, h_sum, h_acc, h_cursor)):
                    kv_buf = b.alloc(MemRef((2 * part,), "bf16", L1), "kv_l1")
                    scores = b.alloc(MemRef((group * tile_kv,), "f32", L1), "scores_l1")
                    probs = b.alloc(MemRef((group * tile_kv,), "bf16", L1), "probs_l1")
                    b.dma(kv_buf, WHOLE, h_kv, Window((tx, 0), (1, 2 * part), (2 * part, 1)))
                    zero, one = b.const(0), b.const(1)
                    length = b.assign("length", f"memref.load {h_cursor.ssa}[{tx}, {zero}] : {h_cursor.type}", "i32")
                    k_start = b.assign("k_start", f"memref.load {h_cursor.ssa}[{tx}, {one}] : {h_cursor.type}", "i32")
                    b.call("dattn_tile_bf16", [b.slab(h_q, [tx]), kv_buf, scores, probs, b.slab(h_max, [tx]),
                                               b.slab(h_sum, [tx]), b.slab(h_acc, [tx]), length, k_start], config)
                    following = b.assign("next_start", f"arith.addi {k_start.ssa}, {b.const(tile_kv, 'i32')} : i32",
                                         "i32")
                    b.emit(f"memref.store {following.ssa}, {h_cursor.ssa}[{tx}, {one}] : {h_cursor.type}")
                    b.dealloc(kv_buf, scores, probs)
            with b.herd(herd_name, (herd, 1), [row_sum, acc, sout, Value(q_col, "index")], link_with=OBJECT) as \
                    ((tx, _), _, (h_sum, h_acc, h_out, h_q_col)):
                out_buf = b.alloc(MemRef((l1_elements(rows, "bf16"),), "bf16", L1), "out_l1")
                b.call("dattn_finalize_bf16", [b.slab(h_acc, [tx]), b.slab(h_sum, [tx]), out_buf], config)
                col = b.affine(f"s0 + s1 * {rows}", [h_q_col.ssa, tx], "out_col")
                b.dma(h_out, Window((col,), (rows,), (1,)), out_buf, Window((0,), (rows,), (1,)))
                b.dealloc(out_buf)
            b.dealloc(q_rows, row_max, row_sum, acc, cursor, head_l2, kv_l2)
    return b.finish(l1)
