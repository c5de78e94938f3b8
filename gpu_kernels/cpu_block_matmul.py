"""``y = x @ W.T`` on block-quantized weights (Numba CPU), for the few rows of a decode step.

``W[o, 32*b + j] = scales[o, b] * codes[o, b, j] + offsets[o, b]`` with int8
codes (`engine.loader.gguf_blocks.BlockQuantized`: GGUF Q4_0 / Q4_1 / Q8_0).
At batch 1 a float32 matmul reads 4 bytes per weight and is bound by memory
bandwidth; this kernel reads 1.25 and converts codes on the fly:

    y[t, o] = sum_b scales[o, b] * (codes[o, b, :] . x[t, b, :]) + offsets[o, b] * sum(x[t, b, :])

Each output row keeps 32 partial sums (one SIMD-friendly block) and reduces
them once. Work grows with the number of rows ``T`` while a float32 GEMM's
memory traffic does not, so the engine uses this kernel only for small ``T``
(`engine.block_linear`). Every output element is computed the same way
whatever ``T`` is, so a request's numbers do not depend on its batch-mates.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

BLOCK = 32


def _block_matmul(x, codes, scales, offsets, out):
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


# Threads pay off only for large weights: a parallel launch costs tens of µs.
_parallel = njit(parallel=True, fastmath=True, boundscheck=False, cache=True)(_block_matmul)
_serial = njit(fastmath=True, boundscheck=False, cache=True)(_block_matmul)
PARALLEL_MIN_WEIGHTS = 1 << 20


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
    kernel = _parallel if num_out * x.shape[1] >= PARALLEL_MIN_WEIGHTS else _serial
    kernel(np.ascontiguousarray(x), codes, scales, offsets, out)
    return out
