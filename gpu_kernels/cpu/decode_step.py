"""One decode step of a Llama-family decoder as one Numba call (CPU).

Eager Paddle runs a decode step as a few hundred small ops, each with its own
dispatch; for a small model the step is then mostly dispatch, not arithmetic.
``decode_step`` runs the whole stack -- embedding, every layer (RMSNorm, QKV
projection, optional Q/K head norms, RoPE, KV-cache write, paged attention,
output projection, MLP) and the final norm -- for ``T`` sequences with one new
token each, in one compiled call. The matmuls are matrix-vector products bound
by reading the weights, so each weight row is read once per step and applied to
all ``T`` tokens, and the rows are split over the cores (``prange``).

A linear ``k`` of the stack comes in one of three formats (``formats[k]``):

============  ===========================================================
``FLOAT``     ``float_w[k]``: float32 ``[in, out]`` (the Paddle parameter)
``INT8``      ``codes[k]`` int8 ``[out, in // 32 * 32]``: ``W = scale * code + offset``
``NIBBLE``    ``nibbles[k]`` uint8 ``[out, in // 32 * 16]``: byte ``j`` of a block holds
              code ``j`` in its low and code ``j + 16`` in its high four bits (GGUF's Q4 order)
============  ===========================================================

with ``scales[k]`` / ``offsets[k]`` float32 ``[out, in // 32]`` for the block
formats; block linears run the kernels of ``block_matmul.py``. The lists hold
one entry per linear in the order ``layer * 4 + (qkv, o, gate_up, down)``,
then optionally the LM head (block formats only); entries of the formats a
linear does not use are placeholders. Attention reuses the paged-attention
pieces of ``attention.py``.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .attention import decode_item, store_rows
from .block_matmul import matvec_par, matvec_seq, tiled_par, tiled_seq

FLOAT, INT8, NIBBLE = 0, 1, 2
QKV, O_PROJ, GATE_UP, DOWN = 0, 1, 2, 3

_PAR = dict(parallel=True, fastmath=True, cache=True, nogil=True, boundscheck=False)
_SEQ = dict(fastmath=True, cache=True, nogil=True, boundscheck=False)


def _attention(q, k_cache, v_cache, block_tables, context_lens, scale, out):
    """Paged decode attention: every (sequence, KV head) is one work item (no key split)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    part_m = np.empty((num_seqs, num_kv_heads, 1, group), np.float32)
    part_l = np.empty((num_seqs, num_kv_heads, 1, group), np.float32)
    part_acc = np.empty((num_seqs, num_kv_heads, 1, group, head_dim), np.float32)
    for item in prange(num_seqs * num_kv_heads):
        i, h = item // num_kv_heads, item % num_kv_heads
        decode_item(q, k_cache, v_cache, block_tables, context_lens, scale, 0, i, h, 0, part_m, part_l, part_acc)
        store_rows(out, i, 1, h * group, group, part_l[i, h, 0], part_acc[i, h, 0])


_attention_par, _attention_seq = njit(**_PAR)(_attention), njit(**_SEQ)(_attention)


@njit(**_SEQ)
def _block_linear(x, codes, scales, offsets, out, parallel):
    if x.shape[0] > 1:
        if parallel:
            tiled_par(x, codes, scales, offsets, out)
        else:
            tiled_seq(x, codes, scales, offsets, out)
    elif parallel:
        matvec_par(x, codes, scales, offsets, out)
    else:
        matvec_seq(x, codes, scales, offsets, out)


@njit(**_SEQ)
def _linear(k, x, formats, float_w, codes, nibbles, scales, offsets, out, parallel):
    """out = x @ W_k.T for linear ``k`` of the stack, in its format."""
    if formats[k] == FLOAT:
        out[:] = np.dot(x, float_w[k])
    elif formats[k] == NIBBLE:
        _block_linear(x, nibbles[k], scales[k], offsets[k], out, parallel)
    else:
        _block_linear(x, codes[k], scales[k], offsets[k], out, parallel)


@njit(**_SEQ)
def _rms_norm(x, weight, eps, out):
    """Row-wise ``x * rsqrt(mean(x^2) + eps) * weight`` (x and out: [rows, dim])."""
    dim = x.shape[1]
    for r in range(x.shape[0]):
        ss = np.float32(0.0)
        for i in range(dim):
            ss += x[r, i] * x[r, i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(dim) + np.float32(eps))
        for i in range(dim):
            out[r, i] = x[r, i] * inv * weight[i]


@njit(**_SEQ)
def _rope(heads, cos, sin):
    """Rotate-half RoPE in place; heads: [num_heads, head_dim], cos/sin: [head_dim] of the token."""
    half = heads.shape[1] // 2
    for h in range(heads.shape[0]):
        for d in range(half):
            x1, x2 = heads[h, d], heads[h, d + half]
            heads[h, d] = x1 * cos[d] - x2 * sin[d]
            heads[h, d + half] = x2 * cos[d + half] + x1 * sin[d + half]


