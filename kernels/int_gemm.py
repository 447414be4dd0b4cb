"""The integer prefill GEMMs: their numerics, and their operands as the NPU holds them.

Numerics, the one definition (the emulator, the kernels' host builds and the weight preparation all follow it):

* **Weights** (N × K, HF's layout), per output channel, symmetric: ``scale = absmax / 127`` in fp32,
  ``x = fp32(w · fp32(127 / absmax))``, ``hi = clamp(rint(x), ±127)`` (rint: half to even). "w8x2a16" keeps the
  rounding's residual as a second int8 term, ``lo = clamp(rint(256 · (x − hi)), ±127)`` (``x − hi`` and the product
  exact in fp32), so ``w = scale · (hi + lo / 256)`` to within ``scale / 512`` (``scale / 256`` where x is exactly
  halfway). A row of zeros has scale 0 and terms 0. Done once, when the weights are prepared.
* **Activations** (M × K), per row, symmetric, to int8 (qmax 127, "int8") or int16. For int16 the scale keeps every
  int32 sum of the GEMM exact whatever the weights, ``127 · Σ|q| ≤ 2³¹ − 1``, and is otherwise as fine as int16
  allows: ``inv = fp32(32767 / absmax)``, ``q = rint(x · inv)``; if ``127 · Σ|q| > 2³¹ − 1`` (a row whose values are
  spread evenly: rare), ``inv = fp32(inv · fp32(ACTIVATION_L1_BUDGET(K) / fp32(Σ|q| + K / 2)))`` and q again, which
  provably keeps the bound (``Σ|q| + K/2`` bounds ``inv · Σ|x|`` from above, and the budget leaves K/2 for the second
  rounding and a margin for the fp32 products); then ``scale = fp32(1 / inv)``. Σ|q| is an exact integer sum, so
  every implementation takes the same branch. A zero row has scale 0 and q 0.
* ``acc = Σ_k q · term`` exactly in int32 per weight term; ``out = bf16((fp32(acc_hi) + fp32(acc_lo) · 2⁻⁸) ·
  fp32(scale_a · scale_w))`` (one term: ``bf16(fp32(acc) · fp32(scale_a · scale_w))``), each step rounded to
  nearest even, the product by 2⁻⁸ exact.

Layouts: a kernel call multiplies ``CALL_K`` = 32 values of K, and its A and W windows each carry one more mmul
K-block (``SCALE_K`` = 4 along K, the int16 × int8 mmul's K) that holds the scales. The scales thus reach a core
through the two DMA channels that bring the operands (a compute tile has two: a third stream is refused).

* Quantized activations, a row: ``K / 32`` runs of 36 int16, each the row's next 32 q, then its fp32 scale as
  two int16 (its bits, low half first) and two zeros (``pack_activations``). Bound by Programs as int32 words.
* Prepared weights ("w8x2a16"), tiled by output column: ``tile_n`` columns (``weight_tile_n``) per tile, and per
  tile and call (32 K) one window of int8 ``[9 kb][T/8 nb][2 t][4 k][8 n]`` (T = tile_n, or 2 · tile_n for a
  [gate | up] pair: the gate's tile_n columns, then the same up columns): kb < 8 the terms' values
  ``term_t[n][32 c + 4 kb + k]`` (B operand order of ``aie::mmul<8, 4, 8, int16, int8>``), kb = 8 the scales: per nb
  block its 8 columns' fp32 scales (32 bytes) in t = 0, zeros in t = 1 (``tile_weights``). The buffer is
  (N / tile_n · K / 32) windows, tile-major, bound as int32 words.
"""
from __future__ import annotations

import torch

WEIGHT_QMAX = 127
ACTIVATION_QMAX = {"int8": 127, "w8a16": 32767, "w8x2a16": 32767}  # integer precision → largest |q| of a row
WEIGHT_TERMS = {"int8": 1, "w8a16": 1, "w8x2a16": 2}
LO_SHIFT = 8  # the second weight term's weight: 2^-LO_SHIFT
INT32_MAX = 2 ** 31 - 1

CALL_K = 32        # K values one kernel call multiplies
SCALE_K = 4        # K of one mmul block of int16 activations: the scale block appended to every call's window
CALL_COLS = CALL_K + SCALE_K
ROW_K_GRANULE = 2 * CALL_K  # K of a row quantize_rows takes: its kernel packs a row's runs in pairs
BLOCK = 8          # mmul rows (M) and columns (N)
MAX_TILE_N = 64    # accumulator columns per tile: two int32 terms of 64 × 64 take 32 KiB of L1
TILE_GRANULE = 16  # tile_n: the kernel's 2 × 2 blocks of mmuls


