"""Device helpers shared by the CUDA kernels, in two implementations.

The kernels read KV caches as flat arrays of 32-bit *words* (two float16 or
bfloat16 elements, or one float32 per word) with 16-byte vector loads, and
convert elements to float32 themselves. Reductions inside a thread group
use warp shuffles.

On a GPU these are LLVM intrinsics / inline PTX and ``shfl_xor_sync``. Under
``NUMBA_ENABLE_CUDASIM=1`` (the CUDA simulator runs kernels as Python threads;
it has no warp shuffles and cannot compile intrinsics) the same names are
plain Python: conversions through NumPy views, reductions through shared
memory and ``syncthreads``. The kernels are written so that every thread of
a block calls a reduction the same number of times, which both versions
need.

Element formats (``KIND``, a compile-time constant of each kernel)::

    F32 = 0   float32 arrays
    F16 = 1   float16 arrays (native on the device)
    BF16 = 2  uint16 arrays holding bfloat16 bits

Names:

``ld4(words, i)``              words[i:i+4] as a tuple of uint32, one 16-byte load (any
                               array of 4-byte elements: a float32 shared buffer is read as bits)
``word_elem(w, e, KIND)``      element e (0 or 1) of word w as float32
``to_f32(x, KIND)``            an array element as float32
``from_f32(v, KIND)``          float32 -> a value to store in an array of KIND
                               (round to nearest even)
``pack2(lo, hi, KIND)``         two float32 -> one uint32 word of two half elements (``lo`` in
                               the low 16 bits; F16 or BF16, round to nearest even)

Half-precision conversions exist once per target, each in the form its target runs best:
``formats.py`` (NumPy, whole arrays), ``cpu/formats.py`` (Numba CPU: LLVM's ``half`` type,
i.e. F16C instructions, and bf16 rounding in integer arithmetic) and here. On the GPU every
conversion is one PTX instruction (``cvt.f32.f16``, ``cvt.rn.f16.f32``, ``cvt.rn.bf16.f32``,
``cvt.rn.{f16,bf16}x2.f32``; sm_80, which the kernels need anyway for ``cp.async``). A shared
bit-twiddling definition compiled for both targets would cost the GPU several integer
instructions and registers per element: in the tensor-core prefill, bf16 rounding that way
while 128 accumulators are live spilled 528 bytes per thread.
``exp2(x)``                    2**x in float32 (fast approximate instruction on the GPU)
``fmax32(a, b)``               max of two float32 (one instruction on the GPU)
``shfl_idx(v, src, scratch)``  v of lane ``src`` of the calling warp
``shfl_xor(v, mask, scratch)`` v of lane ``lane ^ mask``
``group_sum / group_max(v, width, scratch)``
    reduce v over aligned groups of ``width`` consecutive threads; every thread
    gets its group's result. ``scratch``: shared float32[blockDim.x] (simulator only).
"""
from __future__ import annotations

import contextlib
import math
import sys

import numpy as np
from numba import config, cuda

if not hasattr(np, "row_stack"):      # NumPy 2.5 removed it; numba-cuda still calls it
    np.row_stack = np.vstack

SIMULATED = bool(config.ENABLE_CUDASIM)
F32, F16, BF16 = 0, 1, 2


@cuda.jit(device=True)
def vmax(a, b):
    """max() of two numbers (the builtin does not type-check in some numba-cuda versions)."""
    return a if a > b else b


@cuda.jit(device=True)
def vmin(a, b):
    return a if a < b else b


def register_cap(max_registers):
    """``cuda.jit`` options capping registers per thread (None: no cap; the simulator has none)."""
    return {} if SIMULATED or max_registers is None else {"max_registers": max_registers}


