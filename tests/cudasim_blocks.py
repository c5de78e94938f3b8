"""Numba's CUDA simulator with a block scheduler that waits for its threads instead of polling them.

The simulator runs each thread of a block as a Python thread; ``BlockManager.run``
(``numba/cuda/simulator/kernel.py``, numba 0.68.1) then polls them in a busy loop -- every
thread's ``syncthreads_blocked`` flag, ``exception`` and ``is_alive()`` -- until all live
threads wait at a barrier, releases them, and so on until none is alive. The poller holds
the GIL for much of the time the simulated threads could compute, and burns the CPU doing so.

`install` replaces that loop with one that sleeps on a condition until it has something to
do. The rules are the library's: a barrier opens when every thread still running waits at
it (a thread that has returned no longer counts), a thread's exception aborts the block's
other threads (``abort``, their events set) and is raised in the launching thread with the
thread's message, and a block ends when all its threads have returned. What a thread does at
a barrier is the library's ``BlockThread.syncthreads`` (abort checks, its event), plus the
count the scheduler waits on.
"""

from __future__ import annotations

import threading

import numpy as np
from numba.cuda.simulator import kernel as sim


class _Block:
    """What a block's threads tell its scheduler: how many still run, how many wait at the
    barrier, the first that failed."""

    def __init__(self, size: int):
        self.changed = threading.Condition()
        self.live, self.waiting, self.failed = size, 0, None


def _syncthreads(self):
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    block = self._manager._block
    with block.changed:
        self.syncthreads_blocked = True
        block.waiting += 1
        if block.waiting == block.live:
            block.changed.notify()
    self.syncthreads_event.wait()
    self.syncthreads_event.clear()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


_thread_run = sim.BlockThread.run


def _run_thread(self):
    try:
        _thread_run(self)       # the library's: records the thread's exception with its message
    finally:
        block = self._manager._block
        with block.changed:
            block.live -= 1
            if self.exception and block.failed is None:
                block.failed = self
            block.changed.notify()


def _run_block(self, grid_point, *args):
    threads = []
    self._block = block = _Block(int(np.prod(self._block_dim)))
    for block_point in np.ndindex(*self._block_dim):
        def target():
            self._f(*args)
        t = sim.BlockThread(target, self, grid_point, block_point, self._debug)
        threads.append(t)
    for t in threads:
        t.start()
    with block.changed:
        while True:
            block.changed.wait_for(lambda: block.failed is not None or block.live == 0
                                   or block.waiting == block.live)
            if block.failed is not None:
                for other in threads:
                    other.abort = True
                    other.syncthreads_blocked = False
                    other.syncthreads_event.set()
                raise block.failed.exception[0].with_traceback(block.failed.exception[1])
            if block.live == 0:
                break
            for t in threads:       # every thread still running waits at the barrier: open it
                if t.syncthreads_blocked:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
            block.waiting = 0
    for t in threads:
        if t.exception:
            raise t.exception[0].with_traceback(t.exception[1])


def install() -> None:
    sim.BlockThread.syncthreads = _syncthreads
    sim.BlockThread.run = _run_thread
    sim.BlockManager.run = _run_block
