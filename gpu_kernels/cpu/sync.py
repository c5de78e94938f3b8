"""Work sharing between threads inside Numba code: atomic counters and a polite spin wait.

The fused decode step runs on a fixed team of threads (`engine.fused_decode`)
that walk the same sequence of *phases* (one per matmul or attention of each
layer). A phase is cut into items; a thread takes the next item with
``claim`` (an atomic add) and reports it done with ``done``; ``wait_done``
returns once every item of the phase is finished, whichever thread ran it.
A thread that falls behind (descheduled on a busy machine) finds the items
taken and moves on, so nobody waits for a thread to *arrive*, only for work
in progress to end.

A phase's counters are ``counters[phase * STRIDE]`` (items claimed) and
``counters[phase * STRIDE + STRIDE // 2]`` (items done), int64, zeroed before
the step; ``STRIDE`` keeps every counter on its own cache line.
"""
from __future__ import annotations

import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
STRIDE = 16  # int64 slots per phase: claim and done counters 64 bytes apart
SPINS_BEFORE_YIELD = 1 << 12

_sched_yield = types.ExternalFunction("sched_yield", types.int32())


def _pointer(context, builder, arr_t, arr, index_t, index):
    ary = context.make_array(arr_t)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arr_t, ary, [context.cast(builder, index, index_t, types.intp)])


def _check(arr):
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.int64):
        raise TypeError(f"expected a 1-d int64 array of counters, got {arr}")


@intrinsic
def atomic_add(typingctx, arr, index, value):
    """``arr[index] += value`` atomically; returns the value before."""
    _check(arr)

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return builder.atomic_rmw("add", ptr, context.cast(builder, args[2], sig.args[2], types.int64), "seq_cst")
    return types.int64(arr, index, value), codegen


@intrinsic
def atomic_load(typingctx, arr, index):
    """``arr[index]`` read atomically (acquire)."""
    _check(arr)

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return builder.load_atomic(ptr, "acquire", 8)
    return types.int64(arr, index), codegen


@intrinsic
def cpu_relax(typingctx):
    """The spin-wait hint (x86 ``pause``; nothing elsewhere)."""
    def codegen(context, builder, sig, args):
        if _X86:
            pause = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                   "llvm.x86.sse2.pause")
            builder.call(pause, [])
        return context.get_dummy_value()
    return types.void(), codegen


@njit(nogil=True, cache=True)
def claim(counters, phase):
    """The next item of ``phase`` for the calling thread (>= the item count: none left)."""
    return atomic_add(counters, phase * STRIDE, 1)


@njit(nogil=True, cache=True)
def done(counters, phase, items):
    """Report ``items`` items of ``phase`` finished (their results written)."""
    atomic_add(counters, phase * STRIDE + STRIDE // 2, items)


@njit(nogil=True, cache=True)
def wait_done(counters, phase, total):
    """Return once ``total`` items of ``phase`` are finished: spin a while, then yield the core."""
    spins = 0
    while atomic_load(counters, phase * STRIDE + STRIDE // 2) < total:
        spins += 1
        if spins < SPINS_BEFORE_YIELD:
            cpu_relax()
        else:
            _sched_yield()
