"""The decode kernel's two products of a warp stage on tensor cores, in two implementations.

A decode query is one row per head, so a block's ``hpb <= 8`` query heads of one KV head are
rows ``0 .. hpb-1`` of a 16-row ``mma`` tile (the other rows are zero and their results
unused): ``S = Q K^T`` for the stage's 8 keys is ``D / 16`` instructions ``mma.m16n8k16``.
The product with V runs transposed, ``O^T += V^T P^T`` (``D / 16`` instructions
``mma.m16n8k8``: 16 dims x 8 heads per tile): the score accumulators of a lane are then
exactly its ``P^T`` fragment (no shuffles) and every accumulator register holds an output
(the untransposed product would keep 16 - hpb dead rows in registers). The K and V rows
reach the fragments with ``ldmatrix`` (``.trans`` for V^T).

Layouts (lane = ``4 g + t``): the warp's stage holds 8 K rows, then 8 V rows, of ``D`` halves
in shared memory; the 16-byte chunk ``c`` of row ``r`` lies at chunk ``c ^ (r & 7)`` of that
row (a swizzle: the 8 rows of an ``ldmatrix`` phase then hit distinct banks). The query rows
are shared words ``q_sh[g * D / 2 + w]`` (rows >= hpb zero), loaded once into ``qf``.

``load_q(qf, q_sh, lane)``
    ``qf`` (uint32[D / 8]): ``qf[2 k]`` = words of dims ``16 k + 2 t, + 1`` of row ``g``,
    ``qf[2 k + 1]`` = dims ``16 k + 8 + 2 t, + 1``: the A fragments of ``Q``.
``qk(s, qf, q_sh, ring, base, lane, scratch)``
    ``s[0], s[1]`` = the unscaled scores of head ``g`` and keys ``2 t, 2 t + 1`` of the
    stage at word ``base``.
``pv(acc, p0, p1, ring, vbase, lane, scratch)``
    ``acc[4 m + 2 h + e] += sum over the 8 keys k of P[2 t + e, k] V[k, 16 m + 8 h + g]``
    (dims ``16 m + g`` and ``+ 8`` of heads ``2 t, 2 t + 1``), where lane ``4 g + t`` holds
    ``P[g, 2 t] = p0``, ``P[g, 2 t + 1] = p1``; P is rounded to the cache's half format
    first, as the tensor cores take it.
``warp_any(pred, scratch)``
    whether ``pred`` holds in any lane of the warp (the same answer in every lane).

``use_mma``: inline PTX (``ldmatrix``, ``mma.sync``; compute capability >= 8.0). Otherwise
plain Numba with the same layouts (each lane computes its own entries; ``pv`` gathers P from
the lanes that hold it by shuffles): the CUDA simulator's path and that of older GPUs. The
GPU tests check that the two agree.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32

from .primitives import BF16, F16, SIMULATED, ld4, pack2, shfl_idx, word_elem

SWIZZLE = 7        # chunk c of stage row r lies at chunk c ^ (r & SWIZZLE)
STAGE_KEYS = 8     # keys per warp stage (the n of mma.m16n8k16, the k of mma.m16n8k8)


def supported(kind_q, kind_kv, head_dim, hpb):
    """Half queries in the cache's format, head_dim 64 or 128 (rows of 8 or 16 chunks: the
    swizzle needs 8k; at 256 the 8-key stages would not fit the static shared memory and the
    fragments not the registers), at most 8 query heads per block."""
    return kind_kv in (F16, BF16) and kind_q == kind_kv and head_dim in (64, 128) and hpb <= 8


if SIMULATED:
    @cuda.jit(device=True)
    def warp_any(pred, scratch):
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        scratch[tid] = 1.0 if pred else 0.0
        cuda.syncthreads()
        hit = False
        for k in range(32):
            hit = hit or scratch[tid - tid % 32 + k] > 0
        cuda.syncthreads()
        return hit
else:
    @cuda.jit(device=True, inline="always")
    def warp_any(pred, scratch):
        return cuda.any_sync(0xFFFFFFFF, pred)

    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    _I32, _F32 = ir.IntType(32), ir.FloatType()

    @intrinsic
    def shared_base(typingctx, arr):
        """The 32-bit shared-window address of a shared array's first element."""
        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            p = builder.ptrtoint(ary.data, ir.IntType(64))
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), [ir.IntType(64)]),
                               "cvta.to.shared.u64 $0, $1;", "=l,l")
            return builder.trunc(builder.call(asm, [p]), _I32)
        return types.uint32(arr), codegen

    def _cast_all(context, builder, signature, args, types_to):
        return [context.cast(builder, a, t, u) for a, t, u in zip(args, signature.args, types_to)]

    def _ldsm(trans):
        text = ("ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "")
                + ".shared.b16 {$0,$1,$2,$3}, [$4];")

        @intrinsic
        def ldsm(typingctx, addr):
            sig = types.UniTuple(types.uint32, 4)(addr)

            def codegen(context, builder, signature, args):
                (a,) = _cast_all(context, builder, signature, args, [types.uint32])
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I32]),
                                   text, "=r,=r,=r,=r,r,~{memory}", side_effect=True)
                res = builder.call(asm, [a])
                vals = [builder.extract_value(res, k) for k in range(4)]
                return context.make_tuple(builder, signature.return_type, vals)
            return sig, codegen
        return ldsm

    ldsm4, ldsm4_t = _ldsm(False), _ldsm(True)

    def _mma_call(builder, text, na, nb, ops):
        cons = "=f,=f,=f,=f," + ",".join(["r"] * (na + nb) + ["f"] * 4)
        asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_F32] * 4),
                                           [_I32] * (na + nb) + [_F32] * 4), text, cons)
        res = builder.call(asm, ops)
        return builder.extract_value(res, 0), builder.extract_value(res, 1)

    def _mma16(dtype):
        text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32 "
                "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

        @intrinsic
        def mma(typingctx, c0, c1, a0, a2, b0, b1):
            """(d0, d1) = row g of C + A B (A and C rows g + 8 zero): keys 2t, 2t + 1."""
            sig = types.UniTuple(types.float32, 2)(c0, c1, a0, a2, b0, b1)

            def codegen(context, builder, signature, args):
                v = _cast_all(context, builder, signature, args, [types.float32] * 2
                              + [types.uint32] * 4)
                z, zf = ir.Constant(_I32, 0), ir.Constant(_F32, 0.0)
                d = _mma_call(builder, text, 4, 2, [v[2], z, v[3], z, v[4], v[5],
                                                     v[0], v[1], zf, zf])
                return context.make_tuple(builder, signature.return_type, list(d))
            return sig, codegen
        return mma

    def _mma8(dtype):
        text = (f"mma.sync.aligned.m16n8k8.row.col.f32.{dtype}.{dtype}.f32 "
                "{$0,$1,$2,$3}, {$4,$5}, {$6}, {$7,$8,$9,$10};")
        cons = "=f,=f,=f,=f,r,r,r,f,f,f,f"

        @intrinsic
        def mma(typingctx, c0, c1, c2, c3, a0, a1, b0):
            """(d0, d1, d2, d3) = C + A B, one 16 x 8 x 8 tile."""
            sig = types.UniTuple(types.float32, 4)(c0, c1, c2, c3, a0, a1, b0)

            def codegen(context, builder, signature, args):
                v = _cast_all(context, builder, signature, args, [types.float32] * 4
                              + [types.uint32] * 3)
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_F32] * 4),
                                                   [_I32] * 3 + [_F32] * 4), text, cons)
                res = builder.call(asm, [v[4], v[5], v[6], v[0], v[1], v[2], v[3]])
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(res, k) for k in range(4)])
            return sig, codegen
        return mma

    _MMA = {(F16, True): _mma16("f16"), (BF16, True): _mma16("bf16"),
            (F16, False): _mma8("f16"), (BF16, False): _mma8("bf16")}


