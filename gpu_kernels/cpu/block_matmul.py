"""``y = x @ W.T`` on block-quantized weights (Numba CPU).

``W[o, 32*b + j] = scales[o, b] * code[o, b, j] + offsets[o, b]`` with the
codes as int8 (`engine.loader.gguf_blocks.BlockQuantized`: GGUF Q4_0 / Q4_1 /
Q8_0, one code a byte) or as packed nibbles (uint8, two 4-bit codes a byte,
`engine.fused_decode`). A float32 matmul with few rows reads 4 bytes per
weight and is bound by memory bandwidth; these kernels read 1.25 or 0.75.
Three kernels, by the number of input rows ``T``, all built on the row
kernels of `cpu.block_dot`:

* ``T <= MATVEC_T`` (one sequence decoding, or a few), **matvec**: every
  output is one ``block_dot`` over its row; work items of ``ROWS`` outputs.
* ``MATVEC_T < T <= SMALL_T`` (several sequences decoding, short chunks), **tiled**:
  the register-blocked micro-kernel of `cpu.microkernel` unpacks each block
  of ``microkernel.R`` weight rows once and multiplies it into all ``T``
  tokens held in registers; work items of ``TILE`` rows.
* ``T > SMALL_T`` (prefill), **BLAS**: each work item dequantizes ``TILE``
  weight rows to float32 (L2-resident) and multiplies them with all ``T``
  rows through BLAS (``np.dot``, single-threaded: `cpu.blas.single_threaded_blas`),
  which packs its operands for large products.

Every weight is read and converted once per call whatever ``T`` is. The
matmuls are loops over work items of `matvec_rows` / `tiled_rows` /
`blas_rows`, which the fused decode step (`cpu.decode_step`) runs as its own
items.
"""

from __future__ import annotations

import types

import numpy as np
from numba import njit, prange

from .blas import single_threaded_blas
from .block_dot import block_dequant, dot_row
from .microkernel import R, tile_1x8, tile_1x16, tile_4x8, tile_4x16

BLOCK = 32
ROWS = 32  # outputs per matvec work item
TILE = 64  # weight rows per work item of several tokens (a multiple of R)
MATVEC_T = 3  # most tokens for dot products: unpacking a row per token beats a tile half empty
SMALL_T = 64  # most tokens for the micro-kernel; BLAS packs larger products better

_PAR = dict(parallel=True, fastmath=True, boundscheck=False, nogil=True, cache=True)
_SEQ = dict(fastmath=True, boundscheck=False, nogil=True, cache=True)


@njit(**_SEQ)
def block_sums(x, out):
    """out[t, g] = sum of group ``g`` of the row ``x[t]`` (groups of 32 inputs, or 16 where ``out`` has
    twice as many: a weight with a scale per 16)."""
    group = x.shape[1] // out.shape[1]
    for t in range(out.shape[0]):
        for g in range(out.shape[1]):
            out[t, g] = x[t, g * group:(g + 1) * group].sum()


@njit(**_SEQ)
def matvec_rows(x, codes, scales, offsets, sums, out, lo, hi):
    """out[t, o] = W[o] . x[t] for outputs ``lo <= o < hi`` (``sums``: `block_sums` of ``x``); the
    rows stay in L1 while each token takes its dot product."""
    for o in range(lo, hi):
        for t in range(x.shape[0]):
            dot_row(codes, scales, offsets, x[t], sums[t], out[t], o)


