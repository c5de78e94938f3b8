"""``y = x @ W.T`` on block-quantized weights (Numba CPU).

``W[o, 32*b + j] = scales[o, b] * codes[o, b, j] + offsets[o, b]`` with int8
codes (`engine.loader.gguf_blocks.BlockQuantized`: GGUF Q4_0 / Q4_1 / Q8_0).
A float32 matmul with few rows reads 4 bytes per weight and is bound by
memory bandwidth; these kernels read 1.25. Two of them, by the number of
input rows ``T``:

* ``T == 1`` (one sequence decoding), **dot**: codes are converted on the fly,

      y[o] = sum_b scales[o, b] * (codes[o, b, :] . x[b, :]) + offsets[o, b] * sum(x[b, :])

  with 32 partial sums per output (one block) reduced once. Its work grows
  with ``T``, which is why it only serves one row.
* ``T > 1``, **tiled**: each thread dequantizes a tile of ``TILE`` weight rows
  to float32 (L2-resident) and multiplies it with all ``T`` rows through BLAS
  (``np.dot``, single-threaded: `cpu.blas.single_threaded_blas`), so every
  weight is read and converted once per call whatever ``T`` is.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .blas import single_threaded_blas

BLOCK = 32
TILE = 64  # weight rows per dequantized tile: 64 x in_features float32 stays in L2


def _dot_rows(x, codes, scales, offsets, out):
    num_rows = x.shape[0]
    num_out, num_blocks, _ = codes.shape
    x3 = x.reshape((num_rows, num_blocks, BLOCK))
    block_sums = np.empty((num_rows, num_blocks), np.float32)
    for t in range(num_rows):
        for b in range(num_blocks):
            block_sums[t, b] = x3[t, b].sum()
    for o in prange(num_out):
        acc = np.empty(BLOCK, np.float32)
        for t in range(num_rows):
            acc[:] = 0
            shift = np.float32(0)
            for b in range(num_blocks):
                s = scales[o, b]
                for j in range(BLOCK):
                    acc[j] += s * (np.float32(codes[o, b, j]) * x3[t, b, j])
                shift += offsets[o, b] * block_sums[t, b]
            out[t, o] = acc.sum() + shift


@njit(parallel=True, fastmath=True, boundscheck=False, cache=True)
def _tiled(x, codes, scales, offsets, out):
    num_out, num_blocks, _ = codes.shape
    xt = np.ascontiguousarray(x.T)  # [in, T]
    for tile in prange((num_out + TILE - 1) // TILE):
        lo = tile * TILE
        hi = min(num_out, lo + TILE)
        w = np.empty((hi - lo, num_blocks * BLOCK), np.float32)
        for o in range(lo, hi):
            for b in range(num_blocks):
                s, m = scales[o, b], offsets[o, b]
                for j in range(BLOCK):
                    w[o - lo, b * BLOCK + j] = s * np.float32(codes[o, b, j]) + m
        y = np.dot(w, xt)  # [tile, T]
        for o in range(lo, hi):
            for t in range(x.shape[0]):
                out[t, o] = y[o - lo, t]


# Threads pay off only for large weights: a parallel launch has a fixed cost, far larger when
# another process holds a core (every thread of the region must get scheduled).
_dot_parallel = njit(parallel=True, fastmath=True, boundscheck=False, cache=True)(_dot_rows)
_dot_serial = njit(fastmath=True, boundscheck=False, cache=True)(_dot_rows)
PARALLEL_MIN_WEIGHTS = 1 << 23  # e.g. an LM head; one layer's projections run on the calling thread


def block_matmul(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray,
                 out: np.ndarray | None = None) -> np.ndarray:
    """``x`` float32 ``[T, in]`` times the ``[out, in]`` block-quantized weight, transposed: ``[T, out]``."""
    num_out, num_blocks, block = codes.shape
    if block != BLOCK or x.ndim != 2 or x.shape[1] != num_blocks * BLOCK:
        raise ValueError(f"block_matmul: x {x.shape} does not match codes {codes.shape} (blocks of {BLOCK})")
    if x.dtype != np.float32 or codes.dtype != np.int8:
        raise ValueError(f"block_matmul takes float32 x and int8 codes; got {x.dtype} and {codes.dtype}")
    if out is None:
        out = np.empty((x.shape[0], num_out), np.float32)
    x = np.ascontiguousarray(x)
    if x.shape[0] > 1:
        single_threaded_blas()
        _tiled(x, codes, scales, offsets, out)
    elif num_out * x.shape[1] >= PARALLEL_MIN_WEIGHTS:
        _dot_parallel(x, codes, scales, offsets, out)
    else:
        _dot_serial(x, codes, scales, offsets, out)
    return out
