"""attention(seq, heads, kv_heads, head_dim, causal): flash attention, seq-first, GQA, scale 1/sqrt(head_dim).

q/out are (seq, heads*head_dim), every head interleaved per position (the projections' natural output);
kv is (2, seq, kv_heads*head_dim), laid out KV head by KV head: its keys, then its values, each in 8-column
blocks of all positions (a ``stack`` launch gathers them), so one DMA brings a tile a key block and the value
block of the same positions, and one shim task streams a head's blocks to the herd in every round. The copies
into a core and out of it lay the tiles out in the 8x8 blocks attention.cc's mmuls take (each block row-major;
8 contiguous values, 16 bytes, are the innermost run of every access pattern): the queries and outputs column
block by column block by the memtile's 3-D pattern, the key/value block by the shim's (a 3-D pattern thanks to
stack's layout), so the kernel loads each operand block whole.

Schedule: one launch step per (KV head, ``herd_heads`` query heads of its group); the step's herd spans the
array: ``herd_q`` columns × ``herd_heads`` rows (8 × 4 = 32 tiles for Llama-3.2-1B's groups of 4). A group that
no 2 to 4 rows divide (1: multi-head attention; 7: Qwen2.5-0.5B's) takes one head per step, and its ``q_rows``
rows take parts of the sequence instead. The step's L2 buffers are then laid out column by column,
[x][tile][tile_q][head_dim] with tile ``r*q_rows + y``, and filled by a DDR window of that rank, so that
air-split-l2-memref gives each column's memtile its own tiles. (Part y as the step's column block y of a
(positions, columns) buffer, filled through a 4-D window, lowered with each column's shim BDs taking twice its
rows, past the argument's end.)

* DDR → memtiles: the step's queries (all positions, its heads' columns), once per step; AIR splits the
  buffer across the memtiles by the columns that read it. The outputs go back the same way.
* Core (x, y) owns query head ``y`` of the step and, in round r (an ``scf.for`` in the core), the
  ``tile_q`` query rows starting at ``r*block_q + x*tile_q`` (``block_q = herd_q*tile_q``). With ``q_rows``, row y
  owns part y of the step's one head: in round r, the positions from ``(r*q_rows + y)*block_q + x*tile_q``. Its causal
  position comes from its herd coordinates and its own loop indices: no value derived from a launch index
  reaches a core (aircc would turn it into a host-written runtime parameter, read behind a lock once per
  launch step).
* Every tile of the step shares one KV head, so the key/value blocks (``tile_kv`` positions, keys then
  values) reach all of them as one broadcast stream from DDR.
* Per block, a core runs the tile primitives of attention.o (scores with the causal mask, online-softmax
  update, P·V accumulation) only if the block is not wholly in the future of its queries
  (``k_start <= q_start + tile_q - 1``): about half the blocks of a long sequence are skipped. At the end of
  the round, the normalization. Row max, row sum and the f32 accumulator stay in L1 for the round.
* The key/value block is double-buffered: AIR's ping-pong transform gives it a ping and a pong copy, so the
  next block streams in while the core works on this one. Every other buffer of a core (query and output
  tiles, scores, probabilities, row state, accumulator) is allocated at segment scope, a slab per core, so
  that the kv loop is the only loop allocating a buffer: AIR (0e3df89d) labels each loop that allocates one
  for ping-pong, and with the round's buffers allocated in the rounds loop it labels that loop as well and
  its transform fails on the nested pair ("operand does not dominate this use"). At segment scope the round's
  buffers stay single and only the block is doubled. (The output tile cannot share the query tile's L1: the
  DMA refilling the query tile for the next round and the one draining the output hold separate locks, so
  they would race.)

Every round still streams every key/value block (the stream is shared and its length must not depend on
the round for AIR to keep it one broadcast channel); stopping the stream at the round's causal frontier,
and upstream's cascade of key/value stages, are left for later. Upstream's temporal-causal design
(flash_attention/kernel_fusion_based/attn_npu2_temporal_causal.py) found the frontier costly on NPU2 too:
each round's prefix is a shim transfer of its own size, all in flight at once, which it measured to
deadlock past 6 rounds, so beyond that it also streams the full sequence every round.

The kernels mask by position, so only causal attention is supported.

Constraints: causal; heads a multiple of kv_heads; head_dim a multiple of 16; tile_q a multiple of 8,
herd_q*tile_q dividing seq; tile_kv a multiple of 16 dividing seq; herd_heads dividing the group
(heads // kv_heads) and at most the array's 4 rows; the tile's buffers (Q, the K/V block's ping and pong,
scores, probabilities, accumulator, row state, output) fit L1 (tile_kv the largest that does: 32 at tile_q 32
and head_dim 64); the step's queries and outputs fit the memtiles.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..device import DEVICE
from .ir import L1, L2, WHOLE, LaunchBuilder, LaunchIR, MemRef, Value, Window
from .npu2 import (L1_AVAILABLE, check_budget, check_operands, divisors_descending, l1_elements, nbytes,
                   pingpong_copies, require)

BLOCK = 8  # attention.cc's buffers are pre-tiled into 8x8 blocks, each row-major

KIND = "attention"
PARAMS = ("seq", "heads", "kv_heads", "head_dim", "causal")
TUNING = ("herd_q", "herd_heads", "q_rows", "tile_q", "tile_kv")
OBJECT = "attention.o"
TILE_Q_CANDIDATES = (32, 16, 8)
TILE_KV_CANDIDATES = (64, 32, 16)  # attention.cc's AIE path needs multiples of 16
KV_GRANULE = 16


def _l1_bytes(tile_q: int, tile_kv: int, head_dim: int, seq: int) -> dict[str, int]:
    copies = pingpong_copies(seq // tile_kv)  # the kv loop's trips: one block each
    return {"Q tile": nbytes((tile_q, head_dim), "bf16"),
            f"K/V block x{copies} (ping-pong)": copies * nbytes((2, tile_kv, head_dim), "bf16"),
            "f32 scores": nbytes((tile_q, tile_kv), "f32"),
            "bf16 probabilities": nbytes((tile_q, tile_kv), "bf16"),
            "f32 accumulator": nbytes((tile_q, head_dim), "f32"),
            "row max, sum and scale": 3 * nbytes((l1_elements(tile_q, "f32"),), "f32"),
            "output tile": nbytes((tile_q, head_dim), "bf16")}


def _default_tile_q(seq: int) -> int | None:
    """The tile that spreads a round over the most columns; among those, the largest."""
    dividing = [t for t in TILE_Q_CANDIDATES if seq % t == 0]
    return max(dividing, key=lambda t: (divisors_descending(seq // t, DEVICE.columns)[0], t), default=None)


def build(params: dict, operands, tuning: dict) -> LaunchIR:
    seq, heads, kv_heads, head_dim = (params[n] for n in ("seq", "heads", "kv_heads", "head_dim"))
    causal = params["causal"]
    require(causal is True, KIND, "causal", causal, "attention.o masks by position: only causal=True is supported")
    require(heads % kv_heads == 0, KIND, "heads", heads, f"must be a multiple of kv_heads={kv_heads}")
    group = heads // kv_heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    check_operands(KIND, operands, [("q", {(seq, q_dim)}, "bf16"), ("kv", {(2, seq, kv_dim)}, "bf16"),
                                    ("out", {(seq, q_dim)}, "bf16")])
    require(head_dim % KV_GRANULE == 0, KIND, "head_dim", head_dim, f"must be a multiple of {KV_GRANULE}")
    tile_q = tuning.get("tile_q", _default_tile_q(seq))
    require(tile_q is not None and seq % tile_q == 0 and tile_q % DEVICE.mmul_granule == 0, KIND, "tile_q", tile_q,
            f"must divide seq={seq} and be a multiple of {DEVICE.mmul_granule}")
    herd_q = tuning.get("herd_q", divisors_descending(seq // tile_q, DEVICE.columns)[0])
    require(herd_q <= DEVICE.columns, KIND, "herd_q", herd_q, f"the herd spans at most {DEVICE.columns} columns")
    require(seq % (herd_q * tile_q) == 0, KIND, "herd_q", herd_q, f"herd_q*tile_q must divide seq={seq}")
    herd_heads = tuning.get("herd_heads", divisors_descending(group, DEVICE.rows)[0])
    require(herd_heads <= DEVICE.rows and group % herd_heads == 0, KIND, "herd_heads", herd_heads,
            f"must divide the group of {group} query heads per KV head and be at most {DEVICE.rows} (the array's rows)")
    block_q = herd_q * tile_q
    q_rows = tuning.get("q_rows", divisors_descending(seq // block_q, DEVICE.rows)[0] if herd_heads == 1 else 1)
    require(q_rows == 1 or (herd_heads == 1 and q_rows <= DEVICE.rows and seq % (q_rows * block_q) == 0), KIND,
            "q_rows", q_rows, f"parts of the sequence on the rows need herd_heads=1, at most {DEVICE.rows} rows and "
            f"q_rows*herd_q*tile_q dividing seq={seq}")
    dividing = [t for t in TILE_KV_CANDIDATES if seq % t == 0] or [KV_GRANULE]
    tile_kv = tuning.get("tile_kv") or next(
        (t for t in dividing if sum(_l1_bytes(tile_q, t, head_dim, seq).values()) <= L1_AVAILABLE), dividing[-1])
    require(seq % tile_kv == 0 and tile_kv % KV_GRANULE == 0, KIND, "tile_kv", tile_kv,
            f"must divide seq={seq} and be a multiple of {KV_GRANULE}")
    l1 = _l1_bytes(tile_q, tile_kv, head_dim, seq)
    check_budget(KIND, "L1", l1, "lower tile_q or tile_kv")
    # AIR splits the step's query and output buffers across the memtiles of the herd's columns.
    rows = herd_heads * q_rows
    column_share = (seq // herd_q, herd_heads * head_dim)
    check_budget(KIND, "L2", {"a column's queries": nbytes(column_share, "bf16"),
                              "a column's outputs": nbytes(column_share, "bf16")},
                 "raise herd_q or lower herd_heads")

    b = LaunchBuilder(KIND, operands, ("q", "kv", "out"))
    steps = (kv_heads, group // herd_heads)
    b.comment(f"attention seq={seq} heads={heads} kv_heads={kv_heads} head_dim={head_dim} causal={causal}: "
              f"herd {herd_q}x{rows}" + (f" (the sequence in {q_rows} parts)" if q_rows > 1 else "")
              + f", tile_q {tile_q}, tile_kv {tile_kv}, {seq // (q_rows * block_q)} rounds per core, "
              f"{steps[0]}x{steps[1]} launch steps")
    with b.launch("attention", steps, b.operands) as ((kv_head, head_block), _, (q, kv, out)):
        indices = [Value(i, "index") for i in (kv_head, head_block)]
        with b.segment("attention_seg", [*indices, q, kv, out]) as (_, _, (s_kv_head, s_head_block, sq, skv, so)):
            first_head = b.affine(f"s0 * {group} + s1 * {herd_heads}", [s_kv_head.ssa, s_head_block.ssa],
                                  "first_head")
            q_col = b.affine(f"s0 * {head_dim}", [first_head], "q_col")
            kv_col = b.affine(f"s0 * {head_dim}", [s_kv_head.ssa], "kv_col")
            # The step's queries and outputs, all rounds: AIR splits each across the memtiles by column.
            if q_rows == 1:
                l2_shape = (seq, rows * head_dim)
                step_window = Window((0, q_col), l2_shape, (q_dim, 1))
            else:  # column x's tiles first: [x][round*q_rows + part][tile_q][head_dim], the DDR window of that rank
                l2_shape = (herd_q, seq // block_q, tile_q, head_dim)
                step_window = Window((0, 0, 0, q_col), l2_shape, (tile_q * q_dim, block_q * q_dim, q_dim, 1))
            q_l2 = b.alloc(MemRef(l2_shape, "bf16", L2), "q_l2")
            o_l2 = b.alloc(MemRef(l2_shape, "bf16", L2), "o_l2")
            b.dma(q_l2, WHOLE, sq, step_window)
            tiling = _Tiling(seq, head_dim, tile_q, tile_kv, block_q, q_rows)
            tile_state = _tile_state(b, (herd_q, rows), tiling)
            with b.herd("attention_herd", (herd_q, rows), [Value(kv_col, "index"), skv, q_l2, o_l2, *tile_state],
                        link_with=OBJECT) as ((tx, ty), _, (h_kv_col, hkv, hq, ho, *h_state)):
                _emit_core(b, tx, ty, h_kv_col.ssa, hkv, hq, ho, [b.slab(s, [tx, ty]) for s in h_state], tiling)
            b.dma(so, step_window, o_l2, WHOLE)
            b.dealloc(q_l2, o_l2, *tile_state)
    return b.finish(l1)


@dataclass(frozen=True)
class _Tiling:
    seq: int
    head_dim: int
    tile_q: int
    tile_kv: int
    block_q: int
    q_rows: int  # >1: row y of the herd holds part y of the sequence, not a head


def _tile_state(b: LaunchBuilder, herd: tuple[int, int], t: _Tiling) -> list[Value]:
    """Each core's buffers but the key/value block, at segment scope (a slab per core, single: the module docstring
    says why): the query tile, scores, probabilities, row max, sum and scale, the accumulator and the output tile."""
    tile_q, tile_kv, head_dim = t.tile_q, t.tile_kv, t.head_dim
    shapes = [("q_l1", tile_q * head_dim, "bf16"), ("scores_l1", tile_q * tile_kv, "f32"),
              ("probs_l1", tile_q * tile_kv, "bf16"), ("row_max_l1", l1_elements(tile_q, "f32"), "f32"),
              ("row_sum_l1", l1_elements(tile_q, "f32"), "f32"), ("row_scale_l1", l1_elements(tile_q, "f32"), "f32"),
              ("acc_l1", tile_q * head_dim, "f32"), ("out_l1", tile_q * head_dim, "bf16")]
    return [b.alloc(MemRef((*herd, n), dtype, L1), name) for name, n, dtype in shapes]


def _emit_core(b: LaunchBuilder, tx, ty, kv_col, kv, q_step, o_step, state, t: _Tiling) -> None:
    """One core's rounds: in each, its query tile against the key/value blocks its queries can see."""
    seq, head_dim, tile_q, tile_kv = t.seq, t.head_dim, t.tile_q, t.tile_kv
    q_buf, scores, probs, row_max, row_sum, row_scale, acc, out_buf = state
    kv_buf = b.alloc(MemRef((2, tile_kv, head_dim), "bf16", L1), "kv_l1")
    config = {"ATTN_TQ": tile_q, "ATTN_TK": tile_kv, "ATTN_HEAD_DIM": head_dim}
    if t.q_rows == 1:  # the core's head: its columns of the step's queries and outputs, in 8-column blocks
        block_width = q_step.type.shape[-1]
        local_col_block = b.affine(f"s0 * {head_dim // BLOCK}", [ty], "local_col_block")
        rounds = b.loop(0, seq, t.block_q, "round")  # each round's first row
    else:  # the core's part of each round: a tile of its column's share of the step's L2 buffers
        tiles = q_step.type.shape[1]
        rounds = b.loop(0, tiles // t.q_rows, 1, "round")
    with rounds as round_index:
        # the tile in attention.cc's [head_dim/8][tile_q/8][8][8] blocks: a column block's rows are consecutive
        if t.q_rows == 1:  # the L2 row is the position
            first_query = b.affine(f"s0 + s1 * {tile_q}", [round_index, tx], "q_row")
            last_row = b.affine(f"s0 + s1 * {tile_q} + {tile_q - 1}", [round_index, tx], "last_row")
            tile_window = Window((local_col_block, first_query, 0), (head_dim // BLOCK, tile_q, BLOCK),
                                 (BLOCK, block_width, 1))
        else:  # part y of round r: tile r*q_rows + y of column x's share, positions from that tile's block_q on
            tile = b.affine(f"s0 * {t.q_rows} + s1", [round_index, ty], "tile")
            first_query = b.affine(f"s0 * {t.block_q} + s1 * {tile_q}", [tile, tx], "first_query")
            last_row = b.affine(f"s0 + {tile_q - 1}", [first_query], "last_row")
            tile_window = Window((tx, tile, 0, 0, 0), (1, 1, head_dim // BLOCK, tile_q, BLOCK),
                                 (tiles * tile_q * head_dim, tile_q * head_dim, BLOCK, head_dim, 1))
        b.dma(q_buf, WHOLE, q_step, tile_window)
        b.call("attn_init_f32", [row_max, row_sum, acc], config)
        q_start = b.index_to_i32(first_query, "q_start")
        with b.loop(0, seq, tile_kv, "kv") as k_first:
            # keys then values, each in [head_dim/8][tile_kv/8][8][8] blocks: kv holds the KV head's keys then its
            # values, each 8-column block of all positions contiguously (the stack launch), so each column block is
            # one run, and one stride steps from the keys' last column block to the values' first
            b.dma(kv_buf, WHOLE, kv, Window((kv_col, 0, k_first, 0), (1, 2 * head_dim // BLOCK, 1, tile_kv * BLOCK),
                                            (2 * seq, seq * BLOCK, BLOCK, 1)))
            with b.when(b.index_at_most(k_first, last_row, "visible")):
                k_start = b.index_to_i32(k_first, "k_start")
                b.call("attn_qk_tile_bf16", [q_buf, kv_buf, scores, q_start, k_start], config)
                b.call("attn_online_softmax_bf16", [scores, probs, row_max, row_sum, row_scale], config)
                b.call("attn_pv_accumulate_bf16", [probs, kv_buf, row_scale, acc], config)
        b.call("attn_finalize_bf16", [acc, row_sum, out_buf], config)
        b.dma(o_step, tile_window, out_buf, WHOLE)
    b.dealloc(kv_buf)
