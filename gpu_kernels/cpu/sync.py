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
