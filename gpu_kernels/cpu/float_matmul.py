"""``y = x @ W`` for float32 host arrays: dot products for a few rows times an ``[out, in]`` weight,
NumPy's BLAS for the rest.

A float32 LM head in a decode step is a few rows of ``x`` times a large
``[vocab, hidden]`` weight, read from memory once: a bandwidth-bound product.
BLAS runs it as a general matrix product, which for 2-16 rows is 2-3x slower
than reading the weight once (SmolLM2's ``[rows, 576] x [576, 49152]``:
14.6 ms for 4 rows through NumPy's BLAS, 3.8 ms here). NumPy's BLAS also
runs on worker threads of its own, which keep spinning on the cores for about
2^28 cycles after each call (OpenBLAS' ``OPENBLAS_THREAD_TIMEOUT``) and so
slow the Numba kernels that run next: one stream of SmolLM2 float decoded at
30 tok/s with its LM head through NumPy, 39 with this kernel. Here each thread
of Numba's pool, the one every CPU kernel runs on, takes tiles of the weight's
rows and reads each row once for up to ``GROUP`` rows of ``x``.

Many rows of ``x`` (a prefill) are a compute-bound product, which NumPy's
threaded BLAS runs best (faster than one BLAS call per Numba thread on a
part of the rows or columns, measured on Gemma 3's projections).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

FEW_ROWS = 32  # at most this many rows of x times an [out, in] weight: dot products (BLAS is faster above)
TILE = 256  # weight rows per work item (576 float32 inputs: 590 KB, held in L2 across x's row groups)
GROUP = 4  # rows of x that share each read of a weight row


@njit(fastmath=True, boundscheck=False, nogil=True, cache=True)
def _dot_rows(x, w_rows, out, lo, hi):
    """out[:, lo:hi] = x @ w_rows[lo:hi].T, ``GROUP`` rows of x at a time."""
    num_in = w_rows.shape[1]
    t = 0
    while t + GROUP <= x.shape[0]:
        x0, x1, x2, x3 = x[t], x[t + 1], x[t + 2], x[t + 3]
        for o in range(lo, hi):
            w = w_rows[o]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for k in range(num_in):
                v = w[k]
                a0 += x0[k] * v
                a1 += x1[k] * v
                a2 += x2[k] * v
                a3 += x3[k] * v
            out[t, o], out[t + 1, o], out[t + 2, o], out[t + 3, o] = a0, a1, a2, a3
        t += GROUP
    for r in range(t, x.shape[0]):
        xr = x[r]
        for o in range(lo, hi):
            w = w_rows[o]
            acc = np.float32(0.0)
            for k in range(num_in):
                acc += xr[k] * w[k]
            out[r, o] = acc


@njit(parallel=True, fastmath=True, boundscheck=False, nogil=True, cache=True)
def _few_rows(x, w_rows, out):
    num_out = w_rows.shape[0]
    for item in prange((num_out + TILE - 1) // TILE):
        _dot_rows(x, w_rows, out, item * TILE, min(num_out, item * TILE + TILE))


def float_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None, *,
                 transpose_w: bool = False) -> np.ndarray:
    """``x @ w`` (``w`` ``[in, out]``), or ``x @ w.T`` with ``transpose_w`` (``w`` ``[out, in]``).

    ``x`` float32 ``[T, in]``; ``w`` float32; ``out`` float32 ``[T, out]``, C-contiguous.
    """
    if x.ndim != 2 or w.ndim != 2 or x.dtype != np.float32 or w.dtype != np.float32:
        raise ValueError(f"float_matmul takes float32 matrices; got x {x.dtype} {x.shape}, w {w.dtype} {w.shape}")
    num_in, num_out = (w.shape[1], w.shape[0]) if transpose_w else w.shape
    if x.shape[1] != num_in:
        raise ValueError(f"float_matmul: x {x.shape} does not match w {w.shape} "
                         f"({'[out, in]' if transpose_w else '[in, out]'})")
    if out is None:
        out = np.empty((x.shape[0], num_out), np.float32)
    if transpose_w and x.shape[0] <= FEW_ROWS:
        _few_rows(np.ascontiguousarray(x), np.ascontiguousarray(w), out)
    else:
        np.matmul(x, w.T if transpose_w else w, out=out)
    return out
