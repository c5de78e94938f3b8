"""CUDA prefill kernel on tensor cores (float16 / bfloat16 caches and queries).

Same grid, tile order and masking rules as ``prefill.py`` (its docstring): blocks are
(query tile, KV head, head chunk), longest-running tiles first, a tile has ``R`` query rows
(row ``r`` = token ``r // hpb``, head ``r % hpb``) and walks the keys some row can see. What
differs is the arithmetic, laid out as in FlashAttention-2:

* ``warps`` warps, each owning ``16 mt`` consecutive rows (``R = 16 mt warps``); Q, K and V
  stay in the cache's half format in shared memory (rows padded to ``D + 8`` halves), Q
  copied once per block (``cp.async`` when the query has the cache's format, else converted
  element by element);
* per key tile of ``BK`` keys, each warp computes ``S = Q K^T`` and ``O += P V`` with
  ``mma.m16n8k16`` (``mma.py``: CUDA C++ linked into this Numba kernel, or its plain-Numba
  twin), scores and output accumulators in registers in the mma layout (lane ``4 g + t``: rows
  ``g, g + 8`` x columns ``2 t, 2 t + 1`` of each 16 x 8 tile);
* mask and online softmax here, in Numba, on that layout: a row's 4 lanes share its max by
  two shuffles; each lane keeps a partial row sum (added up once at the end); scores are
  scaled in float32 (``scale * log2(e)``, fused into the exponent's argument), probabilities
  rounded to the half format for ``P V``, which also rescales ``O`` (skipped while no row of
  the warp has a new maximum). A row's running maximum moves only when a tile's exceeds it by
  more than ``rescale_slack`` (log2 units): probabilities stay <= 2**slack, exact in the half
  format's relative precision and far from its range, and after the first tiles ``O`` is
  rarely rescaled at all;
* K and V tiles go through ``stages`` shared buffers: the copies of the next ``stages - 1``
  tiles (``cp.async``, paged through the block table) are in flight while tile ``j`` is
  computed, one barrier per tile; a warp skips a key tile that none of its rows can see
  (causal future, before the window);
* a contiguous half output is written a word (two elements) at a time.

Shared memory: ``(R + 2 stages BK) (D + 8) * 2`` bytes, dynamic (sized at launch).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint32

from .mma import mma_ops
from .prefill import locate_query_tile
from .primitives import (F32, SIMULATED, exp2, fmax32, from_f32, pack2, register_cap, shfl_xor,
                         to_f32, vmax, vmin)
from .shared_memory import (cp_async16, cp_async_commit, cp_async_wait, dynamic_shared_vectors,
                            shared_vectors)

NEG = np.float32(-1e30)


def tile_seen_by_rows(kt0, nk, first_pos, last_pos, window):
    """Does any query at positions ``first_pos .. last_pos`` see a key of ``kt0 .. kt0 + nk - 1``?

    Their visible keys together are ``[first_pos - window + 1, last_pos]`` (causal: the last
    query sees the latest key; window: the first query's window starts earliest)."""
    return kt0 <= last_pos and (window <= 0 or kt0 + nk - 1 > first_pos - window)


tile_seen = cuda.jit(device=True, inline="always")(tile_seen_by_rows)


@dataclass(frozen=True)
class MmaTile:
    """Warps per block, 16-row tiles per warp, keys per key tile, head_dim, K/V buffers,
    register cap."""
    warps: int
    mt: int
    keys: int
    head_dim: int
    stages: int = 2             # K/V tile buffers (copies in flight: stages - 1)
    max_registers: int = None
    rescale_slack: float = 8.0  # the running max moves when exceeded by more (log2 units)

    @property
    def threads(self):
        return 32 * self.warps

    @property
    def rows(self):
        return 16 * self.mt * self.warps

    def shared_words(self):
        return (self.rows + 2 * self.stages * self.keys) * (self.head_dim + 8) // 2

    def check(self):
        if not 2 <= self.stages <= 4:
            raise NotImplementedError(f"tensor-core prefill: 2 to 4 stages, got {self.stages}")
        if self.head_dim % 16 or self.keys % 16 or self.keys < 16:
            raise NotImplementedError(f"tensor-core prefill: head_dim ({self.head_dim}) and keys "
                                      f"per tile ({self.keys}) must be multiples of 16")


def default_mma_tile(head_dim):
    if SIMULATED:
        return MmaTile(1, 1, 16, head_dim)
    if head_dim <= 128:     # 3 K/V buffers: (128 + 192) rows of <= 136 halves, 2 blocks per SM
        return MmaTile(4, 2, 32, head_dim, stages=3)
    return MmaTile(4, 1, 32, head_dim)


@functools.lru_cache(maxsize=None)
def build_prefill_mma_kernel(tile, group, hpb, kind_q, kind_kv, kind_o, block_size, q_words,
                             use_mma, lto=True, o_words=False):
    """Compile-time specialization (all arguments constants); returns ``(kernel, tokens per
    query tile, dynamic shared bytes)`` like ``prefill.build_prefill_kernel``.

    ``use_mma``: tensor cores through ``mma.cu`` (``lto``: with link-time optimization);
    else the plain-Numba products. ``o_words``: the kernel's ``ow`` argument is the output's
    memory as 32-bit words (a C-contiguous half output), written two elements at a time."""
    tile.check()
    if kind_kv == F32 or kind_q == F32:
        raise NotImplementedError("tensor-core prefill takes float16/bfloat16 queries and caches")
    threads, R, BK, D, MT = tile.threads, tile.rows, tile.keys, tile.head_dim, tile.mt
    if R < hpb:
        raise NotImplementedError(f"tensor-core prefill: {R} rows hold no token of {hpb} heads")
    BQ = R // hpb
    RV = BQ * hpb
    HCHUNKS = group // hpb
    NT, DT = BK // 8, D // 8
    SW = (D + 8) // 2                       # words per shared row
    ROW_WORDS = D // 2                      # words per cache / query row
    ROW_VECS = D // 8                       # 16-byte vectors per row
    BS = block_size
    PAGE_WORDS = BS * ROW_WORDS
    TILE_WORDS = BK * SW
    K_OFF = R * SW                          # buffer b: K at K_OFF + 2 b TILE_WORDS, V after it
    TPK = math.gcd(threads // BK, ROW_VECS) if threads >= BK else 1   # threads per key
    KEYS_PER_PASS = threads // TPK
    PASSES = -(-BK // KEYS_PER_PASS)
    CPT = ROW_VECS // TPK                   # 16-byte vectors per thread and key
    QVPT = -(-R * ROW_VECS // threads)
    QASYNC = q_words and kind_q == kind_kv
    OWORDS = o_words and kind_o != F32
    SLACK = float32(tile.rescale_slack)
    SKIP = not SIMULATED                    # warps skip invisible tiles (the simulator's
    #                                         shuffles are block barriers: all threads must call)
    qk, pv = mma_ops(kind_kv, MT, NT, D, use_mma)
    SN, ON, MN = MT * NT * 4, MT * DT * 4, MT * 2
    words = tile.shared_words()
    if SIMULATED:
        dyn_bytes = 0
        alloc_smem = shared_vectors(words, uint32)
    else:
        dyn_bytes = 4 * words
        alloc_smem = dynamic_shared_vectors(uint32)
    STAGES = tile.stages
    wait_tile = cp_async_wait[STAGES - 2]
    jit_options = {"fastmath": True, **register_cap(tile.max_registers)}
    if use_mma and lto:
        jit_options["lto"] = True

    @cuda.jit(device=True, inline="always")
    def table_entries(pages, block_tables, i, kt0, hi, tid):
        """The pages of this thread's keys of the tile at kt0 (clamped to the last visible
        key: always a valid entry)."""
        for u in range(PASSES):
            j = vmin(kt0 + tid // TPK + KEYS_PER_PASS * u, hi - 1)
            pages[u] = block_tables[i, j // BS]

    @cuda.jit(device=True, inline="always")
    def fetch(kw, vw, smem, pages, kt0, nk, hi, kvh, num_kv_heads, tid, b):
        """Start copying K and V of keys kt0 .. kt0 + nk - 1 (zeros past them) to buffer b,
        ``pages`` holding their block-table entries (``table_entries``).

        ``TPK`` threads share a key, ``CPT`` 16-byte vectors apiece, a warp's vectors of a
        key contiguous; past the last key the copy reads the last visible key (a valid
        address) and writes zeros."""
        koff = K_OFF + 2 * b * TILE_WORDS
        lane_w = (tid % TPK) * 4
        for u in range(PASSES):
            key = tid // TPK + KEYS_PER_PASS * u
            if key < BK:
                j = vmin(kt0 + key, hi - 1)
                jb = j // BS
                src = (pages[u] * num_kv_heads + kvh) * PAGE_WORDS \
                    + (j - jb * BS) * ROW_WORDS + lane_w
                nbytes = 16 if key < nk else 0
                dst = koff + key * SW + lane_w
                for c in range(CPT):
                    cp_async16(smem, dst + 4 * TPK * c, kw, src + 4 * TPK * c, nbytes)
                    cp_async16(smem, dst + TILE_WORDS + 4 * TPK * c, vw, src + 4 * TPK * c,
                               nbytes)

    @cuda.jit(**jit_options)
    def prefill(q, qw, kw, vw, block_tables, query_start_loc, context_lens, out, ow,
                scale_log2, window, num_kv_heads, head_blocks, tiles_bound):
        tid = cuda.threadIdx.x
        hb = cuda.blockIdx.x % head_blocks
        kvh = hb // HCHUNKS
        head0 = kvh * group + (hb % HCHUNKS) * hpb
        smem = alloc_smem()
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
        tok0 = info_sh[1] * BQ
        n_tok = vmin(BQ, n - tok0)
        first_pos = length - n + tok0
        row0 = query_start_loc[i] + tok0
        lo = 0
        if window > 0:
            lo = vmax(0, first_pos - window + 1)
        hi = first_pos + n_tok
        n_tiles = (hi - lo + BK - 1) // BK
        num_heads = q.shape[1]

        pages = cuda.local.array(PASSES, int32)
        table_entries(pages, block_tables, i, lo, hi, tid)
        fetch(kw, vw, smem, pages, lo, vmin(BK, hi - lo), hi, kvh, num_kv_heads, tid, 0)
        if QASYNC:
            for u in range(QVPT):
                vi = tid + threads * u
                if vi < R * ROW_VECS:
                    r = vi // ROW_VECS
                    w = vi - r * ROW_VECS
                    if r < RV and r // hpb < n_tok:
                        src = ((row0 + r // hpb) * num_heads + head0 + r % hpb) * ROW_WORDS + w * 4
                        cp_async16(smem, r * SW + w * 4, qw, src, 16)
                    else:
                        cp_async16(smem, r * SW + w * 4, qw, 0, 0)
        cp_async_commit()                              # group 0: Q and key tile 0
        for st in range(1, STAGES - 1):                # groups 1 .. STAGES - 2: tiles ahead
            if st < n_tiles:
                table_entries(pages, block_tables, i, lo + st * BK, hi, tid)
                fetch(kw, vw, smem, pages, lo + st * BK, vmin(BK, hi - lo - st * BK),
                      hi, kvh, num_kv_heads, tid, st)
            cp_async_commit()
        if not QASYNC:
            for idx in range(tid, R * ROW_WORDS, threads):
                r = idx // ROW_WORDS
                w = idx - r * ROW_WORDS
                word = uint32(0)
                if r < RV and r // hpb < n_tok:
                    qrow = row0 + r // hpb
                    qh = head0 + r % hpb
                    word = pack2(to_f32(q[qrow, qh, 2 * w], kind_q),
                                 to_f32(q[qrow, qh, 2 * w + 1], kind_q), kind_kv)
                smem[r * SW + w] = word

        lane = tid % 32
        g = lane // 4
        t = lane % 4
        wrow0 = (tid // 32) * MT * 16                  # the warp's first row
        w_first_tok = wrow0 // hpb
        w_last_tok = vmin((wrow0 + 16 * MT - 1) // hpb, n_tok - 1)
        warp_active = w_first_tok < n_tok
        w_first_pos = first_pos + w_first_tok
        w_last_pos = first_pos + w_last_tok

        m_run = cuda.local.array(MN, float32)
        l_run = cuda.local.array(MN, float32)
        a_run = cuda.local.array(MN, float32)
        m_tile = cuda.local.array(MN, float32)
        for x in range(MN):
            m_run[x] = NEG
            l_run[x] = 0.0
        o = cuda.local.array(ON, float32)
        for x in range(ON):
            o[x] = 0.0
        s = cuda.local.array(SN, float32)

        for it in range(n_tiles):
            kt0 = lo + it * BK
            b = it % STAGES
            wait_tile()                                # tile it has landed (this thread's part)
            cuda.syncthreads()                         # ... and everyone's; all are done with
            nxt = it + STAGES - 1                      # the buffer that tile nxt refills
            if nxt < n_tiles:
                table_entries(pages, block_tables, i, lo + nxt * BK, hi, tid)
                fetch(kw, vw, smem, pages, lo + nxt * BK,
                      vmin(BK, hi - lo - nxt * BK), hi, kvh, num_kv_heads, tid, nxt % STAGES)
            cp_async_commit()
            nk = vmin(BK, hi - kt0)
            koff = K_OFF + 2 * b * TILE_WORDS
            live = True
            if SKIP:
                live = warp_active and tile_seen(kt0, nk, w_first_pos, w_last_pos, window)
            if live:
                # ---- S = Q K^T
                qk(s, smem, wrow0 * SW, koff, scratch)
                # ---- mask, online softmax (P replaces S); scores stay unscaled until exp2.
                # Each phase is one loop over the thread's MT * 2 rows with no branch inside,
                # so that the rows' dependency chains (max, shuffles, exp2) interleave.
                interior = nk == BK and kt0 + BK <= w_first_pos + 1 and \
                    (window <= 0 or kt0 > w_last_pos - window)
                if interior:
                    for mh in range(MN):
                        mx = NEG
                        for nn in range(NT):
                            for e in range(2):
                                mx = fmax32(mx, s[((mh // 2) * NT + nn) * 4 + 2 * (mh % 2) + e])
                        m_tile[mh] = mx
                else:
                    for mh in range(MN):
                        # this lane's keys 8 nn + e + 2 t are visible iff in [klo, khi)
                        r = wrow0 + (mh // 2) * 16 + g + 8 * (mh % 2)
                        tok = r // hpb
                        pos = first_pos + tok
                        khi = vmin(nk, pos - kt0 + 1) - 2 * t
                        if r >= RV or tok >= n_tok:
                            khi = -BK
                        klo = -2 * t
                        if window > 0:
                            klo = pos - window + 1 - kt0 - 2 * t
                        mx = NEG
                        for nn in range(NT):
                            for e in range(2):
                                x = s[((mh // 2) * NT + nn) * 4 + 2 * (mh % 2) + e]
                                if nn * 8 + e < klo or nn * 8 + e >= khi:
                                    x = NEG
                                s[((mh // 2) * NT + nn) * 4 + 2 * (mh % 2) + e] = x
                                mx = fmax32(mx, x)
                        m_tile[mh] = mx
                for mh in range(MN):
                    m_tile[mh] = fmax32(m_tile[mh], shfl_xor(m_tile[mh], 1, scratch))
                for mh in range(MN):
                    m_tile[mh] = fmax32(m_tile[mh], shfl_xor(m_tile[mh], 2, scratch))
                for mh in range(MN):
                    # masked scores are NEG: exp2 makes them 0 once the row has a visible
                    # key; before that (m_new still ~NEG) they count 1, and the first
                    # visible key's alpha = 0 wipes them
                    m_new = m_run[mh]
                    m_cand = m_tile[mh] * scale_log2
                    if m_cand > m_new + SLACK:
                        m_new = m_cand
                    alpha = exp2(m_run[mh] - m_new)
                    m_run[mh] = m_new
                    total = float32(0.0)
                    for nn in range(NT):
                        for e in range(2):
                            p = exp2(s[((mh // 2) * NT + nn) * 4 + 2 * (mh % 2) + e]
                                     * scale_log2 - m_new)
                            s[((mh // 2) * NT + nn) * 4 + 2 * (mh % 2) + e] = p
                            total += p
                    l_run[mh] = l_run[mh] * alpha + total
                    a_run[mh] = alpha
                # ---- O = O * alpha + P V
                pv(o, a_run, s, smem, koff + TILE_WORDS, scratch)

        # ---- normalize and store: a row's sum is spread over its 4 lanes
        for m in range(MT):
            for h in range(2):
                total = l_run[m * 2 + h]
                total += shfl_xor(total, 1, scratch)
                total += shfl_xor(total, 2, scratch)
                r = wrow0 + m * 16 + g + 8 * h
                tok = r // hpb
                if r < RV and tok < n_tok:
                    inv = float32(1.0) / total if total > 0 else float32(0.0)
                    orow = row0 + tok
                    oh = head0 + r % hpb
                    if OWORDS:
                        base = (orow * num_heads + oh) * ROW_WORDS + t
                        for nd in range(DT):
                            ow[base + nd * 4] = pack2(o[(m * DT + nd) * 4 + 2 * h] * inv,
                                                      o[(m * DT + nd) * 4 + 2 * h + 1] * inv,
                                                      kind_o)
                    else:
                        for nd in range(DT):
                            out[orow, oh, nd * 8 + 2 * t] = \
                                from_f32(o[(m * DT + nd) * 4 + 2 * h] * inv, kind_o)
                            out[orow, oh, nd * 8 + 2 * t + 1] = \
                                from_f32(o[(m * DT + nd) * 4 + 2 * h + 1] * inv, kind_o)

    return prefill, BQ, dyn_bytes
