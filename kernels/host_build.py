"""The AIE2P kernels built for the host: same C++ sources, compiled by g++, called from torch through ctypes.

Every kernel under ``aie2p/`` has a portable scalar path that is selected when the compiler is not Peano
(``__AIENGINE__`` undefined). Built here, that path is an executable statement of the kernel's contract —
tile sizes, layouts, masking, rounding — which tests hold against ``ops/reference.py`` and which a builder can
mirror tile for tile. bf16 crosses the boundary as its uint16 bit pattern: a torch bf16 tensor is handed over
by reinterpreting its storage, and the kernels round their fp32 results to nearest-even.

Shared libraries are cached by a hash of the sources, the -D defines and the compiler's identity, under
``$TORCH_NPU2_HOST_KERNEL_CACHE`` (default: a per-user folder in the system temp dir). Each is compiled into a
private temporary file and renamed into place, so concurrent builders never see a partial library.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

import torch

from . import catalog
from .builders.externs import kernel_symbol
from .program import pad_rows
from .toolchain import KERNEL_SOURCE_DIR

KERNEL_DIR = KERNEL_SOURCE_DIR
CXX_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++20")
# For the emulator's hot kernels: vectorized for this CPU, with fp32 sums free to reassociate (the NPU's
# lanes sum in their own order too); no other fast-math liberties, so rounding helpers stay exact.
FAST_CXX_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
                  "-fno-trapping-math", "-shared", "-fPIC", "-std=c++20")

Defines = Mapping[str, int | float | str]


class HostBuildError(RuntimeError):
    """g++ rejected a kernel source; the message carries the compiler's output."""


def host_compiler() -> str | None:
    """The host C++ compiler: ``$TORCH_NPU2_HOST_CXX`` or ``g++`` on PATH; None when there is none."""
    return shutil.which(os.environ.get("TORCH_NPU2_HOST_CXX", "g++"))


def cache_dir() -> Path:
    configured = os.environ.get("TORCH_NPU2_HOST_KERNEL_CACHE")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"torch_npu2-host-kernels-{os.getuid()}"


