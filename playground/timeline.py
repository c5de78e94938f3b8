"""The engine timeline: the last minutes of the engine, from its own events and snapshots.

What a vLLM/SGLang dashboard shows: tokens/s (prefill and decode apart), running and waiting
requests, preemptions, KV usage, the prefix-cache hit rate of each request as it starts (its
cached prompt tokens over its prompt), the time to first token of each request and the
inter-token latency of each decoded token. ``EngineMonitor`` feeds a ``Timeline`` from its event
callback and its snapshot poller; ``playground.timeline_chart`` draws ``Timeline.series``.

Idle time is a gap, not a line: a per-second rate is ``None`` for a second with no engine step
within ``gap_s`` of it, and two snapshot samples more than ``gap_s`` apart are not joined.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

__all__ = ["Timeline", "WINDOWS", "percentiles"]

WINDOWS = (60, 120, 300, 900)          # the windows the page offers, seconds
KEEP_S = max(WINDOWS)


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[int, float] | None:
    """``{50: p50, 90: p90, 99: p99}`` of ``values``, None when empty: numpy's default (linear
    interpolation between the closest ranks), computed here since ``np.percentile``'s overhead per
    call was three quarters of a timeline refresh (one call per second of the window)."""
    if not values:
        return None
    ordered, out = sorted(values), {}
    for q in qs:
        pos = (len(ordered) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        out[q] = float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
    return out


class Timeline:
    """Per-second counters, snapshot samples and per-request latencies of the last ``keep`` seconds."""

    def __init__(self, keep: int = KEEP_S, gap_s: float = 5.0):
        self.keep, self.gap_s = keep, gap_s
        self._seconds: dict[int, dict[str, Any]] = {}
        self._samples: deque[tuple[float, int, int, float]] = deque(maxlen=10 * keep)
        self._hits: deque[tuple[float, int, int, str]] = deque(maxlen=4096)     # (t, cached, prompt, request)
        self._ttft: deque[tuple[float, float, str]] = deque(maxlen=4096)        # (first token t, ttft s, request)
        self._added: dict[str, tuple[float, int]] = {}       # request -> (added at, prompt tokens)
        self._prefilled: dict[str, float] = {}              # request -> its last prefill step's end
        self._last_token: dict[str, float] = {}             # request -> when its latest token came
        self._lock = threading.Lock()

    def _bucket(self, t: float) -> dict[str, Any]:
        sec = int(t)
        bucket = self._seconds.get(sec)
        if bucket is None:
            bucket = self._seconds[sec] = {"prefill": 0, "decode": 0, "preempted": 0, "steps": 0, "itl": []}
            for old in [s for s in self._seconds if s < sec - self.keep]:
                del self._seconds[old]
        return bucket

    # -- the engine's events (its event thread) ---------------------------------------
    def on_step(self, t: float, num_tokens: int, num_decode: int, prefill: Mapping[str, int] = (),
                decode: list[str] | tuple = ()) -> None:
        with self._lock:
            bucket = self._bucket(t)
            bucket["steps"] += 1
            bucket["decode"] += num_decode
            bucket["prefill"] += max(num_tokens - num_decode, 0)
            for rid in prefill:
                self._prefilled[rid] = t
            for rid in decode:
                last = self._last_token.get(rid)
                if last is None:                     # its first decode step: the prefill made its first token
                    last = self._first_token(rid)
                if last is not None:
                    bucket["itl"].append(t - last)
                self._last_token[rid] = t

    def _first_token(self, rid: str) -> float | None:
        first, added = self._prefilled.get(rid), self._added.get(rid)
        if first is None:
            return None
        if added is not None:
            self._ttft.append((first, first - added[0], rid))
        self._last_token[rid] = first
        return first

    def on_event(self, kind: str, t: float, data: Mapping[str, Any]) -> None:
        """A request's event: added, started (its prefix-cache hits), preempted, finished."""
        rid = data.get("request_id")
        with self._lock:
            if kind == "request_added":
                self._added[rid] = (t, int(data.get("num_prompt_tokens") or 0))
            elif kind == "request_started" and rid in self._added and rid not in self._prefilled:
                prompt = self._added[rid][1]
                if prompt:
                    self._hits.append((t, int(data.get("num_cached_tokens") or 0), prompt, rid))
            elif kind == "request_preempted":
                self._bucket(t)["preempted"] += 1
            elif kind == "request_finished":
                if rid not in self._last_token and data.get("num_output_tokens"):
                    self._first_token(rid)           # one token only: it never decoded
                for table in (self._added, self._prefilled, self._last_token):
                    table.pop(rid, None)

    def on_snapshot(self, t: float, snap: Mapping[str, Any]) -> None:
        requests = snap.get("requests") or []
        running = sum(r.get("status") == "running" for r in requests)
        with self._lock:
            self._samples.append((t, running, len(requests) - running, float(snap.get("kv_usage", 0.0))))

    # -- what the chart draws ------------------------------------------------------------
    def series(self, window: int = 120, now: float | None = None) -> dict[str, Any]:
        """The last ``window`` seconds, x in seconds before ``now`` (negative):

        ``seconds`` (x of the per-second rates), ``decode tok/s``, ``prefill tok/s``, ``ITL p50`` and
        ``ITL p99`` (ms; None where idle); ``samples`` (x), ``running``, ``waiting``, ``KV usage``
        (None between samples more than ``gap_s`` apart); ``hits`` and ``ttft``: one point per
        request, ``(x, value, request id, detail)``; ``preempted`` (count), and the window's
        percentiles ``ttft_pct`` / ``itl_pct`` (ms, None without data).
        """
        now = time.time() if now is None else now
        start = int(now) - window
        with self._lock:
            seconds = {s: dict(b, itl=list(b["itl"])) for s, b in self._seconds.items() if s >= start - self.gap_s}
            samples = [s for s in self._samples if s[0] >= now - window]
            hits = [h for h in self._hits if h[0] >= now - window]
            ttft = [p for p in self._ttft if p[0] >= now - window]
        active = sorted(s for s, b in seconds.items() if b["steps"])
        out: dict[str, Any] = {k: [] for k in ("seconds", "decode tok/s", "prefill tok/s", "ITL p50", "ITL p99",
                                               "samples", "running", "waiting", "KV usage")}
        itl_all: list[float] = []
        j = 0
        for sec in range(start, int(now)):          # complete seconds only
            while j < len(active) and active[j] < sec - self.gap_s:
                j += 1
            near = j < len(active) and active[j] <= sec + self.gap_s
            b = seconds.get(sec)
            out["seconds"].append(round(sec + 0.5 - now, 2))
            itl = b["itl"] if b else []
            itl_all += itl
            pct = percentiles(itl, (50, 99))
            out["decode tok/s"].append((b["decode"] if b else 0) if near else None)
            out["prefill tok/s"].append((b["prefill"] if b else 0) if near else None)
            out["ITL p50"].append(round(pct[50] * 1000, 1) if pct else None)
            out["ITL p99"].append(round(pct[99] * 1000, 1) if pct else None)
        prev = None
        for t, running, waiting, kv in samples:
            if prev is not None and t - prev > self.gap_s:          # idle in between: a break, not a line
                for key in ("samples", "running", "waiting", "KV usage"):
                    out[key].append(None if key != "samples" else round((prev + t) / 2 - now, 2))
            out["samples"].append(round(t - now, 2))
            out["running"].append(running)
            out["waiting"].append(waiting)
            out["KV usage"].append(round(kv, 4))
            prev = t
        out["hits"] = [(round(t - now, 2), round(cached / prompt, 4), rid, f"{cached} of {prompt} prompt tokens cached")
                       for t, cached, prompt, rid in hits]
        out["ttft"] = [(round(t - now, 2), round(s * 1000, 1), rid, "") for t, s, rid in ttft]
        out["preempted"] = sum(b["preempted"] for s, b in seconds.items() if s >= start)
        ttft_pct = percentiles([s for _, s, _ in ttft])
        itl_pct = percentiles(itl_all)
        out["ttft_pct"] = {q: v * 1000 for q, v in ttft_pct.items()} if ttft_pct else None
        out["itl_pct"] = {q: v * 1000 for q, v in itl_pct.items()} if itl_pct else None
        out["window"] = window
        return out