def kind_of(dtype) -> int:
    """Element format code of a device array dtype (float32 / float16 / uint16 = bf16)."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return F32
    if dtype == np.float16:
        return F16
    if dtype == np.uint16:
        return BF16
    raise TypeError(f"unsupported CUDA attention dtype {dtype}")


class _CurrentBlock:
    """Stands for ``numba.cuda`` in this package's modules during a simulated launch.

    The simulator makes ``cuda.threadIdx`` and friends work by rebinding a device
    function's global ``cuda`` to the launch's fake module on entry and restoring the
    real one on exit (``numba/cuda/simulator/kernelapi.py``, ``swapped_cuda_module``).
    Its threads share the module's globals, so when the first thread to enter a device
    function leaves it, the real module comes back under threads still inside, which
    then fail with "module 'numba.cuda' has no attribute 'syncthreads'" -- now and then,
    as thread switches fall. Bound for the whole launch, this object answers every
    attribute from the launch's fake module, and the per-call swap (which only replaces
    the real module) leaves it in place.
    """

    def __getattr__(self, name):
        from numba.cuda.simulator.kernel import _get_kernel_context
        return getattr(_get_kernel_context(), name)


@contextlib.contextmanager
def simulated_launch():
    """Around one simulated kernel launch: bind :class:`_CurrentBlock` as ``cuda`` in
    this package's modules (no-op on a GPU)."""
    if not SIMULATED:
        yield
        return
    real, stand_in = cuda, _CurrentBlock()       # (this module's own `cuda` is rebound too)
    bound = [(vars(m), name) for m in list(sys.modules.values())
             if getattr(m, "__name__", "").startswith("gpu_kernels.")
             for name, value in list(vars(m).items()) if value is real]
    for globs, name in bound:
        globs[name] = stand_in
    try:
        yield
    finally:
        for globs, name in bound:
            globs[name] = real


if SIMULATED:
    def _f32(bits):
        return np.array([bits & 0xFFFFFFFF], np.uint32).view(np.float32)[0]

    def _bits(value):
        return int(np.array([value], np.float32).view(np.uint32)[0])

    @cuda.jit(device=True)
    def ld4(words, i):
        if words.dtype == np.float32:           # a shared buffer holding copied words
            words = words.view(np.uint32)
        return words[i], words[i + 1], words[i + 2], words[i + 3]

    @cuda.jit(device=True)
    def word_elem(w, e, kind):
        w = int(w)
        if kind == F32:
            return _f32(w)
        half = (w >> 16) if e else (w & 0xFFFF)
        if kind == F16:
            return np.float32(np.array([half], np.uint16).view(np.float16)[0])
        return _f32(half << 16)

    @cuda.jit(device=True)
    def to_f32(x, kind):
        if kind == BF16:
            return _f32(int(x) << 16)
        return np.float32(x)

    @cuda.jit(device=True)
    def from_f32(v, kind):
        if kind == BF16:
            bits = _bits(v)
            return np.uint16(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF)
        if kind == F16:
            return np.float16(v)
        return np.float32(v)

    def _half_bits(v, kind):
        if kind == BF16:
            bits = _bits(v)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
        return int(np.array([v], np.float32).astype(np.float16).view(np.uint16)[0])

    @cuda.jit(device=True)
    def pack2(lo, hi, kind):
        return np.uint32(_half_bits(lo, kind) | (_half_bits(hi, kind) << 16))

    @cuda.jit(device=True)
    def exp2(x):
        return np.float32(math.exp2(x))

    @cuda.jit(device=True)
    def fmax32(a, b):
        return np.float32(a if a > b else b)

    def _exchange(v, src_lane, scratch):
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        scratch[tid] = v
        cuda.syncthreads()
        r = scratch[tid - tid % 32 + src_lane]
        cuda.syncthreads()
        return r

    @cuda.jit(device=True)
    def shfl_idx(v, src, scratch):
        return _exchange(v, src, scratch)

    @cuda.jit(device=True)
    def shfl_xor(v, mask, scratch):
        return _exchange(v, (cuda.threadIdx.x % 32) ^ mask, scratch)

    def _group_reduce(v, width, scratch, is_max):
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        scratch[tid] = v
        cuda.syncthreads()
        base = tid - tid % width
        r = scratch[base]
        for k in range(1, width):
            r = vmax(r, scratch[base + k]) if is_max else r + scratch[base + k]
        cuda.syncthreads()
        return np.float32(r)

    @cuda.jit(device=True)
    def group_sum(v, width, scratch):
        return _group_reduce(v, width, scratch, False)

    @cuda.jit(device=True)
    def group_max(v, width, scratch):
        return _group_reduce(v, width, scratch, True)

