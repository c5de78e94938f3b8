"""CUDA decode kernel: one query token per sequence, the whole GQA group per thread block.

Grid ``(splits, num_kv_heads * head_chunks, num_seqs)``; block ``THREADS`` threads.
A block owns one sequence, one KV head (and ``HPB`` of the query heads that
read it: the whole group unless the group is larger than 8) and one *split*:
a contiguous range of ``chunk`` keys. Long contexts are split over many
blocks so that even one sequence fills the GPU (split-K / flash-decoding).

Each block walks its key range in partitions of ``P`` keys:

1. **block-table prefetch**: the partition's block ids go to shared memory.
2. **K pass**: ``TG`` consecutive threads share one key row; each loads
   ``VPL`` 16-byte vectors of it (a warp reads whole rows, coalesced) and
   multiplies them with its slice of the ``HPB`` query rows, which it keeps in
   registers, pre-scaled by ``scale * log2(e)``. A shuffle reduction over the
   ``TG`` lanes gives the scores, stored in shared memory. Every K byte is
   read once for all ``HPB`` heads.
3. **softmax**: one warp per head: partition max, ``p = exp2(s - m)``, sum;
   the running max / sum / rescale factor live in shared memory.
4. **V pass**: thread ``(tl, dc)`` owns 16-byte column ``dc`` of the V rows
   and accumulates ``p * v`` for rows ``tl, tl + VT, ...`` in registers.

At the end the per-thread accumulators are summed over ``tl`` in shared
memory. With one split the block writes ``acc / l`` to ``out``. With several
it writes its unnormalized state (``m``, ``l``, ``acc``) to a scratch buffer
and takes a ticket from a per-(sequence, head block) counter; the block that
draws the last ticket merges all splits (``out = sum w_s acc_s / sum w_s l_s``,
``w_s = exp2(m_s - max m)``) and resets the counter: no second launch.

Softmax state uses the finite ``NEG`` for minus infinity (fast-math).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint32

from .cuda_primitives import (F32, exp2, from_f32, group_max, group_sum, ld4, to_f32, vmax, vmin,
                              word_elem)

NEG = np.float32(-1e30)
ML_PAD = 32          # part_ml rows are padded to 128 bytes (see cuda.py: no stale L1 lines)


@functools.lru_cache(maxsize=None)
def build_decode_kernel(threads, group, hpb, head_dim, kind_q, kind_kv, kind_o,
                        partition, lanes_per_token, unroll):
    """Compile-time specialization of the decode kernel (all arguments are constants)."""
    EPW = 1 if kind_kv == F32 else 2            # elements per 32-bit word
    DPV = 4 * EPW                               # elements per 16-byte vector
    ROW_VECS = head_dim // DPV                  # vectors per key row
    TG = lanes_per_token
    VPL = ROW_VECS // TG                        # vectors per lane in the K pass
    NGROUPS = threads // TG                     # keys in flight per K step
    VT = threads // ROW_VECS                    # key lanes in the V pass
    NW = max(1, threads // 32)
    WARP = min(32, threads)
    HCHUNKS = group // hpb
    P = partition
    U = unroll
    QN = hpb * VPL * DPV          # query slice per thread (registers)
    ACCN = hpb * DPV              # output accumulators per thread
    WK = U * VPL * 4              # K words in flight per thread
    WV = U * 4                    # V words in flight per thread
    TBL = P + 1                   # block-table entries a partition can span
    RED = threads * DPV

    @cuda.jit(fastmath=True)
    def decode(q, kw, vw, block_tables, context_lens, out, part_ml, part_acc, counters,
               scale_log2, window, num_kv_heads, block_size, splits, chunk):
        tid = cuda.threadIdx.x
        split = cuda.blockIdx.x
        hb = cuda.blockIdx.y
        i = cuda.blockIdx.z
        kvh = hb // HCHUNKS
        head0 = kvh * group + (hb % HCHUNKS) * hpb

        s_sh = cuda.shared.array((hpb, P), float32)       # scores, then probabilities
        tbl_sh = cuda.shared.array(TBL, int32)           # block ids of the partition
        stat_sh = cuda.shared.array((hpb, 3), float32)     # running max, running sum, rescale
        red_sh = cuda.shared.array(RED, float32)
        scratch = cuda.shared.array(threads, float32)
        flag_sh = cuda.shared.array(1, int32)

        length = context_lens[i]
        lo = 0
        if window > 0:
            lo = vmax(0, length - window)
        start = lo + split * chunk
        end = vmin(length, start + chunk)

        lig = tid % TG                                     # lane in the key's thread group
        gid = tid // TG
        qr = cuda.local.array(QN, float32)
        for g in range(hpb):
            for v in range(VPL):
                for e in range(DPV):
                    d = (lig + v * TG) * DPV + e
                    qr[(g * VPL + v) * DPV + e] = to_f32(q[i, head0 + g, d], kind_q) * scale_log2
        dc = tid % ROW_VECS                                # V pass: 16-byte column
        tl = tid // ROW_VECS                               # V pass: key lane
        acc = cuda.local.array(ACCN, float32)
        for k in range(ACCN):
            acc[k] = 0.0
        if tid < hpb:
            stat_sh[tid, 0] = NEG
            stat_sh[tid, 1] = 0.0
        page_words = block_size * ROW_VECS * 4
        cuda.syncthreads()

        for p0 in range(start, end, P):
            n = vmin(P, end - p0)
            b_first = p0 // block_size
            nb = (p0 + n - 1) // block_size - b_first + 1
            for e in range(tid, nb, threads):
                tbl_sh[e] = block_tables[i, b_first + e]
            cuda.syncthreads()

            # ---- K pass: scores of HPB heads x n keys
            wk = cuda.local.array(WK, uint32)
            for t0 in range(0, n, NGROUPS * U):
                for u in range(U):
                    t = t0 + u * NGROUPS + gid
                    if t < n:
                        j = p0 + t
                        jb = j // block_size
                        base = (tbl_sh[jb - b_first] * num_kv_heads + kvh) * page_words \
                            + (j - jb * block_size) * (ROW_VECS * 4)
                        for v in range(VPL):
                            w = ld4(kw, base + (lig + v * TG) * 4)
                            for x in range(4):
                                wk[(u * VPL + v) * 4 + x] = w[x]
                    else:
                        for x in range(VPL * 4):
                            wk[u * VPL * 4 + x] = 0
                for u in range(U):
                    t = t0 + u * NGROUPS + gid
                    dots = cuda.local.array(hpb, float32)
                    for g in range(hpb):
                        dots[g] = 0.0
                    for v in range(VPL):
                        for x in range(4):
                            for e in range(EPW):
                                kval = word_elem(wk[(u * VPL + v) * 4 + x], e, kind_kv)
                                for g in range(hpb):
                                    dots[g] += qr[(g * VPL + v) * DPV + x * EPW + e] * kval
                    for g in range(hpb):
                        score = group_sum(dots[g], TG, scratch)
                        if lig == 0 and t < n:
                            s_sh[g, t] = score
            cuda.syncthreads()

            # ---- softmax over the partition, one warp per head
            warp = tid // WARP
            lane = tid % WARP
            for gi in range(0, hpb, NW):
                g = gi + warp
                active = g < hpb and warp < NW
                m_old = NEG
                mx = NEG
                if active:
                    m_old = stat_sh[g, 0]
                    for t in range(lane, n, WARP):
                        mx = vmax(mx, s_sh[g, t])
                mx = group_max(mx, WARP, scratch)
                m_new = vmax(m_old, mx)
                total = float32(0.0)
                if active:
                    for t in range(lane, n, WARP):
                        p = exp2(s_sh[g, t] - m_new)
                        s_sh[g, t] = p
                        total += p
                total = group_sum(total, WARP, scratch)
                if active and lane == 0:
                    alpha = exp2(m_old - m_new)
                    stat_sh[g, 2] = alpha
                    stat_sh[g, 1] = stat_sh[g, 1] * alpha + total
                    stat_sh[g, 0] = m_new
            cuda.syncthreads()

            # ---- V pass: acc[g, column dc] += p[g, t] * v[t, column dc]
            for g in range(hpb):
                alpha = stat_sh[g, 2]
                for k in range(DPV):
                    acc[g * DPV + k] *= alpha
            wv = cuda.local.array(WV, uint32)
            for t0 in range(0, n, VT * U):
                for u in range(U):
                    t = t0 + u * VT + tl
                    if tl < VT and t < n:
                        j = p0 + t
                        jb = j // block_size
                        base = (tbl_sh[jb - b_first] * num_kv_heads + kvh) * page_words \
                            + (j - jb * block_size) * (ROW_VECS * 4)
                        w = ld4(vw, base + dc * 4)
                        for x in range(4):
                            wv[u * 4 + x] = w[x]
                for u in range(U):
                    t = t0 + u * VT + tl
                    if tl < VT and t < n:
                        for x in range(4):
                            for e in range(EPW):
                                val = word_elem(wv[u * 4 + x], e, kind_kv)
                                for g in range(hpb):
                                    acc[g * DPV + x * EPW + e] += s_sh[g, t] * val
            cuda.syncthreads()

        # ---- sum the key lanes' accumulators; write out (1 split) or the partial state
        for g in range(hpb):
            for k in range(DPV):
                red_sh[tid * DPV + k] = acc[g * DPV + k] if tl < VT else 0.0
            cuda.syncthreads()
            if tid < ROW_VECS:
                l_sum = stat_sh[g, 1]
                for k in range(DPV):
                    total = float32(0.0)
                    for r in range(VT):
                        total += red_sh[(r * ROW_VECS + tid) * DPV + k]
                    d = tid * DPV + k
                    if splits == 1:
                        o = total / l_sum if l_sum > 0 else float32(0.0)
                        out[i, head0 + g, d] = from_f32(o, kind_o)
                    else:
                        part_acc[i, hb, split, g, d] = total
            cuda.syncthreads()
        if splits == 1:
            return
        if tid < hpb:
            part_ml[i, hb, (split * hpb + tid) * 2] = stat_sh[tid, 0]
            part_ml[i, hb, (split * hpb + tid) * 2 + 1] = stat_sh[tid, 1]

        # ---- split-K: the last block of this (sequence, head block) merges all splits
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            ticket = cuda.atomic.add(counters, i * cuda.gridDim.y + hb, 1)
            flag_sh[0] = 1 if ticket == splits - 1 else 0
        cuda.syncthreads()
        if flag_sh[0] == 0:
            return
        cuda.threadfence()
        for idx in range(tid, hpb * head_dim, threads):
            g = idx // head_dim
            d = idx - g * head_dim
            m_max = NEG
            for sp in range(splits):
                m_max = vmax(m_max, part_ml[i, hb, (sp * hpb + g) * 2])
            num = float32(0.0)
            den = float32(0.0)
            for sp in range(splits):
                w8 = exp2(part_ml[i, hb, (sp * hpb + g) * 2] - m_max)
                num += w8 * part_acc[i, hb, sp, g, d]
                den += w8 * part_ml[i, hb, (sp * hpb + g) * 2 + 1]
            o = num / den if den > 0 else float32(0.0)
            out[i, head0 + g, d] = from_f32(o, kind_o)
        if tid == 0:
            counters[i * cuda.gridDim.y + hb] = 0

    return decode