@njit(**_SEQ)
def decode_step(token_ids, positions, slots, block_tables, context_lens,
                embed, norms, qk_norms, qkv_bias, final_norm, cos_table, sin_table,
                formats, float_w, codes, nibbles, scales, offsets,
                k_caches, v_caches, num_heads, num_kv_heads, eps, scale, parallel, out, logit_rows, logits):
    """Hidden states after the final norm for ``T`` decoding sequences, written to ``out`` [T, hidden],
    and, where the stack has an LM head (linear ``4 * num_layers``), the logits of the hidden rows
    ``logit_rows`` written to ``logits`` [len(logit_rows), vocab].

    token_ids, positions, slots: [T] (new token, its position, its KV-cache slot);
    block_tables [T, max_blocks] and context_lens [T] (including the new token)
    as for ``paged_decode``; norms: 2 per layer (input, post-attention);
    qk_norms: 2 per layer (Q, K) or empty; qkv_bias: 1 per layer or empty;
    k_caches / v_caches: float32 ``[num_blocks, kv_heads, block_size, head_dim]`` per layer.
    """
    num_tokens = token_ids.shape[0]
    hidden = embed.shape[1]
    num_layers = len(k_caches)
    head_dim = k_caches[0].shape[3]
    block_size = k_caches[0].shape[2]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    x = np.empty((num_tokens, hidden), np.float32)
    for t in range(num_tokens):
        x[t] = embed[token_ids[t]]
    h = np.empty_like(x)
    qkv = np.empty((num_tokens, q_size + 2 * kv_size), np.float32)
    attn = np.empty((num_tokens, num_heads, head_dim), np.float32)
    proj = np.empty_like(x)
    inter = scales[GATE_UP].shape[0] // 2 if formats[GATE_UP] != FLOAT else float_w[GATE_UP].shape[1] // 2
    gate_up = np.empty((num_tokens, 2 * inter), np.float32)
    act = np.empty((num_tokens, inter), np.float32)
    for layer in range(num_layers):
        lin = 4 * layer
        _rms_norm(x, norms[2 * layer], eps, h)
        _linear(lin + QKV, h, formats, float_w, codes, nibbles, scales, offsets, qkv, parallel)
        if len(qkv_bias) > 0:
            bias = qkv_bias[layer]
            for t in range(num_tokens):
                for i in range(qkv.shape[1]):
                    qkv[t, i] += bias[i]
        k_cache, v_cache = k_caches[layer], v_caches[layer]
        for t in range(num_tokens):
            q = qkv[t, :q_size].reshape((num_heads, head_dim))
            k = qkv[t, q_size:q_size + kv_size].reshape((num_kv_heads, head_dim))
            v = qkv[t, q_size + kv_size:].reshape((num_kv_heads, head_dim))
            if len(qk_norms) > 0:
                _rms_norm(q.copy(), qk_norms[2 * layer], eps, q)
                _rms_norm(k.copy(), qk_norms[2 * layer + 1], eps, k)
            pos = positions[t]
            _rope(q, cos_table[pos], sin_table[pos])
            _rope(k, cos_table[pos], sin_table[pos])
            attn[t] = q
            slot = slots[t]
            blk, off = slot // block_size, slot % block_size
            k_cache[blk, :, off, :] = k
            v_cache[blk, :, off, :] = v
        if parallel and num_tokens > 1:  # one token's attention is too little work to split
            _attention_par(attn.copy(), k_cache, v_cache, block_tables, context_lens, scale, attn)
        else:
            _attention_seq(attn.copy(), k_cache, v_cache, block_tables, context_lens, scale, attn)
        _linear(lin + O_PROJ, attn.reshape((num_tokens, q_size)), formats, float_w, codes, nibbles,
                scales, offsets, proj, parallel)
        x += proj
        _rms_norm(x, norms[2 * layer + 1], eps, h)
        _linear(lin + GATE_UP, h, formats, float_w, codes, nibbles, scales, offsets, gate_up, parallel)
        for t in range(num_tokens):
            for i in range(inter):
                g = gate_up[t, i]
                act[t, i] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[t, inter + i]
        _linear(lin + DOWN, act, formats, float_w, codes, nibbles, scales, offsets, proj, parallel)
        x += proj
    _rms_norm(x, final_norm, eps, out)
    if len(formats) > 4 * num_layers and len(logit_rows) > 0:
        rows = np.empty((len(logit_rows), hidden), np.float32)
        for i in range(len(logit_rows)):
            rows[i] = out[logit_rows[i]]
        _linear(4 * num_layers, rows, formats, float_w, codes, nibbles, scales, offsets, logits, parallel)
