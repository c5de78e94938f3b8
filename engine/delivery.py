"""Handing out what the engine produced, outside its lock.

``FairLock`` serializes access to the (not thread-safe) engine in arrival
order. ``Outbox`` collects, under that lock, the engine's events (for
``subscribe`` callbacks) and deltas (for callers waiting on queues), and hands
them out in engine order after the lock is released, one thread at a time, so
a callback never runs while the engine is locked.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque

logger = logging.getLogger("engine")


class FairLock:
    """A re-entrant lock granted in arrival order.

    The engine thread re-takes the lock for every step; with a plain lock it
    would win every race and starve callers waiting to submit, abort or take
    a snapshot. Tickets make each waiter get its turn at the next step boundary.
    """

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._tickets = itertools.count()
        self._serving = 0
        self._owner: int | None = None
        self._depth = 0

    def __enter__(self):
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return self
            ticket = next(self._tickets)
            while ticket != self._serving:
                self._cond.wait()
            self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc):
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._serving += 1
                self._cond.notify_all()


class Outbox:
    """Events and ``(queue, delta)`` pairs in engine order; ``deliver`` runs callbacks / fills queues.

    ``put_*`` are called under the engine lock, ``deliver`` after it is released. A callback that
    itself triggers a delivery (``abort`` from a callback) leaves the new items to the loop already
    running on its thread, so callbacks never nest.
    """

    def __init__(self):
        self.listeners: list = []
        self._failed: set[int] = set()  # ids of subscribed listeners whose failure has been logged
        self._items: deque = deque()
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def delivering(self) -> bool:
        """True on a thread that is running callbacks right now."""
        return getattr(self._local, "delivering", False)

    def put_events(self, events) -> None:
        self._items.extend(events)

    def put_delta(self, q, delta) -> None:
        self._items.append((q, delta))

    def remove_listener(self, callback) -> None:
        """Unsubscribe ``callback``; its failures are forgotten with it (a later listener may reuse its id)."""
        if callback in self.listeners:
            self.listeners.remove(callback)
            self._failed.discard(id(callback))

    def _log_failure(self, callback) -> None:
        """A listener's first failure is logged with its traceback; later ones at debug level, so a
        view that breaks on every event does not bury the log under a traceback per token."""
        if id(callback) in self._failed:
            logger.debug("event listener %r failed again", callback, exc_info=True)
            return
        self._failed.add(id(callback))
        logger.exception("event listener %r failed (its later failures are logged at debug level)", callback)

    def take_deltas(self) -> list:
        """Empty the outbox, returning its ``(queue, delta)`` pairs and dropping its events."""
        items, self._items = self._items, deque()
        return [item for item in items if isinstance(item, tuple)]

    def deliver(self) -> None:
        if self.delivering:
            return
        with self._lock:
            self._local.delivering = True
            try:
                while True:
                    try:
                        item = self._items.popleft()
                    except IndexError:
                        return
                    if isinstance(item, tuple):
                        item[0].put(item[1])
                        continue
                    for callback in list(self.listeners):
                        try:
                            callback(item)
                        except Exception:  # a broken view must not break serving
                            self._log_failure(callback)
            finally:
                self._local.delivering = False
