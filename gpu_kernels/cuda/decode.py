"""CUDA decode kernel: one query token per sequence, the whole GQA group per thread block.

Grid ``(splits, num_kv_heads * head_chunks, num_seqs)``; block ``NW`` warps.
A block owns one sequence, one KV head (and ``HPB`` of the query heads
reading it: the whole group unless it is larger than 8) and one *split*:
``chunk`` consecutive keys. Long contexts are split over many blocks so that
one sequence fills the GPU (split-K / flash-decoding). The block-table
entries of the chunk are read into shared memory once. Without a sliding window
a split's keys start at ``split * chunk`` whatever the context length, so a block
issues the loads of the length, of its block-table entries, of the query and of
the pages of each warp's first stages together, and the warps start their first
K/V copies from those pages before the table is in shared memory: one round trip
to memory before the first copy instead of several in a row (the length, then the
entries, two per thread at 16 x 8192, then the query, then a barrier).

Every warp streams its own *stages* of ``KPW`` keys (stage ``n`` of warp ``w``
holds keys ``start + (n * NW + w) * KPW + [0, KPW)``) through a private ring
of ``STAGES`` shared-memory slots filled with ``cp.async`` (16 bytes per
copy, coalesced): while a stage is computed the next ones are in flight, and
registers hold no loaded data. Warps meet only at the end. Chunks start at
multiples of ``KPW`` (a sliding window's first key is rounded down and the
keys before it masked), so when ``block_size`` is a multiple of ``KPW`` a
stage lies in one page: one block-table lookup per stage and lane, then
fixed strides (the address arithmetic otherwise dominates the loop). Per stage:

* **scores**: ``TG`` lanes share a key row (``VPL`` 16-byte vectors each) and
  dot it with their slice of the ``HPB`` query rows (registers, pre-scaled by
  ``scale * log2(e)``); a warp pass covers ``TK = 32 / TG`` keys, a stage
  ``P`` passes. The ``P * HPB`` partial dots of a lane are summed over the
  ``TG`` lanes by a *reduce-scatter* (each shuffle level halves the values a
  lane keeps), so each lane ends with whole scores of its own; they go to
  shared memory.
* **softmax**: the warp keeps one running max per head: every lane reads
  the stage's scores, takes the max, rescales by ``2^(m - m')``; the lane
  that owns a score writes its ``p = 2^(s - m')``.
* **P V**: the same lane layout over V rows; a lane accumulates ``p v`` for its
  ``VPL * DPV`` dims of all ``HPB`` heads, and ``sum p``.

At the end the ``TK`` key classes of a warp are summed with shuffles (the
warp's max is common to its lanes), the warps merged in shared memory. With
one split the block writes ``acc / l``; with several it writes ``(m, l, acc)``
to a scratch buffer and takes a ticket from a counter per (sequence, head
block): the block with the last ticket merges all splits
(``sum 2^(m_s - M) acc_s / sum 2^(m_s - M) l_s``, the split weights computed
once into shared memory, the partial rows read with 16-byte loads, several
splits in flight) and resets the counter, so there is no second launch.

Half queries on a cache of the same half format with head_dim 64 or 128 take a second
kernel of the same blocks, splits, ring and merges (``tensor_cores``): its stages are 8 keys,
copied with a swizzle, and their two products run on tensor cores (``decode_mma``), so a
key costs a few issued instructions instead of ~100 (conversions, FMAs, shuffles).

Minus infinity is the finite ``NEG`` (fast-math).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from .primitives import (F32, exp2, fmax32, from_f32, ld4, pack2, register_cap, shfl_idx,
                         shfl_xor, to_f32, vmax, vmin, word_elem)
from . import decode_mma
from .shared_memory import (cp_async16_hinted, cp_async_commit, cp_async_wait, l2_evict_first,
                            lds4f, shared_vectors, syncwarp)

NEG = np.float32(-1e30)
MAX_SPLITS = 256     # split-K: at most this many splits (their weights live in shared memory)
MERGE_UNROLL = 8     # split-K merge: partial rows loaded together
ML_PAD = 32          # part_ml rows are padded to 128 bytes (see backend.py: no stale L1 lines)


def _pow2_divisor(n, limit):
    """The largest power of two <= limit that divides n."""
    p = 1
    while p < limit and n % (2 * p) == 0:
        p *= 2
    return p


def _log2(n):
    return n.bit_length() - 1


def stage_shape(head_dim, itemsize, stage_bytes):
    """(TG lanes per key, TK keys per warp pass, P passes per stage) of a KV row layout."""
    row_vecs = head_dim * itemsize // 16
    tg = _pow2_divisor(row_vecs, 32)
    tk = 32 // tg
    passes = 1
    while passes < 8 and 2 * passes * tk * 2 * head_dim * itemsize <= stage_bytes:
        passes *= 2
    return tg, tk, passes


def _scatter_level(half, offset):
    """One reduce-scatter level: keep half of the values, summed with the partner lane's."""
    @cuda.jit(device=True, inline="always")
    def level(part, lane, scratch):
        upper = (lane & offset) != 0
        for t in range(half):
            low = part[t]
            high = part[t + half]
            mine = high if upper else low
            part[t] = mine + shfl_xor(low if upper else high, offset, scratch)
    return level