else:
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    @intrinsic
    def _ld4(typingctx, arr, idx):
        """One 16-byte load of 4 uint32 words at flat word index idx (16-byte aligned)."""
        sig = types.UniTuple(types.uint32, 4)(arr, idx)

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            base = builder.bitcast(ary.data, ir.IntType(32).as_pointer())
            ptr = builder.gep(base, [args[1]])
            vec = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(32), 4).as_pointer()),
                               align=16)
            vals = [builder.extract_element(vec, ir.Constant(ir.IntType(32), k)) for k in range(4)]
            return context.make_tuple(builder, signature.return_type, vals)
        return sig, codegen

    @intrinsic
    def _as_f32(typingctx, bits):
        def codegen(context, builder, signature, args):
            v = args[0]
            if v.type.width != 32:
                v = builder.trunc(v, ir.IntType(32)) if v.type.width > 32 else \
                    builder.zext(v, ir.IntType(32))
            return builder.bitcast(v, ir.FloatType())
        return types.float32(bits), codegen

    @intrinsic
    def _half_bits_to_f32(typingctx, bits):
        """Low 16 bits of an integer, read as IEEE half -> float32 (cvt.f32.f16)."""
        def codegen(context, builder, signature, args):
            h = builder.trunc(args[0], ir.IntType(16))
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.IntType(16)]),
                               "cvt.f32.f16 $0, $1;", "=f,h")
            return builder.call(asm, [h])
        return types.float32(bits), codegen

    @cuda.jit(device=True)
    def ld4(words, i):
        return _ld4(words, i)

    @cuda.jit(device=True)
    def word_elem(w, e, kind):
        if kind == F32:
            return _as_f32(w)
        if kind == F16:
            return _half_bits_to_f32((w >> np.uint32(16)) if e else w)
        return _as_f32((w & np.uint32(0xFFFF0000)) if e else (w << np.uint32(16)))

    @intrinsic
    def _f32_to_half(typingctx, value):
        """float32 -> float16, round to nearest even (cvt.rn.f16.f32)."""
        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(16), [ir.FloatType()]),
                               "cvt.rn.f16.f32 $0, $1;", "=h,f")
            return builder.call(asm, [args[0]])     # Numba-CUDA keeps float16 values as i16
        return types.float16(value), codegen

    def _cvt_x2(instruction):
        @intrinsic
        def cvt_x2(typingctx, hi, lo):
            """Two float32 -> one word of two halves, ``hi`` in the upper 16 bits (sm_80)."""
            def codegen(context, builder, signature, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ir.FloatType()] * 2),
                                   f"{instruction} $0, $1, $2;", "=r,f,f")
                return builder.call(asm, [args[0], args[1]])
            return types.uint32(types.float32, types.float32), codegen
        return cvt_x2

    _cvt_f16x2 = _cvt_x2("cvt.rn.f16x2.f32")
    _cvt_bf16x2 = _cvt_x2("cvt.rn.bf16x2.f32")

    @intrinsic
    def _f32_to_bf16(typingctx, value):
        """float32 -> bfloat16 bits, round to nearest even (cvt.rn.bf16.f32, sm_80)."""
        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(16), [ir.FloatType()]),
                               "cvt.rn.bf16.f32 $0, $1;", "=h,f")
            return builder.call(asm, [args[0]])
        return types.uint16(types.float32), codegen

    @cuda.jit(device=True)
    def pack2(lo, hi, kind):
        if kind == BF16:
            return _cvt_bf16x2(np.float32(hi), np.float32(lo))
        return _cvt_f16x2(np.float32(hi), np.float32(lo))

    @intrinsic
    def _ex2(typingctx, x):
        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.FloatType()]),
                               "ex2.approx.ftz.f32 $0, $1;", "=f,f")
            return builder.call(asm, [args[0]])
        return types.float32(x), codegen

    @cuda.jit(device=True)
    def exp2(x):
        return _ex2(np.float32(x))

    @intrinsic
    def _fmax(typingctx, a, b):
        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.FloatType(), ir.FloatType()]),
                               "max.ftz.f32 $0, $1, $2;", "=f,f,f")
            return builder.call(asm, [args[0], args[1]])
        return types.float32(types.float32, types.float32), codegen

    @cuda.jit(device=True)
    def fmax32(a, b):
        return _fmax(np.float32(a), np.float32(b))

    @cuda.jit(device=True)
    def to_f32(x, kind):
        if kind == BF16:
            return _as_f32(np.uint32(x) << np.uint32(16))
        return np.float32(x)

    @cuda.jit(device=True)
    def from_f32(v, kind):
        if kind == BF16:
            return _f32_to_bf16(np.float32(v))
        if kind == F16:
            return _f32_to_half(np.float32(v))
        return np.float32(v)

    @cuda.jit(device=True)
    def shfl_idx(v, src, scratch):
        return cuda.shfl_sync(0xFFFFFFFF, v, src)

    @cuda.jit(device=True)
    def shfl_xor(v, mask, scratch):
        return cuda.shfl_xor_sync(0xFFFFFFFF, v, mask)

    @cuda.jit(device=True)
    def group_sum(v, width, scratch):
        off = width // 2
        while off > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            off //= 2
        return v

    @cuda.jit(device=True)
    def group_max(v, width, scratch):
        off = width // 2
        while off > 0:
            v = vmax(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, off))
            off //= 2
        return v
