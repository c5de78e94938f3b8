"""Paged attention on the CPU with Numba (``njit(parallel=True, fastmath=True, cache=True)``).

Arrays are NumPy arrays in the canonical host representation (``formats.py``:
float32, int16 = float16 bits, uint16 = bfloat16 bits); ``formats.to_f32``
/ ``from_f32`` convert elements, all arithmetic is float32. Layout and
semantics are those of ``reference.py``.

Algorithm
---------
Every output row is one (query token, query head). The rows that share a KV
head -- the GQA group of a token, and in prefill a *tile* of consecutive
tokens -- are processed together by one work item, so each K/V page is
pulled into L1 once and reused by all rows.

A work item walks the sequence's block table over a key range and folds each
block into an *online softmax* state per row: running max ``m``, running sum
``l`` and accumulator ``acc[D]``. For one row and one block::

    s_t   = q . k_t                  (q is pre-multiplied by scale)
    m'    = max(m, max_t s_t)
    acc   = acc * exp(m - m') + sum_t exp(s_t - m') v_t
    l     = l   * exp(m - m') + sum_t exp(s_t - m')

and the output is ``acc / l``. The causal / sliding-window mask turns into a
per-row range of visible key offsets inside the block, so nothing is masked
element by element.

Parallelism (``prange``):

* decode: items are (sequence, KV head, split). With few sequences the key
  range is split in ``num_splits`` pieces so all cores work; a second
  ``prange`` merges the partial softmax states (``merge`` below).
* prefill: items are (query tile, KV head); a decode in a mixed batch is a
  tile of one token.

Calls whose work is under ``min_parallel_work`` run the same items in a plain
loop on the calling thread (no split), which is what small decode steps do.

``fastmath`` lets LLVM vectorize the dot products, so "minus infinity" is the
finite ``NEG`` instead of ``-inf``.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .activations import exp_shifted
from .formats import from_f32, to_f32

NEG = np.float32(-1e30)        # finite stand-in for -inf (fastmath assumes no infs)
MIN_SPLIT_TOKENS = 256         # don't split a decode's keys into pieces smaller than this

#: Work (query rows x keys x head_dim, or elements for write_kv) below which a call
#: runs on the calling thread: waking Numba's worker threads costs microseconds on an
#: idle machine but can cost milliseconds when the cores are busy (e.g. with Paddle).
#: Read by dispatch.py at every call, so it can be changed at run time.
min_parallel_work = 1 << 24

_PAR = dict(parallel=True, fastmath=True, cache=True, nogil=True)
_SEQ = dict(fastmath=True, cache=True, nogil=True)


@njit(**_SEQ)
def write_token(key, value, k_cache, v_cache, slot_mapping, t):
    """Copy token t's K/V (all KV heads) to its slot, converting formats; slot -1 = skip."""
    slot = slot_mapping[t]
    if slot < 0:
        return
    block_size = k_cache.shape[2]
    blk = slot // block_size
    off = slot - blk * block_size
    for h in range(key.shape[1]):
        for d in range(key.shape[2]):
            k_cache[blk, h, off, d] = from_f32(to_f32(key[t, h, d]), k_cache)
            v_cache[blk, h, off, d] = from_f32(to_f32(value[t, h, d]), v_cache)


@njit(**_PAR)
def write_kv(key, value, k_cache, v_cache, slot_mapping, min_parallel_work):
    """Scatter ``key/value[t]`` into slot ``slot_mapping[t]`` (-1 = skip), converting formats."""
    num_tokens = key.shape[0]
    if key.size >= min_parallel_work:
        for t in prange(num_tokens):     # prange's index is unsigned: one type for both loops
            write_token(key, value, k_cache, v_cache, slot_mapping, np.int64(t))
    else:
        for t in range(num_tokens):
            write_token(key, value, k_cache, v_cache, slot_mapping, t)


