"""CUDA prefill kernel: tiles of (query tokens x group heads) against tiles of keys.

Grid ``tiles_bound * head_blocks`` (``head_blocks = num_kv_heads *
head_chunks``); block ``threads`` threads. Query tiles are numbered sequence
by sequence (``BQ`` tokens each, the last one of a chunk possibly shorter);
thread 0 finds its block's sequence by scanning ``query_start_loc``, so mixed
batches need no host-side table. Blocks are handed out last tile first, the
head blocks of a tile together: the causal tiles that see the most keys
start first and the short ones fill the tail. Indices past the last tile
exit. A decode in a mixed batch is a one-token tile.

A tile has ``R`` query rows (row ``r`` = token ``r // HPB``, head ``r % HPB``;
rows past ``BQ * HPB`` are padding). The block walks the keys that some row
of the tile can see -- ``[first_pos - window + 1, last_pos]`` -- so key tiles
that are fully masked (in the causal future, or before the sliding window)
are never loaded. Both matmuls are outer products out of shared memory, as
in a CUDA-core SGEMM: per step a thread reads one 16-byte vector of each
operand for every 4 of its rows or columns, and a warp's vectors are few and
contiguous (one or two shared-memory wavefronts each). Per key tile of ``BK``
keys (the keys past the visible ones of a partial tile are zeros):

1. ``S = Q K^T`` over the head dims ``d``: thread ``(rg, kg)`` owns rows
   ``4 rg .. 4 rg + 3`` x keys ``4 kg + 4 KG n .. + 3`` (``n < NK4``): a
   ``4 x 4 NK4`` register tile. Q is kept transposed (``q_sh[d, row]``, float32,
   pre-scaled by ``scale * log2(e)``), K transposed (``kv_sh[d, key]``);
2. causal / window mask (skipped in a tile that every row sees whole), online
   softmax per row: the ``KG`` threads of a row
   share its max through shuffles; each keeps its own partial row sum. ``P``
   goes to shared memory transposed (``p_sh[key, row]``), each row's rescale
   factor to ``a_sh``;
3. ``O = O * alpha + P V`` over the keys: thread ``(rg2, dg)`` owns ``OR4`` groups
   of 4 rows x ``OD4`` vectors of 4 dims; V is kept as it comes
   (``kv_sh[key, d]``); keys past the tile's visible ones are skipped.

K and V tiles travel from the paged cache into a staging buffer by
``cp.async`` (no registers held), one phase ahead: V while ``S`` and ``P`` are
computed, the next K during ``P V``. All threads then convert the staged
tile to float32 in its layout (K transposed, a warp storing one 16-byte
vector of 32 keys: 32 banks). In the staging buffer each key's 16-byte
vectors are XOR-swizzled so that this transposing read touches every bank;
``q_sh`` and ``p_sh`` rows are padded by 4 floats so that their stores do.
The matmul loops read at fixed offsets; their bodies are unrolled by hand
(8 dims, 4 keys per iteration: ``qk_dim`` / ``pv_key`` called in a row),
which leaves ~88% of their instructions FFMA.

Tile shape (threads, ``R``, ``BK``) is a parameter, per head_dim on a GPU
(``cuda.PREFILL_TILES``); all buffers are one block of dynamic shared memory
sized at launch (``launch``). The block size of the cache is a
compile-time constant. All arithmetic is float32 on CUDA cores (Numba has no
tensor-core API).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint32

from .primitives import (F32, SIMULATED, exp2, fmax32, from_f32, group_max, group_sum, ld4,
                              register_cap, to_f32, vmax, vmin, word_elem)
from .shared_memory import (cp_async16, cp_async_commit, cp_async_wait, dynamic_shared_vectors,
                          lds4f, shared_vectors, sts4f)

NEG = np.float32(-1e30)


def _pow2(n):
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True)
class PrefillTile:
    """One tile shape and the thread layouts derived from it (see the module docstring)."""
    threads: int
    rows: int          # R: query rows (tokens x heads) per tile
    keys: int          # BK: keys per key tile
    head_dim: int

    @property
    def key_threads(self):      # KG: threads sharing one row of scores
        return self.threads // (self.rows // 4)

    @property
    def out_dim_threads(self):  # DG: threads across the head dims in P V
        return min(self.head_dim // 4, 16)

    @property
    def out_row_groups(self):   # RG2: groups of 4 rows in P V
        return min(self.threads // self.out_dim_threads, self.rows // 4)

    def check(self):
        """Raise NotImplementedError naming what this shape cannot do."""
        T, R, BK, D = self.threads, self.rows, self.keys, self.head_dim
        if D % 4 or (D // 4) % self.out_dim_threads:
            raise NotImplementedError(f"cuda backend: prefill takes head_dim up to 64 (a multiple "
                                      f"of 4) or a multiple of 64, e.g. 64, 128, 256; got {D}")
        if not (_pow2(R) and R >= 4 and T % (R // 4) == 0 and _pow2(self.key_threads)
                and self.key_threads <= 32):
            raise NotImplementedError(f"cuda prefill tile: rows must be a power of two >= 4 whose "
                                      f"quarter divides threads into <= 32 per row; got rows={R}, "
                                      f"threads={T}")
        if not (_pow2(BK) and BK >= 8 and BK % (4 * self.key_threads) == 0):
            raise NotImplementedError(f"cuda prefill tile: keys must be a power of two >= 8 and a "
                                      f"multiple of 4 x {self.key_threads} threads per row; got "
                                      f"{BK}")
        if (R // 4) % self.out_row_groups:
            raise NotImplementedError(f"cuda prefill tile: {R} rows do not split over "
                                      f"{self.out_row_groups} row groups")


def default_tile(head_dim):
    """The tile for head dims ``cuda.PREFILL_TILES`` does not name (the simulator's: small)."""
    if SIMULATED:                   # few threads: the simulator's barriers cost per thread
        return PrefillTile(16, 32, 16, head_dim)
    return PrefillTile(128, 64, 64, head_dim)


@cuda.jit(device=True)
def locate_query_tile(info, k, query_start_loc, num_seqs, tile_tokens):
    """Query tile ``k`` of the batch, counting each sequence's chunk in tiles of
    ``tile_tokens`` tokens: ``info[0]`` = its sequence (-1 past the last tile), ``info[1]`` =
    its index within that chunk. Blocks take tiles from the last one down, so the
    long-running tiles (late in long chunks) start first."""
    seen = 0
    info[0] = -1
    for s in range(num_seqs):
        tiles = (query_start_loc[s + 1] - query_start_loc[s] + tile_tokens - 1) // tile_tokens
        if k < seen + tiles:
            info[0] = s
            info[1] = k - seen
            return
        seen += tiles


@functools.lru_cache(maxsize=None)
def build_prefill_kernel(tile, group, hpb, kind_q, kind_kv, kind_o, block_size, q_words,
                         max_registers=None):
    """Compile-time specialization of the prefill kernel (all arguments are constants).

    ``q_words``: the query is C-contiguous and the kernel gets it also as 32-bit words, to
    load in 16-byte vectors (else element by element).
    Returns ``(kernel, tokens per query tile, dynamic shared bytes)``; the shared bytes
    must be given at launch (0 in the simulator, whose buffers are static)."""
    tile.check()
    threads, R, BK, D = tile.threads, tile.rows, tile.keys, tile.head_dim
    if R < hpb:
        raise NotImplementedError(f"cuda prefill tile: {R} rows hold no token of {hpb} heads")
    BQ = R // hpb
    RV = BQ * hpb                                # rows holding a query; the rest is padding
    HCHUNKS = group // hpb
    EPW = 1 if kind_kv == F32 else 2             # elements per 32-bit word
    DPV = 4 * EPW                                # elements per 16-byte vector
    ROW_VECS = D // DPV
    ROW_WORDS = 4 * ROW_VECS
    BS = block_size
    PAGE_WORDS = BS * ROW_WORDS
    VPT = -(-BK * ROW_VECS // threads)           # staged vectors per thread and tile
    # staged tile: a key's 16-byte vectors XOR-swizzled, so that 8 consecutive keys spread
    # over all banks
    SWZ = 7 if ROW_VECS % 8 == 0 else 3 if ROW_VECS % 4 == 0 else 1 if ROW_VECS % 2 == 0 else 0
    RP = R + 4                                   # padded rows of q_sh / p_sh
    DL = 8 if D % 8 == 0 else 4                  # Q load: a warp covers 4 rows x DL dims
    DSTEP = DL                                   # step 1: dims per loop iteration
    QEPW = 1 if kind_q == F32 else 2
    QDPV = 4 * QEPW                              # query elements per 16-byte vector
    QVEC = q_words and D % QDPV == 0
    Q_ROW_VECS = D // QDPV
    QVPT = -(-R * Q_ROW_VECS // threads)         # query vectors per thread
    QSTN = 4 * QVPT
    # step 1: S tile
    KG = tile.key_threads
    NK4 = BK // (4 * KG)
    TN = 4 * NK4
    # step 3: O tile
    DG = tile.out_dim_threads
    OD4 = D // 4 // DG
    RG2 = tile.out_row_groups
    OR4 = R // 4 // RG2
    ACTIVE3 = RG2 * DG
    TD = 4 * OD4
    ACCN, SCN, PVN = OR4 * 4 * TD, 4 * TN, OR4 * 4
    QSN, KVN, PSN = D * RP, BK * D, BK * RP
    RAWN = BK * ROW_WORDS
    if SIMULATED:
        dyn_bytes = 0
        alloc_smem = shared_vectors(QSN + KVN + PSN + RAWN)
    else:
        dyn_bytes = 4 * (QSN + KVN + PSN + RAWN)
        alloc_smem = dynamic_shared_vectors()
    wait_all = cp_async_wait[0]

    @cuda.jit(device=True, inline="always")
    def fetch(words, raw, block_tables, i, kt0, nk, kvh, num_kv_heads, tid):
        """Start copying a K or V tile (keys kt0 .. kt0 + nk - 1; zeros past them) to raw."""
        for u in range(VPT):
            vi = tid + threads * u
            if vi < BK * ROW_VECS:
                key = vi // ROW_VECS
                w = vi - key * ROW_VECS
                dst = (key * ROW_VECS + (w ^ (key & SWZ))) * 4
                if key < nk:
                    j = kt0 + key
                    jb = j // BS
                    src = (block_tables[i, jb] * num_kv_heads + kvh) * PAGE_WORDS \
                        + (j - jb * BS) * ROW_WORDS + w * 4
                    cp_async16(raw, dst, words, src, 16)
                else:
                    cp_async16(raw, dst, words, 0, 0)
        cp_async_commit()

    @cuda.jit(device=True, inline="always")
    def convert_k(raw, kv_sh, tid):
        """Staged K tile -> kv_sh[d, key] as float32 (a warp: one vector of 32 keys)."""
        for u in range(VPT):
            vi = tid + threads * u
            if vi < BK * ROW_VECS:
                w = vi // BK
                key = vi - w * BK
                v = ld4(raw, (key * ROW_VECS + (w ^ (key & SWZ))) * 4)
                for e in range(DPV):
                    kv_sh[(w * DPV + e) * BK + key] = word_elem(v[e // EPW], e % EPW, kind_kv)

    @cuda.jit(device=True, inline="always")
    def convert_v(raw, kv_sh, tid):
        """Staged V tile -> kv_sh[key, d] as float32."""
        for u in range(VPT):
            vi = tid + threads * u
            if vi < BK * ROW_VECS:
                key = vi // ROW_VECS
                w = vi - key * ROW_VECS
                v = ld4(raw, (key * ROW_VECS + (w ^ (key & SWZ))) * 4)
                dst = key * D + w * DPV
                if EPW == 2:                              # 8 halves: two float4 stores
                    for h in range(2):
                        sts4f(kv_sh, dst + 4 * h, word_elem(v[2 * h], 0, kind_kv),
                              word_elem(v[2 * h], 1, kind_kv), word_elem(v[2 * h + 1], 0, kind_kv),
                              word_elem(v[2 * h + 1], 1, kind_kv))
                else:
                    sts4f(kv_sh, dst, word_elem(v[0], 0, kind_kv), word_elem(v[1], 0, kind_kv),
                          word_elem(v[2], 0, kind_kv), word_elem(v[3], 0, kind_kv))

    @cuda.jit(device=True, inline="always")
    def qk_dim(q_sh, kv_sh, sc, qv, kv, d, rg, kg):
        """Step 1 for one head dim: sc += this thread's Q rows x K keys at dim d."""
        t = lds4f(q_sh, d * RP + 4 * rg)
        for x in range(4):
            qv[x] = t[x]
        for nn in range(NK4):
            t = lds4f(kv_sh, d * BK + 4 * kg + 4 * KG * nn)
            for x in range(4):
                kv[nn * 4 + x] = t[x]
        for m in range(4):
            for c in range(TN):
                sc[m * TN + c] += qv[m] * kv[c]

    @cuda.jit(device=True, inline="always")
    def pv_key(p_sh, kv_sh, acc, pv, vv, key, rg2, dg):
        """Step 3 for one key: acc += this thread's P rows x V dims of that key."""
        for b in range(OR4):
            t = lds4f(p_sh, key * RP + 4 * (rg2 + RG2 * b))
            for y in range(4):
                pv[b * 4 + y] = t[y]
        for c in range(OD4):
            t = lds4f(kv_sh, key * D + 4 * (dg + DG * c))
            for x in range(4):
                vv[c * 4 + x] = t[x]
        for b in range(OR4 * 4):
            for c in range(TD):
                acc[b * TD + c] += pv[b] * vv[c]

    @cuda.jit(fastmath=True, **register_cap(max_registers))
    def prefill(q, qw, kw, vw, block_tables, query_start_loc, context_lens, out, ow,
                scale_log2, window, num_kv_heads, head_blocks, tiles_bound):
        # ow: the output as words, for the tensor-core kernel's signature (unused here)
        tid = cuda.threadIdx.x
        hb = cuda.blockIdx.x % head_blocks
        kvh = hb // HCHUNKS
        head0 = kvh * group + (hb % HCHUNKS) * hpb

        smem = alloc_smem()
        q_sh = smem[:QSN]
        kv_sh = smem[QSN:QSN + KVN]
        p_sh = smem[QSN + KVN:QSN + KVN + PSN]
        raw = smem[QSN + KVN + PSN:]
        a_sh = cuda.shared.array(R, float32)             # per row: rescale, then final sum
        info_sh = cuda.shared.array(2, int32)
        scratch = cuda.shared.array(threads, float32)

        # ---- which sequence / query tile is this block?
        if tid == 0:
            locate_query_tile(info_sh, tiles_bound - 1 - cuda.blockIdx.x // head_blocks,
                              query_start_loc, context_lens.shape[0], BQ)
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

        fetch(kw, raw, block_tables, i, lo, vmin(BK, hi - lo), kvh, num_kv_heads, tid)
        if QVEC:                                            # all loads in flight at once
            qstage = cuda.local.array(QSTN, uint32)
            for u in range(QVPT):
                vi = tid + threads * u
                r = vi % R                                  # a warp: one vector of 32 rows
                if vi < R * Q_ROW_VECS and r < RV and r // hpb < n_tok:
                    v = ld4(qw, ((row0 + r // hpb) * q.shape[1] + head0 + r % hpb)
                            * (4 * Q_ROW_VECS) + (vi // R) * 4)
                    for x in range(4):
                        qstage[u * 4 + x] = v[x]
                else:
                    for x in range(4):
                        qstage[u * 4 + x] = 0
            for u in range(QVPT):
                vi = tid + threads * u
                if vi < R * Q_ROW_VECS:
                    r = vi % R
                    d = (vi // R) * QDPV
                    for e in range(QDPV):
                        q_sh[(d + e) * RP + r] = word_elem(qstage[u * 4 + e // QEPW], e % QEPW,
                                                           kind_q) * scale_log2
        else:
            for idx in range(tid, R * D, threads):          # a warp: 4 rows x DL dims
                d = idx % DL
                rest = idx // DL
                r = rest % 4
                rest = rest // 4
                r += 4 * (rest % (R // 4))
                d += DL * (rest // (R // 4))
                val = float32(0.0)
                if r < RV and r // hpb < n_tok:
                    val = to_f32(q[row0 + r // hpb, head0 + r % hpb, d], kind_q) * scale_log2
                q_sh[d * RP + r] = val
        wait_all()
        cuda.syncthreads()
        convert_k(raw, kv_sh, tid)
        cuda.syncthreads()
        fetch(vw, raw, block_tables, i, lo, vmin(BK, hi - lo), kvh, num_kv_heads, tid)

        rg = tid // KG
        kg = tid % KG
        rg2 = tid // DG
        dg = tid % DG
        m_run = cuda.local.array(4, float32)
        l_run = cuda.local.array(4, float32)
        for m in range(4):
            m_run[m] = NEG
            l_run[m] = 0.0
        acc = cuda.local.array(ACCN, float32)
        for k in range(ACCN):
            acc[k] = 0.0
        sc = cuda.local.array(SCN, float32)
        qv = cuda.local.array(4, float32)
        kv = cuda.local.array(TN, float32)
        pv = cuda.local.array(PVN, float32)
        vv = cuda.local.array(TD, float32)

        for kt0 in range(lo, hi, BK):
            nk = vmin(BK, hi - kt0)
            # ---- 1. S = Q K^T
            for k in range(SCN):
                sc[k] = 0.0
            for d0 in range(0, D, DSTEP):                # DSTEP dims per iteration, unrolled
                qk_dim(q_sh, kv_sh, sc, qv, kv, d0, rg, kg)
                qk_dim(q_sh, kv_sh, sc, qv, kv, d0 + 1, rg, kg)
                qk_dim(q_sh, kv_sh, sc, qv, kv, d0 + 2, rg, kg)
                qk_dim(q_sh, kv_sh, sc, qv, kv, d0 + 3, rg, kg)
                if DSTEP == 8:
                    qk_dim(q_sh, kv_sh, sc, qv, kv, d0 + 4, rg, kg)
                    qk_dim(q_sh, kv_sh, sc, qv, kv, d0 + 5, rg, kg)
                    qk_dim(q_sh, kv_sh, sc, qv, kv, d0 + 6, rg, kg)
                    qk_dim(q_sh, kv_sh, sc, qv, kv, d0 + 7, rg, kg)
            # ---- 2. mask, online softmax, P -> p_sh (transposed)
            # a tile every row sees whole (before the diagonal, inside the window) needs no
            # mask; padding rows then get scores of a zero query, harmless and never written
            interior = kt0 + BK <= first_pos + 1 and (window <= 0 or kt0 > hi - 1 - window)
            for m in range(4):
                r = 4 * rg + m
                mx = NEG
                if interior:
                    for c in range(TN):
                        mx = fmax32(mx, sc[m * TN + c])
                else:
                    pos = first_pos + r // hpb
                    row_ok = r < RV and r // hpb < n_tok
                    for c in range(TN):
                        key = 4 * kg + 4 * KG * (c // 4) + c % 4
                        j = kt0 + key
                        ok = row_ok and key < nk and j <= pos
                        if window > 0 and j <= pos - window:
                            ok = False
                        s = sc[m * TN + c] if ok else NEG
                        sc[m * TN + c] = s
                        mx = fmax32(mx, s)
                mx = group_max(mx, KG, scratch)
                m_new = fmax32(m_run[m], mx)
                alpha = exp2(m_run[m] - m_new)
                m_run[m] = m_new
                total = float32(0.0)
                for c in range(TN):
                    s = sc[m * TN + c]
                    p = exp2(s - m_new) if s > NEG else float32(0.0)
                    total += p
                    sc[m * TN + c] = p
                l_run[m] = l_run[m] * alpha + total
                if kg == 0:
                    a_sh[r] = alpha
            for c in range(TN):
                key = 4 * kg + 4 * KG * (c // 4) + c % 4
                sts4f(p_sh, key * RP + 4 * rg,
                      sc[c], sc[TN + c], sc[2 * TN + c], sc[3 * TN + c])
            wait_all()
            cuda.syncthreads()
            convert_v(raw, kv_sh, tid)                   # V replaces K
            cuda.syncthreads()
            if kt0 + BK < hi:
                fetch(kw, raw, block_tables, i, kt0 + BK, vmin(BK, hi - kt0 - BK), kvh,
                      num_kv_heads, tid)
            # ---- 3. O = O * alpha + P V
            if tid < ACTIVE3:
                for b in range(OR4):
                    for y in range(4):
                        alpha = a_sh[4 * (rg2 + RG2 * b) + y]
                        for c in range(TD):
                            acc[(b * 4 + y) * TD + c] *= alpha
                for key0 in range(0, nk, 4):             # 4 keys per iteration, unrolled
                    pv_key(p_sh, kv_sh, acc, pv, vv, key0, rg2, dg)
                    pv_key(p_sh, kv_sh, acc, pv, vv, key0 + 1, rg2, dg)
                    pv_key(p_sh, kv_sh, acc, pv, vv, key0 + 2, rg2, dg)
                    pv_key(p_sh, kv_sh, acc, pv, vv, key0 + 3, rg2, dg)
            if kt0 + BK < hi:
                wait_all()
                cuda.syncthreads()
                convert_k(raw, kv_sh, tid)               # the next K tile
                cuda.syncthreads()
                fetch(vw, raw, block_tables, i, kt0 + BK, vmin(BK, hi - kt0 - BK), kvh,
                      num_kv_heads, tid)
        wait_all()
        cuda.syncthreads()

        # ---- row sums: the KG threads of a row each hold part of it
        for m in range(4):
            total = group_sum(l_run[m], KG, scratch)
            if kg == 0:
                a_sh[4 * rg + m] = total
        cuda.syncthreads()
        if tid < ACTIVE3:
            for b in range(OR4):
                for y in range(4):
                    r = 4 * (rg2 + RG2 * b) + y
                    if r < RV and r // hpb < n_tok:
                        l_sum = a_sh[r]
                        inv = float32(1.0) / l_sum if l_sum > 0 else float32(0.0)
                        for c in range(OD4):
                            for x in range(4):
                                out[row0 + r // hpb, head0 + r % hpb, 4 * (dg + DG * c) + x] = \
                                    from_f32(acc[(b * 4 + y) * TD + c * 4 + x] * inv, kind_o)

    return prefill, BQ, dyn_bytes
