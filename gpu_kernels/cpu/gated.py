"""A gated MLP's activation of many rows (Numba CPU): ``act(gate) * up`` of a borrowed model's prefill.

``gated_rows(gate_up, activation, out)``
    ``out[t] = act(gate_up[t, :n]) * gate_up[t, n:]`` for every row ``t`` of ``gate_up``
    (``[rows, 2 n]`` float32, C-contiguous: the fused gate/up product, gate first), ``act``
    SiLU (``SILU``) or GELU's tanh approximation (``GELU_TANH``, Gemma's ``gelu_pytorch_tanh``).

`activate_rows` is the fused decode step's own routine too (``activations``' vector
``exp``, within a few units in the last place of libm's; blocks of rows on every thread for
large products), so a prefill and the captured decode step compute the activation alike.
PaddleFormers computes it as three Paddle CPU ops (a chunk that copies both halves, the
activation, the product): ~1.3 ms for a 257 x 2 x 2048 product, one per layer; here 0.4.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .activations import gelu_tanh_mul, silu_mul

__all__ = ["GELU_TANH", "SILU", "activate_rows", "gated_rows"]

SILU, GELU_TANH = 0, 1  # the activation (``DecoderSpec.activation`` "silu", "gelu_pytorch_tanh")
_PAR = dict(parallel=True, fastmath=False, cache=True, nogil=True, boundscheck=False)
_SEQ = dict(fastmath=True, cache=True, nogil=True, boundscheck=False)  # as the decode step compiled it
ROWS_PER_ITEM = 16
PARALLEL_MIN_ELEMENTS = 1 << 21  # fewer: the calling thread alone
# (a Gemma 3 270M prefill's 257 x 2 x 2048: waking Numba's threads right after a BLAS product
# costs what they save, 0.57 vs 0.51 ms median on 2 cores under TBB)


@njit(**_SEQ)
def activate_rows(gate_up, activation, act):
    """act[t] = activation(gate) * up for each row [gate | up] of gate_up [T, 2 * inter]."""
    inter = act.shape[1]
    for t in range(gate_up.shape[0]):
        if activation == GELU_TANH:
            gelu_tanh_mul(gate_up[t], act[t])
        else:
            silu_mul(gate_up[t], act[t])
        for i in range(inter // 8 * 8, inter):  # the vector routines leave the last inter % 8 to us
            g = gate_up[t, i]
            if activation == GELU_TANH:
                z = np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
                act[t, i] = np.float32(0.5) * g * (np.float32(1.0) + np.tanh(z)) * gate_up[t, inter + i]
            else:
                act[t, i] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[t, inter + i]


@njit(**_PAR)
def _rows_par(gate_up, activation, out):
    items = (gate_up.shape[0] + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    for k in prange(items):
        a = k * ROWS_PER_ITEM
        b = min(a + ROWS_PER_ITEM, gate_up.shape[0])
        activate_rows(gate_up[a:b], activation, out[a:b])


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
        activate_rows(gate_up, activation, out)
    return out
