"""Rotary position embedding of float32 rows, rotate-half form (Numba CPU): a borrowed model's prefill.

``rope_rotate_half(x, cos, sin, out)``
    ``out = x * cos + rotate_half(x) * sin`` for ``x`` ``[batch, heads, tokens, head_dim]``
    (any strides) and ``cos``/``sin`` ``[batch or 1, tokens, head_dim]`` broadcast over the
    heads, where ``rotate_half(x) = concat(-x[..., half:], x[..., :half])`` (Llama, Qwen,
    Gemma: HF's and PaddleFormers' ``apply_rotary_pos_emb``), ``head_dim`` even.

The library computes it as six Paddle CPU ops per tensor (two slices, a negation, a
concatenation, two products and a sum, after expanding ``cos``/``sin`` to the tensor's shape),
each a pass over a ``[1, 4, 257, 256]`` query plus its dispatch. Here it is one pass. Each
element is the same two float32 products and one sum in the same order (no fused
multiply-add: ``fastmath`` off, so LLVM contracts nothing), so the result is bit-identical.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_SEQ = dict(fastmath=False, cache=True, nogil=True, boundscheck=False)


@njit(**_SEQ)
def _rope(x, cos, sin, out):
    batch, heads, tokens, dim = x.shape
    half = dim // 2
    for b in range(batch):
        cb = b if cos.shape[0] > 1 else 0
        for h in range(heads):
            for t in range(tokens):
                for i in range(half):
                    out[b, h, t, i] = x[b, h, t, i] * cos[cb, t, i] + (-x[b, h, t, i + half]) * sin[cb, t, i]
                for i in range(half, dim):
                    out[b, h, t, i] = x[b, h, t, i] * cos[cb, t, i] + x[b, h, t, i - half] * sin[cb, t, i]


def rope_rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out = x * cos[:, None] + rotate_half(x) * sin[:, None]``; float32, see the module docstring."""
    ok = (x.ndim == 4 and x.shape[3] % 2 == 0 and out.shape == x.shape and cos.shape == sin.shape
          and cos.ndim == 3 and cos.shape[0] in (1, x.shape[0]) and cos.shape[1:] == (x.shape[2], x.shape[3])
          and all(a.dtype == np.float32 for a in (x, cos, sin, out)))
    if not ok:
        raise ValueError(f"rope_rotate_half takes float32 x [batch, heads, tokens, head_dim] (head_dim even), "
                         f"cos/sin [batch or 1, tokens, head_dim] and out like x; got x {x.dtype} {x.shape}, "
                         f"cos {cos.dtype} {cos.shape}, sin {sin.dtype} {sin.shape}, out {out.dtype} {out.shape}")
    _rope(x, cos, sin, out)
    return out
