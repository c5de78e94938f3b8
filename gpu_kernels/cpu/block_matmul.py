"""``y = x @ W.T`` on block-quantized weights (Numba CPU).

``W[o, 32*b + j] = scales[o, b] * code[o, b, j] + offsets[o, b]`` with the
codes as int8 (`engine.loader.gguf_blocks.BlockQuantized`: GGUF Q4_0 / Q4_1 /
Q8_0, one code a byte) or as packed nibbles (uint8, two 4-bit codes a byte,
`engine.fused_decode`). A float32 matmul with few rows reads 4 bytes per
weight and is bound by memory bandwidth; these kernels read 1.25 or 0.75.
Two kernels, by the number of input rows ``T``, both built on the row
kernels of `cpu.block_dot`:

* ``T == 1`` (one sequence decoding), **matvec**: every output is one
  ``block_dot`` over its row; work items of ``ROWS`` outputs.
* ``T > 1``, **tiled**: each work item dequantizes ``TILE`` weight rows to
  float32 (L2-resident) and multiplies them with all ``T`` rows through BLAS
  (``np.dot``, single-threaded: `cpu.blas.single_threaded_blas`), so every
  weight is read and converted once per call whatever ``T`` is.

Both are loops over work items of `matvec_rows` / `tiled_rows`, which the
fused decode step (`cpu.decode_step`) runs as its own items.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .blas import single_threaded_blas
from .block_dot import block_dot, block_dequant

BLOCK = 32
ROWS = 32  # outputs per matvec work item
TILE = 64  # weight rows per dequantized tile: 64 x in_features float32 stays in L2

_PAR = dict(parallel=True, fastmath=True, boundscheck=False, nogil=True, cache=True)
_SEQ = dict(fastmath=True, boundscheck=False, nogil=True, cache=True)


@njit(**_SEQ)
def block_sums(x, out):
    """out[b] = sum of block ``b`` of the row ``x``."""
    for b in range(out.shape[0]):
        out[b] = x[b * BLOCK:(b + 1) * BLOCK].sum()


@njit(**_SEQ)
def matvec_rows(x, codes, scales, offsets, sums, out, lo, hi):
    """out[o] = W[o] . x for outputs ``lo <= o < hi`` (``sums``: `block_sums` of ``x``)."""
    for o in range(lo, hi):
        out[o] = block_dot(codes[o], scales[o], offsets[o], x, sums)


@njit(**_SEQ)
def tiled_rows(xt, codes, scales, offsets, w, out, lo, hi):
    """out[:, lo:hi] = x @ W[lo:hi].T with ``xt`` = x.T contiguous: the rows dequantized into the
    scratch ``w`` (>= hi - lo rows), multiplied through BLAS."""
    for o in range(lo, hi):
        block_dequant(codes[o], scales[o], offsets[o], w[o - lo])
    y = np.dot(w[:hi - lo], xt)  # [hi - lo, T]
    for o in range(lo, hi):
        for t in range(xt.shape[1]):
            out[t, o] = y[o - lo, t]


def _matvec(x, codes, scales, offsets, out):
    """out[0] = W @ x[0]; codes 2-d ``[out, row bytes]`` (int8 codes or nibbles)."""
    num_out, num_blocks = scales.shape
    sums = np.empty(num_blocks, np.float32)
    block_sums(x[0], sums)
    for item in prange((num_out + ROWS - 1) // ROWS):
        matvec_rows(x[0], codes, scales, offsets, sums, out[0], item * ROWS, min(num_out, item * ROWS + ROWS))


def _tiled(x, codes, scales, offsets, out):
    """out = x @ W.T for several rows of x: dequantized tiles of W through BLAS."""
    num_out, num_blocks = scales.shape
    xt = np.ascontiguousarray(x.T)  # [in, T]
    for item in prange((num_out + TILE - 1) // TILE):
        w = np.empty((TILE, num_blocks * BLOCK), np.float32)
        tiled_rows(xt, codes, scales, offsets, w, out, item * TILE, min(num_out, item * TILE + TILE))


_matvec_par, _matvec_seq = njit(**_PAR)(_matvec), njit(**_SEQ)(_matvec)
_tiled_par = njit(**_PAR)(_tiled)

# Threads pay off only for large weights: a parallel launch has a fixed cost, far larger when
# another process holds a core (every thread of the region must get scheduled).
PARALLEL_MIN_WEIGHTS = 1 << 23  # e.g. an LM head; one layer's projections run on the calling thread


def block_matmul(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray,
                 out: np.ndarray | None = None) -> np.ndarray:
    """``x`` float32 ``[T, in]`` times the ``[out, in]`` block-quantized weight, transposed: ``[T, out]``.

    ``codes``: int8 ``[out, in // 32, 32]`` or nibbles, uint8 ``[out, in // 32, 16]``.
    """
    num_out, num_blocks, width = codes.shape
    nibbles = codes.dtype == np.uint8
    if width != (BLOCK // 2 if nibbles else BLOCK) or x.ndim != 2 or x.shape[1] != num_blocks * BLOCK:
        raise ValueError(f"block_matmul: x {x.shape} does not match codes {codes.shape} (blocks of {BLOCK})")
    if x.dtype != np.float32 or codes.dtype not in (np.int8, np.uint8):
        raise ValueError(f"block_matmul takes float32 x and int8 codes or uint8 nibbles; got {x.dtype} and "
                         f"{codes.dtype}")
    if out is None:
        out = np.empty((x.shape[0], num_out), np.float32)
    x = np.ascontiguousarray(x)
    rows = np.ascontiguousarray(codes).reshape(num_out, -1)
    scales, offsets = np.ascontiguousarray(scales), np.ascontiguousarray(offsets)
    parallel = num_out * x.shape[1] >= PARALLEL_MIN_WEIGHTS
    if x.shape[0] > 1:
        single_threaded_blas()
        _tiled_par(x, rows, scales, offsets, out)
    elif parallel:
        _matvec_par(x, rows, scales, offsets, out)
    else:
        _matvec_seq(x, rows, scales, offsets, out)
    return out
