"""Work sharing between threads inside Numba code: atomic item counters and completion marks.

The fused decode step runs on a fixed team of threads (`engine.fused_decode`)
that walk the same sequence of *phases* (one per matmul or attention of each
layer). A phase is cut into items; a thread takes the next item with
``claim`` (an atomic add on the phase's counter) and marks it finished with
``finish``. Once no item is left to claim, the thread runs every item not yet
marked finished itself (``finished``), the ones another thread holds
included: an item writes the same values whoever computes it, so a second
copy is harmless, and a thread never waits for another one -- on a busy
machine a descheduled team member costs its own item, not a stall of the
whole step.

``counters[phase * STRIDE]`` counts a phase's claimed items (int64, zeroed
before the step; ``STRIDE`` keeps each on its own cache line).
``marks[phase, item]`` holds the step's ``epoch`` once the item's results are
written, so the marks need no clearing between steps.
"""
from __future__ import annotations

import ctypes

from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

STRIDE = 16  # int64 slots per phase counter: 128 bytes apart


def _pointer(context, builder, arr_t, arr, indices_t, indices):
    ary = context.make_array(arr_t)(context, builder, arr)
    idx = [context.cast(builder, i, t, types.intp) for i, t in zip(indices, indices_t)]
    return cgutils.get_item_pointer(context, builder, arr_t, ary, idx)


def _check(arr, ndim):
    if not (isinstance(arr, types.Array) and arr.ndim == ndim and arr.dtype == types.int64):
        raise TypeError(f"expected a {ndim}-d int64 array, got {arr}")


@intrinsic
def atomic_add(typingctx, arr, index, value):
    """``arr[index] += value`` atomically; returns the value before."""
    _check(arr, 1)

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig.args[0], args[0], [sig.args[1]], [args[1]])
        return builder.atomic_rmw("add", ptr, context.cast(builder, args[2], sig.args[2], types.int64), "seq_cst")
    return types.int64(arr, index, value), codegen


@intrinsic
def atomic_load2(typingctx, arr, i, j):
    """``arr[i, j]`` read atomically (acquire: what was written before its store is visible)."""
    _check(arr, 2)

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1:], args[1:])
        return builder.load_atomic(ptr, "acquire", 8)
    return types.int64(arr, i, j), codegen


@intrinsic
def atomic_store2(typingctx, arr, i, j, value):
    """``arr[i, j] = value`` atomically (release: the writes before it are visible first)."""
    _check(arr, 2)

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1:3], args[1:3])
        builder.store_atomic(context.cast(builder, args[3], sig.args[3], types.int64), ptr, "release", 8)
        return context.get_dummy_value()
    return types.void(arr, i, j, value), codegen


@njit(nogil=True, cache=True)
def claim(counters, phase):
    """The next item of ``phase`` for the calling thread (>= the item count: none left)."""
    return atomic_add(counters, phase * STRIDE, 1)


@njit(nogil=True, cache=True)
def finish(marks, phase, item, epoch):
    """Mark ``item`` of ``phase`` finished in step ``epoch`` (call after writing its results)."""
    atomic_store2(marks, phase, item, epoch)


@njit(nogil=True, cache=True)
def finished(marks, phase, item, epoch):
    """Whether ``item`` of ``phase`` is finished in step ``epoch`` (its results then visible)."""
    return atomic_load2(marks, phase, item) == epoch


# -- joining a step ---------------------------------------------------------------------------
# A team member is a Python thread, woken for each step: it needs the interpreter lock to wake
# and to return, and the app's threads (Gradio's, the monitor's) hold that lock at times. So the
# caller neither waits for members to come nor for them to return to Python: it opens a step
# (``open_step``), runs its own part, and closes it (``close_step``), waiting only for members
# inside the step's Numba code, which need no lock to finish. A member that comes after the close
# leaves at once (``join_step``): the caller has done its part.
OPEN, ACTIVE = 0, STRIDE       # control slots: the epoch members may join (-1: none), members inside
CONTROL_SIZE = 2 * STRIDE

_libc = ctypes.CDLL(None)
_sched_yield = _libc.sched_yield
_sched_yield.restype = ctypes.c_int
_sched_yield.argtypes = []


@intrinsic
def atomic_load(typingctx, arr, index):
    """``arr[index]`` read atomically (sequentially consistent)."""
    _check(arr, 1)

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig.args[0], args[0], [sig.args[1]], [args[1]])
        return builder.load_atomic(ptr, "seq_cst", 8)
    return types.int64(arr, index), codegen


@intrinsic
def atomic_store(typingctx, arr, index, value):
    """``arr[index] = value`` atomically (sequentially consistent)."""
    _check(arr, 1)

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig.args[0], args[0], [sig.args[1]], [args[1]])
        builder.store_atomic(context.cast(builder, args[2], sig.args[2], types.int64), ptr, "seq_cst", 8)
        return context.get_dummy_value()
    return types.void(arr, index, value), codegen


@njit(nogil=True, cache=True)
def open_step(control, epoch):
    """Let members join step ``epoch`` (call before waking them)."""
    atomic_store(control, OPEN, epoch)


@njit(nogil=True, cache=True)
def join_step(control, epoch):
    """A member entering step ``epoch``: True if it may run its part (then call ``leave_step``
    after it), False if the step is closed (it must not touch the step's buffers)."""
    atomic_add(control, ACTIVE, 1)
    if atomic_load(control, OPEN) == epoch:
        return True
    atomic_add(control, ACTIVE, -1)
    return False


@njit(nogil=True, cache=True)
def leave_step(control):
    atomic_add(control, ACTIVE, -1)


@njit(nogil=True)   # not cached: Numba does not cache a function that calls a ctypes pointer
def close_step(control):
    """No member joins from now on; returns once every member inside has left (a member that
    joined is running Numba code: it needs no interpreter lock to finish). Yields the CPU
    while waiting, for a member the OS has descheduled."""
    atomic_store(control, OPEN, -1)
    spins = 0
    while atomic_load(control, ACTIVE) != 0:
        spins += 1
        if spins > 64:
            _sched_yield()
