"""CUDA prefill kernel: tiles of (query tokens x group heads) against tiles of keys.

Grid ``tiles_bound * head_blocks`` (``head_blocks = num_kv_heads *
head_chunks``); block ``threads`` threads. Query tiles are numbered sequence
by sequence (``BQ`` tokens each, the last one of a chunk possibly shorter);
thread 0 finds its block's sequence by scanning ``query_start_loc``, so mixed
batches need no host-side table. Blocks are handed out last tile first, the
head blocks of a tile together: the causal tiles that see the most keys
start first and the short ones fill the tail. Indices past the last tile
exit. A decode in a mixed batch is a one-token tile.

A tile has ``R = BQ * HPB`` query rows (row ``r`` = token ``r // HPB``, head
``r % HPB``), kept in shared memory as float32 rows pre-scaled by
``scale * log2(e)``. The block walks the keys that some row of the tile can
see -- ``[first_pos - window + 1, last_pos]`` -- so key tiles that are fully
masked (in the causal future, or before the sliding window) are never
loaded. Per key tile of ``BK`` keys:

1. ``S = Q K^T``: thread ``(rg, kg)`` owns rows ``rg + RG*m`` x keys
   ``kg + KG*n`` (a ``TM x TN`` register tile); both operands are read as
   16-byte vectors of 4 dims from rows padded by 4 floats (no bank conflicts);
2. causal / window mask, online softmax per row: the ``KG`` threads of a row
   share its max through shuffles; each keeps its own partial row sum;
   ``P`` goes to shared memory transposed (``p_sh[key, row]``), the rescale
   factor of each row too;
3. ``O = O * alpha + P V``: thread ``(rg2, dg)`` owns ``RB`` blocks of 4 rows x
   ``TD4`` vectors of 4 dims (16-64 accumulators), reading one 16-byte vector
   of P per ``16 * TD4`` multiply-adds and one of V per ``16 * RB``.

K and V tiles are fetched into registers one phase ahead (V during step 1,
the next K during step 3) and converted to float32 when stored to shared
memory, which holds one K or V tile at a time.

Tile shape (``R``, ``BK``, ``KG``) and block size are parameters. The default
shape keeps Q, K/V and P under Numba's 48 KB of static shared memory; larger
tiles (the backend's choice on a GPU: 64 rows x 64 keys, 16 threads per row
of scores, a 4 x 4 score tile per thread) live in dynamic shared memory, sized
at launch (``cuda_launch``). Each 16-byte shared load of step 1 then feeds 8
multiply-adds instead of 5.

All arithmetic is float32 on CUDA cores (Numba has no tensor-core API).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from .cuda_primitives import (F32, SIMULATED, exp2, from_f32, group_max, group_sum, ld4,
                              register_cap, to_f32, vmax, vmin, word_elem)
from .cuda_shared import dynamic_shared_vectors, lds4f, shared_vectors, sts4f

NEG = np.float32(-1e30)
STATIC_SHARED_LIMIT = 44 * 1024       # larger Q/K/V/P buffers go to dynamic shared memory


def tile_shape(head_dim, hpb, rows=None, keys=None):
    """(rows R, keys BK) per tile. Default: Q, one K/V tile and P fit in ~40 KB of shared
    memory; a requested ``rows`` is rounded down to whole blocks of 4 rows and whole tokens."""
    unit = hpb * 4 // math.gcd(hpb, 4)              # rows come in blocks of 4 and whole tokens
    if rows is None:
        rows = min(64, 4096 // head_dim)
    if keys is None:
        keys = 32 if head_dim <= 128 else 16
    return max(unit, rows // unit * unit), keys


def shared_bytes(head_dim, rows, keys):
    """Bytes of the Q, K/V and P buffers (float32 rows padded by 4)."""
    return 4 * (rows * (head_dim + 4) + keys * (head_dim + 4) + keys * (rows + 4))


@functools.lru_cache(maxsize=None)
def build_prefill_kernel(threads, group, hpb, head_dim, kind_q, kind_kv, kind_o,
                         max_registers=None, rows=None, keys=None, key_threads=8):
    """Compile-time specialization of the prefill kernel (all arguments are constants).

    Returns ``(kernel, tokens per query tile, dynamic shared bytes)``: buffers over
    ``STATIC_SHARED_LIMIT`` bytes are dynamic shared memory, to be given at launch."""
    R, BK = tile_shape(head_dim, hpb, rows, keys)
    BQ = R // hpb
    D = head_dim
    DP = D + 4                                   # padded row of q_sh / kv_sh
    PST = R + 4                                  # padded row of p_sh
    EPW = 1 if kind_kv == F32 else 2
    DPV = 4 * EPW
    ROW_VECS = D // DPV
    HCHUNKS = group // hpb
    # step 1: S tile
    KG = min(key_threads, BK)
    TN = BK // KG
    RG = threads // KG
    TM = -(-R // RG)
    # step 3: O tile
    C4 = D // 4
    DG = min(C4, 16)
    if C4 % DG or D % 4:
        raise NotImplementedError(f"cuda backend: prefill takes head_dim up to 64 (a multiple of 4) or a "
                                  f"multiple of 64, e.g. 64, 128, 256; got {head_dim}")
    TD4 = C4 // DG
    RG2 = threads // DG
    RB = -(-(R // 4) // RG2)
    TD = 4 * TD4
    ACCN = RB * 4 * TD
    SCN = TM * TN
    VPT = -(-BK * ROW_VECS // threads)           # 16-byte vectors per thread per K/V tile
    STN = VPT * 4
    QSN = R * DP
    KVN = BK * DP
    PSN = BK * PST
    dyn_bytes = 0
    if not SIMULATED and shared_bytes(D, R, BK) > STATIC_SHARED_LIMIT:
        dyn_bytes = shared_bytes(D, R, BK)
        alloc_smem = dynamic_shared_vectors()
    else:
        alloc_smem = shared_vectors(QSN + KVN + PSN)
    QVN = TM * 4
    KVV = TN * 4
    PVN = RB * 4

    @cuda.jit(device=True, inline="always")
    def fetch(words, stage, block_tables, i, kt0, nk, kvh, num_kv_heads, block_size, tid):
        """This thread's 16-byte vectors of a K or V tile, into registers."""
        page_words = block_size * ROW_VECS * 4
        for u in range(VPT):
            vi = tid + threads * u
            key = vi // ROW_VECS
            if vi < BK * ROW_VECS and key < nk:
                j = kt0 + key
                jb = j // block_size
                base = (block_tables[i, jb] * num_kv_heads + kvh) * page_words \
                    + (j - jb * block_size) * (ROW_VECS * 4) + (vi - key * ROW_VECS) * 4
                w = ld4(words, base)
                for x in range(4):
                    stage[u * 4 + x] = w[x]
            else:
                for x in range(4):
                    stage[u * 4 + x] = 0                 # zero rows past the tile's end

    @cuda.jit(device=True, inline="always")
    def store(stage, kv_sh, tid):
        """The fetched vectors as float32 rows of kv_sh."""
        for u in range(VPT):
            vi = tid + threads * u
            if vi < BK * ROW_VECS:
                key = vi // ROW_VECS
                dst = key * DP + (vi - key * ROW_VECS) * DPV
                if EPW == 2:                              # 8 halves: two float4 stores
                    for h in range(2):
                        w0 = stage[u * 4 + 2 * h]
                        w1 = stage[u * 4 + 2 * h + 1]
                        sts4f(kv_sh, dst + 4 * h, word_elem(w0, 0, kind_kv),
                              word_elem(w0, 1, kind_kv), word_elem(w1, 0, kind_kv),
                              word_elem(w1, 1, kind_kv))
                else:
                    sts4f(kv_sh, dst, word_elem(stage[u * 4], 0, kind_kv),
                          word_elem(stage[u * 4 + 1], 0, kind_kv),
                          word_elem(stage[u * 4 + 2], 0, kind_kv),
                          word_elem(stage[u * 4 + 3], 0, kind_kv))

    @cuda.jit(fastmath=True, **register_cap(max_registers))
    def prefill(q, kw, vw, block_tables, query_start_loc, context_lens, out,
                scale_log2, window, num_kv_heads, block_size, head_blocks, tiles_bound):
        tid = cuda.threadIdx.x
        hb = cuda.blockIdx.x % head_blocks
        kvh = hb // HCHUNKS
        head0 = kvh * group + (hb % HCHUNKS) * hpb

        smem = alloc_smem()
        q_sh = smem[:QSN]
        kv_sh = smem[QSN:QSN + KVN]
        p_sh = smem[QSN + KVN:]
        a_sh = cuda.shared.array(R, float32)             # per row: rescale, then final sum
        info_sh = cuda.shared.array(2, int32)
        scratch = cuda.shared.array(threads, float32)

        # ---- which sequence / query tile is this block?
        if tid == 0:
            k = tiles_bound - 1 - cuda.blockIdx.x // head_blocks   # long-running tiles first
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
        lo = 0
        if window > 0:
            lo = vmax(0, first_pos - window + 1)
        hi = first_pos + n_tok                              # keys [lo, hi) can be visible

        stage = cuda.local.array(STN, uint32)
        fetch(kw, stage, block_tables, i, lo, vmin(BK, hi - lo), kvh, num_kv_heads, block_size,
              tid)
        for idx in range(tid, R * D, threads):
            r = idx // D
            d = idx - r * D
            val = float32(0.0)
            if r // hpb < n_tok:
                val = to_f32(q[row0 + r // hpb, head0 + r % hpb, d], kind_q) * scale_log2
            q_sh[r * DP + d] = val
        store(stage, kv_sh, tid)

        rg = tid // KG
        kg = tid % KG
        rg2 = tid // DG
        dg = tid % DG
        m_run = cuda.local.array(TM, float32)
        l_run = cuda.local.array(TM, float32)
        for m in range(TM):
            m_run[m] = NEG
            l_run[m] = 0.0
        acc = cuda.local.array(ACCN, float32)
        for k in range(ACCN):
            acc[k] = 0.0
        sc = cuda.local.array(SCN, float32)
        qv = cuda.local.array(QVN, float32)
        kv = cuda.local.array(KVV, float32)
        pv = cuda.local.array(PVN, float32)
        vv = cuda.local.array(TD, float32)
        cuda.syncthreads()

        for kt0 in range(lo, hi, BK):
            nk = vmin(BK, hi - kt0)
            fetch(vw, stage, block_tables, i, kt0, nk, kvh, num_kv_heads, block_size, tid)
            # ---- 1. S = Q K^T
            for k in range(SCN):
                sc[k] = 0.0
            for c2 in range(0, C4, 2):                   # two 4-dim steps per iteration
                for c in range(c2, c2 + 2):
                    for m in range(TM):
                        t = lds4f(q_sh, vmin(rg + RG * m, R - 1) * DP + 4 * c)
                        for x in range(4):
                            qv[m * 4 + x] = t[x]
                    for nn in range(TN):
                        t = lds4f(kv_sh, (kg + KG * nn) * DP + 4 * c)
                        for x in range(4):
                            kv[nn * 4 + x] = t[x]
                    for m in range(TM):
                        for nn in range(TN):
                            for x in range(4):
                                sc[m * TN + nn] += qv[m * 4 + x] * kv[nn * 4 + x]
            # ---- 2. mask, online softmax, P -> p_sh (transposed)
            for m in range(TM):
                r = rg + RG * m
                pos = first_pos + r // hpb
                mx = NEG
                for nn in range(TN):
                    j = kt0 + kg + KG * nn
                    ok = kg + KG * nn < nk and j <= pos and r < R and r // hpb < n_tok
                    if window > 0 and j <= pos - window:
                        ok = False
                    s = sc[m * TN + nn] if ok else NEG
                    sc[m * TN + nn] = s
                    mx = vmax(mx, s)
                mx = group_max(mx, KG, scratch)
                m_new = vmax(m_run[m], mx)
                alpha = exp2(m_run[m] - m_new)
                m_run[m] = m_new
                total = float32(0.0)
                for nn in range(TN):
                    s = sc[m * TN + nn]
                    p = exp2(s - m_new) if s > NEG else float32(0.0)
                    total += p
                    if r < R:
                        p_sh[(kg + KG * nn) * PST + r] = p
                l_run[m] = l_run[m] * alpha + total
                if kg == 0 and r < R:
                    a_sh[r] = alpha
            cuda.syncthreads()
            store(stage, kv_sh, tid)                     # V replaces K
            if kt0 + BK < hi:
                fetch(kw, stage, block_tables, i, kt0 + BK, vmin(BK, hi - kt0 - BK), kvh,
                      num_kv_heads, block_size, tid)
            cuda.syncthreads()
            # ---- 3. O = O * alpha + P V
            for b in range(RB):
                for y in range(4):
                    alpha = a_sh[vmin(4 * (rg2 + RG2 * b) + y, R - 1)]
                    for c in range(TD):
                        acc[(b * 4 + y) * TD + c] *= alpha
            for key2 in range(0, BK, 2):                 # two keys per iteration
                for key in range(key2, key2 + 2):
                    for b in range(RB):
                        t = lds4f(p_sh, key * PST + vmin(4 * (rg2 + RG2 * b), R - 4))
                        for y in range(4):
                            pv[b * 4 + y] = t[y]
                    for c in range(TD4):
                        t = lds4f(kv_sh, key * DP + 4 * (dg + DG * c))
                        for x in range(4):
                            vv[c * 4 + x] = t[x]
                    for b in range(RB):
                        for y in range(4):
                            for c in range(TD):
                                acc[(b * 4 + y) * TD + c] += pv[b * 4 + y] * vv[c]
            cuda.syncthreads()
            if kt0 + BK < hi:
                store(stage, kv_sh, tid)                 # the next K tile
                cuda.syncthreads()

        # ---- row sums: the KG threads of a row each hold part of it
        for m in range(TM):
            r = rg + RG * m
            total = group_sum(l_run[m], KG, scratch)
            if kg == 0 and r < R:
                a_sh[r] = total
        cuda.syncthreads()
        for b in range(RB):
            for y in range(4):
                r = 4 * (rg2 + RG2 * b) + y
                if r < R and r // hpb < n_tok:
                    l_sum = a_sh[r]
                    inv = float32(1.0) / l_sum if l_sum > 0 else float32(0.0)
                    for c in range(TD4):
                        for x in range(4):
                            out[row0 + r // hpb, head0 + r % hpb, 4 * (dg + DG * c) + x] = \
                                from_f32(acc[(b * 4 + y) * TD + c * 4 + x] * inv, kind_o)

    return prefill, BQ, dyn_bytes
