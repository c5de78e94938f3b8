"""One decode step of a Llama-family decoder as one Numba call per thread (CPU).

Eager Paddle runs a decode step as a few hundred small ops, each with its own
dispatch; for a small model the step is then mostly dispatch, not arithmetic.
``decode_step`` runs the whole stack -- embedding, every layer (RMSNorm, QKV
projection, optional Q/K head norms, RoPE, KV-cache write, paged attention,
output projection, MLP), the final norm and the LM head -- for ``T`` sequences
with one new token each. The layer is Llama's pre-norm layer or Gemma 3's
"sandwich" (norms after attention and MLP too, scaled embeddings, GELU, a
sliding window on some layers, a RoPE base per layer): `decode_step` lists
the arrays and flags that say which. Each weight row is read once per step and applied to
all ``T`` tokens.

A team of threads calls ``decode_step`` together (`engine.fused_decode` keeps
the team), each with its ``tid``; alone, one thread does everything. The
threads walk the same *phases* -- per layer: QKV, attention, O, gate/up, down;
then the LM head -- and share each phase's items (`cpu.sync`): ``DOT_ROWS`` output rows of a matmul
(dot products, up to ``MATVEC_T`` tokens) or ``TILE`` (the register-blocked
micro-kernel of `cpu.microkernel`, more tokens), one (sequence, KV head) of
attention. A thread that runs out of items to claim runs the unfinished
ones itself rather than wait, so no thread ever waits for another (a
descheduled one on a busy machine costs the others one item, not the step);
a matmul phase ends on ``TAIL_ITEMS`` items a quarter that size, so the
item a thread runs twice at the end of a phase is a small one.
Cheap row-wise work between matmuls (norms, residual adds, the activation) every thread
does for itself on its own copy. Every phase writes its own per-layer buffer,
so a thread that falls behind never finds its inputs overwritten; it finds the
items finished and catches up. A result does not depend on which thread
computed it, nor on how many did.

A linear ``k`` of the stack comes in one of three formats (``formats[k]``):

============  ===========================================================
``FLOAT``     ``float_w[k]``: float32 ``[in, out]`` (the Paddle parameter; for up to ``MATVEC_T``
              tokens, items of ``K_ROWS`` input rows into ``partials``, summed in order)
``INT8``      ``codes[k]`` int8 ``[out, in // 32 * 32]``: ``W = scale * code + offset``
``NIBBLE``    ``nibbles[k]`` uint8 ``[out, in // 32 * 16]``: byte ``j`` of a block holds
              code ``j`` in its low and code ``j + 16`` in its high four bits (GGUF's Q4 order)
============  ===========================================================

with ``scales[k]`` / ``offsets[k]`` float32 ``[out, in // 32]`` for the block
formats; block rows run the row kernels of ``block_matmul.py`` (the same ones
its matmul runs). The lists hold one entry per linear in the order
``layer * 4 + (qkv, o, gate_up, down)``, then optionally the LM head (block
formats only); entries of the formats a linear does not use are placeholders.
Attention reuses the paged-attention pieces of ``attention.py``.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .attention import decode_item, store_rows
from .block_matmul import MATVEC_T, SMALL_T, blas_rows, block_sums, matvec_rows, padded_transpose, tiled_rows
from .gated import activate_rows
from .sync import claim, finish, finished, join_step, leave_step

FLOAT, INT8, NIBBLE = 0, 1, 2
QKV, O_PROJ, GATE_UP, DOWN = 0, 1, 2, 3
PHASES_PER_LAYER = 5  # QKV, attention, O, gate/up, down

_SEQ = dict(fastmath=True, cache=True, nogil=True, boundscheck=False)
DOT_ROWS = 128  # weight rows per item of a dot-product matmul: long runs of contiguous rows stream from
# memory faster than items interleaved every 32 rows between the threads
TILE = 48  # weight rows per item of a several-token matmul (a multiple of the micro-kernel's R): small
# enough that the half item a phase loses at its end (a thread runs a held item again) stays small
BLAS_TILE = 256  # most weight rows per item of a matmul of more than SMALL_T tokens
K_ROWS = 64  # input rows per item of a float32 linear's product with up to MATVEC_T tokens
TAIL_ITEMS = 4  # a dot-product or micro-kernel phase ends on this many items of a quarter the rows


def num_phases(num_layers: int) -> int:
    """Phases of one step (the LM head's included); the counters array holds ``sync.STRIDE`` per phase."""
    return PHASES_PER_LAYER * num_layers + 1


@njit(**_SEQ)
def _rows_of(k, x, formats, float_w, codes, nibbles, scales, offsets, sums, xt, w, yt, out, lo, hi):
    """out[:, lo:hi] for linear ``k`` (block formats)."""
    if x.shape[0] <= MATVEC_T:
        if formats[k] == NIBBLE:
            matvec_rows(x, nibbles[k], scales[k], offsets[k], sums, out, lo, hi)
        else:
            matvec_rows(x, codes[k], scales[k], offsets[k], sums, out, lo, hi)
    elif x.shape[0] <= SMALL_T:
        if formats[k] == NIBBLE:
            tiled_rows(xt, nibbles[k], scales[k], offsets[k], yt, out, lo, hi)
        else:
            tiled_rows(xt, codes[k], scales[k], offsets[k], yt, out, lo, hi)
    elif formats[k] == NIBBLE:
        blas_rows(xt, nibbles[k], scales[k], offsets[k], w, out, lo, hi)
    else:
        blas_rows(xt, codes[k], scales[k], offsets[k], w, out, lo, hi)


@njit(**_SEQ)
def split_rows(num_out, rows, tail):
    """A matmul phase's items: ``big`` items of ``rows`` outputs over the first ``head``, then items of
    ``small`` (with ``tail``: ``TAIL_ITEMS`` or so of a quarter of ``rows``, starting on a multiple of 4
    so the micro-kernel's groups of rows stay where they are; else none) -> (big, small, head, items)."""
    small, head = rows, num_out
    if tail:  # the thread that finishes first then runs at most a small item a second time
        small = rows // 4
        head = max(0, num_out - TAIL_ITEMS * small) // 4 * 4
    big = (head + rows - 1) // rows
    return big, small, head, big + (num_out - head + small - 1) // small


@njit(**_SEQ)
def _item_rows(item, big, rows, small, head, num_out):
    """Output rows [lo, hi) of a matmul phase's ``item``: ``big`` items of ``rows`` over the first
    ``head`` outputs, then items of ``small`` up to ``num_out``."""
    if item < big:
        lo = item * rows
        return lo, min(head, lo + rows)
    lo = head + (item - big) * small
    return lo, min(num_out, lo + small)


@njit(**_SEQ)
def float_items(num_in):
    """Items of a float32 linear with ``num_in`` inputs and up to ``MATVEC_T`` tokens: ``K_ROWS`` rows each."""
    return (num_in + K_ROWS - 1) // K_ROWS


def float_partials(float_shapes):
    """Where each float32 linear's partial products start in the shared ``partials`` array, and its
    size: ``float_shapes[k]`` = (in, out) of linear ``k``, (0, 0) for a block linear (start -1)."""
    starts = np.full(len(float_shapes), -1, np.int64)
    size = 0
    for k, (num_in, num_out) in enumerate(float_shapes):
        if num_in:
            starts[k] = size
            size += float_items(num_in) * MATVEC_T * num_out
    return starts, size


@njit(**_SEQ)
def _float_part(x, w, partials, start, item):
    """Item ``item`` of a float32 linear: x[:, rows] @ w[rows] for its ``K_ROWS`` input rows, into its slot."""
    num_in, num_out = w.shape
    lo, hi = item * K_ROWS, min(num_in, item * K_ROWS + K_ROWS)
    at = start + item * MATVEC_T * num_out
    slot = partials[at:at + x.shape[0] * num_out].reshape((x.shape[0], num_out))
    # into the slot by a copy of the finished product, never as BLAS's output: another thread may be
    # running the same item (`_float_phase`) or summing the slot, and BLAS writes its output in passes
    # (zeroed, then accumulated), which that thread would read half done
    slot[:] = np.dot(np.ascontiguousarray(x[:, lo:hi]), w[lo:hi])


@njit(**_SEQ)
def _float_phase(x, w, partials, start, out, counters, marks, epoch, phase):
    """out = x @ w for a float32 ``[in, out]`` weight and up to ``MATVEC_T`` tokens: the weight's rows in
    items of ``K_ROWS`` (contiguous, one BLAS call each), shared by the team, each product into its own
    slot of ``partials``; then every thread sums the slots in item order into a copy of its own and
    writes it out, so the result does not depend on who computed what."""
    items = float_items(w.shape[0])
    item = claim(counters, phase)
    while item < items:
        _float_part(x, w, partials, start, item)
        finish(marks, phase, item, epoch)
        item = claim(counters, phase)
    for item in range(items):
        if not finished(marks, phase, item, epoch):
            _float_part(x, w, partials, start, item)
            finish(marks, phase, item, epoch)
    num_out = w.shape[1]
    total = np.zeros((x.shape[0], num_out), np.float32)
    for item in range(items):
        at = start + item * MATVEC_T * num_out
        for t in range(x.shape[0]):
            row = partials[at + t * num_out:at + (t + 1) * num_out]
            for j in range(num_out):
                total[t, j] += row[j]
    out[:] = total


@njit(**_SEQ)
def _linear_phase(k, x, formats, float_w, codes, nibbles, scales, offsets, partials, partial_at, out, counters,
                  marks, epoch, phase, team_size):
    """out = x @ W_k.T as one phase: this thread runs the items it claims, then every item not yet
    finished (`cpu.sync`)."""
    if formats[k] == FLOAT and x.shape[0] <= MATVEC_T and partial_at[k] >= 0:
        _float_phase(x, float_w[k], partials, partial_at[k], out, counters, marks, epoch, phase)
        return
    if formats[k] == FLOAT:  # one item: a BLAS call on the whole [in, out] weight
        if claim(counters, phase) == 0 or not finished(marks, phase, 0, epoch):
            out[:] = np.dot(x, float_w[k])
            finish(marks, phase, 0, epoch)
        return
    num_out, num_blocks = scales[k].shape
    sums = np.empty((x.shape[0], num_blocks), np.float32)
    xt = np.empty((1, 1), np.float32)
    w = np.empty((1, 1), np.float32)
    yt = np.empty((1, 1), np.float32)
    if x.shape[0] <= MATVEC_T:
        rows = DOT_ROWS
        block_sums(x, sums)
    elif x.shape[0] <= SMALL_T:  # the micro-kernel on TILE rows an item
        rows = TILE
        xt = padded_transpose(x)
        yt = np.empty((rows, xt.shape[1]), np.float32)
    else:  # BLAS on tiles of up to BLAS_TILE rows (most efficient on tall tiles), a multiple of team_size of them
        items = max(team_size, (num_out + BLAS_TILE - 1) // BLAS_TILE)
        items = (items + team_size - 1) // team_size * team_size
        rows = (num_out + items - 1) // items
        xt = np.ascontiguousarray(x.T)
        w = np.empty((rows, x.shape[1]), np.float32)
    big, small, head, items = split_rows(num_out, rows, x.shape[0] <= SMALL_T)
    item = claim(counters, phase)
    while item < items:
        lo, hi = _item_rows(item, big, rows, small, head, num_out)
        _rows_of(k, x, formats, float_w, codes, nibbles, scales, offsets, sums, xt, w, yt, out, lo, hi)
        finish(marks, phase, item, epoch)
        item = claim(counters, phase)
    for item in range(items):  # held by another thread (or one that has not come yet): run it here too
        if not finished(marks, phase, item, epoch):
            lo, hi = _item_rows(item, big, rows, small, head, num_out)
            _rows_of(k, x, formats, float_w, codes, nibbles, scales, offsets, sums, xt, w, yt, out, lo, hi)
            finish(marks, phase, item, epoch)


@njit(**_SEQ)
def _attention_item(item, layer, qkv, positions, slots, block_tables, context_lens, qk_norms, qkv_bias,
                    cos_table, sin_table, window, grouped, k_cache, v_cache, num_heads, num_kv_heads, eps, scale,
                    q, part_m, part_l, part_acc, out):
    """Sequence ``t``, KV head ``h``: bias, Q/K norms and RoPE of its heads, its K/V into the cache,
    paged attention of its query heads (over the last ``window`` keys where ``window > 0``)."""
    head_dim = k_cache.shape[3]
    block_size = k_cache.shape[2]
    group = num_heads // num_kv_heads
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    t, h = item // num_kv_heads, item % num_kv_heads
    row = qkv[t].copy()
    if len(qkv_bias) > 0:
        row += qkv_bias[layer]
    if grouped:  # per KV head: its query heads, its key, its value
        q_at = h * (group + 2) * head_dim
        k_at = q_at + group * head_dim
        v_at = k_at + head_dim
    else:  # all queries, all keys, all values
        q_at, k_at, v_at = h * group * head_dim, q_size + h * head_dim, q_size + kv_size + h * head_dim
    qh = row[q_at:q_at + group * head_dim].reshape((group, head_dim))
    kh = row[k_at:k_at + head_dim].reshape((1, head_dim))
    vh = row[v_at:v_at + head_dim]
    if len(qk_norms) > 0:
        _rms_norm(qh.copy(), qk_norms[2 * layer], eps, qh)
        _rms_norm(kh.copy(), qk_norms[2 * layer + 1], eps, kh)
    pos = positions[t]
    _rope(qh, cos_table[pos], sin_table[pos])
    _rope(kh, cos_table[pos], sin_table[pos])
    q[t, h * group:(h + 1) * group] = qh
    slot = slots[t]
    blk, off = slot // block_size, slot % block_size
    k_cache[blk, h, off, :] = kh[0]
    v_cache[blk, h, off, :] = vh
    decode_item(q, k_cache, v_cache, block_tables, context_lens, scale, window, t, h, 0, part_m, part_l, part_acc)
    store_rows(out, t, 1, h * group, group, part_l[t, h, 0], part_acc[t, h, 0])


@njit(**_SEQ)
def _attention_phase(layer, qkv, positions, slots, block_tables, context_lens, qk_norms, qkv_bias,
                     cos_table, sin_table, window, grouped, k_cache, v_cache, num_heads, num_kv_heads, eps, scale,
                     q, part_m, part_l, part_acc, out, counters, marks, epoch, phase):
    """Attention of every (sequence, KV head) as the phase's items -> out [T, num_heads, head_dim]."""
    items = qkv.shape[0] * num_kv_heads
    item = claim(counters, phase)
    while item < items:
        _attention_item(item, layer, qkv, positions, slots, block_tables, context_lens, qk_norms, qkv_bias,
                        cos_table, sin_table, window, grouped, k_cache, v_cache, num_heads, num_kv_heads, eps,
                        scale, q, part_m, part_l, part_acc, out)
        finish(marks, phase, item, epoch)
        item = claim(counters, phase)
    for item in range(items):
        if not finished(marks, phase, item, epoch):
            _attention_item(item, layer, qkv, positions, slots, block_tables, context_lens, qk_norms, qkv_bias,
                            cos_table, sin_table, window, grouped, k_cache, v_cache, num_heads, num_kv_heads,
                            eps, scale, q, part_m, part_l, part_acc, out)
            finish(marks, phase, item, epoch)


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
def decode_step(tid, team_size, counters, marks, epoch, token_ids, positions, slots, block_tables, context_lens,
                embed, embed_scale, norms, qk_norms, qkv_bias, final_norm, cos_tables, sin_tables, windows,
                grouped_qkv, activation, formats, float_w, codes, nibbles, scales, offsets, partials, partial_at,
                k_caches, v_caches, num_heads, num_kv_heads, eps, scale,
                qkv_buf, attn_buf, o_buf, gate_up_buf, down_buf, out, logit_rows, logits):
    """Thread ``tid`` (of ``team_size``)'s part of one decode step for ``T`` sequences (one new token each).

    Thread 0 writes the hidden states after the final norm to ``out`` [T, hidden];
    where the stack has an LM head (linear ``4 * num_layers``), the logits of the
    hidden rows ``logit_rows`` go to ``logits`` [len(logit_rows), vocab].

    counters: int64 ``[num_phases(num_layers) * STRIDE]``, zeroed, and marks: int64
    ``[num_phases(num_layers), >= items of any phase]``, shared by the team; epoch: this
    step's number, never used before with these marks (`cpu.sync`);
    token_ids, positions, slots: [T] (new token, its position, its KV-cache slot);
    block_tables [T, max_blocks] and context_lens [T] (including the new token)
    as for ``paged_decode``; embed_scale: the embedding rows' factor (Gemma's
    ``sqrt(hidden)``, else 1); norms: RMSNorm weights (as multiplied: Gemma's ``1 + w``),
    2 per layer (input, post-attention: a pre-norm layer) or 4 (input, post-attention,
    pre-feedforward, post-feedforward: a "sandwich" layer, whose attention and MLP
    outputs are normed before their residual adds);
    qk_norms: 2 per layer (Q, K) or empty; qkv_bias: 1 per layer or empty;
    cos_tables / sin_tables: per layer, rotate-half RoPE tables ``[positions, head_dim]``;
    windows: int64 [num_layers], a layer's sliding window (0: the whole context);
    grouped_qkv: the QKV product is laid out per KV head (its query heads, key, value)
    rather than all queries, all keys, all values; activation: ``gated.SILU`` or ``gated.GELU_TANH``;
    partials / partial_at: the float32 linears' partial products (`float_partials`: where each starts,
    -1 for a block linear);
    k_caches / v_caches: float32 ``[num_blocks, kv_heads, block_size, head_dim]`` per layer;
    ``*_buf``: the shared per-layer results, ``[num_layers, T, ...]`` (attention's
    ``[num_layers, T, num_heads, head_dim]``).
    """
    num_tokens = token_ids.shape[0]
    hidden = embed.shape[1]
    num_layers = len(k_caches)
    head_dim = k_caches[0].shape[3]
    group = num_heads // num_kv_heads
    q_size = num_heads * head_dim
    inter = gate_up_buf.shape[2] // 2
    sandwich = len(norms) == 4 * num_layers
    per_layer = 4 if sandwich else 2
    x = np.empty((num_tokens, hidden), np.float32)  # this thread's copy of the residual stream
    for t in range(num_tokens):
        x[t] = embed[token_ids[t]] * embed_scale
    h = np.empty_like(x)
    act = np.empty((num_tokens, inter), np.float32)
    q = np.empty((num_tokens, num_heads, head_dim), np.float32)
    part_m = np.empty((num_tokens, num_kv_heads, 1, group), np.float32)
    part_l = np.empty((num_tokens, num_kv_heads, 1, group), np.float32)
    part_acc = np.empty((num_tokens, num_kv_heads, 1, group, head_dim), np.float32)
    for layer in range(num_layers):
        lin, phase, norm = 4 * layer, PHASES_PER_LAYER * layer, per_layer * layer
        _rms_norm(x, norms[norm], eps, h)
        _linear_phase(lin + QKV, h, formats, float_w, codes, nibbles, scales, offsets, partials, partial_at,
                      qkv_buf[layer],
                      counters, marks, epoch, phase, team_size)
        _attention_phase(layer, qkv_buf[layer], positions, slots, block_tables, context_lens, qk_norms, qkv_bias,
                         cos_tables[layer], sin_tables[layer], windows[layer], grouped_qkv,
                         k_caches[layer], v_caches[layer], num_heads, num_kv_heads, eps,
                         scale, q, part_m, part_l, part_acc, attn_buf[layer], counters, marks, epoch, phase + 1)
        _linear_phase(lin + O_PROJ, attn_buf[layer].reshape((num_tokens, q_size)), formats, float_w, codes,
                      nibbles, scales, offsets, partials, partial_at, o_buf[layer], counters, marks, epoch, phase + 2,
                      team_size)
        if sandwich:
            _rms_norm(o_buf[layer], norms[norm + 1], eps, h)
            x += h
            _rms_norm(x, norms[norm + 2], eps, h)
        else:
            x += o_buf[layer]
            _rms_norm(x, norms[norm + 1], eps, h)
        _linear_phase(lin + GATE_UP, h, formats, float_w, codes, nibbles, scales, offsets, partials, partial_at,
                      gate_up_buf[layer],
                      counters, marks, epoch, phase + 3, team_size)
        activate_rows(gate_up_buf[layer], activation, act)
        _linear_phase(lin + DOWN, act, formats, float_w, codes, nibbles, scales, offsets, partials, partial_at,
                      down_buf[layer],
                      counters, marks, epoch, phase + 4, team_size)
        if sandwich:
            _rms_norm(down_buf[layer], norms[norm + 3], eps, h)
            x += h
        else:
            x += down_buf[layer]
    _rms_norm(x, final_norm, eps, h)
    if tid == 0:
        out[:] = h
    if len(formats) > 4 * num_layers and len(logit_rows) > 0:
        rows = np.empty((len(logit_rows), hidden), np.float32)
        for i in range(len(logit_rows)):
            rows[i] = h[logit_rows[i]]
        _linear_phase(4 * num_layers, rows, formats, float_w, codes, nibbles, scales, offsets, partials, partial_at,
                      logits,
                      counters, marks, epoch, PHASES_PER_LAYER * num_layers, team_size)


@njit(**_SEQ)
def member_step(control, tid, team_size, *args):
    """A team member's ``decode_step(tid, team_size, *args)`` if it joins the step in time
    (``sync.join_step``; ``args[2]`` is the step's epoch), else nothing: joining, the step and
    leaving are one call, so a member never holds the step open while it waits for the
    interpreter lock."""
    if join_step(control, args[2]):
        decode_step(tid, team_size, *args)
        leave_step(control)
