"""Reference paged attention in NumPy: the definition every backend must match.

Cache layout (docs/ARCHITECTURE.md)::

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]

Token ``j`` of sequence ``i`` (its position, counting from 0) lives in block
``block_tables[i, j // block_size]`` at offset ``j % block_size``.

Visibility. A query at position ``p`` sees the key at position ``j`` when::

    j <= p                      (causal)
    j >  p - sliding_window     (only with a sliding window)

Decode has one query per sequence, at position ``context_lens[i] - 1``.
Prefill packs the query chunks of all sequences; sequence ``i`` owns rows
``query_start_loc[i] : query_start_loc[i+1]`` and these are the *last*
``n_i`` of its ``context_lens[i]`` tokens, so row ``t`` of the chunk is at
position ``context_lens[i] - n_i + t`` (bottom-right-aligned causal mask). A
decode in a mixed batch is a chunk of length 1.

Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads //
num_kv_heads)``.

A query that sees no key at all (a zero-length context) gets an all-zero
output row. Scores and softmax are computed in float64 here; the kernels
use float32 with an online (streaming) softmax.

Arrays may be NumPy float32/float64/float16, or canonical half bits
(``formats.py``: int16 = float16, uint16 = bfloat16). ``out`` receives the
result in its own format.
"""
from __future__ import annotations

import numpy as np

from .formats import from_float32, to_float32


def write_kv(key, value, k_cache, v_cache, slot_mapping):
    """Scatter ``key/value[t]`` ([num_tokens, num_kv_heads, head_dim]) to slot ``slot_mapping[t]``.

    Slot ``s`` is block ``s // block_size``, offset ``s % block_size``;
    slot -1 is skipped. Values are rounded to the cache's format.
    """
    block_size = k_cache.shape[2]
    slots = np.asarray(slot_mapping).astype(np.int64)
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    k = from_float32(to_float32(key[keep]), k_cache.dtype)
    v = from_float32(to_float32(value[keep]), v_cache.dtype)
    # k_cache[blocks, :, offsets, :] has shape [n, num_kv_heads, head_dim]
    k_cache[blocks, :, offsets, :] = k
    v_cache[blocks, :, offsets, :] = v


def gather_kv(cache, block_table, length):
    """The first ``length`` tokens of one sequence: [num_kv_heads, length, head_dim] float32."""
    block_size = cache.shape[2]
    n_blocks = -(-length // block_size)
    pages = cache[np.asarray(block_table[:n_blocks], dtype=np.int64)]  # [nb, Hkv, bs, D]
    pages = to_float32(pages).transpose(1, 0, 2, 3)
    return pages.reshape(cache.shape[1], n_blocks * block_size, cache.shape[3])[:, :length]


def attend(q, k, v, positions, scale, sliding_window):
    """Exact attention of queries ``q`` [n, H, D] at ``positions`` over keys/values [Hkv, L, D].

    Returns float64 [n, H, D].
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads, length, _ = k.shape
    group = num_heads // num_kv_heads
    out = np.zeros((n, num_heads, head_dim), np.float64)
    if n == 0 or length == 0:
        return out
    key_pos = np.arange(length)
    visible = key_pos[None, :] <= positions[:, None]                    # [n, L]
    if sliding_window:
        visible &= key_pos[None, :] > positions[:, None] - sliding_window
    kv_of_head = np.arange(num_heads) // group
    k64 = k.astype(np.float64)[kv_of_head]                             # [H, L, D]
    v64 = v.astype(np.float64)[kv_of_head]
    scores = np.einsum("nhd,hld->hnl", q.astype(np.float64), k64) * scale
    scores = np.where(visible[None], scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(scores - m)
    denom = p.sum(axis=-1, keepdims=True)
    p = np.divide(p, denom, out=np.zeros_like(p), where=denom > 0)
    return np.einsum("hnl,hld->nhd", p, v64)


def paged_prefill(query, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                  scale, *, sliding_window=None, out):
    """Chunked prefill (and mixed prefill/decode) attention; see the module docstring."""
    q_all = to_float32(query)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    result = np.zeros(q_all.shape, np.float64)
    for i in range(len(ctx)):
        start, end = qsl[i], qsl[i + 1]
        n, length = end - start, ctx[i]
        if n == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], length)
        v = gather_kv(v_cache, block_tables[i], length)
        positions = np.arange(length - n, length)
        result[start:end] = attend(q_all[start:end], k, v, positions, scale, sliding_window)
    out[...] = from_float32(result.astype(np.float32), out.dtype)
    return out


def paged_decode(query, k_cache, v_cache, block_tables, context_lens, scale, *,
                 sliding_window=None, out):
    """Decode attention: one query per sequence at position ``context_lens[i] - 1``."""
    num_seqs = query.shape[0]
    qsl = np.arange(num_seqs + 1, dtype=np.int32)
    return paged_prefill(query, k_cache, v_cache, block_tables, qsl, context_lens, scale,
                         sliding_window=sliding_window, out=out)
