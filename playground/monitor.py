"""What the live views draw from: the latest engine snapshot and recent steps.

One ``EngineMonitor`` serves every browser tab of an app:

* it subscribes to the engine's events and keeps the most recent ``step``
  events in a ring buffer (the batch-size chart); the callback runs on the
  engine thread, so it only appends a small dict;
* a background thread takes ``llm.snapshot()`` whenever an event says the
  engine changed (at most every ``interval`` seconds) and keeps it as a dict;
  views render from that copy, so many tabs refreshing never add load on the
  engine and never wait for it.

The snapshot shares the engine's lock and the interpreter with the decode
loop, so the monitor keeps its own cost small: the dict is built without
``dataclasses.asdict``'s deep copy (the snapshot's fields are immutable), and
while no view has read the snapshot for ``idle_after`` seconds it is taken
only every ``idle_interval`` seconds (the timeline keeps its samples).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Protocol

from engine.snapshot import EngineEvent, EngineSnapshot

from .timeline import Timeline

__all__ = ["EngineMonitor", "snapshot_dict"]


def snapshot_dict(snapshot: EngineSnapshot, last: tuple[EngineSnapshot, dict] | None = None) -> dict:
    """``snapshot.to_dict()``, built without copying what cannot change.

    ``EngineSnapshot`` is frozen and its fields are tuples, strings and numbers
    (``StepInfo.prefill``, a dict, is copied), so the nested dataclasses become
    dicts and everything else is shared; ``asdict`` deep-copies every value.
    With ``last`` (the previous snapshot and its dict), a block whose ``BlockInfo``
    is the same object as in the previous snapshot (the engine keeps those of
    unchanged blocks, ``engine.snapshot.BlockInfos``) keeps its dict too: views
    then find the changed blocks by identity (``playground.render``).
    """
    out = {k: _plain(v) for k, v in vars(snapshot).items() if k != "blocks"}
    before, before_dicts = (last[0].blocks, last[1]["blocks"]) if last else ((), ())
    if len(before) != len(snapshot.blocks):
        before = ()
    out["blocks"] = tuple(before_dicts[i] if before and before[i] is b else _plain(b)
                          for i, b in enumerate(snapshot.blocks))
    return out


def _plain(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return {k: _plain(v) for k, v in vars(value).items()}
    if type(value) is tuple:
        return tuple(map(_plain, value)) if value and hasattr(value[0], "__dataclass_fields__") else value
    if type(value) is dict:
        return {k: _plain(v) for k, v in value.items()}
    if type(value) is list:
        return [_plain(v) for v in value]
    return value


class Observable(Protocol):
    """What the monitor needs of an ``engine.LLM``."""

    def snapshot(self) -> EngineSnapshot: ...

    def subscribe(self, callback: Callable[[EngineEvent], None]) -> Callable[[], None]: ...


class EngineMonitor:
    """Latest snapshot dict + ring buffer of the last ``capacity`` engine steps."""

    def __init__(self, llm: Observable, *, capacity: int = 200, interval: float = 0.5,
                 idle_interval: float = 1.0, idle_after: float = 2.0):
        self.llm = llm
        self.interval = interval
        self.idle_interval, self.idle_after = max(idle_interval, interval), idle_after
        self._read_at = time.monotonic()     # when a view last read the snapshot
        self._steps: deque[dict] = deque(maxlen=capacity)
        # engine step -> (time, duration, prefill {request: tokens}, decode requests): the per-reply batch view
        self._batches: OrderedDict[int, tuple] = OrderedDict()
        self.batches_capacity = 4096
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._wake = threading.Event()           # ends the idle pause early: a view is back
        self._stop = threading.Event()
        self.num_steps = 0
        self.version = 0            # bumps with every new snapshot: a view's cheap "did anything change"
        self.timeline = Timeline()
        self._last = None           # (snapshot, its dict): unchanged blocks keep their dicts
        self._owners: dict[int, tuple[str, str, tuple]] = {}    # block -> (hash, request, range) last held
        first = llm.snapshot()
        # The views count from here: the warm-up's steps and prefix-cache reset are not the visitors'.
        stats = first.prefix_cache
        self._base = (first.step, stats.queries, stats.hits, stats.reset_count) if stats is not None else None
        self._snapshot = self._dict(first)
        self.timeline.on_snapshot(time.time(), self._snapshot)
        self._unsubscribe = llm.subscribe(self._on_event)
        self._thread = threading.Thread(target=self._poll, name="playground-monitor", daemon=True)
        self._thread.start()

    # -- engine thread ------------------------------------------------------------
    def _on_event(self, event: EngineEvent) -> None:
        if event.kind == "step":
            data = event.data
            record = {
                "step": event.step - (self._base[0] if self._base else 0),
                "time": event.time,
                "batch_size": int(data["batch_size"]),
                "num_tokens": data["num_tokens"],
                "duration_s": data["duration_s"],
                "num_prefill": len(data["prefill"]),
                "num_decode": len(data["decode"]),
            }
            with self._lock:
                self._steps.append(record)
                self.num_steps += 1
                self._batches[event.step] = (event.time, data["duration_s"], data["prefill"], data["decode"])
                if len(self._batches) > self.batches_capacity:
                    self._batches.popitem(last=False)
            self.timeline.on_step(event.time, record["num_tokens"], record["num_decode"], data["prefill"],
                                  data["decode"])
        elif event.kind.startswith("request_"):
            self.timeline.on_event(event.kind, event.time, event.data)
        self._changed.set()

    # -- poller thread ------------------------------------------------------------
    def _poll(self) -> None:
        while not self._stop.is_set():
            self._changed.wait()
            if self._stop.is_set():
                return
            self._changed.clear()
            started = time.monotonic()
            self.refresh()
            # At most one snapshot per interval, counting the time the snapshot itself took;
            # a slower pace while no view reads them.
            watched = time.monotonic() - self._read_at < self.idle_after
            pause = self.interval if watched else self.idle_interval
            self._wake.wait(max(0.0, pause - (time.monotonic() - started)))
            self._wake.clear()

    def refresh(self) -> dict:
        """Take a fresh snapshot now (blocks until the engine lets us) and return it."""
        snap = self._dict(self.llm.snapshot())
        with self._lock:
            self._snapshot = snap
            self.version += 1
        self.timeline.on_snapshot(time.time(), snap)
        return snap

    def _dict(self, snapshot: EngineSnapshot) -> dict:
        before = self._last[1]["blocks"] if self._last else ()
        snap = snapshot_dict(snapshot, self._last)
        self._last = (snapshot, snap)
        blocks = snap["blocks"]
        for i, b in enumerate(blocks):
            if (not before or before[i] is not b) and b.get("owners") and b.get("block_hash") and b.get("token_range"):
                self._owners[b["block_id"]] = (b["block_hash"], b["owners"][0], tuple(b["token_range"]))
        if self._base is not None:
            step, queries, hits, resets = self._base
            stats = dict(snap.get("prefix_cache") or {})
            stats["queries"], stats["hits"] = stats.get("queries", 0) - queries, stats.get("hits", 0) - hits
            stats["reset_count"] = stats.get("reset_count", 0) - resets
            stats["hit_rate"] = stats["hits"] / stats["queries"] if stats["queries"] > 0 else 0.0
            snap = dict(snap, step=snap.get("step", 0) - step, prefix_cache=stats)
        return snap

    def last_owner(self, block_id: int | None) -> tuple[str, str, tuple] | None:
        """``(block hash, request, token range)`` of the request that last held ``block_id`` with that hash."""
        return self._owners.get(block_id) if block_id is not None else None

    # -- readers (any thread) -------------------------------------------------------
    def mark_read(self) -> None:
        """A view is watching: keep (or bring back at once) the fast pace of snapshots."""
        if time.monotonic() - self._read_at >= self.idle_after:
            self._wake.set()                 # a view is back: the next snapshot without the idle pause
        self._read_at = time.monotonic()

    def snapshot(self) -> dict:
        """The latest snapshot dict (at most about ``interval`` s behind the engine while views read it)."""
        self.mark_read()
        with self._lock:
            return self._snapshot

    def steps(self, last: int | None = None) -> list[dict]:
        """The recorded steps, oldest first (only the ``last`` N if given)."""
        with self._lock:
            items = list(self._steps)
        return items[-last:] if last else items

    def batches(self, steps) -> dict[int, tuple]:
        """For each engine step of ``steps`` still recorded: ``(time, duration_s, prefill, decode)``, who
        the step served (``prefill``: request -> tokens, ``decode``: requests)."""
        with self._lock:
            return {s: self._batches[s] for s in steps if s in self._batches}

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until the latest snapshot shows no live request; return it."""
        deadline = time.monotonic() + timeout
        snap = self.refresh()
        while snap.get("requests") and time.monotonic() < deadline:
            time.sleep(0.05)
            snap = self.refresh()
        return snap

    def close(self) -> None:
        """Stop listening to the engine and end the poller thread."""
        self._stop.set()
        self._wake.set()
        self._changed.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