@njit(**_SEQ)
def attend_range(q, qpos, k_cache, v_cache, table, h, lo, hi, window, m, l, acc, s):
    """Fold keys ``[lo, hi)`` of one sequence's KV head ``h`` into the softmax state of rows ``q``.

    q: [R, D] float32, pre-scaled; qpos: [R] query positions; table: the
    sequence's block-table row; m, l: [R]; acc: [R, D]; s: [block_size] scratch.
    Row r only sees keys j with j <= qpos[r] and (window <= 0 or j > qpos[r] - window).
    """
    num_rows, head_dim = q.shape
    block_size = k_cache.shape[2]
    for b in range(lo // block_size, (hi + block_size - 1) // block_size):
        blk = table[b]
        j0 = b * block_size
        t_lo = max(lo - j0, 0)
        t_hi = min(hi - j0, block_size)
        for r in range(num_rows):
            p = qpos[r]
            a = t_lo
            e = min(t_hi, p + 1 - j0)
            if window > 0:
                a = max(a, p - window + 1 - j0)
            if a >= e:
                continue
            mx = NEG
            for t in range(a, e):
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += q[r, d] * to_f32(k_cache[blk, h, t, d])
                s[t] = dot
                mx = max(mx, dot)
            m_new = max(m[r], mx)
            c = np.exp(m[r] - m_new)
            l_r = l[r] * c
            for d in range(head_dim):
                acc[r, d] *= c
            exp_shifted(s, m_new)  # s[t] = exp(s[t] - m_new), 8 at a time (entries outside [a, e) unused)
            for t in range(len(s) // 8 * 8, e):
                s[t] = np.exp(s[t] - m_new)
            for t in range(a, e):
                pr = s[t]
                l_r += pr
                for d in range(head_dim):
                    acc[r, d] += pr * to_f32(v_cache[blk, h, t, d])
            m[r] = m_new
            l[r] = l_r


@njit(**_SEQ)
def load_rows(query, tok0, n_tok, head0, group, scale, qf):
    """qf[r] = scale * query[tok0 + r // group, head0 + r % group] as float32."""
    for r in range(n_tok * group):
        tok = tok0 + r // group
        hq = head0 + r % group
        for d in range(query.shape[2]):
            qf[r, d] = to_f32(query[tok, hq, d]) * scale


@njit(**_SEQ)
def store_rows(out, tok0, n_tok, head0, group, l, acc):
    """out[tok0 + r // group, head0 + r % group] = acc[r] / l[r] (zeros when l == 0)."""
    for r in range(n_tok * group):
        tok = tok0 + r // group
        hq = head0 + r % group
        inv = np.float32(1.0) / l[r] if l[r] > 0 else np.float32(0.0)
        for d in range(out.shape[2]):
            out[tok, hq, d] = from_f32(acc[r, d] * inv, out)


def choose_splits(num_seqs, num_kv_heads, max_context, num_threads):
    """Key-range pieces per (sequence, KV head) so that there are >= 2 items per thread."""
    items = num_seqs * num_kv_heads
    if num_threads <= 1 or items >= 2 * num_threads:
        return 1
    want = -(-2 * num_threads // max(items, 1))
    return max(1, min(want, max_context // MIN_SPLIT_TOKENS))


_choose_splits = njit(**_SEQ)(choose_splits)


@njit(**_SEQ)
def decode_item(query, k_cache, v_cache, block_tables, context_lens, scale, window,
                i, h, part, part_m, part_l, part_acc):
    """Piece ``part`` of sequence i's keys for KV head h -> softmax state in part_*[i, h, part]."""
    group, head_dim = part_acc.shape[3], part_acc.shape[4]
    splits = part_acc.shape[2]
    length = context_lens[i]
    pos = length - 1
    lo = max(0, pos - window + 1) if window > 0 else 0
    chunk = (length - lo + splits - 1) // splits
    c_lo = lo + part * chunk
    c_hi = min(length, c_lo + chunk)
    qf = np.empty((group, head_dim), np.float32)
    load_rows(query, i, 1, h * group, group, scale, qf)
    qpos = np.full(group, pos, np.int64)
    m = part_m[i, h, part]
    l = part_l[i, h, part]
    acc = part_acc[i, h, part]
    m[:] = NEG
    l[:] = 0.0
    acc[:] = 0.0
    if c_lo < c_hi:
        s = np.empty(k_cache.shape[2], np.float32)
        attend_range(qf, qpos, k_cache, v_cache, block_tables[i], h, c_lo, c_hi,
                     window, m, l, acc, s)


@njit(**_SEQ)
def merge(part_m, part_l, part_acc):
    """Combine softmax states of key-range pieces: [P, R], [P, R], [P, R, D] -> l [R], acc [R, D]."""
    splits, num_rows, head_dim = part_acc.shape
    if splits == 1:
        return part_l[0], part_acc[0]
    l = np.zeros(num_rows, np.float32)
    acc = np.zeros((num_rows, head_dim), np.float32)
    for r in range(num_rows):
        m = NEG
        for p in range(splits):
            m = max(m, part_m[p, r])
        for p in range(splits):
            if part_l[p, r] > 0:
                w = np.exp(part_m[p, r] - m)
                l[r] += part_l[p, r] * w
                for d in range(head_dim):
                    acc[r, d] += part_acc[p, r, d] * w
    return l, acc


@njit(**_PAR)
def paged_decode(query, k_cache, v_cache, block_tables, context_lens, scale, window, out,
                 num_threads, min_parallel_work):
    """One query per sequence at position context_lens[i] - 1 (see module docstring).

    ``num_threads`` (``numba.get_num_threads()``) sizes the key-range split;
    problems under ``min_parallel_work`` (keys x heads x head_dim) run on the calling thread.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    max_context = 0
    keys = 0
    for i in range(num_seqs):
        length = context_lens[i]
        max_context = max(max_context, length)
        keys += min(length, window) if window > 0 else length
    parallel = keys * num_heads * head_dim >= min_parallel_work
    splits = _choose_splits(num_seqs, num_kv_heads, max_context, num_threads if parallel else 1)
    part_m = np.empty((num_seqs, num_kv_heads, splits, group), np.float32)
    part_l = np.empty((num_seqs, num_kv_heads, splits, group), np.float32)
    part_acc = np.empty((num_seqs, num_kv_heads, splits, group, head_dim), np.float32)
    items = num_seqs * num_kv_heads * splits
    if parallel:
        for uitem in prange(items):      # prange's index is unsigned: one type for both loops
            item = np.int64(uitem)
            decode_item(query, k_cache, v_cache, block_tables, context_lens, scale, window,
                        item // (num_kv_heads * splits), (item // splits) % num_kv_heads,
                        item % splits, part_m, part_l, part_acc)
        for uitem in prange(num_seqs * num_kv_heads):
            item = np.int64(uitem)
            i, h = item // num_kv_heads, item % num_kv_heads
            l, acc = merge(part_m[i, h], part_l[i, h], part_acc[i, h])
            store_rows(out, i, 1, h * group, group, l, acc)
    else:
        for item in range(items):
            decode_item(query, k_cache, v_cache, block_tables, context_lens, scale, window,
                        item // num_kv_heads, item % num_kv_heads, np.int64(0),
                        part_m, part_l, part_acc)
        for item in range(num_seqs * num_kv_heads):
            i, h = item // num_kv_heads, item % num_kv_heads
            store_rows(out, i, 1, h * group, group, part_l[i, h, 0], part_acc[i, h, 0])
