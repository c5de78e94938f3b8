"""A gated MLP's activation of many rows (Numba CPU): ``act(gate) * up`` of a borrowed model's prefill.

``gated_rows(gate_up, activation, out)``
    ``out[t] = act(gate_up[t, :n]) * gate_up[t, n:]`` for every row ``t`` of ``gate_up``
    (``[rows, 2 n]`` float32, C-contiguous: the fused gate/up product, gate first), ``act``
    SiLU (``SILU``) or GELU's tanh approximation (``GELU_TANH``, Gemma's ``gelu_pytorch_tanh``).

It is the fused decode step's own routine (``decode_step._activate``: ``activations``' vector
``exp``, within a few units in the last place of libm's; blocks of rows on every thread for
large products), so a prefill and the captured decode step compute the activation alike.
PaddleFormers computes it as three Paddle CPU ops (a chunk that copies both halves, the
activation, the product): ~1.3 ms for a 257 x 2 x 2048 product, one per layer; here 0.4.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .decode_step import GELU_TANH, SILU, _activate

__all__ = ["GELU_TANH", "SILU", "gated_rows"]

_PAR = dict(parallel=True, fastmath=False, cache=True, nogil=True, boundscheck=False)
ROWS_PER_ITEM = 16
PARALLEL_MIN_ELEMENTS = 1 << 21  # fewer: the calling thread alone
# (a Gemma 3 270M prefill's 257 x 2 x 2048: waking Numba's threads right after a BLAS product
# costs what they save, 0.57 vs 0.51 ms median on 2 cores under TBB)


@njit(**_PAR)
def _rows_par(gate_up, activation, out):
    items = (gate_up.shape[0] + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    for k in prange(items):
        a = k * ROWS_PER_ITEM
        b = min(a + ROWS_PER_ITEM, gate_up.shape[0])
        _activate(gate_up[a:b], activation, out[a:b])


def gated_rows(gate_up: np.ndarray, activation: int, out: np.ndarray) -> np.ndarray:
    """``out = act(gate_up[:, :n]) * gate_up[:, n:]``, ``n = out.shape[1]`` (see the module docstring)."""
    if (gate_up.ndim != 2 or out.ndim != 2 or gate_up.dtype != np.float32 or out.dtype != np.float32
            or gate_up.shape != (out.shape[0], 2 * out.shape[1]) or not gate_up.flags.c_contiguous
            or not out.flags.c_contiguous or activation not in (SILU, GELU_TANH)):
        raise ValueError(f"gated_rows takes C-contiguous float32 gate_up [rows, 2 n], out [rows, n] and an "
                         f"activation SILU ({SILU}) or GELU_TANH ({GELU_TANH}); got gate_up {gate_up.dtype} "
                         f"{gate_up.shape}, out {out.dtype} {out.shape}, activation {activation!r}")
    if gate_up.size >= PARALLEL_MIN_ELEMENTS:
        _rows_par(gate_up, activation, out)
    else:
        _activate(gate_up, activation, out)
    return out
