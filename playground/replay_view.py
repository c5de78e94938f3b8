"""Preemption replay: the KV cache's events (``llm.kv_events``, ``engine.kv_events``) as a Plotly
timeline to scrub, and the block pool as it stood after the event the slider points at.

The figure has one lane per kind (allocate, free, evict, preempt, recompute, reset), a marker per
event whose hover is its cause ("req-3 needed 2 blocks with 0 free: req-5, the newest running
request, gives its blocks back"), and below them the blocks held by requests after each event,
replayed from the log itself (an allocation takes its new and shared blocks, a free gives them
back); a range slider under it scrubs the window and a line marks the event shown. The state
beside it (``replay_state_html``) is that replay at the chosen event: one cell per block coloured
by the requests holding it, the event's own blocks outlined, its cause in words.
"""

from __future__ import annotations

import copy
import functools
import json
from collections import OrderedDict
from html import escape
from typing import Any

__all__ = ["Replay", "replay_figure", "replay_state_html", "replay_summary_html", "held_after", "REPLAY_EMPTY"]

KIND_COLORS = {"allocate": "#4f46e5", "free": "#64748b", "evict": "#d97706", "preempt": "#dc2626",
               "recompute": "#16a34a", "reset": "#0e7490"}
LANES = tuple(KIND_COLORS)
FONT_PX = 12
PALETTE = ("#6366f1", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#06b6d4", "#ec4899", "#84cc16",
           "#f97316", "#14b8a6", "#a855f7", "#eab308")

REPLAY_EMPTY = ('<div class="rp"><p>Press <b>Load the KV events</b> to replay what the KV cache did: every '
                "allocation, free, eviction, preemption and recompute, with its cause. A small KV pool "
                "(<code>--kv-cache-memory</code>) and the batch demo make preemptions.</p></div>")