@functools.lru_cache(maxsize=None)
def stage_ops(kind, head_dim, use_mma):
    """(load_q, qk, pv) for one format and head_dim; see the module docstring."""
    HW = head_dim // 2                 # words of a row
    ROW_VECS = head_dim // 8           # 16-byte chunks of a row
    MT = head_dim // 16                # 16-dim output tiles (of O^T)
    J = head_dim // 32                 # ldmatrix.x4 per row block

    @cuda.jit(device=True, inline="always")
    def load_q(qf, q_sh, lane):
        g = lane // 4
        t = lane % 4
        for k in range(head_dim // 16):
            qf[2 * k] = q_sh[g * HW + 8 * k + t]
            qf[2 * k + 1] = q_sh[g * HW + 8 * k + 4 + t]

    if use_mma:
        mma16 = _MMA[(kind, True)]
        mma8 = _MMA[(kind, False)]

        @cuda.jit(device=True, inline="always")
        def qk(s, qf, q_sh, ring, base, lane, scratch):
            r = lane & 7
            addr = shared_base(ring) + np.uint32(4 * base + 16 * r * ROW_VECS)
            c0 = float32(0.0)                            # two chains: even and odd k-steps
            c1 = float32(0.0)
            d0 = float32(0.0)
            d1 = float32(0.0)
            for j in range(J):
                chunk = 4 * j + (lane >> 3)
                f = ldsm4(addr + np.uint32(16 * (chunk ^ r)))
                c0, c1 = mma16(c0, c1, qf[4 * j], qf[4 * j + 1], f[0], f[1])
                d0, d1 = mma16(d0, d1, qf[4 * j + 2], qf[4 * j + 3], f[2], f[3])
            s[0] = c0 + d0
            s[1] = c1 + d1

        @cuda.jit(device=True, inline="always")
        def pv(acc, p0, p1, ring, vbase, lane, scratch):
            r = lane & 7
            b = pack2(p0, p1, kind)                      # P^T[keys 2t, 2t + 1][head g]
            addr = shared_base(ring) + np.uint32(4 * vbase + 16 * r * ROW_VECS)
            for j in range(J):
                chunk = 4 * j + (lane >> 3)
                f = ldsm4_t(addr + np.uint32(16 * (chunk ^ r)))   # V^T: dims 32 j .. + 31
                for h in range(2):
                    m = 2 * j + h
                    acc[4 * m], acc[4 * m + 1], acc[4 * m + 2], acc[4 * m + 3] = mma8(
                        acc[4 * m], acc[4 * m + 1], acc[4 * m + 2], acc[4 * m + 3],
                        f[2 * h], f[2 * h + 1], b)

        return load_q, qk, pv

    @cuda.jit(device=True, inline="always")
    def qk(s, qf, q_sh, ring, base, lane, scratch):
        g = lane // 4
        t = lane % 4
        for e in range(2):
            key = 2 * t + e
            row = base + key * 4 * ROW_VECS
            dot = float32(0.0)
            for c in range(ROW_VECS):
                w = ld4(ring, row + 4 * (c ^ (key & SWIZZLE)))
                for x in range(4):
                    qw = q_sh[g * HW + 4 * c + x]
                    dot += word_elem(qw, 0, kind) * word_elem(w[x], 0, kind)
                    dot += word_elem(qw, 1, kind) * word_elem(w[x], 1, kind)
            s[e] = dot

    @cuda.jit(device=True, inline="always")
    def pv(acc, p0, p1, ring, vbase, lane, scratch):
        g = lane // 4
        t = lane % 4
        for e in range(2):                               # head 2 t + e
            for tp in range(4):                          # keys 2 tp, 2 tp + 1
                x0 = shfl_idx(p0, 4 * (2 * t + e) + tp, scratch)
                x1 = shfl_idx(p1, 4 * (2 * t + e) + tp, scratch)
                pw = pack2(x0, x1, kind)                 # as the tensor cores round P
                for e2 in range(2):
                    key = 2 * tp + e2
                    xp = word_elem(pw, e2, kind)
                    row = vbase + key * 4 * ROW_VECS
                    for m in range(MT):
                        for h in range(2):
                            dim = 16 * m + 8 * h + g
                            w = ld4(ring, row + 4 * ((dim // 8) ^ (key & SWIZZLE)))
                            for x in range(4):
                                if x == (dim % 8) // 2:
                                    acc[4 * m + 2 * h + e] += xp * word_elem(w[x], dim % 2, kind)

    return load_q, qk, pv
