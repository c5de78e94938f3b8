"""CUDA prefill kernel: tiles of (query tokens x group heads) against tiles of keys.

Grid ``(max_tiles, num_kv_heads * head_chunks)``; block ``THREADS`` threads.
Query tiles are numbered sequence by sequence (``BQ`` tokens each, the last
one of a chunk possibly shorter); thread 0 finds its block's sequence by
scanning ``query_start_loc``, so mixed batches need no host-side table.
Blocks past the last tile exit. A decode in a mixed batch is a one-token tile.

A tile has ``R = BQ * HPB`` query rows (row ``r`` = token ``r // HPB``, head
``r % HPB``), kept in shared memory as float32, transposed (``q_sh[d, r]``)
and pre-scaled by ``scale * log2(e)``. The block walks the keys that some row
of the tile can see -- ``[first_pos - window + 1, last_pos]`` -- so key tiles
that are fully masked (in the causal future, or before the sliding window)
are never loaded. Per key tile of ``BK`` keys:

1. load K (16-byte vectors, coalesced) into ``kv_sh[d, key]`` as float32;
2. ``S = Q K^T``: each thread computes an ``RS x KS`` register tile, applies
   the causal / window mask, writes ``s_sh[r, key]``;
3. online softmax per row (``TPR`` threads per row, shuffle reductions);
4. load V into the same buffer as ``kv_sh[key, d]``;
5. ``O += P V``: each thread owns ``OR`` rows x ``OD`` columns of the output
   in registers, rescaled by the row's ``exp2(m_old - m_new)`` first.

All arithmetic is float32 on CUDA cores (Numba has no tensor-core API).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32

from .cuda_primitives import (F32, exp2, from_f32, group_max, group_sum, ld4, to_f32, vmax, vmin,
                              word_elem)

NEG = np.float32(-1e30)


def tile_shape(head_dim, hpb, threads):
    """(rows R, keys BK) per tile: each of q_sh / kv_sh stays near 16 KB of shared memory."""
    rows = max(hpb, min(32, 4096 // head_dim) // hpb * hpb)
    keys = max(8, min(64, 4096 // head_dim))
    return min(rows, threads // hpb * hpb), keys


@functools.lru_cache(maxsize=None)
def build_prefill_kernel(threads, group, hpb, head_dim, kind_q, kind_kv, kind_o):
    """Compile-time specialization of the prefill kernel (all arguments are constants)."""
    R, BK = tile_shape(head_dim, hpb, threads)
    BQ = R // hpb
    EPW = 1 if kind_kv == F32 else 2
    DPV = 4 * EPW
    ROW_VECS = head_dim // DPV
    HCHUNKS = group // hpb
    # S = Q K^T: thread (tr, tk) owns rows tr + TR*a (a < RS), keys tk + TK*b (b < KS)
    KS = 1
    while KS < 4 and 2 * KS * threads <= R * BK and BK % (2 * KS) == 0:
        KS *= 2
    TK = BK // KS
    TR = threads // TK
    RS = -(-R // TR)
    # softmax: TPR threads per row
    TPR = max(1, threads // R)
    # O += P V: thread (orow, odim) owns rows orow + ORT*a (a < OR), dims odim + ODT*c (c < OD)
    ODT = math.gcd(32, head_dim, threads)
    ORT = threads // ODT
    OR = -(-R // ORT)
    OD = head_dim // ODT
    KT_STRIDE = BK + 1                       # padded transposed-K row (fewer bank conflicts)
    KV_WORDS = max(head_dim * KT_STRIDE, BK * head_dim)
    ACCN = OR * OD                           # output accumulators per thread
    SCN = RS * KS                            # scores per thread

    @cuda.jit(fastmath=True)
    def prefill(q, kw, vw, block_tables, query_start_loc, context_lens, out,
                scale_log2, window, num_kv_heads, block_size):
        tid = cuda.threadIdx.x
        hb = cuda.blockIdx.y
        kvh = hb // HCHUNKS
        head0 = kvh * group + (hb % HCHUNKS) * hpb

        q_sh = cuda.shared.array((head_dim, R), float32)
        kv_sh = cuda.shared.array(KV_WORDS, float32)
        s_sh = cuda.shared.array((R, BK), float32)
        stat_sh = cuda.shared.array((R, 3), float32)     # running max, running sum, rescale
        info_sh = cuda.shared.array(2, int32)
        scratch = cuda.shared.array(threads, float32)

        # ---- which sequence / query tile is this block?
        if tid == 0:
            k = cuda.blockIdx.x
            seen = 0
            info_sh[0] = -1
            for s in range(context_lens.shape[0]):
                n_s = query_start_loc[s + 1] - query_start_loc[s]
                tiles = (n_s + BQ - 1) // BQ
                if k < seen + tiles:
                    info_sh[0] = s
                    info_sh[1] = k - seen
                    break
                seen += tiles
        cuda.syncthreads()
        i = info_sh[0]
        if i < 0:
            return
        n = query_start_loc[i + 1] - query_start_loc[i]
        length = context_lens[i]
        tok0 = info_sh[1] * BQ                              # first token of the tile in the chunk
        n_tok = vmin(BQ, n - tok0)
        first_pos = length - n + tok0
        row0 = query_start_loc[i] + tok0                    # its row in query / out

        for idx in range(tid, R * head_dim, threads):
            r = idx // head_dim
            d = idx - r * head_dim
            val = float32(0.0)
            if r // hpb < n_tok:
                val = to_f32(q[row0 + r // hpb, head0 + r % hpb, d], kind_q) * scale_log2
            q_sh[d, r] = val
        for r in range(tid, R, threads):
            stat_sh[r, 0] = NEG
            stat_sh[r, 1] = 0.0
        acc = cuda.local.array(ACCN, float32)
        for k in range(OR * OD):
            acc[k] = 0.0
        orow = tid // ODT
        odim = tid % ODT
        tr = tid // TK
        tk = tid % TK
        page_words = block_size * ROW_VECS * 4
        lo = 0
        if window > 0:
            lo = vmax(0, first_pos - window + 1)
        hi = first_pos + n_tok                              # keys [lo, hi) can be visible
        cuda.syncthreads()

        for kt0 in range(lo, hi, BK):
            nk = vmin(BK, hi - kt0)
            # ---- 1. K tile, transposed: kv_sh[d * KT_STRIDE + key]
            for vi in range(tid, BK * ROW_VECS, threads):
                key = vi // ROW_VECS
                vc = vi - key * ROW_VECS
                if key < nk:
                    j = kt0 + key
                    jb = j // block_size
                    base = (block_tables[i, jb] * num_kv_heads + kvh) * page_words \
                        + (j - jb * block_size) * (ROW_VECS * 4) + vc * 4
                    w = ld4(kw, base)
                    for x in range(4):
                        for e in range(EPW):
                            kv_sh[(vc * DPV + x * EPW + e) * KT_STRIDE + key] = \
                                word_elem(w[x], e, kind_kv)
                else:                                        # masked below; keep it finite
                    for k in range(DPV):
                        kv_sh[(vc * DPV + k) * KT_STRIDE + key] = 0.0
            cuda.syncthreads()
            # ---- 2. scores with the causal / sliding-window mask
            sc = cuda.local.array(SCN, float32)
            for k in range(RS * KS):
                sc[k] = 0.0
            for d in range(head_dim):
                for a in range(RS):
                    qv = q_sh[d, vmin(tr + TR * a, R - 1)]
                    for b in range(KS):
                        sc[a * KS + b] += qv * kv_sh[d * KT_STRIDE + tk + TK * b]
            for a in range(RS):
                r = tr + TR * a
                pos = first_pos + r // hpb
                if r >= R:
                    continue
                for b in range(KS):
                    key = tk + TK * b
                    j = kt0 + key
                    ok = key < nk and j <= pos and r // hpb < n_tok
                    if window > 0 and j <= pos - window:
                        ok = False
                    s_sh[r, key] = sc[a * KS + b] if ok else NEG
            cuda.syncthreads()
            # ---- 3. online softmax, TPR threads per row
            r = tid // TPR
            part = tid % TPR
            mx = NEG
            if r < R:
                for key in range(part, nk, TPR):
                    mx = vmax(mx, s_sh[r, key])
            mx = group_max(mx, TPR, scratch)
            m_old = NEG
            if r < R:
                m_old = stat_sh[r, 0]
            m_new = vmax(m_old, mx)
            total = float32(0.0)
            if r < R:
                for key in range(part, nk, TPR):
                    s = s_sh[r, key]
                    p = exp2(s - m_new) if s > NEG else float32(0.0)
                    s_sh[r, key] = p
                    total += p
            total = group_sum(total, TPR, scratch)
            cuda.syncthreads()
            if r < R and part == 0:
                alpha = exp2(m_old - m_new)
                stat_sh[r, 2] = alpha
                stat_sh[r, 1] = stat_sh[r, 1] * alpha + total
                stat_sh[r, 0] = m_new
            # ---- 4. V tile: kv_sh[key * head_dim + d]
            for vi in range(tid, BK * ROW_VECS, threads):
                key = vi // ROW_VECS
                vc = vi - key * ROW_VECS
                if key < nk:
                    j = kt0 + key
                    jb = j // block_size
                    base = (block_tables[i, jb] * num_kv_heads + kvh) * page_words \
                        + (j - jb * block_size) * (ROW_VECS * 4) + vc * 4
                    w = ld4(vw, base)
                    for x in range(4):
                        for e in range(EPW):
                            kv_sh[key * head_dim + vc * DPV + x * EPW + e] = \
                                word_elem(w[x], e, kind_kv)
            cuda.syncthreads()
            # ---- 5. O = O * alpha + P V
            for a in range(OR):
                alpha = stat_sh[vmin(orow + ORT * a, R - 1), 2]
                for c in range(OD):
                    acc[a * OD + c] *= alpha
            for key in range(nk):
                for a in range(OR):
                    p = s_sh[vmin(orow + ORT * a, R - 1), key]
                    for c in range(OD):
                        acc[a * OD + c] += p * kv_sh[key * head_dim + odim + ODT * c]
            cuda.syncthreads()

        for a in range(OR):
            r = orow + ORT * a
            if r < R and r // hpb < n_tok:
                l_sum = stat_sh[r, 1]
                inv = float32(1.0) / l_sum if l_sum > 0 else float32(0.0)
                for c in range(OD):
                    out[row0 + r // hpb, head0 + r % hpb, odim + ODT * c] = \
                        from_f32(acc[a * OD + c] * inv, kind_o)

    return prefill, BQ