@functools.lru_cache(maxsize=1)
def _frame() -> dict:
    """The figure without data (validated by Plotly once)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4],
                        subplot_titles=("", "blocks held by requests"))
    for kind, color in KIND_COLORS.items():
        fig.add_trace(go.Scatter(name=kind, mode="markers", marker={"color": color, "size": 10, "symbol": (
            "x" if kind == "preempt" else "diamond" if kind == "evict" else "circle")},
            hovertemplate="%{customdata}<extra></extra>", meta=kind), row=1, col=1)
    fig.add_trace(go.Scatter(name="held", mode="lines", line={"color": "#0f172a", "width": 2, "shape": "hv"},
                             hovertemplate="event %{x}: %{y} blocks held<extra></extra>", meta="held"), row=2, col=1)
    # The legend above the lanes (the summary above the figure gives the counts): on a phone it wraps
    # to three rows, which the top margin holds without covering the first lane.
    fig.update_layout(height=560, margin={"l": 72, "r": 8, "t": 72, "b": 24}, font={"size": FONT_PX},
                      hovermode="closest", template="none", plot_bgcolor="#ffffff", uirevision="replay",
                      legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0, "font": {"size": FONT_PX}})
    fig.update_annotations(font_size=FONT_PX + 1, x=0, xanchor="left")
    fig.update_xaxes(gridcolor="#e2e8f0", zeroline=False, tickfont={"size": FONT_PX})
    fig.update_xaxes(title_text="event #", rangeslider={"visible": True, "thickness": 0.08}, row=2, col=1)
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=list(reversed(LANES)), row=1, col=1)
    fig.update_yaxes(gridcolor="#e2e8f0", rangemode="tozero", row=2, col=1)
    return dict(fig.to_plotly_json(), config={"displayModeBar": False, "responsive": True})


def held_after(events: list[dict]) -> list[dict[int, list[str]]]:
    """After each event, the blocks requests hold (block id -> requests), replayed from the log."""
    held: dict[int, list[str]] = {}
    out = []
    for e in events:
        rid = e["request_id"]
        if e["kind"] == "allocate":
            for b in e["blocks"] + e.get("shared", []):
                held.setdefault(b, []).append(rid)
        elif e["kind"] == "free":
            for b in e["blocks"]:
                owners = held.get(b, [])
                if rid in owners:
                    owners.remove(rid)
                if not owners:
                    held.pop(b, None)
        out.append({b: list(o) for b, o in held.items()})
    return out


def replay_figure(log: dict, at: int | None = None) -> dict:
    """The figure (Plotly's JSON) of ``llm.kv_events()``; ``at``: the index of the event marked."""
    frame, events = _frame(), log.get("events", [])
    xs = [e["seq"] for e in events]
    held = [len(h) for h in held_after(events)]
    data = []
    for trace in frame["data"]:
        trace = dict(trace)
        if trace["meta"] == "held":
            trace["x"], trace["y"] = xs, held
        else:
            mine = [e for e in events if e["kind"] == trace["meta"]]
            trace["x"] = [e["seq"] for e in mine]
            trace["y"] = [trace["meta"]] * len(mine)
            trace["customdata"] = [f"#{e['seq']} · step {e['step']}<br>{escape(e['cause'])}"
                                   f"<br>blocks {', '.join(map(str, e['blocks'][:12]))}"
                                   f"{' …' if len(e['blocks']) > 12 else ''}" for e in mine]
        data.append(trace)
    layout = copy.copy(frame["layout"])
    counters = log.get("counters", {})
    layout["annotations"] = [dict(a, text=f"blocks held by requests (of {counters.get('num_blocks', '?')})")
                             for a in frame["layout"]["annotations"]]
    if at is not None and 0 <= at < len(events):
        layout["shapes"] = [{"type": "line", "xref": "x", "yref": "paper", "x0": xs[at], "x1": xs[at], "y0": 0,
                             "y1": 1, "line": {"color": "#dc2626", "width": 1.5, "dash": "dot"}}]
    return {"data": data, "layout": layout, "config": frame["config"]}


def replay_summary_html(log: dict) -> str:
    """One line: how many events of each kind, beside the engine's counters."""
    events, counters = log.get("events", []), log.get("counters", {})
    counts = {k: sum(1 for e in events if e["kind"] == k) for k in LANES}
    parts = " · ".join(f'<span style="color:{KIND_COLORS[k]}">{counts[k]} {k}</span>' for k in LANES if counts[k])
    dropped = f" · {log['dropped']} older events no longer kept" if log.get("dropped") else ""
    return (f'<div class="rp" id="replay-summary">{len(events)} events: {parts or "none yet"}{dropped}. '
            f"Engine counters: {counters.get('preemptions', 0)} preemptions, {counters.get('evictions', 0)} "
            "evictions.</div>")


def replay_state_html(log: dict, at: int) -> str:
    """The pool after event ``at``: cells coloured by holder, the event's blocks outlined, its cause."""
    events = log.get("events", [])
    if not events:
        return REPLAY_EMPTY
    at = max(0, min(int(at), len(events) - 1))
    event, held = events[at], held_after(events[: at + 1])[-1]
    num_blocks = int(log.get("counters", {}).get("num_blocks") or (max(held, default=0) + 1))
    owners = sorted({r for rs in held.values() for r in rs} | {event["request_id"]} - {None})
    color = {r: PALETTE[i % len(PALETTE)] for i, r in enumerate(owners)}
    marked = set(event["blocks"])
    cells = []
    for b in range(num_blocks):
        rs = held.get(b, [])
        bg = color[rs[0]] if rs else "#f1f5f9"
        ring = f"outline:2px solid {KIND_COLORS[event['kind']]};outline-offset:1px;" if b in marked else ""
        shared = "box-shadow:inset 0 0 0 2px #0f172a;" if len(rs) > 1 else ""
        cells.append(f'<span title="block {b}: {escape(", ".join(rs) or "not held")}" style="width:14px;height:14px;'
                     f'border-radius:3px;background:{bg};{ring}{shared}display:inline-block"></span>')
    legend = "".join(f'<span style="white-space:nowrap;margin-right:10px"><span style="display:inline-block;'
                     f'width:10px;height:10px;border-radius:2px;background:{color[r]}"></span> {escape(r)}</span>'
                     for r in owners)
    return (f'<div class="rp" id="replay-state" style="font:13px/1.45 system-ui,sans-serif">'
            f'<div><b style="color:{KIND_COLORS[event["kind"]]}">{escape(event["kind"])}</b> · event #{event["seq"]} '
            f'of {len(events)} · step {event["step"]}</div><div style="margin:3px 0 6px">{escape(event["cause"])}</div>'
            f'<div style="display:flex;flex-wrap:wrap;gap:3px">{"".join(cells)}</div>'
            f'<div style="margin-top:6px;font-size:12px">{legend} · outlined: this event\'s blocks · '
            f"ringed: shared by two or more · grey: not held (free or cached)</div></div>")


class Replay:
    """The replay tab's events: load the log from the engine (any engine client), scrub it."""

    def __init__(self, llm: Any):
        self.llm = llm
        self._logs: OrderedDict[str, dict] = OrderedDict()      # tab -> the log it loaded

    def build(self) -> None:
        """The tab's body: a button, the summary, the figure, the slider and the state at its event."""
        import gradio as gr

        with gr.Row(equal_height=True):
            self.button = gr.Button("Load the KV events", size="sm", variant="primary", elem_id="replay-load")
        self.summary = gr.HTML("", apply_default_css=False, elem_id="replay-summary-box")
        self.figure = gr.Plot(show_label=False, elem_id="replay-figure")
        self.slider = gr.Slider(0, 1, value=0, step=1, label="event (scrub)", interactive=False, elem_id="replay-at")
        self.state = gr.HTML(REPLAY_EMPTY, apply_default_css=False, elem_id="replay-state-box")

    def wire(self, T: Any, session: Any) -> None:
        quiet = dict(api_visibility="private", show_progress="hidden", preprocess=False)
        self.button.click(T(self.load), [session], [self.figure, self.slider, self.state, self.summary], **quiet)
        self.slider.change(T(self.scrub), [session, self.slider], [self.figure, self.state],
                           trigger_mode="always_last", **quiet)

    @staticmethod
    def plot(figure: dict) -> Any:
        from gradio.components.plot import PlotData

        return PlotData(type="plotly", plot=json.dumps(figure))

    def load(self, session: Any) -> tuple:
        """(figure, slider, state, summary) of the engine's log as it is now, the last event shown."""
        import gradio as gr

        try:
            log = self.llm.kv_events()
        except NotImplementedError as exc:          # a foreign server: say why
            return gr.skip(), gr.skip(), f'<div class="rp">{escape(str(exc))}</div>', ""
        self._logs[session.session_id] = log
        self._logs.move_to_end(session.session_id)
        while len(self._logs) > 64:
            self._logs.popitem(last=False)
        last = max(0, len(log["events"]) - 1)
        slider = gr.Slider(minimum=0, maximum=max(1, last), value=last, step=1, interactive=bool(log["events"]))
        return (self.plot(replay_figure(log, last)), slider, replay_state_html(log, last), replay_summary_html(log))

    def scrub(self, session: Any, at: Any) -> tuple:
        """(figure, state) at event ``at`` of the log this tab loaded."""
        import gradio as gr

        log = self._logs.get(session.session_id)
        if log is None or not log["events"]:
            return gr.skip(), REPLAY_EMPTY
        try:
            at = int(float(at))
        except (TypeError, ValueError):
            raise gr.Error(f"the event to show is an integer in [0, {len(log['events']) - 1}]; got {at!r:.40}")
        at = max(0, min(at, len(log["events"]) - 1))
        return self.plot(replay_figure(log, at)), replay_state_html(log, at)
