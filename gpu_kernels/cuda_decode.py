"""CUDA decode kernel: one query token per sequence, the whole GQA group per thread block.

Grid ``(splits, num_kv_heads * head_chunks, num_seqs)``; block ``THREADS``
threads (``NW`` warps). A block owns one sequence, one KV head (and ``HPB``
of the query heads reading it: the whole group unless it is larger than 8)
and one *split*: ``chunk`` consecutive keys. Long contexts are split over
many blocks so that one sequence fills the GPU (split-K / flash-decoding).

The block walks its keys in segments of ``SEG``; a segment's block-table
entries are prefetched into shared memory. Inside a segment every warp
streams its own *steps* of ``ST`` keys with no block-wide barrier:

* **K**: ``TG`` lanes share a key row; each loads ``VPL`` 16-byte vectors and
  dots them with its slice of the ``HPB`` query rows (kept in registers,
  pre-scaled by ``scale * log2(e)``); a shuffle reduction over the ``TG``
  lanes gives the scores. Each K byte is read once for all ``HPB`` heads.
* **V**: ``VL`` lanes share a value row (each owns ``VPLV`` 16-byte columns),
  so a warp covers ``TPV`` keys per load; the V loads are issued together
  with the K loads, before any arithmetic, to keep many bytes in flight.
* **softmax**: a lane fetches its keys' scores with ``shfl`` and keeps a
  private online-softmax state (max ``m``, sum ``l``, accumulators) over the
  keys it has seen: ``acc = acc * 2^(m - m') + 2^(s - m') v``.

At the end the lanes' states are merged with shuffles, the warps' states in
shared memory. With one split the block writes ``acc / l``; with several it
writes ``(m, l, acc)`` to a scratch buffer and takes a ticket from a counter
per (sequence, head block): the block with the last ticket merges all splits
(``sum 2^(m_s - M) acc_s / sum 2^(m_s - M) l_s``) and resets the counter, so
there is no second launch.

Minus infinity is the finite ``NEG`` (fast-math).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint32

from .cuda_primitives import (F32, SIMULATED, exp2, from_f32, group_sum, ld4, shfl_idx, shfl_xor,
                              to_f32, vmax, vmin, word_elem)

NEG = np.float32(-1e30)
ML_PAD = 32          # part_ml rows are padded to 128 bytes (see cuda.py: no stale L1 lines)


def _pow2_divisor(n, limit):
    """The largest power of two <= limit that divides n."""
    p = 1
    while p < limit and n % (2 * p) == 0:
        p *= 2
    return p


@functools.lru_cache(maxsize=None)
def build_decode_kernel(threads, group, hpb, head_dim, kind_q, kind_kv, kind_o, block_size,
                        segment, lanes_per_token, unroll, max_registers=None):
    """Compile-time specialization of the decode kernel (all arguments are constants)."""
    EPW = 1 if kind_kv == F32 else 2            # elements per 32-bit word
    DPV = 4 * EPW                               # elements per 16-byte vector
    ROW_VECS = head_dim // DPV                  # vectors per key row
    NW = threads // 32
    TG = lanes_per_token                        # K: lanes per key
    VPL = ROW_VECS // TG                        # K: vectors per lane
    TK = 32 // TG                               # K: keys per warp load
    VL = _pow2_divisor(ROW_VECS, 32)            # V: lanes per key
    VPLV = ROW_VECS // VL                       # V: vectors per lane
    TPV = 32 // VL                              # V: keys per warp load
    U = unroll
    ST = TK * U                                 # keys per warp step
    VTL = ST // TPV                             # V: keys per lane per step
    HCHUNKS = group // hpb
    SEG = segment
    TBL = SEG + 2
    QN = hpb * VPL * DPV                        # query slice per lane
    ACCN = hpb * VPLV * DPV                     # accumulators per lane
    WKN = U * VPL * 4                           # K words in flight per lane
    WVN = VTL * VPLV * 4                        # V words in flight per lane
    SCN = U * hpb
    WSTATE = NW * hpb * head_dim
    # The simulator has no warp shuffles: there, partial dots and the lanes' final
    # softmax states go through shared memory instead (two barriers per step).
    SIM = SIMULATED
    SIM_DOTS = SCN * threads if SIM else 1
    LSTATE = hpb * (2 + VPLV * DPV)
    SIM_STATE = LSTATE * threads if SIM else 1
    BS = block_size
    ROW_WORDS = ROW_VECS * 4
    PAGE_WORDS = BS * ROW_WORDS
    SVN = VTL * hpb

    options = {} if SIM or max_registers is None else {"max_registers": max_registers}

    @cuda.jit(device=True, inline="always")
    def load_step(kw, vw, tbl_sh, b_first, seg0, seg_n, s0, blk_stride, head_off, lane, wk, wv):
        """Issue this lane's 16-byte loads of one step: K rows, then V rows."""
        for u in range(U):
            t = s0 + u * TK + lane // TG
            if t < seg_n:
                j = seg0 + t
                jb = j // BS
                base = tbl_sh[jb - b_first] * blk_stride + head_off + (j - jb * BS) * ROW_WORDS
                for v in range(VPL):
                    w = ld4(kw, base + (lane % TG + v * TG) * 4)
                    for x in range(4):
                        wk[(u * VPL + v) * 4 + x] = w[x]
        for m in range(VTL):
            t = s0 + m * TPV + lane // VL
            if t < seg_n:
                j = seg0 + t
                jb = j // BS
                base = tbl_sh[jb - b_first] * blk_stride + head_off + (j - jb * BS) * ROW_WORDS
                for v in range(VPLV):
                    w = ld4(vw, base + (lane % VL + v * VL) * 4)
                    for x in range(4):
                        wv[(m * VPLV + v) * 4 + x] = w[x]

    @cuda.jit(device=True, inline="always")
    def compute_step(qr, wk, wv, acc, m_run, l_run, sc, sv, scratch, sim_dots, s0, seg_n,
                     tid, lane):
        """Scores of the step's keys, then the lane's online-softmax update with its V rows."""
        for u in range(U):
            for g in range(hpb):
                dot = float32(0.0)
                for v in range(VPL):
                    for x in range(4):
                        for e in range(EPW):
                            dot += qr[(g * VPL + v) * DPV + x * EPW + e] * \
                                word_elem(wk[(u * VPL + v) * 4 + x], e, kind_kv)
                if SIM:
                    sim_dots[(u * hpb + g) * threads + tid] = dot
                else:
                    sc[u * hpb + g] = group_sum(dot, TG, scratch)
        if SIM:
            cuda.syncthreads()
        vt = lane // VL
        # this lane's keys: s0 + m * TPV + vt (m < VTL); fetch their scores
        for m in range(VTL):
            u = (m * TPV) // TK                     # the K load that held these keys
            src = ((m * TPV) % TK + vt) * TG         # a lane that has the score
            for g in range(hpb):
                if SIM:
                    s = float32(0.0)
                    for x in range(TG):
                        s += sim_dots[(u * hpb + g) * threads + (tid - lane) + src + x]
                else:
                    s = shfl_idx(sc[u * hpb + g], src, scratch)
                sv[m * hpb + g] = s if s0 + m * TPV + vt < seg_n else NEG
        if SIM:
            cuda.syncthreads()
        # one rescale per step, then accumulate p * v
        for g in range(hpb):
            m_new = m_run[g]
            for m in range(VTL):
                m_new = vmax(m_new, sv[m * hpb + g])
            alpha = exp2(m_run[g] - m_new)
            m_run[g] = m_new
            l_sum = l_run[g] * alpha
            for k in range(VPLV * DPV):
                acc[g * VPLV * DPV + k] *= alpha
            for m in range(VTL):
                p = exp2(sv[m * hpb + g] - m_new) if sv[m * hpb + g] > NEG else float32(0.0)
                l_sum += p
                for v in range(VPLV):
                    for x in range(4):
                        for e in range(EPW):
                            k = (g * VPLV + v) * DPV + x * EPW + e
                            acc[k] += p * word_elem(wv[(m * VPLV + v) * 4 + x], e, kind_kv)
            l_run[g] = l_sum

    @cuda.jit(fastmath=True, **options)
    def decode(q, kw, vw, block_tables, context_lens, out, part_ml, part_acc, counters,
               scale_log2, window, num_kv_heads, splits, chunk):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        split = cuda.blockIdx.x
        hb = cuda.blockIdx.y
        i = cuda.blockIdx.z
        kvh = hb // HCHUNKS
        head0 = kvh * group + (hb % HCHUNKS) * hpb

        tbl_sh = cuda.shared.array(TBL, int32)
        w_acc = cuda.shared.array(WSTATE, float32)          # per-warp accumulators
        w_ml = cuda.shared.array((NW, hpb, 2), float32)      # per-warp (max, sum)
        f_ml = cuda.shared.array((hpb, 2), float32)          # block (max, sum)
        scratch = cuda.shared.array(threads, float32)
        flag_sh = cuda.shared.array(1, int32)
        sim_dots = cuda.shared.array(SIM_DOTS, float32)
        sim_state = cuda.shared.array(SIM_STATE, float32)

        length = context_lens[i]
        lo = 0
        if window > 0:
            lo = vmax(0, length - window)
        start = lo + split * chunk
        end = vmin(length, start + chunk)

        kl = lane % TG                                       # K: lane within the key's group
        vl = lane % VL                                       # V: lane within the key's group
        qr = cuda.local.array(QN, float32)
        for g in range(hpb):
            for v in range(VPL):
                for e in range(DPV):
                    d = (kl + v * TG) * DPV + e
                    qr[(g * VPL + v) * DPV + e] = to_f32(q[i, head0 + g, d], kind_q) * scale_log2
        acc = cuda.local.array(ACCN, float32)
        for k in range(ACCN):
            acc[k] = 0.0
        m_run = cuda.local.array(hpb, float32)
        l_run = cuda.local.array(hpb, float32)
        for g in range(hpb):
            m_run[g] = NEG
            l_run[g] = 0.0
        blk_stride = num_kv_heads * PAGE_WORDS
        head_off = kvh * PAGE_WORDS
        wk_a = cuda.local.array(WKN, uint32)
        wv_a = cuda.local.array(WVN, uint32)
        wk_b = cuda.local.array(WKN, uint32)
        wv_b = cuda.local.array(WVN, uint32)
        sc = cuda.local.array(SCN, float32)
        sv = cuda.local.array(SVN, float32)
        for k in range(WKN):
            wk_a[k] = 0
            wk_b[k] = 0
        for k in range(WVN):
            wv_a[k] = 0
            wv_b[k] = 0

        for seg0 in range(start, end, SEG):
            seg_n = vmin(SEG, end - seg0)
            b_first = seg0 // BS
            nb = (seg0 + seg_n - 1) // BS - b_first + 1
            cuda.syncthreads()
            for e in range(tid, nb, threads):
                tbl_sh[e] = block_tables[i, b_first + e]
            cuda.syncthreads()
            # Steps of NW * ST keys (warp w takes the w-th ST of each), software-pipelined:
            # the loads of step n + 1 are in flight while step n is computed.
            steps = (seg_n + NW * ST - 1) // (NW * ST)
            load_step(kw, vw, tbl_sh, b_first, seg0, seg_n, warp * ST, blk_stride, head_off,
                      lane, wk_a, wv_a)
            for n in range(0, steps, 2):
                s0 = n * NW * ST + warp * ST
                if n + 1 < steps:
                    load_step(kw, vw, tbl_sh, b_first, seg0, seg_n, s0 + NW * ST, blk_stride,
                              head_off, lane, wk_b, wv_b)
                compute_step(qr, wk_a, wv_a, acc, m_run, l_run, sc, sv, scratch, sim_dots, s0,
                             seg_n, tid, lane)
                if n + 1 < steps:
                    if n + 2 < steps:
                        load_step(kw, vw, tbl_sh, b_first, seg0, seg_n, s0 + 2 * NW * ST,
                                  blk_stride, head_off, lane, wk_a, wv_a)
                    compute_step(qr, wk_b, wv_b, acc, m_run, l_run, sc, sv, scratch, sim_dots,
                                 s0 + NW * ST, seg_n, tid, lane)

        # ---- merge the TPV lane classes of each warp (lanes vl, vl + VL, ...)
        if SIM:
            for g in range(hpb):
                sim_state[tid * LSTATE + g * 2] = m_run[g]
                sim_state[tid * LSTATE + g * 2 + 1] = l_run[g]
            for k in range(ACCN):
                sim_state[tid * LSTATE + 2 * hpb + k] = acc[k]
            cuda.syncthreads()
            for c in range(1, TPV if lane < VL else 1):      # lane vl merges vl + c * VL
                other = (tid + c * VL) * LSTATE
                for g in range(hpb):
                    m_o = sim_state[other + g * 2]
                    m_new = vmax(m_run[g], m_o)
                    a_me = exp2(m_run[g] - m_new)
                    a_o = exp2(m_o - m_new)
                    m_run[g] = m_new
                    l_run[g] = l_run[g] * a_me + sim_state[other + g * 2 + 1] * a_o
                    for k in range(VPLV * DPV):
                        idx = g * VPLV * DPV + k
                        acc[idx] = acc[idx] * a_me + sim_state[other + 2 * hpb + idx] * a_o
        else:
            off = VL
            while off < 32:
                for g in range(hpb):
                    m_o = shfl_xor(m_run[g], off, scratch)
                    l_o = shfl_xor(l_run[g], off, scratch)
                    m_new = vmax(m_run[g], m_o)
                    a_me = exp2(m_run[g] - m_new)
                    a_o = exp2(m_o - m_new)
                    m_run[g] = m_new
                    l_run[g] = l_run[g] * a_me + l_o * a_o
                    for k in range(VPLV * DPV):
                        idx = g * VPLV * DPV + k
                        acc[idx] = acc[idx] * a_me + shfl_xor(acc[idx], off, scratch) * a_o
                off *= 2
        # ---- merge the warps in shared memory
        if lane < VL:
            for g in range(hpb):
                if lane == 0:
                    w_ml[warp, g, 0] = m_run[g]
                    w_ml[warp, g, 1] = l_run[g]
                for v in range(VPLV):
                    for k in range(DPV):
                        d = (vl + v * VL) * DPV + k
                        w_acc[(warp * hpb + g) * head_dim + d] = acc[(g * VPLV + v) * DPV + k]
        cuda.syncthreads()
        if tid < hpb:
            m_max = NEG
            for w8 in range(NW):
                m_max = vmax(m_max, w_ml[w8, tid, 0])
            den = float32(0.0)
            for w8 in range(NW):
                den += exp2(w_ml[w8, tid, 0] - m_max) * w_ml[w8, tid, 1]
            f_ml[tid, 0] = m_max
            f_ml[tid, 1] = den
        cuda.syncthreads()
        for idx in range(tid, hpb * head_dim, threads):
            g = idx // head_dim
            num = float32(0.0)
            for w8 in range(NW):
                num += exp2(w_ml[w8, g, 0] - f_ml[g, 0]) * w_acc[w8 * hpb * head_dim + idx]
            if splits == 1:
                den = f_ml[g, 1]
                o = num / den if den > 0 else float32(0.0)
                out[i, head0 + g, idx - g * head_dim] = from_f32(o, kind_o)
            else:
                part_acc[i, hb, split, g, idx - g * head_dim] = num
        if splits == 1:
            return
        if tid < hpb:
            part_ml[i, hb, (split * hpb + tid) * 2] = f_ml[tid, 0]
            part_ml[i, hb, (split * hpb + tid) * 2 + 1] = f_ml[tid, 1]

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
