"""Chunked prefill on the CPU as tiled matrix products (Numba + BLAS ``np.dot``).

Same contract as ``reference.paged_prefill`` (packed chunks, each the last tokens
of its sequence, bottom-right-aligned causal mask, optional sliding window,
GQA, fp32/fp16/bf16 caches, softmax in float32), organised for long chunks.

Tiling
------
A work item is (sequence, KV head, query tile): ``tile`` consecutive tokens
of one chunk times the ``group`` query heads that read that KV head, i.e.
``R = tile * group`` rows, row ``r`` = token ``r // group``, head ``r % group``.
The item walks the keys its rows can see, ``[lo, hi)`` with ``hi`` = last
token's position + 1 and ``lo`` = 0 (or the window start of its first
token), in KV tiles of ``KV_TILE`` keys; keys before ``lo`` or after ``hi``
are never touched, so fully masked KV tiles are skipped. Per KV tile:

1. gather the tile's keys and values from their pages into contiguous float32
   scratch ``K [n, D]`` and ``V [n, D]`` (this also converts fp16/bf16);
2. ``S = Q K^T``  (``[R, D] x [D, n]``, BLAS sgemm; ``Q`` is pre-scaled);
3. per row, the visible keys of the tile are one contiguous range ``[a, e)``
   (causal: ``j <= p``; window: ``j > p - w``): fold them into the row's
   online-softmax state (running max ``m``, sum ``l``) and overwrite ``S``
   with the probabilities ``P`` (zero outside ``[a, e)``), rescaling the row's
   accumulator by ``exp(m_old - m_new)``;
4. ``acc += P V``  (``[R, n] x [n, D]``, BLAS sgemm).

The output row is ``acc / l`` (zeros for a row that sees no key).

Chunks shorter than ``MIN_TILED_TOKENS`` tokens (decodes in a mixed batch,
small speculative chunks) use the row-by-row ``cpu.attend_range`` instead,
which has no gather or BLAS call overhead.

Parallelism: one ``prange`` iteration per thread, each claiming the next item from an
atomic counter (``sync.atomic_add``) until none is left, the costliest items first (rows
times visible keys: the longest-processing-time-first rule). Causal work grows with a
tile's index, so Numba's static split of a ``prange`` over the items (each thread a
contiguous share) left one thread with most of the late tiles: a Gemma 3 270M layer of 257
tokens (head_dim 256, 4 query heads on 1 KV head: six items) ran 1.5 ms on one thread while
the other idled after 0.7; claimed in that order, 1.2 ms. Claimed items also leave less to
a thread that the machine's other work delays. Calls under ``min_parallel_work`` run on the
calling thread.

Numba lowers ``np.dot`` on contiguous float32 2-D arrays to BLAS through
SciPy's ``cython_blas`` (SciPy's bundled OpenBLAS). The items already use
every core, so ``single_threaded_blas()`` (called by the dispatch layer)
sets that OpenBLAS to one thread: its own threads would only compete with
the items (and with Paddle) for the same cores. NumPy's BLAS is not touched.

``exp`` here is ``fast_exp``, a polynomial that LLVM vectorizes (Numba's
``np.exp`` is a scalar libm call without Intel SVML), relative error ~2e-7.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .attention import NEG, attend_range, load_rows, store_rows
from .formats import _u32_as_f32, to_f32
from .sync import atomic_add

TILE_ROWS = 192          # query rows (tokens x group heads) per item of a long chunk
KV_TILE = 256            # keys per gathered K/V tile
MIN_TILED_TOKENS = 8     # chunks shorter than this take the row-by-row path

_PAR = dict(parallel=True, fastmath=True, cache=True, nogil=True)
_SEQ = dict(fastmath=True, cache=True, nogil=True)


@njit(**_SEQ)
def fast_exp(x):
    """exp(x) for float32 x <= 0 (softmax: score minus running max): 2^n * e^f.

    n = round(x / ln2) by truncating x / ln2 - 1/2 (x <= 0), f = x - n ln2 in
    [-ln2/2, ln2/2]; e^f is a degree-6 Taylor polynomial and 2^n is built in the
    exponent bits. Only selects, multiplies and integer ops, so loops vectorize.
    x is clamped to [-87, 0]: below -87 the result is ~1e-38 instead of 0.
    """
    x = x if x > np.float32(-87.0) else np.float32(-87.0)
    x = x if x < np.float32(0.0) else np.float32(0.0)
    n = np.int32(x * np.float32(1.4426950408889634) - np.float32(0.5))
    fn = np.float32(n)
    f = x - fn * np.float32(0.693145751953125) - fn * np.float32(1.428606765330187e-06)
    p = np.float32(1.0 / 720)
    p = p * f + np.float32(1.0 / 120)
    p = p * f + np.float32(1.0 / 24)
    p = p * f + np.float32(1.0 / 6)
    p = p * f + np.float32(0.5)
    p = p * f + np.float32(1.0)
    p = p * f + np.float32(1.0)
    return p * _u32_as_f32((n + np.int32(127)) << np.int32(23))


@njit(**_SEQ)
def gather_kv(k_cache, v_cache, table, h, j0, j1, kt, vt):
    """kt[j - j0], vt[j - j0] = K, V of KV head h at key positions j in [j0, j1), as float32."""
    block_size, head_dim = k_cache.shape[2], k_cache.shape[3]
    j = j0
    while j < j1:
        b = j // block_size
        off = j - b * block_size
        blk = table[b]
        n = min(block_size - off, j1 - j)
        for t in range(n):
            row = j - j0 + t
            for d in range(head_dim):
                kt[row, d] = to_f32(k_cache[blk, h, off + t, d])
                vt[row, d] = to_f32(v_cache[blk, h, off + t, d])
        j += n


@njit(**_SEQ)
def softmax_tile(s, first_pos, group, j0, window, m, l, acc):
    """Step 3 of the module docstring: scores ``s [R, n]`` of keys j0.. -> probabilities in place."""
    rows, n = s.shape
    head_dim = acc.shape[1]
    for r in range(rows):
        p = first_pos + r // group
        a = max(p - window + 1 - j0, 0) if window > 0 else 0
        e = min(p + 1 - j0, n)
        if a >= e:
            s[r, :] = 0.0
            continue
        mx = NEG
        for t in range(a, e):
            v = s[r, t]
            mx = v if v > mx else mx
        m_new = max(m[r], mx)
        c = fast_exp(m[r] - m_new)
        total = np.float32(0.0)
        for t in range(a, e):
            pr = fast_exp(s[r, t] - m_new)
            s[r, t] = pr
            total += pr
        s[r, :a] = 0.0
        s[r, e:] = 0.0
        l[r] = l[r] * c + total
        m[r] = m_new
        if c != 1.0:
            for d in range(head_dim):
                acc[r, d] *= c


@njit(**_SEQ)
def tiled_item(query, k_cache, v_cache, table, q_row, first_pos, n_tok, h, group, scale,
               window, out):
    """Query tokens ``q_row .. q_row + n_tok`` (positions from first_pos) x KV head h, tiled."""
    head_dim = query.shape[2]
    rows = n_tok * group
    qf = np.empty((rows, head_dim), np.float32)
    load_rows(query, q_row, n_tok, h * group, group, scale, qf)
    m = np.full(rows, NEG, np.float32)
    l = np.zeros(rows, np.float32)
    acc = np.zeros((rows, head_dim), np.float32)
    pv = np.empty((rows, head_dim), np.float32)
    kt = np.empty((KV_TILE, head_dim), np.float32)
    vt = np.empty((KV_TILE, head_dim), np.float32)
    s_buf = np.empty(rows * KV_TILE, np.float32)
    lo = max(0, first_pos - window + 1) if window > 0 else 0
    hi = first_pos + n_tok
    for j0 in range(lo, hi, KV_TILE):
        j1 = min(j0 + KV_TILE, hi)
        n = j1 - j0
        gather_kv(k_cache, v_cache, table, h, j0, j1, kt, vt)
        s = s_buf[:rows * n].reshape(rows, n)
        np.dot(qf, kt[:n].T, s)
        softmax_tile(s, first_pos, group, j0, window, m, l, acc)
        np.dot(s, vt[:n], pv)
        acc += pv
    store_rows(out, q_row, n_tok, h * group, group, l, acc)


@njit(**_SEQ)
def row_item(query, k_cache, v_cache, table, q_row, first_pos, n_tok, h, group, scale,
             window, out):
    """The same item row by row (``cpu.attend_range``): for decodes and short chunks."""
    head_dim = query.shape[2]
    rows = n_tok * group
    qf = np.empty((rows, head_dim), np.float32)
    load_rows(query, q_row, n_tok, h * group, group, scale, qf)
    qpos = np.empty(rows, np.int64)
    for r in range(rows):
        qpos[r] = first_pos + r // group
    m = np.full(rows, NEG, np.float32)
    l = np.zeros(rows, np.float32)
    acc = np.zeros((rows, head_dim), np.float32)
    s = np.empty(k_cache.shape[2], np.float32)
    lo = max(0, first_pos - window + 1) if window > 0 else 0
    hi = first_pos + n_tok
    if lo < hi:
        attend_range(qf, qpos, k_cache, v_cache, table, h, lo, hi, window, m, l, acc, s)
    store_rows(out, q_row, n_tok, h * group, group, l, acc)


@njit(**_SEQ)
def run_item(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
             window, out, tile_start, tile, num_tiled, k, h):
    """Query tile ``k`` (numbered across the sequences) on KV head ``h``."""
    group = query.shape[1] // k_cache.shape[1]
    i = np.searchsorted(tile_start, k, side="right") - 1
    n = query_start_loc[i + 1] - query_start_loc[i]
    t_tok = tile[i]
    t0 = (k - tile_start[i]) * t_tok
    n_tok = min(t_tok, n - t0)
    first_pos = context_lens[i] - n + t0
    if n >= num_tiled:
        tiled_item(query, k_cache, v_cache, block_tables[i], query_start_loc[i] + t0,
                   first_pos, n_tok, h, group, scale, window, out)
    else:
        row_item(query, k_cache, v_cache, block_tables[i], query_start_loc[i] + t0,
                 first_pos, n_tok, h, group, scale, window, out)


@njit(**_SEQ)
def costliest_first(query_start_loc, context_lens, tile_start, tile, window):
    """The query tiles ordered by their work (tokens times the keys they see), largest first."""
    cost = np.empty(tile_start[-1], np.int64)
    for i in range(context_lens.shape[0]):
        n = query_start_loc[i + 1] - query_start_loc[i]
        for z in range(tile_start[i + 1] - tile_start[i]):
            t0 = z * tile[i]
            n_tok = min(tile[i], n - t0)
            hi = context_lens[i] - n + t0 + n_tok
            lo = max(0, hi - n_tok - window + 1) if window > 0 else 0
            cost[tile_start[i] + z] = n_tok * (hi - lo)
    return np.argsort(-cost, kind="mergesort")


@njit(**_PAR)
def paged_prefill(query, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                  scale, window, out, num_threads, min_parallel_work, num_tiled=MIN_TILED_TOKENS):
    """Packed query chunks, each the last tokens of its sequence (see module docstring).

    ``num_threads``: Numba's threads (``numba.get_num_threads()``), one claiming loop each.
    ``num_tiled``: chunks of at least this many tokens take the tiled BLAS path.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_seqs = context_lens.shape[0]
    # tile[i]: tokens per query tile of sequence i; tile_start[i]: its first tile's number
    tile = np.empty(num_seqs, np.int64)
    tile_start = np.zeros(num_seqs + 1, np.int64)
    work = 0
    for i in range(num_seqs):
        n = query_start_loc[i + 1] - query_start_loc[i]
        rows = TILE_ROWS if n >= num_tiled else 64
        tile[i] = max(1, rows // group)
        tile_start[i + 1] = tile_start[i] + (n + tile[i] - 1) // tile[i]
        keys = min(context_lens[i], window) if window > 0 else context_lens[i]
        work += n * keys
    items = tile_start[num_seqs] * num_kv_heads
    if work * num_heads * head_dim >= min_parallel_work:
        order = costliest_first(query_start_loc, context_lens, tile_start, tile, window)
        taken = np.zeros(1, np.int64)    # items handed out so far
        for _ in prange(num_threads):    # one iteration a thread; each claims items until none is left
            k = atomic_add(taken, 0, 1)
            while k < items:
                run_item(query, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                         scale, window, out, tile_start, tile, num_tiled, order[k // num_kv_heads],
                         k % num_kv_heads)
                k = atomic_add(taken, 0, 1)
    else:
        for item in range(items):
            run_item(query, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                     scale, window, out, tile_start, tile, num_tiled, item // num_kv_heads,
                     item % num_kv_heads)
