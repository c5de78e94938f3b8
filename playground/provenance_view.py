"""Where every token's K/V came from, and the batches each reply token was decoded in.

``engine.provenance.Provenance`` (a request's record, on its ``RequestOutput`` and on the finishing
stream delta) says, per position, which step put its K/V in the cache and how: a prefix-cache hit
(``stored_by`` names, per block, the request that computed it), prefill chunk k at step n, a
recompute after a preemption; and per reply token the step that sampled it and that step's batch
size. Here:

* ``provenance_html``: the prompt's tokens coloured by their source (hover: which turn or request
  stored the block; which chunk, step and batch), the reply's tokens by the batch size they were
  decoded in, above a line of counts -- the engine's own (``Provenance.counts``: cached tokens are
  the prefix cache's hits for this request);
* ``batch_figure``: a Plotly figure (as ``timeline_chart``) of the reply's inter-token latency over
  its tokens beside the requests that shared each step (decoding, or prefilling how many tokens),
  from the step events the playground's monitor keeps (``EngineMonitor.batches``): a latency spike
  sits over the step that a long prefill shared;
* ``block_source``: one line for the block inspector (what computed the positions of a block).

Names: ``name(request_id)`` gives the label a viewer may see ("turn 2", "another visitor's
request"); a request id is never shown as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from html import escape
from typing import Any

from .render import _visible
from .styles import CSS

__all__ = ["provenance_html", "batch_figure", "block_source", "PROVENANCE_EMPTY", "KIND_COLORS"]

PROVENANCE_EMPTY = ("<div class='pg-panel ps-view'><i>Where each token's K/V came from shows here for the reply "
                    "shown, once it has finished: prefix-cache hits, prefill chunks, recomputes, and the batches "
                    "its tokens were decoded in.</i></div>")
KIND_COLORS = {"cached": "#bbf7d0", "prefill": ("#bfdbfe", "#e0e7ff"), "recompute": "#fed7aa", None: "#e2e8f0"}
BATCH_COLORS = ("#ede9fe", "#ddd6fe", "#c4b5fd", "#a78bfa", "#8b5cf6", "#7c3aed")   # batch size 1, 2, ... 6+

_STYLE = """<style>
.ps-text{line-height:1.9;white-space:pre-wrap;word-break:break-word;font-size:13px}
.ps-tok{border-radius:3px;padding:1px 0;box-shadow:inset -1px 0 0 #fff}
.ps-tok.ps-chunk-start{box-shadow:inset 2px 0 0 #1d4ed8}
.ps-legend{display:flex;flex-wrap:wrap;gap:2px 12px;color:#334155;font-size:12px;margin:4px 0}
.ps-sw{display:inline-block;width:11px;height:11px;border-radius:2px;vertical-align:-1px;margin-right:3px}
.ps-counts{margin:2px 0 4px;color:#334155}.ps-counts b{color:#0f172a}
</style>"""


def _stored_by(span, position: int):
    """The request that computed the cached block holding ``position`` (None: unknown)."""
    if not span.stored_by:
        return None
    per_block = max((span.end - span.start) // len(span.stored_by), 1)
    return span.stored_by[min((position - span.start) // per_block, len(span.stored_by) - 1)]


def _describe(span, position: int, name: Callable[[Any], str]) -> str:
    if span is None:
        return "no record"
    if span.kind == "cached":
        who = _stored_by(span, position)
        return ("prefix-cache hit: its block was computed by "
                + (name(who) if who is not None else "a request from before these records"))
    if span.kind == "prefill":
        return f"computed in prefill chunk {span.chunk + 1} at step {span.step} (a batch of {span.batch_size})"
    if span.kind == "recompute":
        return f"recomputed after a preemption, at step {span.step} (a batch of {span.batch_size})"
    return f"computed by decode step {span.step} (a batch of {span.batch_size})"


def _color(span) -> str:
    if span is None:
        return KIND_COLORS[None]
    if span.kind == "prefill":
        return KIND_COLORS["prefill"][span.chunk % 2]
    return KIND_COLORS.get(span.kind, KIND_COLORS[None])


def _batch_color(size: int) -> str:
    return BATCH_COLORS[min(max(size, 1), len(BATCH_COLORS)) - 1]


def provenance_html(prov: Any, prompt_texts: Sequence[str], reply_texts: Sequence[str] = (), *,
                    name: Callable[[Any], str] = lambda rid: "an earlier request") -> str:
    """The prompt's tokens by their K/V's source and the reply's by their decode batch (``prov``: a
    ``Provenance``; ``*_texts``: one string per token)."""
    if prov is None:
        return f"{CSS}{PROVENANCE_EMPTY}"
    n = len(prompt_texts)
    sources = prov.sources(n)
    counts = prov.counts()
    chunks = sum(1 for s in prov.spans if s.kind == "prefill")
    stored = sorted({name(_stored_by(s, p)) if _stored_by(s, p) is not None else "earlier requests"
                     for p, s in enumerate(sources) if s is not None and s.kind == "cached"})
    spans, shown = [], {"cached": 0, "prefill": 0, "recompute": 0, "unknown": 0}
    for p, (text, span) in enumerate(zip(prompt_texts, sources)):
        kind = span.kind if span is not None else "unknown"
        shown[kind if kind in shown else "unknown"] += 1
        start = span is not None and span.kind == "prefill" and p == span.start and span.chunk > 0
        spans.append(f'<span class="ps-tok ps-{kind}{" ps-chunk-start" if start else ""}" data-pos="{p}" '
                     f'style="background:{_color(span)}" title="#{p}: {escape(_describe(span, p, name))}">'
                     f"{escape(_visible(text))}</span>")
    reply = []
    for j, (text, tok) in enumerate(zip(reply_texts, prov.reply)):
        how = "a decode step" if tok.decode else "the end of a prefill (its first token, or after a recompute)"
        reply.append(f'<span class="ps-tok ps-reply" data-index="{j}" data-batch="{tok.batch_size}" '
                     f'style="background:{_batch_color(tok.batch_size)}" title="reply token {j}: sampled at step '
                     f'{tok.step} by {how}, in a batch of {tok.batch_size}">{escape(_visible(text))}</span>')
    sizes = [t.batch_size for t in prov.reply]
    batches = f"in batches of {min(sizes)}–{max(sizes)}" if sizes and min(sizes) != max(sizes) else (
        f"in batches of {sizes[0]}" if sizes else "")
    count_line = (
        f'<div class="ps-counts" data-cached="{counts["cached"]}" data-prefill="{counts["prefill"]}" '
        f'data-chunks="{chunks}" data-recompute="{counts["recompute"]}" data-decode="{counts["decode"]}" '
        f'data-reply="{len(prov.reply)}" data-shown-cached="{shown["cached"]}" '
        f'data-shown-prefill="{shown["prefill"]}" data-shown-recompute="{shown["recompute"]}">'
        f'<b>{counts["cached"]}</b> from the prefix cache{" (stored by " + escape(", ".join(stored)) + ")" if stored else ""}'
        f' · <b>{counts["prefill"]}</b> computed in {chunks} prefill chunk{"s" if chunks != 1 else ""}'
        f' · <b>{counts["recompute"]}</b> recomputed after a preemption'
        f' · <b>{len(prov.reply)}</b> reply tokens {batches}</div>')
    sw = "".join(f'<span><span class="ps-sw" style="background:{c}"></span>{escape(label)}</span>' for label, c in (
        ("prefix-cache hit", KIND_COLORS["cached"]), ("prefill chunk 1, 3, …", KIND_COLORS["prefill"][0]),
        ("chunk 2, 4, …", KIND_COLORS["prefill"][1]), ("recomputed", KIND_COLORS["recompute"]),
        ("reply: batch 1 → 6+", f"linear-gradient(90deg,{BATCH_COLORS[0]},{BATCH_COLORS[-1]})")))
    return (f'{CSS}{_STYLE}<div class="pg-panel ps-view">{count_line}<div class="ps-legend">{sw}</div>'
            f'<div class="pg-sub">Prompt ({n} tokens; hover one for its source)</div>'
            f'<div class="ps-text ps-prompt">{"".join(spans)}</div>'
            + (f'<div class="pg-sub">Reply (coloured by the batch it was decoded in)</div>'
               f'<div class="ps-text ps-replytext">{"".join(reply)}</div>' if reply else "")
            + "</div>")


def block_source(prov: Any, start: int, end: int, name: Callable[[Any], str]) -> str | None:
    """What put positions ``start..end - 1`` (a block) in the cache, in a line; None without a record."""
    if prov is None or end <= start:
        return None
    parts: list[str] = []
    for span in prov.sources(end)[start:end]:
        text = _describe(span, start, name) if span is not None else "no record"
        if not parts or parts[-1] != text:
            parts.append(text)
    return "; ".join(parts)


@functools.lru_cache(maxsize=1)
def _frame() -> dict:
    """The batch figure without data, as Plotly's JSON (validated once, as ``timeline_chart``'s)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12, row_heights=[0.55, 0.45],
                        subplot_titles=("inter-token latency (ms) · x: reply token", "requests in the step"))
    fig.add_trace(go.Scatter(mode="lines+markers", name="ITL", line={"color": "#6366f1"},
                             hovertemplate="token %{x}: %{y:.0f} ms<br>%{customdata}<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(name="decoding", marker_color="#a78bfa",
                         hovertemplate="token %{x}: %{y} decoding<br>%{customdata}<extra></extra>"), row=2, col=1)
    fig.add_trace(go.Bar(name="prefilling", marker_color="#f59e0b",
                         hovertemplate="token %{x}: %{y} prefilling<br>%{customdata}<extra></extra>"), row=2, col=1)
    fig.update_layout(barmode="stack", height=360, margin={"l": 44, "r": 8, "t": 28, "b": 30}, font={"size": 12},
                      template="none", plot_bgcolor="#ffffff", hovermode="closest", showlegend=True,
                      legend={"orientation": "h", "y": -0.12, "x": 0}, uirevision="batches")
    fig.update_annotations(font_size=13, x=0, xanchor="left")
    fig.update_xaxes(gridcolor="#e2e8f0")
    fig.update_yaxes(gridcolor="#e2e8f0", rangemode="tozero")
    return dict(fig.to_plotly_json(), config={"displayModeBar": False, "responsive": True})


def batch_figure(prov: Any, batches: Mapping[int, tuple], request_id: str, name: Callable[[Any], str]) -> dict:
    """Plotly's JSON: the reply's inter-token latency per token (top) above who shared each step (bottom).

    ``batches``: engine step -> ``(time, duration_s, prefill {request: tokens}, decode requests)``
    (``EngineMonitor.batches``); tokens whose steps it no longer holds are left out."""
    xs, itl, decode_n, prefill_n, hover = [], [], [], [], []
    for j in range(1, len(prov.reply)):
        here, before = batches.get(prov.reply[j].step), batches.get(prov.reply[j - 1].step)
        if here is None or before is None:
            continue
        _, duration, prefill, decode = here
        others = [name(r) for r in decode if r != request_id]
        pre = [f"{name(r)} ({n} prompt tokens)" for r, n in prefill.items() if r != request_id]
        xs.append(j)
        itl.append((here[0] - before[0]) * 1000)
        decode_n.append(len(decode))
        prefill_n.append(len(prefill))
        hover.append(f"step {prov.reply[j].step} took {duration * 1000:.0f} ms<br>decoding with this reply: "
                     f"{', '.join(others) or 'nothing else'}<br>prefilling: {', '.join(pre) or 'none'}")
    frame = _frame()
    data = [dict(trace, x=xs, y=y, customdata=hover) for trace, y in zip(frame["data"], (itl, decode_n, prefill_n))]
    return {"data": data, "layout": frame["layout"], "config": frame["config"]}