def activation_l1_budget(K: int) -> float:
    """The bound on Σ|q| a rescaled row is quantized against: (2³¹ − 1) / 127 less K (the second rounding's K/2 and
    as much again for the fp32 products), in fp32."""
    return float(torch.tensor(INT32_MAX // WEIGHT_QMAX - K, dtype=torch.float32))


def quantize_weight_terms(w: torch.Tensor, terms: int = 2) -> tuple[torch.Tensor, ...]:
    """W (N × K) as the integer GEMMs hold it: ``(hi, scale)`` or, with two terms, ``(hi, lo, scale)``; int8 (N × K)
    terms, fp32 scales (N,)."""
    x = w.to(torch.float32, copy=True)  # scaled in place below (the weight's fp32 temporaries dominate the preparation's time)
    absmax = x.abs().amax(-1, keepdim=True)
    inverse = torch.where(absmax > 0, torch.tensor(float(WEIGHT_QMAX)) / absmax, torch.zeros_like(absmax))
    scaled = x.mul_(inverse)
    hi = torch.round(scaled).clamp_(-WEIGHT_QMAX, WEIGHT_QMAX)
    scale = (absmax / WEIGHT_QMAX).reshape(-1)
    if terms == 1:
        return hi.to(torch.int8), scale
    lo = scaled.sub_(hi).mul_(2.0 ** LO_SHIFT).round_().clamp_(-WEIGHT_QMAX, WEIGHT_QMAX)
    return hi.to(torch.int8), lo.to(torch.int8), scale


def quantize_activations(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: each row of ``x`` (last dimension K) as int32 integers in [−qmax, qmax] and its fp32 scale
    (shape ``x.shape[:-1] + (1,)``), x ≈ q · scale; with qmax 32767 the scale also keeps 127 · Σ|q| within int32."""
    x = x.float()
    K = x.shape[-1]
    absmax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(absmax > 0, torch.tensor(float(qmax)) / absmax, torch.zeros_like(absmax))
    q = torch.round(x * inv)  # |x · inv| ≤ qmax (1 + 2⁻²³) < qmax + 1/2: no clamp needed
    if qmax > WEIGHT_QMAX:
        spent = q.abs().sum(-1, keepdim=True, dtype=torch.float64)  # exact: at most 32767 · K
        over = spent * WEIGHT_QMAX > INT32_MAX
        if bool(over.any()):
            bound = (spent + K // 2).float()
            rescaled = inv * (torch.tensor(activation_l1_budget(K)) / bound)
            inv = torch.where(over, rescaled, inv)
            q = torch.round(x * inv)
    scale = torch.where(inv > 0, torch.reciprocal(inv), torch.zeros_like(inv))
    return q.to(torch.int32), scale


def integer_product(q: torch.Tensor, scale_a: torch.Tensor, *weight: torch.Tensor) -> torch.Tensor:
    """bf16 output of quantized activations (q (M, K) integers, scale_a (M, 1)) times int8 weight terms (each
    (N, K)) with their (N,) scales, as the definition above computes it."""
    *terms, scale_w = weight
    # fp32(acc) from the exact integer sum, rounded to nearest even like the core's int32 → fp32 conversion
    acc = _integer_sum(q, terms[0]).float()
    if len(terms) == 2:
        acc = acc + _integer_sum(q, terms[1]).float() * 2.0 ** -LO_SHIFT
    return (acc * (scale_a * scale_w.reshape(1, -1))).to(torch.bfloat16)


def _integer_sum(q: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """Σ_k q[m, k] · term[n, k], exactly, as float64 (|q| < 2^15 fits the split below and an exact fp64). torch's
    int8 GEMM (``_int_mm``, int32 sums: |128 · 127 · K| < 2^31 for the K of any model here) takes q as two int8
    digits, q = 256 · hi + (lo + 128); without it (a GEMM of 16 rows or fewer, K or N not a multiple of 8), fp64
    sums, exact below 2^53."""
    (M, K), N = q.shape, term.shape[0]
    if M <= 16 or K % 8 or N % 8:
        return torch.matmul(q.double(), term.double().T)
    hi = torch.div(q, 256, rounding_mode="floor")
    lo = q - 256 * hi - 128
    b = term.T.contiguous()
    sums = torch._int_mm(hi.to(torch.int8), b).double().mul_(256)  # exact: every partial sum stays below 2^53
    return sums.add_(torch._int_mm(lo.to(torch.int8), b)).add_(128 * term.sum(1, dtype=torch.int64).double())


def integer_gemm(a: torch.Tensor, w: torch.Tensor, precision: str) -> torch.Tensor:
    """bf16 ``A · Wᵀ`` at integer ``precision`` from bf16 A (M × K) and W (N × K): both quantized here (the weights'
    quantization is a function of W alone, so this is what prepared weights give)."""
    if precision not in WEIGHT_TERMS:
        raise ValueError(f"integer_gemm: precision must be one of {', '.join(map(repr, WEIGHT_TERMS))}, "
                         f"got {precision!r}")
    q, scale_a = quantize_activations(a, ACTIVATION_QMAX[precision])
    return integer_product(q, scale_a, *quantize_weight_terms(w, WEIGHT_TERMS[precision]))


def weight_tile_n(N: int, halves: int = 1) -> int:
    """Output columns per tile of the integer GEMM (per half of a [gate | up] pair): the widest herd of up to 4 rows
    dividing N into multiples of 16, then the largest multiple of 16 up to MAX_TILE_N / halves dividing its share.
    The weights are prepared in tiles of it, and the builder takes the same."""
    if N % TILE_GRANULE:
        raise ValueError(f"weight_tile_n: N must be a multiple of {TILE_GRANULE}, got {N}")
    herd_n = next(h for h in (4, 2, 1) if (N // TILE_GRANULE) % h == 0)
    share = N // herd_n
    return next(t for t in range(MAX_TILE_N // halves, 0, -TILE_GRANULE) if share % t == 0)


def activation_cols(K: int) -> int:
    """int16 values of one quantized activation row of K."""
    if K % CALL_K:
        raise ValueError(f"the integer GEMMs take K a multiple of {CALL_K}, got {K}")
    return K // CALL_K * CALL_COLS


def activation_words(K: int) -> int:
    return activation_cols(K) // 2


def pack_activations(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(M, K) integers and their (M, 1) fp32 scales as the quantized-activation rows: (M, activation_words(K))
    int32 words."""
    M, K = q.shape
    runs = torch.zeros(M, K // CALL_K, CALL_COLS, dtype=torch.int16)
    runs[:, :, :CALL_K] = q.reshape(M, K // CALL_K, CALL_K).to(torch.int16)
    runs[:, :, CALL_K:CALL_K + 2] = scale.reshape(M, 1, 1).float().expand(M, K // CALL_K, 1).contiguous() \
        .view(torch.int16)
    return runs.reshape(M, -1).view(torch.int32)


def unpack_activations(words: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_activations``' inverse: ((M, K) int32 integers, (M, 1) fp32 scales, from the first run)."""
    runs = words.contiguous().view(torch.int16).reshape(words.shape[0], K // CALL_K, CALL_COLS)
    scale = runs[:, 0, CALL_K:CALL_K + 2].contiguous().view(torch.float32).reshape(-1, 1)
    return runs[:, :, :CALL_K].reshape(words.shape[0], K).to(torch.int32), scale


def window_bytes(tile_columns: int) -> int:
    """Bytes of one call's prepared-weight window over ``tile_columns`` accumulator columns (two terms)."""
    return (CALL_K + SCALE_K) // SCALE_K * (tile_columns // BLOCK) * 2 * SCALE_K * BLOCK


def tile_weights(hi: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, tile_n: int, halves: int = 1) -> torch.Tensor:
    """Two-term weights (hi, lo: (C, K) int8, scale: (C,) fp32; C = N, or for a [gate | up] pair (``halves`` 2) the
    gate's N rows then the up's) tiled as the GEMM reads them: (tiles · K / 32, window words) int32, a tile being
    tile_n columns (tile_n of the gate, then the same of the up)."""
    C, K = hi.shape
    if K % CALL_K:
        raise ValueError(f"tile_weights: K must be a multiple of {CALL_K}, got {K}")
    pairs = _tile_columns(C, tile_n, halves)
    calls, T = K // CALL_K, pairs.shape[1]
    terms = torch.stack([hi, lo])[:, pairs]                        # (2, tiles, T, K)
    blocks = terms.reshape(2, -1, T // BLOCK, BLOCK, calls, CALL_K // SCALE_K, SCALE_K)
    # → [tile][call][kb][nb][t][k][n]
    values = blocks.permute(1, 4, 5, 2, 0, 6, 3)
    window = torch.zeros(values.shape[0], calls, CALL_K // SCALE_K + 1, T // BLOCK, 2, SCALE_K, BLOCK,
                         dtype=torch.int8)
    window[:, :, :-1] = values
    scales = scale.float()[pairs].reshape(-1, 1, T // BLOCK, BLOCK).expand(-1, calls, -1, -1).contiguous()
    window[:, :, -1, :, 0] = scales.view(torch.int8).reshape(-1, calls, T // BLOCK, SCALE_K, BLOCK)
    return window.reshape(-1, window_bytes(T)).view(torch.int32)


def untile_weights(words: torch.Tensor, C: int, K: int, tile_n: int, halves: int = 1) -> tuple[torch.Tensor, ...]:
    """``tile_weights``' inverse: (hi, lo, scale) of C columns."""
    calls = K // CALL_K
    pairs = _tile_columns(C, tile_n, halves)
    T = pairs.shape[1]
    window = words.contiguous().view(torch.int8).reshape(-1, calls, CALL_K // SCALE_K + 1, T // BLOCK, 2, SCALE_K,
                                                         BLOCK)
    values = window[:, :, :-1].permute(4, 0, 3, 6, 1, 2, 5).reshape(2, -1, K)  # (2, tiles · T, K)
    scales = window[:, 0, -1, :, 0].contiguous().view(torch.float32).reshape(-1)
    order = pairs.reshape(-1)
    hi, lo = torch.empty(C, K, dtype=torch.int8), torch.empty(C, K, dtype=torch.int8)
    hi[order], lo[order] = values[0], values[1]
    scale = torch.empty(C)
    scale[order] = scales
    return hi, lo, scale


def prepared_weight_shape(out_features: int, in_features: int, halves: int = 1) -> tuple[int, int]:
    """(windows, window words) of a prepared weight (a [gate | up] pair of (out, in) weights with ``halves`` 2)."""
    tile_n = weight_tile_n(out_features, halves)
    return (out_features // tile_n * (activation_cols(in_features) // CALL_COLS),
            window_bytes(halves * tile_n) // 4)


def prepared_out_features(shape, in_features: int, halves: int = 1) -> int | None:
    """The out features a prepared weight of ``shape`` holds at ``in_features`` (None if no weight has it)."""
    windows, words = shape
    calls, column_words = in_features // CALL_K, window_bytes(BLOCK) // 4 // BLOCK  # words per column of a window
    if in_features % CALL_K or not calls or words % (halves * column_words) or windows % calls:
        return None
    tile_n = words // (halves * column_words)
    N = windows // calls * tile_n
    return N if N and N % TILE_GRANULE == 0 and weight_tile_n(N, halves) == tile_n else None


PREPARE_COLUMNS = 2048  # output columns quantized at a time: their fp32 temporaries, not the whole weight's


def prepare_weight(w: torch.Tensor, halves: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """A bf16 weight (or the [gate; up] rows of a pair, ``halves`` 2) quantized to two int8 terms and tiled as the
    integer GEMMs read it (into ``out``, int32 words of ``prepared_weight_shape``, if given), a few tiles at a time
    (each column is quantized on its own, so the result does not depend on the chunking)."""
    C, K = w.shape
    N = C // halves
    tile_n = weight_tile_n(N, halves)
    out = torch.empty(prepared_weight_shape(N, K, halves), dtype=torch.int32) if out is None else out
    step = max(tile_n, PREPARE_COLUMNS // tile_n * tile_n)
    windows = K // CALL_K
    for start in range(0, N, step):
        stop = min(N, start + step)
        columns = torch.cat([w[h * N + start:h * N + stop] for h in range(halves)])
        tiles = tile_weights(*quantize_weight_terms(columns), tile_n, halves)
        out[start // tile_n * windows:stop // tile_n * windows] = tiles
    return out


def _tile_columns(C: int, tile_n: int, halves: int) -> torch.Tensor:
    """(tiles, halves · tile_n) column indices of each tile: tile_n consecutive columns of each half."""
    N = C // halves
    if C % halves or N % tile_n or tile_n % TILE_GRANULE:
        raise ValueError(f"{C} columns in {halves} half(s) do not split into tiles of {tile_n} (a multiple of "
                         f"{TILE_GRANULE})")
    tiles = torch.arange(N).reshape(N // tile_n, 1, tile_n)
    return (tiles + N * torch.arange(halves).reshape(1, halves, 1)).reshape(N // tile_n, halves * tile_n)