@functools.lru_cache(maxsize=None)
def build_decode_kernel(threads, group, hpb, head_dim, kind_q, kind_kv, kind_o, block_size,
                        table_len, stages, stage_bytes, max_registers=None, tensor_cores=0,
                        l2_hint=()):
    """Compile-time specialization of the decode kernel (all arguments are constants).

    ``l2_hint``: L2 qualifiers of the K/V copies (``shared_memory.cp_async16_hinted``).

    ``tensor_cores``: 0 the CUDA-core stage below; 1 the tensor-core stage of
    ``decode_mma`` in plain Numba (simulator, GPUs without ``mma.sync``); 2 with ``mma.sync``.
    """
    EPW = 1 if kind_kv == F32 else 2            # elements per 32-bit word
    DPV = 4 * EPW                               # elements per 16-byte vector
    ROW_VECS = head_dim // DPV                  # vectors per key row
    ROW_WORDS = 4 * ROW_VECS
    NW = threads // 32
    TG, TK, P = stage_shape(head_dim, 4 // EPW, stage_bytes)
    VPL = ROW_VECS // TG                        # vectors per lane and row
    DL = VPL * DPV                              # dims per lane
    KPW = P * TK                                # keys per warp stage
    if tensor_cores:
        KPW = decode_mma.STAGE_KEYS
    SWZ = decode_mma.SWIZZLE if tensor_cores else 0
    HP2 = 1 << _log2(2 * hpb - 1)               # heads rounded up to a power of two
    NV = P * HP2                                # partial dots per lane
    LEVELS = _log2(TG)
    SCAT = min(LEVELS, _log2(NV))               # reduce-scatter levels
    NF = NV >> SCAT                             # whole scores per lane afterwards
    SLOT = 2 * KPW * ROW_WORDS                  # words per warp stage: K rows, then V rows
    RING = max(stages * NW * SLOT, NW * hpb * head_dim, 2 * MAX_SPLITS * hpb)
    CPL = KPW * ROW_VECS // 32                  # copies per lane, tensor and stage
    FAST = 32 % ROW_VECS == 0 and block_size % KPW == 0    # a stage never straddles pages
    KSTEP = max(1, 32 // ROW_VECS)              # keys between a lane's copies (FAST)
    HCHUNKS = group // hpb
    BS = block_size
    PAGE_WORDS = BS * ROW_WORDS
    TBL = table_len + 1
    TPT = -(-TBL // threads)                    # block-table entries per thread (prologue)
    SWN = -(-NW * KPW * HP2 // 4) * 4          # per-warp scores / probabilities, 16-byte rounded
    MWN = NW * HP2
    alloc_smem = shared_vectors(RING + 2 * SWN)
    ACCN = DL * hpb
    STAGES = stages
    NFIRST = stages - 1                         # stages in flight before the loop
    wait_ring = cp_async_wait[stages - 2]
    wait_all = cp_async_wait[0]
    copy = cp_async16_hinted(l2_hint)
    EVICT = "evict_first" in l2_hint
    noop = _scatter_level(0, 1)
    L0, L1, L2, L3, L4 = [_scatter_level(NV >> (k + 1), TG >> (k + 1)) if k < SCAT else noop
                          for k in range(5)]

    @cuda.jit(device=True, inline="always")
    def read_heads(buf, i, dst):
        """dst[:HPB] = buf[i:i + HPB] (16-byte loads when a key's row is 4k floats)."""
        if HP2 % 4 == 0:
            for h in range(HP2 // 4):
                t = lds4f(buf, i + 4 * h)
                for x in range(4):
                    dst[4 * h + x] = t[x]
        else:
            for g in range(hpb):
                dst[g] = buf[i + g]

    @cuda.jit(device=True, inline="always")
    def load_table(block_tables, i, split, chunk, window, tid, warp, tb, first):
        """Load the chunk's block-table entries into ``tb`` (registers, ``TPT`` per thread)
        and, when a stage lies in one page (``FAST``), the pages of this warp's first
        ``NFIRST`` stages into ``first``, before the context length is known, all loads at
        once; returns how many entries the block loaded into ``tb`` (0 with a window: its
        chunk starts relative to the length, and nothing is loaded).

        Without a window a split's keys start at ``split * chunk`` whatever the length, so the
        loads of the length, these entries and the query are in flight together, and the
        first copies (``issue_first``) wait for one round trip instead of several in a row.
        Entries past the sequence's end are loaded (within the table) but never used."""
        n = 0
        if window <= 0:
            start = split * chunk
            b_first = start // BS
            n = vmin((start + chunk - 1) // BS - b_first + 1, block_tables.shape[1] - b_first)
            for u in range(TPT):
                e = tid + u * threads
                if e < n:
                    tb[u] = block_tables[i, b_first + e]
            if FAST:
                for s in range(NFIRST):
                    jb = (start + (s * NW + warp) * KPW) // BS
                    first[s] = block_tables[i, jb] if jb < block_tables.shape[1] else 0
        return n

    @cuda.jit(device=True, inline="always")
    def store_table(block_tables, i, tb, n_loaded, tbl_sh, tid, n_keys, b_first, end):
        """``tbl_sh[e]`` = the chunk's ``e``-th block-table entry: from ``tb`` (``load_table``)
        or, with a window, read now."""
        if n_loaded > 0:
            for u in range(TPT):
                e = tid + u * threads
                if e < n_loaded:
                    tbl_sh[e] = tb[u]
        elif n_keys > 0:
            for e in range(tid, (end - 1) // BS - b_first + 1, threads):
                tbl_sh[e] = block_tables[i, b_first + e]

    @cuda.jit(device=True, inline="always")
    def issue_page(ring, kw, vw, page, n, key0, end, blk_stride, head_off, warp, lane, pol):
        """The copies of stage n of this warp, whose keys (from ``key0``) lie in block ``page``
        (``FAST``: one table lookup, then fixed strides)."""
        dst = ((n % STAGES) * NW + warp) * SLOT + lane * 4
        j = key0 + lane // ROW_VECS
        src = page * blk_stride + head_off + (j - (key0 // BS) * BS) * ROW_WORDS \
            + (lane % ROW_VECS) * 4
        for c in range(CPL):
            nbytes = 16 if j + c * KSTEP < end else 0
            d = dst + 128 * c
            if SWZ:                                      # row r, chunk ch ^ (r & SWZ)
                r = lane // ROW_VECS + c * KSTEP
                d = dst - lane * 4 + r * ROW_WORDS + 4 * ((lane % ROW_VECS) ^ (r & SWZ))
            copy(ring, d, kw, src + c * KSTEP * ROW_WORDS, nbytes, pol)
            copy(ring, d + KPW * ROW_WORDS, vw, src + c * KSTEP * ROW_WORDS, nbytes, pol)

    @cuda.jit(device=True, inline="always")
    def issue(ring, kw, vw, tbl_sh, n, n_stages, start, end, b_first, blk_stride, head_off,
              warp, lane, pol):
        """Start the copies of stage n of this warp into its ring slot; commit a group."""
        if n < n_stages and FAST:
            key0 = start + (n * NW + warp) * KPW
            page = 0
            if key0 < end:
                page = tbl_sh[key0 // BS - b_first]
            issue_page(ring, kw, vw, page, n, key0, end, blk_stride, head_off, warp, lane, pol)
        elif n < n_stages:
            dst = ((n % STAGES) * NW + warp) * SLOT
            key0 = start + (n * NW + warp) * KPW
            for c in range(CPL):
                idx = lane + 32 * c
                kk = idx // ROW_VECS
                j = key0 + kk
                src = 0
                nbytes = 0
                if j < end:
                    jb = j // BS
                    src = tbl_sh[jb - b_first] * blk_stride + head_off \
                        + (j - jb * BS) * ROW_WORDS + (idx - kk * ROW_VECS) * 4
                    nbytes = 16
                d = dst + idx * 4
                if SWZ:
                    d = dst + kk * ROW_WORDS + 4 * ((idx - kk * ROW_VECS) ^ (kk & SWZ))
                copy(ring, d, kw, src, nbytes, pol)
                copy(ring, d + KPW * ROW_WORDS, vw, src, nbytes, pol)
        cp_async_commit()

    @cuda.jit(device=True, inline="always")
    def issue_first(ring, kw, vw, first, n_stages, start, end, blk_stride, head_off, warp,
                    lane, pol):
        """``issue`` of stages ``0 .. NFIRST - 1`` with the pages ``load_table`` put in
        ``first``: before the block's table is in shared memory."""
        for n in range(NFIRST):
            if n < n_stages:
                key0 = start + (n * NW + warp) * KPW
                page = first[n] if key0 < end else 0
                issue_page(ring, kw, vw, page, n, key0, end, blk_stride, head_off, warp, lane,
                           pol)
            cp_async_commit()

    @cuda.jit(device=True, inline="always")
    def open_chunk(ring, kw, vw, block_tables, i, length, split, chunk, window, kvh, num_kv_heads,
                   tb, n_loaded, first, early, tbl_sh, tid, warp, lane):
        """The window's first key ``lo``, the split's keys ``[start, end)`` (stages at multiples
        of ``KPW`` from ``lo``), their count and first block, this KV head's stride and offset in the pages,
        the warp-stage count and the copies' L2 policy; with ``early`` the first stages' copies
        are issued from ``first``, then the block table goes to shared memory (``store_table``)."""
        lo = 0
        if window > 0:
            lo = vmax(0, length - window)
        start = lo - lo % KPW + split * chunk
        end = vmin(length, start + chunk)
        n_keys = vmax(0, end - start)
        b_first = start // BS
        blk_stride = num_kv_heads * PAGE_WORDS
        head_off = kvh * PAGE_WORDS
        n_stages = (n_keys + NW * KPW - 1) // (NW * KPW)
        pol = l2_evict_first() if EVICT else uint64(0)
        if early:
            issue_first(ring, kw, vw, first, n_stages, start, end, blk_stride, head_off, warp,
                        lane, pol)
        store_table(block_tables, i, tb, n_loaded, tbl_sh, tid, n_keys, b_first, end)
        return lo, start, end, n_keys, b_first, blk_stride, head_off, n_stages, pol

    @cuda.jit(device=True, inline="always")
    def finish(tid, i, hb, split, head0, splits, ring, w_ml, f_ml, flag_sh, out, part_ml,
               part_acc, counters):
        """Merge the warps' (max, sum, acc) rows (``w_ml``, ``ring``) and write the output or
        this split's partial; the last split's block merges all splits."""
        w_acc = ring
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
        wts = ring                                           # free: split weights, then sums
        for e in range(tid, splits * hpb, threads):
            wts[e] = part_ml[i, hb, 2 * e]
            wts[MAX_SPLITS * hpb + e] = part_ml[i, hb, 2 * e + 1]
        cuda.syncthreads()
        if tid < hpb:
            m_max = NEG
            for sp in range(splits):
                m_max = vmax(m_max, wts[sp * hpb + tid])
            den = float32(0.0)
            for sp in range(splits):
                den += exp2(wts[sp * hpb + tid] - m_max) * wts[MAX_SPLITS * hpb + sp * hpb + tid]
            f_ml[tid, 0] = m_max
            f_ml[tid, 1] = float32(1.0) / den if den > 0 else float32(0.0)
        cuda.syncthreads()
        for e in range(tid, splits * hpb, threads):
            g = e % hpb
            wts[e] = exp2(wts[e] - f_ml[g, 0]) * f_ml[g, 1]
        cuda.syncthreads()
        # out = sum_s w_s acc_s: 16-byte loads, MERGE_UNROLL splits in flight per thread
        row = hpb * head_dim
        base = (i * cuda.gridDim.y + hb) * splits * row
        for vi in range(tid, row // 4, threads):
            g = (4 * vi) // head_dim
            o4 = cuda.local.array(4, float32)
            for x in range(4):
                o4[x] = 0.0
            for sp0 in range(0, splits, MERGE_UNROLL):
                for u in range(MERGE_UNROLL):
                    sp = sp0 + u
                    if sp < splits:
                        t = lds4f(part_acc, base + sp * row + 4 * vi)
                        w8 = wts[sp * hpb + g]
                        for x in range(4):
                            o4[x] += w8 * t[x]
            for x in range(4):
                out[i, head0 + g, 4 * vi - g * head_dim + x] = from_f32(o4[x], kind_o)
        if tid == 0:
            counters[i * cuda.gridDim.y + hb] = 0

    @cuda.jit(fastmath=True, **register_cap(max_registers))
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

        smem = alloc_smem()
        ring = smem[:RING]                                   # KV stages; later warp states
        s_w = smem[RING:RING + SWN]                          # per warp: scores of a stage
        p_w = smem[RING + SWN:]                              # per warp: probabilities
        tbl_sh = cuda.shared.array(TBL, int32)
        m_w = cuda.shared.array(MWN, float32)           # per warp: running max per head
        w_ml = cuda.shared.array((NW, hpb, 2), float32)      # per-warp (max, sum)
        f_ml = cuda.shared.array((hpb, 2), float32)          # block (max, sum)
        scratch = cuda.shared.array(threads, float32)
        flag_sh = cuda.shared.array(1, int32)

        tb = cuda.local.array(TPT, int32)
        first = cuda.local.array(NFIRST, int32)
        n_loaded = load_table(block_tables, i, split, chunk, window, tid, warp, tb, first)
        early = FAST and window <= 0                         # first copies from `first`
        length = context_lens[i]
        lo, start, end, n_keys, b_first, blk_stride, head_off, n_stages, pol = open_chunk(
            ring, kw, vw, block_tables, i, length, split, chunk, window, kvh, num_kv_heads, tb,
            n_loaded, first, early, tbl_sh, tid, warp, lane)
        kl = lane % TG                                       # lane within its key's group
        kslot = lane // TG                                   # which key of a pass
        qr = cuda.local.array(ACCN, float32)
        for g in range(hpb):
            for v in range(VPL):
                for e in range(DPV):
                    qr[g * DL + v * DPV + e] = \
                        to_f32(q[i, head0 + g, (kl + v * TG) * DPV + e], kind_q) * scale_log2
        acc = cuda.local.array(ACCN, float32)
        for k in range(ACCN):
            acc[k] = 0.0
        m_run = cuda.local.array(hpb, float32)
        l_run = cuda.local.array(hpb, float32)
        alpha = cuda.local.array(hpb, float32)
        pg = cuda.local.array(HP2, float32)
        sv = cuda.local.array(HP2, float32)
        part = cuda.local.array(NV, float32)
        sc = cuda.local.array(NF, float32)
        for g in range(hpb):
            m_run[g] = NEG
            l_run[g] = 0.0
        ibase = (kl >> (LEVELS - SCAT)) * NF                 # first score index this lane keeps
        sw = warp * KPW * HP2
        cuda.syncthreads()

        if not early:
            for n in range(STAGES - 1):
                issue(ring, kw, vw, tbl_sh, n, n_stages, start, end, b_first, blk_stride,
                      head_off, warp, lane, pol)
        for n in range(n_stages):
            wait_ring()                                      # stage n has landed (own copies)
            syncwarp()                                       # ... all lanes' copies; slot free
            issue(ring, kw, vw, tbl_sh, n + STAGES - 1, n_stages, start, end, b_first,
                  blk_stride, head_off, warp, lane, pol)
            base = ((n % STAGES) * NW + warp) * SLOT
            key0 = start + (n * NW + warp) * KPW
            # ---- scores: partial dots, then reduce-scatter over the TG lanes of a key
            for x in range(NV):
                part[x] = 0.0
            for p in range(P):
                row = base + (p * TK + kslot) * ROW_WORDS
                for v in range(VPL):
                    w = ld4(ring, row + (kl + v * TG) * 4)
                    for x in range(4):
                        for e in range(EPW):
                            kf = word_elem(w[x], e, kind_kv)
                            for g in range(hpb):
                                part[p * HP2 + g] += qr[g * DL + v * DPV + x * EPW + e] * kf
            L0(part, lane, scratch)
            L1(part, lane, scratch)
            L2(part, lane, scratch)
            L3(part, lane, scratch)
            L4(part, lane, scratch)
            off = TG >> (SCAT + 1)
            while off > 0:                                   # fewer values than lanes
                part[0] += shfl_xor(part[0], off, scratch)
                off //= 2
            for r in range(NF):
                idx = ibase + r
                kk = (idx // HP2) * TK + kslot
                s = part[r] if key0 + kk < end and key0 + kk >= lo else NEG
                sc[r] = s
                if idx % HP2 < hpb:
                    s_w[sw + kk * HP2 + idx % HP2] = s
            syncwarp()
            # ---- softmax: the warp's running max per head
            for g in range(hpb):
                pg[g] = m_run[g]
            for kk in range(KPW):
                read_heads(s_w, sw + kk * HP2, sv)
                for g in range(hpb):
                    pg[g] = fmax32(pg[g], sv[g])
            same = True
            for g in range(hpb):
                alpha[g] = exp2(m_run[g] - pg[g])
                same = same and pg[g] == m_run[g]
                m_run[g] = pg[g]
                m_w[warp * HP2 + g] = pg[g]                  # the same value from every lane
            for r in range(NF):
                idx = ibase + r
                g = idx % HP2
                if g < hpb:
                    s = sc[r]
                    p_w[sw + ((idx // HP2) * TK + kslot) * HP2 + g] = \
                        exp2(s - m_w[warp * HP2 + g]) if s > NEG else float32(0.0)
            syncwarp()
            # ---- O = O * alpha + P V (no rescale while no head's max moved: warp-uniform)
            if not same:
                for g in range(hpb):
                    l_run[g] *= alpha[g]
                    for k in range(DL):
                        acc[g * DL + k] *= alpha[g]
            for p in range(P):
                kk = p * TK + kslot
                read_heads(p_w, sw + kk * HP2, pg)
                for g in range(hpb):
                    l_run[g] += pg[g]
                row = base + KPW * ROW_WORDS + kk * ROW_WORDS
                for v in range(VPL):
                    w = ld4(ring, row + (kl + v * TG) * 4)
                    for x in range(4):
                        for e in range(EPW):
                            vf = word_elem(w[x], e, kind_kv)
                            for g in range(hpb):
                                acc[g * DL + v * DPV + x * EPW + e] += pg[g] * vf

        # ---- merge the TK key classes of each warp (same max: plain sums)
        off = TG
        while off < 32:
            for g in range(hpb):
                l_run[g] += shfl_xor(l_run[g], off, scratch)
                for k in range(DL):
                    acc[g * DL + k] += shfl_xor(acc[g * DL + k], off, scratch)
            off *= 2
        # ---- merge the warps in shared memory (the ring is free now)
        wait_all()
        cuda.syncthreads()
        w_acc = ring
        if lane < TG:
            for g in range(hpb):
                if lane == 0:
                    w_ml[warp, g, 0] = m_run[g]
                    w_ml[warp, g, 1] = l_run[g]
                for v in range(VPL):
                    for e in range(DPV):
                        w_acc[(warp * hpb + g) * head_dim + (kl + v * TG) * DPV + e] = \
                            acc[g * DL + v * DPV + e]
        cuda.syncthreads()
        finish(tid, i, hb, split, head0, splits, ring, w_ml, f_ml, flag_sh, out, part_ml,
               part_acc, counters)

    if not tensor_cores:
        return decode

    HW = head_dim // 2                          # words of a query row
    QW = 8 * HW                                 # q_sh: 8 rows (an mma tile's rows g)
    QPT = -(-QW // threads)                     # q_sh words per thread
    MT = head_dim // 16
    ACC2 = 4 * MT                               # accumulators per lane (decode_mma.pv)
    QF = head_dim // 8                          # query fragment words per lane
    load_q, qk, pv = decode_mma.stage_ops(kind_kv, head_dim, tensor_cores == 2)

    @cuda.jit(fastmath=True, **register_cap(max_registers))
    def decode_tc(q, kw, vw, block_tables, context_lens, out, part_ml, part_acc, counters,
                  scale_log2, window, num_kv_heads, splits, chunk):
        """The same blocks, splits, ring and merges; a stage's products on tensor cores
        (``decode_mma``): lane ``4 g + t`` holds the scores and softmax state of head ``g``
        (rows >= hpb unused) for keys ``2 t, 2 t + 1`` of each stage, and the output dims
        ``16 m + g, + 8`` of heads ``2 t, 2 t + 1``."""
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        split = cuda.blockIdx.x
        hb = cuda.blockIdx.y
        i = cuda.blockIdx.z
        kvh = hb // HCHUNKS
        head0 = kvh * group + (hb % HCHUNKS) * hpb

        smem = alloc_smem()
        ring = smem[:RING]
        tbl_sh = cuda.shared.array(TBL, int32)
        q_sh = cuda.shared.array(QW, uint32)
        w_ml = cuda.shared.array((NW, hpb, 2), float32)
        f_ml = cuda.shared.array((hpb, 2), float32)
        scratch = cuda.shared.array(threads, float32)
        flag_sh = cuda.shared.array(1, int32)

        tb = cuda.local.array(TPT, int32)
        first = cuda.local.array(NFIRST, int32)
        n_loaded = load_table(block_tables, i, split, chunk, window, tid, warp, tb, first)
        early = FAST and window <= 0
        length = context_lens[i]
        qv = cuda.local.array(QPT, uint32)                   # query words, stored below
        for u in range(QPT):
            e = tid + u * threads
            g = e // HW
            d = 2 * (e - g * HW)
            word = uint32(0)
            if g < hpb:
                word = pack2(to_f32(q[i, head0 + g, d], kind_q),
                             to_f32(q[i, head0 + g, d + 1], kind_q), kind_kv)
            qv[u] = word
        lo, start, end, n_keys, b_first, blk_stride, head_off, n_stages, pol = open_chunk(
            ring, kw, vw, block_tables, i, length, split, chunk, window, kvh, num_kv_heads, tb,
            n_loaded, first, early, tbl_sh, tid, warp, lane)
        for u in range(QPT):
            e = tid + u * threads
            if e < QW:
                q_sh[e] = qv[u]
        g = lane // 4
        t = lane % 4
        acc = cuda.local.array(ACC2, float32)
        for k in range(ACC2):
            acc[k] = 0.0
        qf = cuda.local.array(QF, uint32)
        s = cuda.local.array(2, float32)
        m_run = NEG
        l_run = float32(0.0)
        cuda.syncthreads()
        load_q(qf, q_sh, lane)

        if not early:
            for n in range(STAGES - 1):
                issue(ring, kw, vw, tbl_sh, n, n_stages, start, end, b_first, blk_stride,
                      head_off, warp, lane, pol)
        for n in range(n_stages):
            wait_ring()
            syncwarp()
            issue(ring, kw, vw, tbl_sh, n + STAGES - 1, n_stages, start, end, b_first,
                  blk_stride, head_off, warp, lane, pol)
            base = ((n % STAGES) * NW + warp) * SLOT
            key0 = start + (n * NW + warp) * KPW + 2 * t
            qk(s, qf, q_sh, ring, base, lane, scratch)
            s0 = s[0] * scale_log2 if key0 < end and key0 >= lo else NEG
            s1 = s[1] * scale_log2 if key0 + 1 < end and key0 + 1 >= lo else NEG
            m_new = fmax32(m_run, fmax32(s0, s1))
            m_new = fmax32(m_new, shfl_xor(m_new, 1, scratch))
            m_new = fmax32(m_new, shfl_xor(m_new, 2, scratch))
            p0 = exp2(s0 - m_new) if s0 > NEG else float32(0.0)
            p1 = exp2(s1 - m_new) if s1 > NEG else float32(0.0)
            alpha = exp2(m_run - m_new)
            a0 = shfl_idx(alpha, 8 * t, scratch)             # heads 2t, 2t + 1 (output layout)
            a1 = shfl_idx(alpha, 8 * t + 4, scratch)
            if decode_mma.warp_any(m_new != m_run, scratch):   # rare once the max settles
                l_run *= alpha
                for k in range(ACC2 // 2):
                    acc[2 * k] *= a0
                    acc[2 * k + 1] *= a1
            m_run = m_new
            l_run += p0 + p1
            pv(acc, p0, p1, ring, base + KPW * ROW_WORDS, lane, scratch)

        # ---- the 4 lanes of a head hold disjoint keys' sums (same max)
        l_run += shfl_xor(l_run, 1, scratch)
        l_run += shfl_xor(l_run, 2, scratch)
        wait_all()
        cuda.syncthreads()
        if g < hpb and t == 0:
            w_ml[warp, g, 0] = m_run
            w_ml[warp, g, 1] = l_run
        for e in range(2):
            if 2 * t + e < hpb:
                for m in range(MT):
                    for h in range(2):
                        ring[(warp * hpb + 2 * t + e) * head_dim + 16 * m + 8 * h + g] = \
                            acc[4 * m + 2 * h + e]
        cuda.syncthreads()
        finish(tid, i, hb, split, head0, splits, ring, w_ml, f_ml, flag_sh, out, part_ml,
               part_acc, counters)

    return decode_tc
