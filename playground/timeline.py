"""The engine timeline: the last minutes of the engine, second by second.

What a vLLM/SGLang dashboard shows, from the engine's own events and
snapshots: tokens/s (prefill and decode apart), running and waiting requests,
preemptions, KV usage and the prefix-cache hit rate. ``EngineMonitor`` feeds
a ``Timeline`` from its event callback (steps, preemptions) and its snapshot
poller; ``timeline_html`` draws it as four small line charts.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from .styles import CSS as _CSS
from .svgchart import line_chart_svg

__all__ = ["Timeline", "timeline_html"]


class Timeline:
    """Per-second counters and snapshot samples of the last ``window`` seconds."""

    def __init__(self, window: int = 120):
        self.window = window
        self._seconds: dict[int, dict[str, float]] = {}
        self._samples: deque[tuple[float, int, int, float, int, int]] = deque(maxlen=4 * window)
        self._lock = threading.Lock()

    def _bucket(self, t: float) -> dict[str, float]:
        sec = int(t)
        bucket = self._seconds.get(sec)
        if bucket is None:
            bucket = self._seconds[sec] = {"prefill": 0, "decode": 0, "preempted": 0}
            for old in [s for s in self._seconds if s < sec - self.window]:
                del self._seconds[old]
        return bucket

    def on_step(self, t: float, num_tokens: int, num_decode: int) -> None:
        with self._lock:
            bucket = self._bucket(t)
            bucket["decode"] += num_decode
            bucket["prefill"] += max(num_tokens - num_decode, 0)

    def on_preempt(self, t: float) -> None:
        with self._lock:
            self._bucket(t)["preempted"] += 1

    def on_snapshot(self, t: float, snap: Mapping[str, Any]) -> None:
        requests = snap.get("requests") or []
        running = sum(r.get("status") == "running" for r in requests)
        stats = snap.get("prefix_cache") or {}
        with self._lock:
            self._samples.append((t, running, len(requests) - running, float(snap.get("kv_usage", 0.0)),
                                  int(stats.get("hits", 0)), int(stats.get("queries", 0))))

    def series(self, now: float | None = None) -> dict[str, list[tuple[float, float]]]:
        """Each quantity as ``[(seconds ago (negative), value), ...]``, oldest first."""
        now = time.time() if now is None else now
        start = int(now) - self.window
        with self._lock:
            seconds = dict(self._seconds)
            samples = [s for s in self._samples if s[0] >= now - self.window]
        out: dict[str, list[tuple[float, float]]] = {k: [] for k in (
            "decode tok/s", "prefill tok/s", "preemptions", "running", "waiting", "KV usage", "prefix hit rate")}
        for sec in range(start, int(now)):          # complete seconds only
            b = seconds.get(sec, {"prefill": 0, "decode": 0, "preempted": 0})
            x = sec + 1 - now
            out["decode tok/s"].append((x, b["decode"]))
            out["prefill tok/s"].append((x, b["prefill"]))
            out["preemptions"].append((x, b["preempted"]))
        prev = None
        for t, running, waiting, kv, hits, queries in samples:
            x = t - now
            out["running"].append((x, running))
            out["waiting"].append((x, waiting))
            out["KV usage"].append((x, kv))
            if prev is not None and queries > prev[1]:
                out["prefix hit rate"].append((x, (hits - prev[0]) / (queries - prev[1])))
            prev = (hits, queries)
        return out


def timeline_html(series: Mapping[str, list[tuple[float, float]]], window: int = 120) -> str:
    """Four small charts: tokens/s, requests, KV usage, prefix hit rate (per prompt read)."""
    x_range = (-float(window), 0.0)
    preempted = sum(v for _, v in series.get("preemptions", []))
    charts = [
        line_chart_svg([("decode tok/s", "#6366f1", series.get("decode tok/s", [])),
                        ("prefill tok/s", "#d97706", series.get("prefill tok/s", []))],
                       x_range=x_range, title="tokens/s (decode, prefill)", css_class="pg-chart tl-tokens"),
        line_chart_svg([("running", "#16a34a", series.get("running", [])),
                        ("waiting", "#dc2626", series.get("waiting", []))],
                       x_range=x_range, title=f"running, waiting · {preempted:.0f} preempted",
                       css_class="pg-chart tl-requests"),
        line_chart_svg([("KV usage", "#0e7490", series.get("KV usage", []))], x_range=x_range, percent=True,
                       title="KV usage", css_class="pg-chart tl-kv"),
        line_chart_svg([("prefix hit rate", "#16a34a", series.get("prefix hit rate", []))], x_range=x_range,
                       percent=True, title="prefix hit rate",
                       css_class="pg-chart tl-hits"),
    ]
    cells = "".join(f"<div>{c}</div>" for c in charts)
    return (f'{_CSS}<div class="pg-panel timeline"><div class="pg-sub">Engine timeline (last {window} s)</div>'
            f'<div style="display:grid;grid-template-columns:1fr 1fr;gap:4px 10px">{cells}</div></div>')
