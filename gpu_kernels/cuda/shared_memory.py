"""Shared-memory traffic: asynchronous copies (``cp.async``), 16-byte loads/stores, warp barriers.

The decode kernel streams the KV cache through a ring of shared-memory
stages: each thread issues 16-byte copies that land in shared memory without
passing through its registers, so many bytes can be in flight per thread at
little register cost.

``cp_async16(dst, di, src, si, nbytes)``
    copy the 16 bytes at 32-bit word ``si`` of the global array ``src`` to word
    ``di`` of the shared array ``dst`` (both 16-byte aligned); ``nbytes`` 16
    copies, 0 writes zeros and reads nothing (the padding of a partial stage).
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

    @intrinsic
    def _cp_async16(typingctx, dst, di, src, si, nbytes):
        sig = types.void(dst, di, src, si, nbytes)

        def codegen(context, builder, signature, args):
            d = _word_ptr(context, builder, signature.args[0], args[0], args[1])
            s = _word_ptr(context, builder, signature.args[2], args[2], args[3])
            n = args[4]
            if n.type.width != 32:
                n = builder.trunc(n, ir.IntType(32)) if n.type.width > 32 else \
                    builder.zext(n, ir.IntType(32))
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [_I64, _I64, ir.IntType(32)]),
                "{\n\t.reg .u64 sa, ga;\n\t.reg .u32 s32;\n\tcvta.to.shared.u64 sa, $0;\n"
                "\tcvt.u32.u64 s32, sa;\n\tcvta.to.global.u64 ga, $1;\n"
                "\tcp.async.cg.shared.global [s32], [ga], 16, $2;\n}",
                "l,l,r,~{memory}", side_effect=True)
            builder.call(asm, [d, s, n])
            return context.get_dummy_value()
        return sig, codegen

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
        _cp_async16(dst, di, src, si, nbytes)

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
