"""The KV cache's history: every allocate, free, evict, preempt and recompute, each with its cause.

``KVEventLog`` is a bounded log of plain dicts (they pickle and go out as JSON as they are), kept
by the ``KVCacheManager`` and written where the thing happens:

* ``allocate`` (``KVCacheManager.allocate_slots``): a request got new blocks (``blocks``) and took
  prefix-cache hits (``shared``): "req-3 needed 2 blocks for 17 tokens";
* ``evict`` (``BlockPool.get_new_blocks``): a cached block lost its hash because an allocation took
  it from the front of the LRU queue: "req-3 needed 2 blocks; block 7 was the least recently used";
* ``free`` (``KVCacheManager.free``): a request's blocks went back (``cached``: the ones that stay in
  the prefix cache), because it finished or was preempted;
* ``preempt`` (``Scheduler``): "req-2 needed 1 block with 0 free: req-5, the newest running, gives
  its 6 blocks back";
* ``recompute`` (``Scheduler``, at re-admission): a preempted request resumes, N tokens computed again;
* ``reset`` (the prefix cache reset): every hash dropped.

A decode step writes nothing unless a request crosses into a new block (one ``allocate`` per
``block_size`` tokens); ``benchmarks/kv_events.py`` measures it. Every event has a sequence number,
so a reader asks for what it has not seen (``since``); the oldest are dropped past ``maxlen``.
The counts of ``preempt`` and ``evict`` equal the engine's counters (``Scheduler.num_preemptions``,
``BlockPool.num_evictions``) while nothing was dropped (``tests/test_kv_events.py``).
"""

from __future__ import annotations

import time
from collections import deque

__all__ = ["KVEventLog", "KINDS"]

KINDS = ("allocate", "free", "evict", "preempt", "recompute", "reset")


class KVEventLog:
    def __init__(self, maxlen: int = 4096):
        self._events: deque[dict] = deque(maxlen=maxlen)
        self._next = 0
        self.step = 0                   # the engine step being scheduled (set by the engine)

    def add(self, kind: str, request_id: str | None, blocks, cause: str, **extra) -> None:
        self._events.append({"seq": self._next, "step": self.step, "time": time.time(), "kind": kind,
                             "request_id": request_id, "blocks": list(blocks), "cause": cause, **extra})
        self._next += 1

    def since(self, seq: int = 0) -> dict:
        """``{"events": [...], "next": seq to ask for next, "dropped": events after ``seq`` no longer kept}``."""
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ValueError(f"since must be a non-negative integer (an event's seq); got {seq!r}")
        first = self._next - len(self._events)
        skip = max(0, seq - first)
        events = [dict(e) for i, e in enumerate(self._events) if i >= skip]
        return {"events": events, "next": self._next, "dropped": max(0, first - seq)}