@njit(**_SEQ)
def padded_transpose(x):
    """x [T, in] as ``xt`` [in, Tp] for `tiled_rows`: transposed, zero columns up to ``Tp``, a multiple of 8."""
    num_tokens, width = x.shape
    xt = np.zeros((width, (num_tokens + 7) // 8 * 8), np.float32)
    xt[:, :num_tokens] = x.T
    return xt


@njit(**_SEQ)
def tiled_rows(xt, codes, scales, offsets, yt, out, lo, hi):
    """out[:, lo:hi] = x @ W[lo:hi].T for ``T = out.shape[0]`` tokens, ``xt`` = `padded_transpose` (x):
    the micro-kernel on ``R`` rows at a time, results through the scratch ``yt`` [>= hi - lo, Tp]."""
    width = xt.shape[1]
    o = lo
    while o < hi:
        rows = R if hi - o >= R else 1
        for col in range(0, width, 16):
            if rows == R:
                if col + 16 <= width:
                    tile_4x16(codes, scales, offsets, o, xt, yt, o - lo, col)
                else:
                    tile_4x8(codes, scales, offsets, o, xt, yt, o - lo, col)
            elif col + 16 <= width:
                tile_1x16(codes, scales, offsets, o, xt, yt, o - lo, col)
            else:
                tile_1x8(codes, scales, offsets, o, xt, yt, o - lo, col)
        o += rows
    # row by row: out's rows lie a multiple of 4 KB apart for a gate/up (3072 floats) or an LM head
    # (49152), so a column's T stores all map to one L1 set (8 ways) and a column at a time they evicted
    # each other; a row at a time writes whole cache lines
    for t in range(out.shape[0]):
        for o in range(lo, hi):
            out[t, o] = yt[o - lo, t]


@njit(**_SEQ)
def blas_rows(xt, codes, scales, offsets, w, out, lo, hi):
    """out[:, lo:hi] = x @ W[lo:hi].T with ``xt`` = x.T contiguous: the rows dequantized into the
    scratch ``w`` (>= hi - lo rows), multiplied through BLAS."""
    for o in range(lo, hi):
        block_dequant(codes[o], scales[o], offsets[o], w[o - lo])
    out[:, lo:hi] = np.dot(xt.T, w[:hi - lo].T)  # [T, hi - lo]: written row by row, as `tiled_rows` does


def _matvec(x, codes, scales, offsets, out):
    """out = x @ W.T, a dot product per token and row; codes 2-d ``[out, row bytes]`` (int8 codes or nibbles)."""
    num_out, num_blocks = scales.shape
    sums = np.empty((x.shape[0], num_blocks), np.float32)
    block_sums(x, sums)
    for item in prange((num_out + ROWS - 1) // ROWS):
        matvec_rows(x, codes, scales, offsets, sums, out, item * ROWS, min(num_out, item * ROWS + ROWS))


def _tiled(x, codes, scales, offsets, out):
    """out = x @ W.T for a few rows of x: the micro-kernel on groups of dequantized rows."""
    num_out, num_blocks = scales.shape
    xt = padded_transpose(x)
    for item in prange((num_out + TILE - 1) // TILE):
        yt = np.empty((TILE, xt.shape[1]), np.float32)
        tiled_rows(xt, codes, scales, offsets, yt, out, item * TILE, min(num_out, item * TILE + TILE))


def _blas(x, codes, scales, offsets, out):
    """out = x @ W.T for many rows of x: dequantized tiles of W through BLAS."""
    num_out, num_blocks = scales.shape
    xt = np.ascontiguousarray(x.T)  # [in, T]
    for item in prange((num_out + TILE - 1) // TILE):
        w = np.empty((TILE, x.shape[1]), np.float32)
        blas_rows(xt, codes, scales, offsets, w, out, item * TILE, min(num_out, item * TILE + TILE))


def _renamed(fn, name: str):
    """``fn`` under another name. Numba's on-disk cache files a function by its qualified name and
    first line, not by its compile flags: two ``njit``s of one function (threaded and not) would
    overwrite each other's cached machine code, and the next process would load the same code for
    both."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = name
    return copy


_matvec_par, _matvec_seq = njit(**_PAR)(_matvec), njit(**_SEQ)(_renamed(_matvec, "_matvec_one_thread"))
_tiled_par, _blas_par = njit(**_PAR)(_tiled), njit(**_PAR)(_blas)

# Threads pay off only for large weights: a parallel launch has a fixed cost, far larger when
# another process holds a core (every thread of the region must get scheduled).
PARALLEL_MIN_WEIGHTS = 1 << 23  # e.g. an LM head; one layer's projections run on the calling thread


def block_matmul(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray,
                 out: np.ndarray | None = None) -> np.ndarray:
    """``x`` float32 ``[T, in]`` times the ``[out, in]`` block-quantized weight, transposed: ``[T, out]``.

    ``codes``: int8 ``[out, in // 32, 32]`` or nibbles, uint8 ``[out, in // 32, 16]``; ``scales``
    ``[out, in // 32]``, or ``[out, in // 16]`` for a scale per 16 inputs (`cpu.block_dot`).
    """
    num_out, num_blocks, width = codes.shape
    nibbles = codes.dtype == np.uint8
    if width != (BLOCK // 2 if nibbles else BLOCK) or x.ndim != 2 or x.shape[1] != num_blocks * BLOCK:
        raise ValueError(f"block_matmul: x {x.shape} does not match codes {codes.shape} (blocks of {BLOCK})")
    if scales.ndim != 2 or scales.shape[1] not in (num_blocks, 2 * num_blocks):
        raise ValueError(f"block_matmul: scales {scales.shape} need a scale per 32 or per 16 inputs of codes "
                         f"{codes.shape}")
    if x.dtype != np.float32 or codes.dtype not in (np.int8, np.uint8):
        raise ValueError(f"block_matmul takes float32 x and int8 codes or uint8 nibbles; got {x.dtype} and "
                         f"{codes.dtype}")
    if out is None:
        out = np.empty((x.shape[0], num_out), np.float32)
    x = np.ascontiguousarray(x)
    rows = np.ascontiguousarray(codes).reshape(num_out, -1)
    scales, offsets = np.ascontiguousarray(scales), np.ascontiguousarray(offsets)
    parallel = num_out * x.shape[1] >= PARALLEL_MIN_WEIGHTS
    if x.shape[0] > SMALL_T:
        single_threaded_blas()
        _blas_par(x, rows, scales, offsets, out)
    elif x.shape[0] > MATVEC_T:
        _tiled_par(x, rows, scales, offsets, out)
    elif parallel:
        _matvec_par(x, rows, scales, offsets, out)
    else:
        _matvec_seq(x, rows, scales, offsets, out)
    return out