@lru_cache(maxsize=None)
def _compiler_identity(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    return f"{os.path.realpath(compiler)}\n{version}"


def define_flags(defines: Defines) -> list[str]:
    flags = []
    for name, value in sorted(defines.items()):
        if not name.isidentifier():
            raise ValueError(f"not a macro name: {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError(f"-D{name}: expected int, float or str, got {type(value).__name__}")
        flags.append(f"-D{name}={value!r}" if isinstance(value, float) else f"-D{name}={value}")
    return flags


def sources_digest(source: Path) -> bytes:
    """The kernel and every header beside it: a header edit must rebuild."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(KERNEL_DIR.glob("*.h")):
        digest.update(header.name.encode())
        digest.update(header.read_bytes())
    return digest.digest()


def build(source_name: str, defines: Defines | None = None, fast: bool = False) -> Path:
    """Compile ``aie2p/<source_name>`` with the given -D defines (``fast``: ``FAST_CXX_FLAGS``); returns the
    cached shared library."""
    source = KERNEL_DIR / source_name
    flags = [*(FAST_CXX_FLAGS if fast else CXX_FLAGS), *define_flags(defines or {})]
    return cached_compile(f"{source.stem}.so", [*flags, str(source)], [sources_digest(source)])


def cached_compile(name: str, arguments: list[str], inputs: list[bytes]) -> Path:
    """``<compiler> <arguments> -o <output>``, cached under :func:`cache_dir` by the compiler's identity, the
    arguments and ``inputs`` (the bytes the output depends on that the arguments only name); ``name`` is
    ``<stem>.<suffix>`` of the output."""
    compiler = host_compiler()
    if compiler is None:
        raise HostBuildError("no host C++ compiler: install g++ or set TORCH_NPU2_HOST_CXX")
    key = hashlib.sha256()
    for part in (_compiler_identity(compiler).encode(), "\0".join(arguments).encode(), *inputs):
        key.update(part)
        key.update(b"\0")
    stem, suffix = name.split(".", 1)
    output = cache_dir() / f"{stem}-{key.hexdigest()[:20]}.{suffix}"
    if output.exists():
        return output
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{output.stem}-", suffix=f".{suffix}.partial", dir=output.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *arguments, "-o", partial], capture_output=True, text=True)
        if result.returncode != 0:
            raise HostBuildError(f"{compiler} {' '.join(arguments)} failed:\n{result.stderr}")
        os.replace(partial, output)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return output


_load_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL] = {}


def load(source_name: str, defines: Defines | None = None, fast: bool = False) -> ctypes.CDLL:
    """Build (or reuse) and load a kernel variant; each library is loaded once per process."""
    library = build(source_name, defines, fast)
    with _load_lock:
        if library not in _loaded:
            _loaded[library] = ctypes.CDLL(str(library))
        return _loaded[library]


_SCALAR_ARGTYPES = {"i": ctypes.c_int32, "f": ctypes.c_float}  # any other argument letter is a pointer


def _function(library: ctypes.CDLL, symbol: str) -> ctypes._CFuncPtr:
    """``symbol`` of ``library``, its ctypes argument types from its record (builders/externs.py)."""
    function = getattr(library, symbol)
    function.argtypes = [_SCALAR_ARGTYPES.get(a, ctypes.c_void_p) for a in kernel_symbol(symbol).arguments]
    function.restype = None
    return function


def _require_bf16(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype != torch.bfloat16:
        raise TypeError(f"{name}: expected a torch.bfloat16 tensor, got {tensor.dtype}")
    return tensor.detach().contiguous()


def _round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def rope_half_split(x: torch.Tensor, lut: torch.Tensor, head_dim: int, *, tile_rows: int = 4) -> torch.Tensor:
    """``rope_half_split_bf16`` over x (rows, heads*head_dim) and lut (rows, head_dim), tile by tile."""
    x, lut = _require_bf16("x", x), _require_bf16("lut", lut)
    rows, width = x.shape
    if width % head_dim or lut.shape != (rows, head_dim):
        raise ValueError(f"x {tuple(x.shape)} and lut {tuple(lut.shape)} do not fit head_dim {head_dim}")
    library = load("rope_half_split.cc",
                   {"ROPE_ROWS": tile_rows, "ROPE_HEADS": width // head_dim, "ROPE_HEAD_DIM": head_dim})
    kernel = _function(library, "rope_half_split_bf16")
    padded_rows = _round_up(rows, tile_rows)
    x_tiles, lut_tiles = pad_rows(x, padded_rows), pad_rows(lut, padded_rows)
    y = torch.empty_like(x_tiles)
    for first in range(0, padded_rows, tile_rows):
        kernel(x_tiles[first].data_ptr(), lut_tiles[first].data_ptr(), y[first].data_ptr())
    return y[:rows]


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, tile: int = 512) -> torch.Tensor:
    """``silu_mul_bf16`` elementwise over same-shaped gate and up, ``tile`` elements per call."""
    gate, up = _require_bf16("gate", gate), _require_bf16("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    kernel = _function(load("silu_mul.cc", {"SILU_MUL_LEN": tile}), "silu_mul_bf16")
    count = gate.numel()
    padded = _round_up(count, tile)
    gate_flat, up_flat = pad_rows(gate.reshape(-1), padded), pad_rows(up.reshape(-1), padded)
    out = torch.empty_like(gate_flat)
    for first in range(0, padded, tile):
        kernel(gate_flat[first:].data_ptr(), up_flat[first:].data_ptr(), out[first:].data_ptr())
    return out[:count].reshape(gate.shape)


def gemv(w: torch.Tensor, x: torch.Tensor, *, tile_rows: int = 32, out_dtype=torch.bfloat16,
         fast: bool = False) -> torch.Tensor:
    """``gemv_bf16`` (or ``gemv_bf16_f32`` for ``out_dtype=torch.float32``): y = w @ x for w (out, in) and
    x (in,), ``tile_rows`` rows of w per call; ``fast`` builds with ``FAST_CXX_FLAGS``."""
    w, x = _require_bf16("w", w), _require_bf16("x", x)
    rows, depth = w.shape
    if x.shape != (depth,):
        raise ValueError(f"w {tuple(w.shape)} and x {tuple(x.shape)} do not fit")
    symbol = {torch.bfloat16: "gemv_bf16", torch.float32: "gemv_bf16_f32"}[out_dtype]
    library = load("gemv.cc", {"GEMV_ROWS": tile_rows, "GEMV_K": depth}, fast)
    kernel = _function(library, symbol)
    padded_rows = _round_up(rows, tile_rows)
    w_tiles = pad_rows(w, padded_rows)
    y = torch.empty(padded_rows, dtype=out_dtype)
    for first in range(0, padded_rows, tile_rows):
        kernel(w_tiles[first].data_ptr(), x.data_ptr(), y[first:].data_ptr())
    return y[:rows]


def _prepared_x(x: torch.Tensor, k: int, quant_code: int, fast: bool) -> torch.Tensor:
    """x as the packed GEMVs of K ``k`` (a call's K) read it: ``gemv_q_prepare_x`` over a copy (transposed per group
    of 32 blocks; as it is for rows of whole-row groups)."""
    x = x.clone()
    library = load("gemv.cc", {"GEMV_ROWS": 1, "GEMV_K": k, "GEMV_QUANT": quant_code}, fast)
    _function(library, "gemv_q_prepare_x")(x.data_ptr(), x.shape[0])
    return x


def gemv_packed(w: torch.Tensor, x: torch.Tensor, weights: str, *, tile_rows: int = 32, out_dtype=torch.float32,
                k_chunk: int | None = None, fast: bool = False) -> torch.Tensor:
    """``gemv_q_bf16_f32`` (or ``gemv_q_bf16`` for bf16) over a packed weight (kernels/quant.py, format
    ``weights``): w (out, row_bytes) uint8, x (in,) bf16, ``tile_rows`` rows per call. With ``k_chunk`` (whole
    groups of a row), ``gemv_q_partial_f32`` walks each row group's K in chunks of it and the fp32 sums return."""
    x = _require_bf16("x", x)
    depth = x.shape[0]
    from .quant import GEMV_QUANT, weight_format
    fmt = weight_format(weights)
    w = w.contiguous().view(torch.uint8) if w.dtype == torch.int32 else w
    if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != fmt.row_bytes(depth):
        raise ValueError(f"w must be (rows, {fmt.row_bytes(depth)}) uint8 for {weights} rows of {depth}, got "
                         f"{tuple(w.shape)} {w.dtype}")
    rows = w.shape[0]
    padded_rows = _round_up(rows, tile_rows)
    w_tiles = pad_rows(w, padded_rows)
    x = _prepared_x(x, k_chunk or depth, GEMV_QUANT[weights], fast)
    if k_chunk is None or k_chunk == depth:
        symbol = {torch.bfloat16: "gemv_q_bf16", torch.float32: "gemv_q_bf16_f32"}[out_dtype]
        library = load("gemv.cc", {"GEMV_ROWS": tile_rows, "GEMV_K": depth, "GEMV_QUANT": GEMV_QUANT[weights]}, fast)
        kernel = _function(library, symbol)
        y = torch.empty(padded_rows, dtype=out_dtype)
        for first in range(0, padded_rows, tile_rows):
            kernel(w_tiles[first].data_ptr(), x.data_ptr(), y[first:].data_ptr())
        return y[:rows]
    library = load("gemv.cc", {"GEMV_ROWS": tile_rows, "GEMV_K": k_chunk, "GEMV_QUANT": GEMV_QUANT[weights]}, fast)
    partial = _function(library, "gemv_q_partial_f32")
    chunk_bytes = fmt.row_bytes(k_chunk)
    y = torch.empty(padded_rows, dtype=torch.float32)
    for first in range(0, padded_rows, tile_rows):
        for k0 in range(0, depth, k_chunk):
            start = k0 // k_chunk * chunk_bytes
            chunk = w_tiles[first:first + tile_rows, start:start + chunk_bytes].contiguous()
            partial(chunk.data_ptr(), x.data_ptr(), y[first:].data_ptr(), k0)
    return y[:rows].to(out_dtype)


def dequant_rows(w: torch.Tensor, in_features: int, weights: str, *, tile_rows: int = 4,
                 fast: bool = False) -> torch.Tensor:
    """``gemv_q_dequant_bf16`` over a packed weight (kernels/quant.py, format ``weights``: w (out, row_bytes) uint8
    or int32 words), ``tile_rows`` rows per call: the (out, in_features) bf16 weight."""
    from .quant import GEMV_QUANT, as_bytes, weight_format
    w = as_bytes(w)
    row_bytes = weight_format(weights).row_bytes(in_features)
    if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != row_bytes:
        raise ValueError(f"w must be (rows, {row_bytes}) uint8 for {weights} rows of {in_features}, got "
                         f"{tuple(w.shape)} {w.dtype}")
    rows = w.shape[0]
    padded_rows = _round_up(rows, tile_rows)
    w_tiles = pad_rows(w, padded_rows)
    library = load("gemv.cc", {"GEMV_ROWS": tile_rows, "GEMV_K": in_features, "GEMV_QUANT": GEMV_QUANT[weights]}, fast)
    kernel = _function(library, "gemv_q_dequant_bf16")
    out = torch.empty(padded_rows, in_features, dtype=torch.bfloat16)
    for first in range(0, padded_rows, tile_rows):
        kernel(w_tiles[first].data_ptr(), out[first].data_ptr())
    return out[:rows]


def gemv_add(w: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, *, tile_rows: int = 8,
             k_chunk: int | None = None) -> torch.Tensor:
    """``bf16(W x) + residual`` the way the fused ``gemv_add`` launch walks it: per ``tile_rows`` rows,
    ``gemv_partial_f32`` over K in chunks of ``k_chunk`` (default: all of K), then ``gemv_add_bf16``."""
    w, x, residual = _require_bf16("w", w), _require_bf16("x", x), _require_bf16("residual", residual)
    rows, depth = w.shape
    k_chunk = k_chunk or depth
    if x.shape != (depth,) or residual.shape != (rows,) or depth % k_chunk or rows % tile_rows:
        raise ValueError(f"w {tuple(w.shape)}, x {tuple(x.shape)}, residual {tuple(residual.shape)}: expected "
                         f"x of the row length, residual of the row count, k_chunk ({k_chunk}) dividing K and "
                         f"tile_rows ({tile_rows}) dividing the rows")
    library = load("gemv.cc", {"GEMV_ROWS": tile_rows, "GEMV_K": k_chunk})
    partial = _function(library, "gemv_partial_f32")
    finish = _function(library, "gemv_add_bf16")
    acc = torch.empty(tile_rows, dtype=torch.float32)
    y = torch.empty(rows, dtype=torch.bfloat16)
    for row0 in range(0, rows, tile_rows):
        for k0 in range(0, depth, k_chunk):
            chunk = w[row0:row0 + tile_rows, k0:k0 + k_chunk].contiguous()
            partial(chunk.data_ptr(), x.data_ptr(), acc.data_ptr(), k0)
        finish(acc.data_ptr(), residual.data_ptr(), y.data_ptr(), row0, row0)
    return y


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rmsnorm_bf16`` of one row, x and weight packed into one buffer as the fused decode FFN's tiles get them."""
    x, weight = _require_bf16("x", x), _require_bf16("weight", weight)
    if x.dim() != 1 or weight.shape != x.shape:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: expected two vectors of one length")
    norm = _function(load("gemv.cc", {"GEMV_ROWS": 1, "GEMV_K": x.shape[0]}), "rmsnorm_bf16")
    packed = torch.cat((x, weight))
    out = torch.empty_like(x)
    norm(packed.data_ptr(), out.data_ptr(), float(eps))
    return out


def rms_gemv_rows(x: torch.Tensor, norm_weight: torch.Tensor, w: torch.Tensor, eps: float, *,
                  tile_rows: int = 8) -> torch.Tensor:
    """``W · (rmsnorm(x) * norm_weight)`` the way a tile of the fused ``rms_gemv`` launch walks it:
    ``rmsnorm_bf16`` once, then ``gemv_rows_bf16`` per ``tile_rows`` rows into one output buffer."""
    w = _require_bf16("w", w)
    rows, depth = w.shape
    if rows % tile_rows or x.shape != (depth,):
        raise ValueError(f"w {tuple(w.shape)}, x {tuple(x.shape)}: expected x of the row length and tile_rows "
                         f"({tile_rows}) dividing the rows")
    rows_kernel = _function(load("gemv.cc", {"GEMV_ROWS": tile_rows, "GEMV_K": depth}), "gemv_rows_bf16")
    normed = rmsnorm(x, norm_weight, eps)
    y = torch.empty(rows, dtype=torch.bfloat16)
    for row0 in range(0, rows, tile_rows):
        rows_kernel(w[row0].data_ptr(), normed.data_ptr(), y.data_ptr(), row0)
    return y


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``swiglu_bf16`` of n interleaved (gate, up) pairs, shape (n, 2): silu(gate) * up, as the fused down
    projection's tiles make it from rms_gemv's interleaved output."""
    gate_up = _require_bf16("gate_up", gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] != 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)}: expected (n, 2), (gate, up) pairs")
    kernel = _function(load("gemv.cc", {"GEMV_ROWS": 1, "GEMV_K": 32}), "swiglu_bf16")
    work = gate_up.contiguous().clone()
    kernel(work.data_ptr(), gate_up.shape[0])
    return work.reshape(-1)[:gate_up.shape[0]].clone()


ATTENTION_BLOCK = 8  # the side of the 8x8 blocks attention.cc's buffers are pre-tiled into


def attention_unblocks(blocks: torch.Tensor) -> torch.Tensor:
    """The row-major (rows, cols) matrix of a buffer attention.cc holds in [rows/8][cols/8][8][8] blocks (scores,
    probs)."""
    rows, cols, b = *blocks.shape, ATTENTION_BLOCK
    return blocks.reshape(rows // b, cols // b, b, b).permute(0, 2, 1, 3).reshape(rows, cols)


def attention_head_blocks(matrix: torch.Tensor) -> torch.Tensor:
    """A row-major (rows, head_dim) tile as attention.cc holds q, acc and out: [head_dim/8][rows/8][8][8]."""
    rows, cols, b = *matrix.shape, ATTENTION_BLOCK
    return matrix.reshape(rows // b, b, cols // b, b).permute(2, 0, 1, 3).contiguous().reshape(rows, cols)


def attention_head_unblocks(blocks: torch.Tensor) -> torch.Tensor:
    """The row-major tile of a buffer held as :func:`attention_head_blocks` lays it out."""
    rows, cols, b = *blocks.shape, ATTENTION_BLOCK
    return blocks.reshape(cols // b, rows // b, b, b).permute(1, 2, 0, 3).reshape(rows, cols)


def attention_kv_blocks(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """attention.cc's kv buffer from (tile_k, head_dim) keys and values: each half [head_dim/8][tile_k/8][8][8]."""
    b = ATTENTION_BLOCK

    def blocked(m):
        return m.reshape(m.shape[0] // b, b, m.shape[1] // b, b).permute(2, 0, 1, 3)

    return torch.stack((blocked(keys), blocked(values))).contiguous()


class AttentionTiles:
    """The five attention tile primitives of one compiled variant, on torch tensors: the tiles given and returned
    row-major, the state buffers in attention.cc's block layout (:func:`attention_unblocks` reads them)."""

    def __init__(self, head_dim: int, tile_q: int = 32, tile_k: int = 32):
        self.head_dim, self.tile_q, self.tile_k = head_dim, tile_q, tile_k
        library = load("attention.cc", {"ATTN_TQ": tile_q, "ATTN_TK": tile_k, "ATTN_HEAD_DIM": head_dim})
        self._init = _function(library, "attn_init_f32")
        self._qk = _function(library, "attn_qk_tile_bf16")
        self._softmax = _function(library, "attn_online_softmax_bf16")
        self._pv = _function(library, "attn_pv_accumulate_bf16")
        self._finalize = _function(library, "attn_finalize_bf16")

    def new_state(self) -> dict[str, torch.Tensor]:
        """Fresh per-query-tile buffers (row_max, row_sum, row_scale, acc, scores, probs), initialized."""
        tq, tk, d = self.tile_q, self.tile_k, self.head_dim
        state = {
            "row_max": torch.empty(tq, dtype=torch.float32),
            "row_sum": torch.empty(tq, dtype=torch.float32),
            "row_scale": torch.empty(tq, dtype=torch.float32),
            "acc": torch.empty(tq, d, dtype=torch.float32),
            "scores": torch.empty(tq, tk, dtype=torch.float32),
            "probs": torch.empty(tq, tk, dtype=torch.bfloat16),
        }
        self._init(state["row_max"].data_ptr(), state["row_sum"].data_ptr(), state["acc"].data_ptr())
        return state

    def _check_tile(self, name: str, tile: torch.Tensor, rows: int) -> None:
        if tile.dtype != torch.bfloat16 or tile.shape != (rows, self.head_dim):
            raise ValueError(f"{name}: expected a bf16 ({rows}, {self.head_dim}) tile")

    def qk(self, state: dict[str, torch.Tensor], q: torch.Tensor, k: torch.Tensor, q_start: int, k_start: int) -> None:
        """``state["scores"]`` = q . k of the q tile against the k tile, causally masked."""
        self._check_tile("q", q, self.tile_q)
        self._check_tile("k", k, self.tile_k)
        q_blocks, kv = attention_head_blocks(q), attention_kv_blocks(k, torch.zeros_like(k))  # QK^T reads the key half
        self._qk(q_blocks.data_ptr(), kv.data_ptr(), state["scores"].data_ptr(), q_start, k_start)

    def accumulate(self, state: dict[str, torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_start: int, k_start: int) -> None:
        """One key/value tile into the state: QK^T with the causal mask, online softmax, PV accumulate."""
        self._check_tile("q", q, self.tile_q)
        self._check_tile("k", k, self.tile_k)
        self._check_tile("v", v, self.tile_k)
        q_blocks, kv = attention_head_blocks(q), attention_kv_blocks(k, v)  # the buffers live through the calls
        self._qk(q_blocks.data_ptr(), kv.data_ptr(), state["scores"].data_ptr(), q_start, k_start)
        self._softmax(state["scores"].data_ptr(), state["probs"].data_ptr(), state["row_max"].data_ptr(),
                      state["row_sum"].data_ptr(), state["row_scale"].data_ptr())
        self._pv(state["probs"].data_ptr(), kv.data_ptr(), state["row_scale"].data_ptr(), state["acc"].data_ptr())

    def finalize(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.empty(self.tile_q, self.head_dim, dtype=torch.bfloat16)
        self._finalize(state["acc"].data_ptr(), state["row_sum"].data_ptr(), out.data_ptr())
        return attention_head_unblocks(out)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, *, tile_q: int = 32,
                    tile_k: int = 32, q_offset: int = 0) -> torch.Tensor:
    """Seq-first causal GQA from the tile primitives, walked the way an NPU builder walks them.

    q (Sq, H*D) holds positions q_offset .. q_offset+Sq-1; k, v (Sk, Hkv*D) hold positions 0 .. Sk-1 (a prefill
    has q_offset 0 and Sq == Sk; a decode step against a cache has Sq == 1 and q_offset = its position).
    """
    q, k, v = _require_bf16("q", q), _require_bf16("k", k), _require_bf16("v", v)
    heads, kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    if heads % kv_heads or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: not a GQA layout")
    tiles = AttentionTiles(head_dim, tile_q, tile_k)
    q_rows, kv_rows = q.shape[0], k.shape[0]
    q_padded = pad_rows(q, _round_up(q_rows, tile_q)).reshape(-1, heads, head_dim)
    k_padded = pad_rows(k, _round_up(kv_rows, tile_k)).reshape(-1, kv_heads, head_dim)
    v_padded = pad_rows(v, _round_up(kv_rows, tile_k)).reshape(-1, kv_heads, head_dim)
    out = torch.empty_like(q_padded)
    group = heads // kv_heads
    for head in range(heads):
        keys, values = k_padded[:, head // group].contiguous(), v_padded[:, head // group].contiguous()
        for q_first in range(0, q_padded.shape[0], tile_q):
            q_tile = q_padded[q_first:q_first + tile_q, head].contiguous()
            q_start = q_offset + q_first
            state = tiles.new_state()
            # Key tiles past the tile's last query position are fully masked: skipped, as on the NPU.
            for k_first in range(0, min(keys.shape[0], q_start + tile_q), tile_k):
                tiles.accumulate(state, q_tile, keys[k_first:k_first + tile_k], values[k_first:k_first + tile_k],
                                 q_start, k_first)
            out[q_first:q_first + tile_q, head] = tiles.finalize(state)
    return out.reshape(q_padded.shape[0], -1)[:q_rows]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, head_dim: int, *,
                     tile_k: int = 64) -> torch.Tensor:
    """decode_attention.cc's three calls walked as the decode_attention launch walks them: per KV head, its query
    group against every ``tile_k`` rows of k and v (capacity, kv_heads*head_dim), the first ``length`` valid.
    q is one row (heads*head_dim,); returns the attention row, bf16."""
    q, k, v = _require_bf16("q", q), _require_bf16("k", k), _require_bf16("v", v)
    heads, kv_heads, capacity = q.shape[-1] // head_dim, k.shape[1] // head_dim, k.shape[0]
    if heads % kv_heads or v.shape != k.shape or capacity % tile_k:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: not a GQA layout of whole "
                         f"{tile_k}-row tiles")
    group = heads // kv_heads
    library = load("decode_attention.cc", {"DATTN_GROUP": group, "DATTN_TK": tile_k, "DATTN_HEAD_DIM": head_dim})
    init = _function(library, "dattn_init_f32")
    tile = _function(library, "dattn_tile_bf16")
    finalize = _function(library, "dattn_finalize_bf16")
    digits = torch.tensor(catalog.decode_attn_length_digits(length), dtype=torch.bfloat16)
    queries = torch.cat((q.flatten(), digits))
    out = torch.empty(kv_heads, group * head_dim, dtype=torch.bfloat16)
    query, cursor = torch.empty(group * head_dim, dtype=torch.bfloat16), torch.empty(2, dtype=torch.int32)
    row_max, row_sum = torch.empty(group), torch.empty(group)
    acc, scores = torch.empty(group, head_dim), torch.empty(group, tile_k)
    probs = torch.empty(group, tile_k, dtype=torch.bfloat16)
    for h in range(kv_heads):
        keys, values = (t[:, h * head_dim:(h + 1) * head_dim].contiguous() for t in (k, v))
        init(queries.data_ptr(), kv_heads, h, query.data_ptr(), row_max.data_ptr(), row_sum.data_ptr(),
             acc.data_ptr(), cursor.data_ptr())
        for first in range(0, capacity, tile_k):
            kv = torch.cat((keys[first:first + tile_k].flatten(), values[first:first + tile_k].flatten()))
            tile(query.data_ptr(), kv.data_ptr(), scores.data_ptr(), probs.data_ptr(), row_max.data_ptr(),
                 row_sum.data_ptr(), acc.data_ptr(), int(cursor[0]), int(cursor[1]))
            cursor[1] += tile_k
        finalize(acc.data_ptr(), row_sum.data_ptr(), out[h].data_ptr())
    return out.reshape(q.shape)


GEMM_BLOCK = 8  # the side of the 8x8 blocks gemm.cc's L1 tiles are pre-tiled into


def _gemm_l1_tiles(matrix: torch.Tensor, tile_rows: int, tile_k: int) -> torch.Tensor:
    """A (rows, K) operand cut as the L2 -> L1 DMA cuts it: one contiguous [K/8][rows/8][8][8] buffer per
    (row tile, K tile), indexed [row tile][K tile]."""
    rows, depth = matrix.shape
    b = GEMM_BLOCK
    blocks = matrix.reshape(rows // tile_rows, tile_rows // b, b, depth // tile_k, tile_k // b, b)
    # (row tile, row block, row, K tile, K block, k) -> (row tile, K tile, K block, row block, row, k)
    return blocks.permute(0, 3, 4, 1, 2, 5).contiguous()


def gemm_swiglu(a: torch.Tensor, w_gate_up: torch.Tensor, *, tile_m: int, tile_k: int, tile_n: int, drain_n: int,
                defines: Defines | None = None) -> torch.Tensor:
    """``silu(bf16(A · Wgᵀ)) * bf16(A · Wuᵀ)`` for w_gate_up = [Wg | Wu] (N × 2K), as the gemm_swiglu launch's herd
    makes it: each tile's W holds its tile_n gate rows then the same up rows (gemm.cc built 2·tile_n wide), and
    ``gemm_f32_swiglu_to_bf16`` drains a gate chunk and its up chunk ``drain_n`` columns at a time."""
    a, w_gate_up = _require_bf16("a", a), _require_bf16("w_gate_up", w_gate_up)
    (m, depth), (n, width) = a.shape, w_gate_up.shape
    if width != 2 * depth:
        raise ValueError(f"a {tuple(a.shape)} and w_gate_up {tuple(w_gate_up.shape)}: expected rows of 2K={2 * depth}")
    for name, extent, tile in (("M", m, tile_m), ("K", depth, tile_k), ("N", n, tile_n), ("tile_n", tile_n, drain_n)):
        if extent % tile:
            raise ValueError(f"{name}={extent}: expected a multiple of {tile}")
    library = load("gemm.cc", {"GEMM_TILE_M": tile_m, "GEMM_TILE_K": tile_k, "GEMM_TILE_N": 2 * tile_n,
                               "GEMM_DRAIN_N": drain_n, **(defines or {})})
    zero = _function(library, "gemm_zero_f32")
    accumulate = _function(library, "gemm_bf16_f32_wnk")
    drain = _function(library, "gemm_f32_swiglu_to_bf16")
    # each tile's W: its tile_n gate rows, then the same up rows
    gate, up = (half.reshape(n // tile_n, tile_n, depth) for half in w_gate_up.split(depth, dim=1))
    w_tiles = _gemm_l1_tiles(torch.stack((gate, up), 1).reshape(2 * n, depth), 2 * tile_n, tile_k)
    a_tiles, b, chunks = _gemm_l1_tiles(a, tile_m, tile_k), GEMM_BLOCK, tile_n // drain_n
    out = torch.empty(m // tile_m, n // tile_n, tile_n // b, tile_m // b, b, b, dtype=torch.bfloat16)
    acc = torch.empty(2 * chunks, drain_n // b, tile_m // b, b, b, dtype=torch.float32)
    for mi in range(m // tile_m):
        for ni in range(n // tile_n):
            zero(acc.data_ptr())
            for ki in range(depth // tile_k):
                accumulate(a_tiles[mi, ki].data_ptr(), w_tiles[ni, ki].data_ptr(), acc.data_ptr())
            for chunk in range(chunks):
                drain(acc[chunk].data_ptr(), acc[chunks + chunk].data_ptr(),
                      out[mi, ni, chunk * (drain_n // b)].data_ptr())
    return out.permute(0, 3, 4, 1, 2, 5).reshape(m, n)


def gemm(a: torch.Tensor, w: torch.Tensor, *, tile_m: int, tile_k: int, tile_n: int, out_dtype=torch.bfloat16,
         defines: Defines | None = None, drain_n: int | None = None) -> torch.Tensor:
    """``C = A · Wᵀ`` for a (M, K) and w (N, K), with gemm.cc's three calls per output tile as the builder's herd
    makes them: ``gemm_zero_f32``, ``gemm_bf16_f32_wnk`` once per ``tile_k`` step of K, ``gemm_f32_to_bf16``
    (skipped for ``out_dtype=torch.float32``, which returns the fp32 accumulator), once per ``drain_n`` columns
    (default: the whole tile). Operands are pre-tiled here the way the DMAs pre-tile them; ``defines`` adds -D
    macros (e.g. the BFP16 emulation switch)."""
    a, w = _require_bf16("a", a), _require_bf16("w", w)
    (m, depth), (n, w_depth) = a.shape, w.shape
    if w_depth != depth:
        raise ValueError(f"a {tuple(a.shape)} and w {tuple(w.shape)}: expected the same K (w in (N, K) layout)")
    for name, extent, tile in (("M", m, tile_m), ("K", depth, tile_k), ("N", n, tile_n)):
        if extent % tile:
            raise ValueError(f"{name}={extent}: expected a multiple of its tile {tile}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    drain_n = tile_n if drain_n is None else drain_n
    if drain_n <= 0 or drain_n % GEMM_BLOCK or tile_n % drain_n:
        raise ValueError(f"drain_n={drain_n}: expected a positive multiple of {GEMM_BLOCK} dividing tile_n={tile_n}")
    library = load("gemm.cc", {"GEMM_TILE_M": tile_m, "GEMM_TILE_K": tile_k, "GEMM_TILE_N": tile_n,
                               "GEMM_DRAIN_N": drain_n, **(defines or {})})
    zero = _function(library, "gemm_zero_f32")
    accumulate = _function(library, "gemm_bf16_f32_wnk")
    drain = _function(library, "gemm_f32_to_bf16")
    a_tiles, w_tiles = _gemm_l1_tiles(a, tile_m, tile_k), _gemm_l1_tiles(w, tile_n, tile_k)
    b = GEMM_BLOCK
    # Output tiles in the kernel's [N/8][M/8][8][8] layout, indexed [M tile][N tile].
    out = torch.empty(m // tile_m, n // tile_n, tile_n // b, tile_m // b, b, b, dtype=out_dtype)
    acc = torch.empty(tile_n // b, tile_m // b, b, b, dtype=torch.float32)
    for mi in range(m // tile_m):
        for ni in range(n // tile_n):
            zero(acc.data_ptr())
            for ki in range(depth // tile_k):
                accumulate(a_tiles[mi, ki].data_ptr(), w_tiles[ni, ki].data_ptr(), acc.data_ptr())
            if out_dtype == torch.float32:
                out[mi, ni] = acc
            else:  # a chunk of drain_n columns is drain_n/8 whole block rows of the [N/8][M/8][8][8] tile
                for chunk in range(0, tile_n // b, drain_n // b):
                    drain(acc[chunk].data_ptr(), out[mi, ni, chunk].data_ptr())
    # (M tile, N tile, N block, M block, m, n) -> (M tile, M block, m, N tile, N block, n)
    return out.permute(0, 3, 4, 1, 2, 5).reshape(m, n)


# ---- the integer GEMMs ("w8x2a16", kernels/int_gemm.py): quantize_rows.cc and gemm_int8.cc ---------------------
QUANT_STATE_FLOATS = 16  # quantize_rows.cc's state between its two calls


def quantize_rows(x: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
    """``quantize_rows_prepare`` then ``quantize_rows_chunk`` per ``chunk`` values (default: the whole row) of each
    row of x (M, K) bf16, as a tile of the quantize_rows launch walks them: (M, int_gemm.activation_words(K)) int32."""
    from . import int_gemm

    x = _require_bf16("x", x)
    rows, depth = x.shape
    chunk = chunk or depth
    library = load("quantize_rows.cc", {"QUANT_K": depth, "QUANT_CHUNK": chunk})
    prepare, pack = _function(library, "quantize_rows_prepare"), _function(library, "quantize_rows_chunk")
    out = torch.empty(rows, int_gemm.activation_words(depth), dtype=torch.int32)
    state = torch.empty(QUANT_STATE_FLOATS, dtype=torch.float32)
    chunk_words = int_gemm.activation_words(chunk)
    for r in range(rows):
        prepare(x[r].data_ptr(), state.data_ptr())
        for c in range(depth // chunk):
            piece = torch.empty(chunk_words, dtype=torch.int32)
            pack(x[r].data_ptr(), state.data_ptr(), piece.data_ptr(), c)
            out[r, c * chunk_words:(c + 1) * chunk_words] = piece
    return out


def int_gemm_a_windows(a_words: torch.Tensor, K: int, tile_m: int) -> torch.Tensor:
    """The quantized rows (M, activation_words(K)) cut as the L2 -> L1 DMA cuts them for gemm_int8.cc: per row tile
    and call, [9 kb][tile_m m][2 words], indexed [row tile][call]."""
    from . import int_gemm

    rows = a_words.shape[0]
    calls, run_words = K // int_gemm.CALL_K, int_gemm.CALL_COLS // 2
    runs = a_words.reshape(rows // tile_m, tile_m, calls, run_words // 2, 2)  # [tile][m][call][kb][2 words]
    return runs.permute(0, 2, 3, 1, 4).contiguous()


def gemm_int(a_words: torch.Tensor, w_words: torch.Tensor, N: int, *, tile_n: int, tile_m: int = 64,
             drain_n: int | None = None, swiglu: bool = False) -> torch.Tensor:
    """gemm_int8.cc's calls as the gemm_int (or, ``swiglu``, gemm_int_swiglu) launch's herd makes them, per output
    tile: ``gemm_int_zero_i32``, ``gemm_int_w8x2`` per call of 32 K (the A window cut from the quantized rows, the W
    window one row of the prepared weight), and the drain per ``drain_n`` columns (default tile_n). a_words:
    (M, activation_words(K)) int32 rows; w_words: the prepared weight (int_gemm.prepared_weight_shape)."""
    from . import int_gemm

    rows = a_words.shape[0]
    K = a_words.shape[1] * 2 // int_gemm.CALL_COLS * int_gemm.CALL_K
    halves = 2 if swiglu else 1
    T, drain_n = halves * tile_n, drain_n or tile_n
    calls = K // int_gemm.CALL_K
    if rows % tile_m or N % tile_n or tile_n % drain_n or drain_n % GEMM_BLOCK:
        raise ValueError(f"M={rows}, N={N}: expected multiples of tile_m={tile_m} and tile_n={tile_n}, and drain_n="
                         f"{drain_n} a multiple of {GEMM_BLOCK} dividing tile_n")
    if tuple(w_words.shape) != (N // tile_n * calls, int_gemm.window_bytes(T) // 4):
        raise ValueError(f"w {tuple(w_words.shape)}: not a prepared weight of {N} columns, K={K}, tile_n={tile_n}")
    library = load("gemm_int8.cc", {"GEMM_TILE_M": tile_m, "GEMM_TILE_N": T, "GEMM_DRAIN_N": drain_n})
    zero, mac = _function(library, "gemm_int_zero_i32"), _function(library, "gemm_int_w8x2")
    drain = _function(library, "gemm_int_swiglu_drain_bf16" if swiglu else "gemm_int_drain_bf16")
    a_tiles = int_gemm_a_windows(a_words.contiguous(), K, tile_m)
    w_tiles = w_words.contiguous().reshape(N // tile_n, calls, -1)
    b, chunks = GEMM_BLOCK, tile_n // drain_n
    chunk_elements = drain_n // b * 2 * tile_m * b
    acc = torch.empty(halves * chunks, chunk_elements, dtype=torch.int32)
    row_scale, col_scale = torch.empty(tile_m), torch.empty(halves * chunks, drain_n)
    out = torch.empty(rows // tile_m, N // tile_n, chunks, drain_n // b, tile_m // b, b, b, dtype=torch.bfloat16)
    for mi in range(rows // tile_m):
        for ni in range(N // tile_n):
            zero(acc.data_ptr())
            for call in range(calls):
                mac(a_tiles[mi, call].data_ptr(), w_tiles[ni, call].data_ptr(), acc.data_ptr(), row_scale.data_ptr(),
                    col_scale.data_ptr())
            for chunk in range(chunks):
                if swiglu:
                    drain(acc[chunk].data_ptr(), acc[chunks + chunk].data_ptr(), row_scale.data_ptr(),
                          col_scale[chunk].data_ptr(), col_scale[chunks + chunk].data_ptr(),
                          out[mi, ni, chunk].data_ptr())
                else:
                    drain(acc[chunk].data_ptr(), row_scale.data_ptr(), col_scale[chunk].data_ptr(),
                          out[mi, ni, chunk].data_ptr())
    # (M tile, N tile, chunk, N block, M block, m, n) -> (M tile, M block, m, N tile, chunk, N block, n)
    return out.permute(0, 4, 5, 1, 2, 3, 6).reshape(rows, N)
