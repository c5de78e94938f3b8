"""The engine timeline's data and its Plotly figure (playground.timeline, playground.timeline_chart)."""

from __future__ import annotations

import json

import numpy as np
import plotly.graph_objects as go
import pytest

from playground.timeline import Timeline, percentiles
from playground.timeline_chart import timeline_figure

NOW = 1_000_000.0


def a_request(tl: Timeline, rid: str, t: float, prompt: int, cached: int, tokens: int, itl: float = 0.1) -> None:
    """The events one request makes: added, started, one prefill step, ``tokens - 1`` decode steps."""
    tl.on_event("request_added", t, {"request_id": rid, "num_prompt_tokens": prompt})
    tl.on_event("request_started", t, {"request_id": rid, "num_cached_tokens": cached})
    tl.on_step(t + 0.2, prompt - cached, 0, {rid: prompt - cached}, [])
    for i in range(1, tokens):
        tl.on_step(t + 0.2 + i * itl, 1, 1, {}, [rid])
    tl.on_event("request_finished", t + 0.2 + tokens * itl, {"request_id": rid, "num_output_tokens": tokens})


def test_idle_time_is_a_gap_not_a_line():
    tl = Timeline(gap_s=5)
    tl.on_snapshot(NOW - 100, {"requests": [{"status": "running"}] * 3, "kv_usage": 0.9})
    tl.on_snapshot(NOW - 99, {"requests": [], "kv_usage": 0.1})
    tl.on_snapshot(NOW - 20, {"requests": [{"status": "running"}], "kv_usage": 0.2})
    a_request(tl, "r1", NOW - 100, 40, 0, 5)
    a_request(tl, "r2", NOW - 20, 40, 0, 5)
    s = tl.series(120, now=NOW)
    # Running requests: 3, then 0, then nothing drawn for 79 idle seconds, then 1 (no ramp from 0 to 1).
    assert s["running"] == [3, 0, None, 1]
    assert s["samples"][2] == (s["samples"][1] + s["samples"][3]) / 2
    # Decode tok/s: values around the two requests, None over the idle minute in between.
    rates = dict(zip(s["seconds"], s["decode tok/s"]))
    assert rates[-99.5] == 4 and rates[-19.5] == 4
    assert all(v is None for x, v in rates.items() if -90 < x < -30)
    assert all(v is not None for x, v in rates.items() if -104 < x < -95)


def test_hits_ttft_and_itl_per_request():
    tl = Timeline()
    a_request(tl, "first", NOW - 30, 40, 0, 3, itl=0.05)
    for i in range(4):                      # a batch demo: half of each prompt from the prefix cache
        a_request(tl, f"batch-{i}", NOW - 10, 40, 20, 3, itl=0.1)
    s = tl.series(60, now=NOW)
    assert [round(h[1], 2) for h in s["hits"]] == [0.0, 0.5, 0.5, 0.5, 0.5]
    assert s["hits"][1][3] == "20 of 40 prompt tokens cached"
    assert [round(p[1]) for p in s["ttft"]] == [200] * 5
    assert round(s["ttft_pct"][50]) == 200
    assert round(s["itl_pct"][50]) == 100 and round(s["itl_pct"][99]) == 100
    assert round(min(v for v in s["ITL p50"] if v is not None)) == 50
    # A one-token reply never decodes: its TTFT comes with its end.
    a_request(tl, "one", NOW - 5, 10, 0, 1)
    assert len(tl.series(60, now=NOW)["ttft"]) == 6
    assert tl.series(20, now=NOW)["hits"][0][2] == "batch-0"        # the window drops older requests


def test_percentiles_are_numpys():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = list(rng.exponential(size=n))
        assert percentiles(values) == pytest.approx(dict(zip((50, 90, 99), np.percentile(values, (50, 90, 99)))))
    assert percentiles([]) is None


def test_the_figure_is_plotly_json_with_step_lines_and_gaps():
    tl = Timeline()
    a_request(tl, "r", NOW - 10, 40, 20, 4)
    fig = timeline_figure(tl.series(60, now=NOW))
    go.Figure(fig["data"], fig["layout"])               # Plotly itself accepts it (it validates)
    json.dumps(fig)
    lines = [t for t in fig["data"] if t["mode"] == "lines"]
    assert lines and all(t["line"]["shape"] == "hv" and t["connectgaps"] is False for t in lines)
    assert all("%{x" in t["hovertemplate"] for t in fig["data"])           # every point has its own hover
    hits = next(t for t in fig["data"] if t["name"] == "request hit rate")
    assert hits["y"] == [0.5] and hits["customdata"][0][0] == "r"
    assert fig["layout"]["xaxis"]["range"] == [-60, 0]
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert any(t.startswith("TTFT (ms) · p50/p90/p99 200/200/200 ms") for t in titles)
    assert fig["layout"]["font"]["size"] >= 12
