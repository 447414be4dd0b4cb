"""attention(seq, heads, kv_heads, head_dim, causal): flash attention, seq-first, GQA, scale 1/sqrt(head_dim).

q/out are (seq, heads*head_dim), every head interleaved per position (the projections' natural output);
kv is (2, seq, kv_heads*head_dim): the keys, then the values (a ``stack`` launch gathers them), so one
DMA brings a tile a key block and the value block of the same positions. Each head's window is strided
with a contiguous ``head_dim`` inner dimension: no transposes.

Schedule: one launch step per (KV head, query head of its group, block of ``herd_q*tile_q`` query rows).

* DDR → memtile: the Q block of that head; each tile of a 1-D herd takes its ``tile_q`` rows into L1.
* Each tile streams the key/value blocks (``tile_kv`` positions of its KV head) DDR → L1. Every tile of
  the herd reads the same blocks, so AIR broadcasts them: one stream, one shim buffer descriptor per
  launch step for the whole walk. A tile has two input DMA channels: one for Q, one for K/V.
* Per block, the tile primitives of attention.o (built for this launch's tile sizes): scores with the
  causal mask, online-softmax update, P·V accumulation; at the end, the normalization. The running row
  max, row sum and f32 accumulator stay in L1 for the whole pass.
* Result tile L1 → memtile → DDR.

Every tile visits every K/V block (the blocks are broadcast, so all tiles run the same trip count) and
the kernel's positional mask zeroes a block wholly in a row's future. Skipping those blocks would halve
the work at long sequences and is left for later. The kernels mask by position, so only causal
attention is supported.

Constraints: causal; heads a multiple of kv_heads; head_dim a multiple of 16; tile_q a multiple of 8
dividing seq, herd_q*tile_q dividing seq; tile_kv a multiple of 16 dividing seq; the tile's buffers
(Q, the K/V block, scores, probabilities, accumulator, row state, output) fit L1, single-buffered (the
Program compiles attention without ping-pong).
"""
from __future__ import annotations

from .ir import L1, L2, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window
from .npu2 import (COLUMNS, HERD_CANDIDATES, L1_AVAILABLE, MMUL_GRANULE, check_budget, check_operands,
                   check_params, check_tuning, largest_dividing, nbytes, require)

KIND = "attention"
PARAMS = ("seq", "heads", "kv_heads", "head_dim", "causal")
TUNING = ("herd_q", "tile_q", "tile_kv")
OBJECT = "attention.o"
TILE_Q_CANDIDATES = (32, 16, 8)
TILE_KV_CANDIDATES = (64, 32, 16)  # attention.cc's AIE path needs multiples of 16
KV_GRANULE = 16


def _l1_bytes(tile_q: int, tile_kv: int, head_dim: int) -> dict[str, int]:
    return {"Q tile": nbytes((tile_q, head_dim), "bf16"),
            "K/V block": nbytes((2, tile_kv, head_dim), "bf16"),
            "f32 scores": nbytes((tile_q, tile_kv), "f32"),
            "bf16 probabilities": nbytes((tile_q, tile_kv), "bf16"),
            "f32 accumulator": nbytes((tile_q, head_dim), "f32"),
            "row max, sum and scale": 3 * nbytes((tile_q,), "f32"),
            "output tile": nbytes((tile_q, head_dim), "bf16")}


def _l2_bytes(block_q: int, head_dim: int) -> dict[str, int]:
    return {"Q block": nbytes((block_q, head_dim), "bf16"), "O block": nbytes((block_q, head_dim), "bf16")}


