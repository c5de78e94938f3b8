"""RMS normalisation of float32 rows (Numba CPU): the norms of a borrowed model's prefill.

``rms_norm(x, weight, eps, offset, out)``
    ``out[r] = x[r] / sqrt(mean(x[r] ** 2) + eps) * (weight + offset)`` for every row ``r``
    of ``x`` (``[rows, dim]``, any strides); ``offset`` 0 is Llama's norm, 1 Gemma's
    (``1 + weight``).

PaddleFormers computes a norm as five Paddle CPU ops (square, mean, add, rsqrt, two
multiplies), each a pass over the tensor plus its dispatch: ~0.4 ms for a 257 x 640 tensor,
six norms a Gemma 3 layer. Here it is one pass per row, the rows spread over the threads.
The mean of squares is summed in float64 (Paddle sums float32), so results agree with the
library's to float32 rounding, not bit for bit. The squares of float32 values are exact in
float64, and the sum may be reassociated (``fastmath`` ``reassoc`` on that loop alone), which
lets LLVM vectorize it: a norm of a 257 x 640 tensor 0.17 -> 0.05 ms; reordering a float64 sum of
a row moves it by far less than a float32 rounding step.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

_PAR = dict(parallel=True, fastmath=False, cache=True, nogil=True, boundscheck=False)
_SEQ = dict(fastmath=False, cache=True, nogil=True, boundscheck=False)
PARALLEL_MIN_ELEMENTS = 1 << 20  # fewer: the calling thread alone (a one-pass op: a parallel launch costs more)


@njit(fastmath={"reassoc"}, cache=True, nogil=True, boundscheck=False)
def _sum_squares(x, r):
    s = 0.0
    for i in range(x.shape[1]):
        v = np.float64(x[r, i])
        s += v * v
    return s


@njit(**_SEQ)
def _row(x, scale, eps, out, r):
    dim = x.shape[1]
    s = _sum_squares(x, r)
    inv = np.float32(1.0 / math.sqrt(np.float32(s / dim) + eps))
    for i in range(dim):
        out[r, i] = (x[r, i] * inv) * scale[i]


@njit(**_PAR)
def _rows_par(x, scale, eps, out):
    for r in prange(x.shape[0]):
        _row(x, scale, eps, out, r)


@njit(**_SEQ)
def _rows_seq(x, scale, eps, out):
    for r in range(x.shape[0]):
        _row(x, scale, eps, out, r)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, offset: float, out: np.ndarray) -> np.ndarray:
    """``out = x / sqrt(mean(x**2, -1) + eps) * (weight + offset)`` row by row; float32 ``[rows, dim]``."""
    if x.ndim != 2 or x.dtype != np.float32 or weight.shape != (x.shape[1],) or out.shape != x.shape:
        raise ValueError(f"rms_norm takes float32 x [rows, dim], weight [dim] and out like x; got x "
                         f"{x.dtype} {x.shape}, weight {weight.shape}, out {out.shape}")
    scale = (weight.astype(np.float32) + np.float32(offset)).astype(np.float32)
    eps = np.float32(eps)
    (_rows_par if x.size >= PARALLEL_MIN_ELEMENTS else _rows_seq)(x, scale, eps, out)
    return out
