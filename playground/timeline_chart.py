"""The engine timeline as one Plotly figure: six charts over a shared time axis.

tokens/s (decode, prefill), requests (running, waiting), KV usage, the prefix-cache hit rate of
each request as it starts, each request's time to first token and the inter-token latency's
p50 and p99 per second, with the window's TTFT and ITL percentiles in their charts' titles. Rates and states are step lines (``line_shape="hv"``: a value holds until the next one),
idle time is a gap (``None``, ``connectgaps=False``), every point has its own hover.

The figure's frame (subplots, axes, trace styles) is built once with ``plotly.graph_objects``;
each drawing copies it and fills in the points (``timeline_figure``), so the once-a-second
refresh of every open tab never runs Plotly's validation. The page draws the figure with the
Plotly.js that Gradio's ``gr.Plot`` brings (``playground.live_panels`` calls ``Plotly.react``).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

__all__ = ["timeline_figure", "FONT_PX", "HEIGHT_PX"]

FONT_PX = 12            # legible on a phone: the figure is drawn at its size, not scaled down
HEIGHT_PX = 760
ROWS = ("tokens/s", "requests", "KV usage", "prefix hit rate", "TTFT", "inter-token latency")
# (row, name, colour, series key, shape): the per-second and per-sample lines
LINES = (
    (1, "decode tok/s", "#6366f1", "seconds", "decode tok/s"),
    (1, "prefill tok/s", "#d97706", "seconds", "prefill tok/s"),
    (2, "running", "#16a34a", "samples", "running"),
    (2, "waiting", "#dc2626", "samples", "waiting"),
    (3, "KV usage", "#0e7490", "samples", "KV usage"),
    (6, "ITL p50", "#6366f1", "seconds", "ITL p50"),
    (6, "ITL p99", "#a855f7", "seconds", "ITL p99"),
)
# (row, name, colour, series key): one marker per request
POINTS = (
    (4, "request hit rate", "#16a34a", "hits"),
    (5, "TTFT", "#d97706", "ttft"),
)


@functools.lru_cache(maxsize=1)
def _frame() -> dict:
    """The figure without data, as Plotly's JSON (validated once)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=len(ROWS), cols=1, shared_xaxes=True, vertical_spacing=0.055, subplot_titles=ROWS)
    for row, name, color, _, key in LINES:
        fig.add_trace(go.Scatter(
            name=name, mode="lines", line={"color": color, "width": 2, "shape": "hv"}, connectgaps=False,
            hovertemplate=f"{name}: %{{y:.{3 if key == 'KV usage' else 0}~f}}<br>%{{x:.1f}} s<extra></extra>"
            if key != "KV usage" else "KV usage: %{y:.1%}<br>%{x:.1f} s<extra></extra>",
            meta=key), row=row, col=1)
    for row, name, color, key in POINTS:
        fmt = "%{y:.0%}" if key == "hits" else "%{y:,.0f} ms"
        fig.add_trace(go.Scatter(
            name=name, mode="markers", marker={"color": color, "size": 9},
            hovertemplate=f"%{{customdata[0]}}<br>{name}: {fmt}<br>%{{customdata[1]}}%{{x:.1f}} s<extra></extra>",
            meta=key), row=row, col=1)
    fig.update_layout(
        height=HEIGHT_PX, margin={"l": 48, "r": 8, "t": 28, "b": 36}, font={"size": FONT_PX},
        hovermode="closest", showlegend=True, uirevision="timeline", template="none", plot_bgcolor="#ffffff",
        legend={"orientation": "h", "y": -0.04, "x": 0, "font": {"size": FONT_PX}},
    )
    fig.update_annotations(font_size=FONT_PX + 1, x=0, xanchor="left")
    fig.update_xaxes(gridcolor="#e2e8f0", zeroline=False, ticksuffix=" s", tickfont={"size": FONT_PX})
    fig.update_yaxes(gridcolor="#e2e8f0", rangemode="tozero", tickfont={"size": FONT_PX})
    fig.update_yaxes(tickformat=".0%", range=[0, 1.05], row=3, col=1)
    fig.update_yaxes(tickformat=".0%", range=[0, 1.05], row=4, col=1)
    return dict(fig.to_plotly_json(), config={"displayModeBar": False, "responsive": True})


def _ms(p: dict | None) -> str:
    """p50/p90/p99, in ms (in s from a second up)."""
    if not p:
        return "no data yet"
    if p[50] >= 1000:
        return "p50/p90/p99 " + "/".join(f"{p[q] / 1000:.1f}" for q in (50, 90, 99)) + " s"
    return "p50/p90/p99 " + "/".join(f"{p[q]:.0f}" for q in (50, 90, 99)) + " ms"


def timeline_figure(series: dict[str, Any]) -> dict:
    """The figure (``{"data": [...], "layout": {...}}``, Plotly's JSON) of ``Timeline.series(window)``."""
    frame = _frame()
    window = series.get("window", 120)
    data = []
    for trace in frame["data"]:
        key = trace["meta"]
        trace = dict(trace)
        if key in ("hits", "ttft"):
            points = series.get(key, [])
            trace["x"] = [p[0] for p in points]
            trace["y"] = [p[1] for p in points]
            trace["customdata"] = [[p[2], f"{p[3]}<br>" if p[3] else ""] for p in points]
        else:
            x_key = next(x for _, _, _, x, k in LINES if k == key)
            trace["x"], trace["y"] = series.get(x_key, []), series.get(key, [])
        data.append(trace)
    layout = copy.copy(frame["layout"])
    titles = {
        "requests": f"requests (running, waiting) · {series.get('preempted', 0)} preempted",
        "prefix hit rate": f"prefix hit rate of each request · {len(series.get('hits', []))} requests",
        "tokens/s": "tokens/s · x: seconds ago (0 = now)",
        "TTFT": f"TTFT (ms) · {_ms(series.get('ttft_pct'))}",
        "inter-token latency": f"ITL (ms) · {_ms(series.get('itl_pct'))}",
    }
    layout["annotations"] = [dict(a, text=titles.get(a["text"], a["text"])) for a in frame["layout"]["annotations"]]
    for name in [k for k in frame["layout"] if k.startswith("xaxis")]:
        layout[name] = dict(frame["layout"][name], range=[-window, 0])
    return {"data": data, "layout": layout, "config": frame["config"]}