def build(params: dict, operands, tuning: dict | None = None) -> LaunchIR:
    tuning = dict(tuning or {})
    check_params(KIND, params, PARAMS)
    check_tuning(KIND, tuning, TUNING)
    seq, heads, kv_heads, head_dim = (params[n] for n in ("seq", "heads", "kv_heads", "head_dim"))
    causal = params["causal"]
    require(causal is True, KIND, "causal", causal, "attention.o masks by position: only causal=True is supported")
    require(heads % kv_heads == 0, KIND, "heads", heads, f"must be a multiple of kv_heads={kv_heads}")
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    check_operands(KIND, operands, [("q", {(seq, q_dim)}, "bf16"), ("kv", {(2, seq, kv_dim)}, "bf16"),
                                    ("out", {(seq, q_dim)}, "bf16")])
    require(head_dim % KV_GRANULE == 0, KIND, "head_dim", head_dim, f"must be a multiple of {KV_GRANULE}")
    tile_q = tuning.get("tile_q", largest_dividing(seq, TILE_Q_CANDIDATES))
    require(tile_q is not None and seq % tile_q == 0 and tile_q % MMUL_GRANULE == 0, KIND, "tile_q", tile_q,
            f"must divide seq={seq} and be a multiple of {MMUL_GRANULE}")
    herd_q = tuning.get("herd_q", largest_dividing(seq // tile_q, HERD_CANDIDATES))
    require(herd_q <= COLUMNS, KIND, "herd_q", herd_q, f"the herd spans at most {COLUMNS} columns")
    require(seq % (herd_q * tile_q) == 0, KIND, "herd_q", herd_q, f"herd_q*tile_q must divide seq={seq}")
    dividing = [t for t in TILE_KV_CANDIDATES if seq % t == 0] or [KV_GRANULE]
    tile_kv = tuning.get("tile_kv") or next(
        (t for t in dividing if sum(_l1_bytes(tile_q, t, head_dim).values()) <= L1_AVAILABLE), dividing[-1])
    require(seq % tile_kv == 0 and tile_kv % KV_GRANULE == 0, KIND, "tile_kv", tile_kv,
            f"must divide seq={seq} and be a multiple of {KV_GRANULE}")
    check_budget(KIND, "L1", _l1_bytes(tile_q, tile_kv, head_dim), "lower tile_q or tile_kv")
    block_q = herd_q * tile_q
    check_budget(KIND, "L2", _l2_bytes(block_q, head_dim), "lower herd_q or tile_q")

    b = LaunchBuilder(KIND, operands, ("q", "kv", "out"))
    group = heads // kv_heads
    b.comment(f"attention seq={seq} heads={heads} kv_heads={kv_heads} head_dim={head_dim} causal={causal}: "
              f"herd {herd_q}x1, tile_q {tile_q}, tile_kv {tile_kv}, {kv_heads}x{group}x{seq // block_q} launch steps")
    steps = (kv_heads, group, seq // block_q)
    with b.launch("attention", steps, b.operands) as ((kv_head, member, qb), _, (q, kv, out)):
        indices = [Value(i, "index") for i in (kv_head, member, qb)]
        with b.segment("attention_seg", [*indices, q, kv, out]) as (_, _, (s_kv_head, s_member, s_qb, sq, skv, so)):
            q_row0 = b.affine(f"s0 * {block_q}", [s_qb.ssa], "q_row0")
            q_col = b.affine(f"s0 * {group * head_dim} + s1 * {head_dim}", [s_kv_head.ssa, s_member.ssa], "q_col")
            kv_col = b.affine(f"s0 * {head_dim}", [s_kv_head.ssa], "kv_col")
            q_l2 = b.alloc(MemRef((block_q, head_dim), "bf16", L2), "q_l2")
            o_l2 = b.alloc(MemRef((block_q, head_dim), "bf16", L2), "o_l2")
            b.dma(q_l2, WHOLE, sq, Window((q_row0, q_col), (block_q, head_dim), (q_dim, 1)))
            herd_operands = [Value(q_row0, "index"), Value(kv_col, "index"), skv, q_l2, o_l2]
            with b.herd("attention_herd", (herd_q, 1), herd_operands, link_with=OBJECT) as (
                    (tx, _), _, (h_row0, h_kv_col, hkv, hq, ho)):
                _emit_tile(b, tx, h_row0.ssa, h_kv_col.ssa, hkv, hq, ho, seq, head_dim, tile_q, tile_kv)
            b.dma(so, Window((q_row0, q_col), (block_q, head_dim), (q_dim, 1)), o_l2, WHOLE)
            b.dealloc(q_l2, o_l2)
    return b.finish()


def _emit_tile(b: LaunchBuilder, tx, q_row0, kv_col, kv, q_block, o_block, seq, head_dim, tile_q, tile_kv) -> None:
    kv_dim = kv.type.shape[2]
    q_buf = b.alloc(MemRef((tile_q * head_dim,), "bf16", L1), "q_l1")
    kv_buf = b.alloc(MemRef((2, tile_kv, head_dim), "bf16", L1), "kv_l1")
    scores = b.alloc(MemRef((tile_q * tile_kv,), "f32", L1), "scores_l1")
    probs = b.alloc(MemRef((tile_q * tile_kv,), "bf16", L1), "probs_l1")
    row_max, row_sum, row_scale = (b.alloc(MemRef((tile_q,), "f32", L1), n)
                                   for n in ("row_max_l1", "row_sum_l1", "row_scale_l1"))
    acc = b.alloc(MemRef((tile_q * head_dim,), "f32", L1), "acc_l1")
    out_buf = b.alloc(MemRef((tile_q * head_dim,), "bf16", L1), "out_l1")
    config = {"ATTN_TQ": tile_q, "ATTN_TK": tile_kv, "ATTN_HEAD_DIM": head_dim}
    local_row = b.affine(f"s0 * {tile_q}", [tx], "local_row")
    b.dma(q_buf, WHOLE, q_block, Window((local_row, 0), (tile_q, head_dim), (head_dim, 1)))
    b.call("attn_init_f32", [row_max, row_sum, acc], config)
    q_start = b.index_to_i32(b.affine("s0 + s1", [q_row0, local_row], "q_row"), "q_start")
    with b.loop(0, seq, tile_kv, "kv") as first:
        b.dma(kv_buf, WHOLE, kv, Window((0, first, kv_col), (2, tile_kv, head_dim), (seq * kv_dim, kv_dim, 1)))
        k_start = b.index_to_i32(first, "k_start")
        b.call("attn_qk_tile_bf16", [q_buf, kv_buf, scores, q_start, k_start], config)
        b.call("attn_online_softmax_bf16", [scores, probs, row_max, row_sum, row_scale], config)
        b.call("attn_pv_accumulate_bf16", [probs, kv_buf, row_scale, acc], config)
    b.call("attn_finalize_bf16", [acc, row_sum, out_buf], config)
    b.dma(o_block, Window((local_row, 0), (tile_q, head_dim), (head_dim, 1)), out_buf, WHOLE)
    b.dealloc(q_buf, kv_buf, scores, probs, row_max, row_sum, row_scale, acc, out_buf)
