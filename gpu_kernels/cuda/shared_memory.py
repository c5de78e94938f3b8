"""Shared-memory traffic: asynchronous copies (``cp.async``), 16-byte loads/stores, warp barriers.

The decode kernel streams the KV cache through a ring of shared-memory
stages: each thread issues 16-byte copies that land in shared memory without
passing through its registers, so many bytes can be in flight per thread at
little register cost.

``cp_async16(dst, di, src, si, nbytes)``
    copy the 16 bytes at 32-bit word ``si`` of the global array ``src`` to word
    ``di`` of the shared array ``dst`` (both 16-byte aligned); ``nbytes`` 16
    copies, 0 writes zeros and reads nothing (the padding of a partial stage).
``cp_async16_hinted(hint)``
    ``copy(dst, di, src, si, nbytes, policy)``: ``cp_async16`` with L2 qualifiers for a
    stream read once. ``hint`` is a tuple of ``"evict_first"`` (the copies carry
    ``policy``, made once per kernel by ``l2_evict_first()``: their lines are the first
    that L2 replaces, so the stream does not push out what other kernels keep there) and
    ``"L2::64B"`` / ``"L2::128B"`` / ``"L2::256B"`` (the L2 prefetch size); without
    ``"evict_first"`` ``policy`` is ignored. The simulator ignores the hint.
``l2_evict_first()``
    an ``L2::evict_first`` cache policy (64-bit, opaque; 0 in the simulator).
``cp_async_commit()``
    closes the group of copies this thread issued since the last commit.
``cp_async_wait[n]()``
    waits until at most ``n`` of this thread's groups are still in flight
    (``n`` is a compile-time constant, hence one function per value).
``syncwarp()``
    barrier of the calling warp; after ``cp_async_wait`` it makes the other
    lanes' completed copies visible.
``lds4f(arr, i)``
    ``arr.flat[i:i+4]`` of a C-contiguous float32 array (shared or global) as four
    float32, one 16-byte load (``i`` a multiple of 4).
``sts4f(arr, i, a, b, c, d)``
    ``arr[i:i+4] = a, b, c, d``, one 16-byte store (``i`` a multiple of 4).
``shared_vectors(n, dtype=float32)``
    a device function returning a 16-byte-aligned shared array of ``n`` 4-byte
    elements, for the buffers these accesses touch (Numba aligns shared arrays
    to their element size only). Call it once per kernel and carve the
    buffers from the result at offsets that are multiples of 4.
``dynamic_shared_vectors()``
    the same for the block's dynamic shared memory (its size given at launch; over
    48 KB the kernel must opt in, see ``launch``). Not in the simulator.

Under ``NUMBA_ENABLE_CUDASIM=1`` the copies happen at once, commit and wait do
nothing and ``syncwarp`` is a block barrier (the simulator has no warp
barrier; the kernels call it equally often in every thread).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from .primitives import SIMULATED


def shared_vectors(n, dtype=float32):
    """See the module docstring."""
    if SIMULATED:
        @cuda.jit(device=True)
        def alloc():
            return cuda.shared.array(n, dtype)
    else:
        @cuda.jit(device=True, inline="always")
        def alloc():
            return cuda.shared.array(n, dtype, alignment=16)
    return alloc


def dynamic_shared_vectors(dtype=float32):
    """See the module docstring."""
    @cuda.jit(device=True, inline="always")
    def alloc():
        return cuda.shared.array(0, dtype, alignment=16)
    return alloc


if SIMULATED:
    @cuda.jit(device=True)
    def cp_async16(dst, di, src, si, nbytes):
        words = dst.view(np.uint32) if dst.dtype != np.uint32 else dst
        for x in range(4):
            words[di + x] = src[si + x] if nbytes else 0

    @cuda.jit(device=True)
    def cp_async_commit():
        pass

    def cp_async16_hinted(hint=()):
        @cuda.jit(device=True)
        def copy(dst, di, src, si, nbytes, policy):
            cp_async16(dst, di, src, si, nbytes)
        return copy

    @cuda.jit(device=True)
    def l2_evict_first():
        return np.uint64(0)

    def _wait():
        pass

    cp_async_wait = (_wait,) * 4

    @cuda.jit(device=True)
    def syncwarp():
        cuda.syncthreads()

    @cuda.jit(device=True)
    def lds4f(arr, i):
        flat = arr.reshape(-1) if arr.ndim > 1 else arr
        return flat[i], flat[i + 1], flat[i + 2], flat[i + 3]

    @cuda.jit(device=True)
    def sts4f(arr, i, a, b, c, d):
        arr[i] = a
        arr[i + 1] = b
        arr[i + 2] = c
        arr[i + 3] = d

else:
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    _I32P = ir.IntType(32).as_pointer()
    _I64 = ir.IntType(64)

    def _word_ptr(context, builder, arrty, arr, idx):
        ary = context.make_array(arrty)(context, builder, arr)
        return builder.ptrtoint(builder.gep(builder.bitcast(ary.data, _I32P), [idx]), _I64)

    _PREFETCH = ("L2::64B", "L2::128B", "L2::256B")

    def _copy_intrinsic(hint):
        """The ``cp.async`` of ``cp_async16`` with the qualifiers of ``hint``."""
        unknown = set(hint) - {"evict_first", *_PREFETCH}
        if unknown:
            raise ValueError(f"cp_async16_hinted: unknown hint {sorted(unknown)}; accepted: "
                             f"'evict_first', {', '.join(map(repr, _PREFETCH))}")
        policy = "evict_first" in hint
        quals = (".L2::cache_hint" if policy else "") + "".join(
            "." + h for h in _PREFETCH if h in hint)

        @intrinsic
        def _copy(typingctx, dst, di, src, si, nbytes, pol):
            sig = types.void(dst, di, src, si, nbytes, types.uint64)

            def codegen(context, builder, signature, args):
                d = _word_ptr(context, builder, signature.args[0], args[0], args[1])
                s = _word_ptr(context, builder, signature.args[2], args[2], args[3])
                n = args[4]
                if n.type.width != 32:
                    n = builder.trunc(n, ir.IntType(32)) if n.type.width > 32 else \
                        builder.zext(n, ir.IntType(32))
                ops, types_in, cons = [d, s, n], [_I64, _I64, ir.IntType(32)], "l,l,r"
                if policy:
                    ops.append(context.cast(builder, args[5], signature.args[5], types.uint64))
                    types_in.append(_I64)
                    cons += ",l"
                asm = ir.InlineAsm(
                    ir.FunctionType(ir.VoidType(), types_in),
                    "{\n\t.reg .u64 sa, ga;\n\t.reg .u32 s32;\n\tcvta.to.shared.u64 sa, $0;\n"
                    "\tcvt.u32.u64 s32, sa;\n\tcvta.to.global.u64 ga, $1;\n"
                    f"\tcp.async.cg.shared.global{quals} [s32], [ga], 16, $2"
                    + (", $3" if policy else "") + ";\n}",
                    cons + ",~{memory}", side_effect=True)
                builder.call(asm, ops)
                return context.get_dummy_value()
            return sig, codegen
        return _copy

    _plain_copy = _copy_intrinsic(())

    @intrinsic
    def _evict_first(typingctx):
        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(_I64, []),
                               "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "=l")
            return builder.call(asm, [])
        return types.uint64(), codegen

    @cuda.jit(device=True)
    def l2_evict_first():
        """See the module docstring."""
        return _evict_first()

    def _asm_statement(text):
        @intrinsic
        def _stmt(typingctx):
            def codegen(context, builder, signature, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                                   side_effect=True)
                builder.call(asm, [])
                return context.get_dummy_value()
            return types.void(), codegen
        return _stmt

    _commit = _asm_statement("cp.async.commit_group;")

    @cuda.jit(device=True)
    def cp_async16(dst, di, src, si, nbytes):
        _plain_copy(dst, di, src, si, nbytes, np.uint64(0))

    _hinted: dict = {}

    def cp_async16_hinted(hint=()):
        """See the module docstring."""
        hint = tuple(sorted(hint))
        if hint not in _hinted:
            copy = _copy_intrinsic(hint)

            @cuda.jit(device=True)
            def hinted(dst, di, src, si, nbytes, policy):
                copy(dst, di, src, si, nbytes, policy)
            _hinted[hint] = hinted
        return _hinted[hint]

    @cuda.jit(device=True)
    def cp_async_commit():
        _commit()

    def _make_wait(n):
        stmt = _asm_statement(f"cp.async.wait_group {n};")

        @cuda.jit(device=True)
        def wait():
            stmt()
        return wait

    cp_async_wait = tuple(_make_wait(n) for n in range(4))

    @cuda.jit(device=True)
    def syncwarp():
        cuda.syncwarp(0xFFFFFFFF)

    @intrinsic
    def _lds4f(typingctx, arr, idx):
        sig = types.UniTuple(types.float32, 4)(arr, idx)

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            f32 = ir.FloatType()
            ptr = builder.gep(builder.bitcast(ary.data, f32.as_pointer()), [args[1]])
            vec = builder.load(builder.bitcast(ptr, ir.VectorType(f32, 4).as_pointer()), align=16)
            vals = [builder.extract_element(vec, ir.Constant(ir.IntType(32), k)) for k in range(4)]
            return context.make_tuple(builder, signature.return_type, vals)
        return sig, codegen

    @cuda.jit(device=True)
    def lds4f(arr, i):
        return _lds4f(arr, i)

    @intrinsic
    def _sts4f(typingctx, arr, idx, a, b, c, d):
        sig = types.void(arr, idx, types.float32, types.float32, types.float32, types.float32)

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            f32 = ir.FloatType()
            vec = ir.Constant(ir.VectorType(f32, 4), ir.Undefined)
            for k in range(4):
                vec = builder.insert_element(vec, args[2 + k], ir.Constant(ir.IntType(32), k))
            ptr = builder.gep(builder.bitcast(ary.data, f32.as_pointer()), [args[1]])
            builder.store(vec, builder.bitcast(ptr, ir.VectorType(f32, 4).as_pointer()), align=16)
            return context.get_dummy_value()
        return sig, codegen

    @cuda.jit(device=True)
    def sts4f(arr, i, a, b, c, d):
        _sts4f(arr, i, np.float32(a), np.float32(b), np.float32(c), np.float32(d))
