"""Renderers: engine snapshots, events and outputs → self-contained HTML/SVG.

Every function here is pure: it takes plain data (``EngineSnapshot.to_dict()``
dicts, step records from engine events, logprob records) and returns an HTML
string with its own ``<style>``. Nothing here imports Gradio or the engine, so
the Gradio app (``gr.HTML``) and the Jupyter widgets (``ipywidgets.HTML``) show
the same views, and tests can feed handcrafted dicts.

Views:
    block_map_html      every physical KV block as a coloured cell
    prefix_cache_html   this turn's cached vs computed prompt tokens, hit rate
                        per turn, global prefix-cache statistics
    logprob_html        a reply's tokens coloured by probability, with top-k
                        alternatives and entropy on hover (see logprobs.py for
                        turning engine logprobs into records)
    engine_panel_html   model, backend, TTFT, decode tok/s, batch size per step
    batch_table_html    the batch demo's concurrent requests
    alignment_html      a backend-consistency report (two model implementations)
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any

from .logprobs import token_tooltip_rows
from .styles import CSS as _CSS
from .styles import PALETTE, STATE_STYLE
from .svgchart import bar_chart_svg

__all__ = [
    "PALETTE", "STATE_STYLE", "owner_colors", "owner_order", "block_map_html", "prefix_cache_html",
    "engine_badges", "logprob_html", "prob_color", "engine_panel_html", "batch_table_html", "alignment_html",
]


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


# --------------------------------------------------------------------------- #
# KV block map
# --------------------------------------------------------------------------- #
def owner_colors(request_ids: Iterable[str]) -> dict[str, str]:
    """Give each request a palette colour, stable across snapshots.

    A request's preferred colour comes from a hash of its id, so it keeps its
    colour while other requests come and go; collisions among the requests
    passed in move to the next free colour.
    """
    colors: dict[str, str] = {}
    taken: set[int] = set()
    for rid in request_ids:
        if rid in colors:
            continue
        slot = zlib.crc32(str(rid).encode()) % len(PALETTE)
        if len(taken) < len(PALETTE):
            while slot in taken:
                slot = (slot + 1) % len(PALETTE)
        taken.add(slot)
        colors[rid] = PALETTE[slot]
    return colors


def block_kind(block: Mapping[str, Any]) -> str:
    """Classify a block dict as ``used``, ``shared``, ``cached`` or ``free``."""
    if block.get("ref_cnt", 0) > 1:
        return "shared"
    if block.get("ref_cnt", 0) == 1 or block.get("state") == "used":
        return "used"
    if block.get("state") == "cached" or block.get("hashed"):
        return "cached"
    return "free"


def _cell_look(kind: str, owners: Sequence[str], colors: Mapping[str, str]) -> tuple[str, str]:
    """Extra class and inline style of a cell: owner colour class for used
    cells, a diagonal split of the owners' colours for shared ones."""
    if kind == "used" and owners and colors.get(owners[0]) in PALETTE:
        return f" kv-o{PALETTE.index(colors[owners[0]])}", ""
    if kind == "shared":
        cols = [colors.get(o, "#475569") for o in owners[:4]] or ["#475569"]
        step = 100 / len(cols)
        stops = ",".join(f"{c} {i * step:.0f}% {(i + 1) * step:.0f}%" for i, c in enumerate(cols))
        return "", f' style="background:linear-gradient(135deg,{stops})"'
    if kind == "used":
        return "", ' style="background:#475569"'
    return "", ""


def _cell_title(block: Mapping[str, Any], kind: str) -> str:
    parts = [f"block {block.get('block_id')}", "cached, reusable" if kind == "cached" else kind]
    if kind != "free":
        parts.append(f"ref {block.get('ref_cnt', 0)}")
    owners = block.get("owners") or []
    if owners:
        parts.append("owners " + ", ".join(str(o) for o in owners))
    token_range = block.get("token_range")
    if token_range and token_range[1] > token_range[0]:
        parts.append(f"tokens {token_range[0]}–{token_range[1] - 1}")
    if block.get("hashed") and kind != "cached":
        parts.append("hashed")
    return " · ".join(parts)


def block_map_html(
    snapshot: Mapping[str, Any],
    *,
    labels: Mapping[str, str] | None = None,
    columns: int | None = None,
    colors: Mapping[str, str] | None = None,
    css: bool = True,
) -> str:
    """Render the KV block map of a snapshot dict.

    Args:
        snapshot: ``EngineSnapshot.to_dict()`` (``blocks``, ``requests``, ...).
        labels: optional display names for request ids in the legend
            (e.g. ``{"chat-1a2b": "this chat"}``).
        columns: cells per row; defaults to 32, 48 or 64 depending on how
            many blocks there are, so 1,000+ blocks stay readable.
        colors: ``{request_id: colour}`` kept across snapshots by the caller
            (``colors.OwnerColors``); by default ``owner_colors`` of this
            snapshot alone.
        css: start with the panels' ``<style>`` (off for a map that replaces one
            already on the page).

    Each cell is a ``div.kv-cell.kv-<kind>`` with ``data-block``,
    ``data-ref`` and ``data-owners`` attributes and a hover ``title``.
    """
    if snapshot.get("blocks_hidden"):
        return _hidden_map(snapshot, css)
    all_blocks = snapshot.get("blocks") or []
    labels = labels or {}
    request_order = owner_order(snapshot)
    if colors is None or any(rid not in colors for rid in request_order):
        colors = {**owner_colors(request_order), **(colors or {})}
    colors = {rid: colors[rid] for rid in request_order}
    cells, counts, per_owner = _grid(all_blocks, colors)
    n = len(all_blocks)
    cols = columns or (32 if n <= 512 else 48 if n <= 2048 else 64)
    in_use = counts["used"] + counts["shared"]
    usage = snapshot.get("kv_usage", in_use / n if n else 0.0)
    head = (
        f'<div class="pg-head"><span><b>{in_use}</b> / {n} blocks in use ({usage * 100:.1f}%)</span>'
        f'<span><b>{counts["shared"]}</b> shared</span><span><b>{counts["cached"]}</b> cached</span>'
        f'<span>block size <b>{_e(snapshot.get("block_size", "?"))}</b> tokens</span>'
        f'<span>step <b>{_e(snapshot.get("step", 0))}</b></span></div>'
    )
    legend = []
    for rid, color in colors.items():
        if rid not in per_owner:
            continue
        name = labels.get(rid, rid if len(rid) <= 14 else "…" + rid[-12:])
        legend.append(
            f'<span class="kv-legend-item" data-kind="owner" data-request="{_e(rid)}" title="{_e(rid)}">'
            f'<span class="kv-swatch" style="background:{color}"></span>{_e(name)} ({per_owner[rid]})</span>'
        )
    for kind, text in (("shared", "shared (ref > 1)"), ("cached", "cached, reusable"), ("free", "free")):
        style = ' style="background:#64748b"' if kind == "shared" else ""
        legend.append(
            f'<span class="kv-legend-item" data-kind="{kind}"><span class="kv-swatch kv-{kind}"{style}>'
            f"</span>{text} ({counts[kind]})</span>"
        )
    return (
        f'{_CSS if css else ""}<div class="pg-panel kv-map" data-step="{_e(snapshot.get("step", 0))}">{head}'
        f'<div class="kv-grid" style="grid-template-columns:repeat({cols},minmax(0,1fr))">'
        f'{cells}</div><div class="kv-legend">{"".join(legend)}</div></div>'
    )


def _hidden_map(snapshot: Mapping[str, Any], css: bool) -> str:
    """The map's place when the engine's blocks cannot be seen (a server read through its metrics):
    why, and what is known instead."""
    requests = snapshot.get("requests") or ()
    running = sum(r.get("status") == "running" for r in requests)
    n = snapshot.get("num_blocks") or 0
    pool = f' of {n} blocks × {_e(snapshot.get("block_size"))} tokens' if n else ""
    return (
        f'{_CSS if css else ""}<div class="pg-panel kv-map kv-hidden" data-step="{_e(snapshot.get("step", 0))}">'
        f'<div class="pg-head"><span>KV usage <b>{float(snapshot.get("kv_usage", 0.0)) * 100:.1f}%</b>{pool}</span>'
        f'<span><b>{running}</b> running</span><span><b>{len(requests) - running}</b> waiting</span></div>'
        f'<div class="kv-why" style="padding:10px 12px;border:1px dashed #94a3b8;border-radius:6px;color:#334155;'
        f'background:#f8fafc"><b>No block map for this server.</b> {_e(snapshot["blocks_hidden"])}</div></div>'
    )


_last_order: tuple = ()     # (requests, blocks, order) of the last snapshot read


def owner_order(snapshot: Mapping[str, Any]) -> list[str]:
    """The snapshot's request ids, each once: its requests first, then the blocks' owners, in order.

    Every open tab's map reads the same snapshot several times a second (its colours, legend
    names and cells), so the last result is kept while the snapshot's blocks stay the same object.
    """
    global _last_order
    requests, blocks = snapshot.get("requests") or (), snapshot.get("blocks") or ()
    last = _last_order
    if last and last[0] is requests and last[1] is blocks:
        return last[2]
    ids = [r["request_id"] for r in requests]
    for b in blocks:
        ids.extend(b.get("owners") or ())
    order = list(dict.fromkeys(ids))
    if isinstance(blocks, tuple) and isinstance(requests, tuple):   # an immutable snapshot's
        _last_order = (requests, blocks, order)
    return order


_last_grid: tuple = ()      # (blocks, colours, grid): every tab draws the same snapshot's grid once
_cells: dict[tuple, tuple[str, str]] = {}   # what a cell is drawn from -> (kind, its HTML)
_MAX_CELLS = 1 << 16                        # then start afresh: cells of blocks long since rewritten


def _cell(block: Mapping[str, Any], owners: tuple[str, ...], colors: Mapping[str, str]) -> tuple[str, str]:
    """A block's kind and cell HTML. Between two snapshots only the blocks that requests wrote
    to or freed change, so each cell is kept under what it is drawn from (id, ref count, state,
    hash, owners and their colours, token span) and drawn again only when one of those changes."""
    key = (block.get("block_id"), block.get("ref_cnt", 0), block.get("state"), bool(block.get("hashed")),
           owners, _owner_colors(owners, colors), tuple(block.get("token_range") or ()))
    hit = _cells.get(key)
    if hit is None:
        kind = block_kind(block)
        extra = f' data-ref="{_e(block.get("ref_cnt", 0))}" data-owners="{_e(",".join(owners))}"' if owners else ""
        cls, style = _cell_look(kind, owners, colors)
        hit = (kind, f'<div class="kv-cell kv-{kind}{cls}" data-block="{_e(block.get("block_id"))}"{extra}{style} '
                     f'title="{_e(_cell_title(block, kind))}"></div>')
        if len(_cells) >= _MAX_CELLS:
            _cells.clear()
        _cells[key] = hit
    return hit


_drawn: dict = {}   # block id -> (its dict, owners, their colours, kind, cell) as drawn last


def _grid(blocks: Sequence[Mapping[str, Any]], colors: Mapping[str, str]) -> tuple[str, dict, dict]:
    """The map's cells (HTML), the block counts by kind and the blocks per owner.

    The cells depend only on the blocks and their owners' colours, not on the tab (its legend
    names differ), so the last result is kept for the next tab that draws the same snapshot.
    Between two snapshots the monitor keeps the dict of every block that did not change
    (``monitor.snapshot_dict``), so in a snapshot's tuple of blocks a block drawn last time from
    the same dict object, whose owners kept their colours, keeps its cell; the others are drawn
    again (`_cell`).
    """
    global _last_grid
    key = tuple(colors.items())
    last = _last_grid
    if last and last[0] is blocks and last[1] == key:
        return last[2]
    counts = {"used": 0, "shared": 0, "cached": 0, "free": 0}
    per_owner: dict[str, int] = {}
    cells = []
    frozen = isinstance(blocks, tuple)  # a snapshot's dicts, never changed in place (a list's could be)
    for b in sorted(blocks, key=_block_id):
        bid = b.get("block_id", 0)
        drawn = _drawn.get(bid) if frozen else None
        if drawn is None or drawn[0] is not b or drawn[2] != _owner_colors(drawn[1], colors):
            owners = tuple(str(o) for o in b.get("owners") or ())
            kind, cell = _cell(b, owners, colors)
            drawn = _drawn[bid] = (b, owners, _owner_colors(owners, colors), kind, cell)
        owners, kind = drawn[1], drawn[3]
        for o in owners:
            per_owner[o] = per_owner.get(o, 0) + 1
        counts[kind] += 1
        cells.append(drawn[4])
    if len(_drawn) > _MAX_CELLS:
        _drawn.clear()
    result = ("".join(cells), counts, per_owner)
    if frozen:
        _last_grid = (blocks, key, result)
    return result


def _block_id(block: Mapping[str, Any]) -> int:
    return block.get("block_id", 0)


def _owner_colors(owners: tuple[str, ...], colors: Mapping[str, str]) -> tuple:
    return tuple(colors.get(o) for o in owners)


# --------------------------------------------------------------------------- #
# Prefix cache
# --------------------------------------------------------------------------- #
def prefix_cache_html(
    snapshot: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]] = (),
) -> str:
    """Render the prefix-cache panel.

    Args:
        snapshot: a snapshot dict; its ``prefix_cache`` gives the global stats.
        history: one dict per turn of this conversation, oldest first, with
            ``num_prompt_tokens`` and ``num_cached_tokens`` (and an optional
            ``label``); the last one is "this turn".
    """
    parts = [_CSS, '<div class="pg-panel prefix-panel">', '<div class="pg-sub">This turn</div>']
    if history:
        turn = history[-1]
        total = int(turn.get("num_prompt_tokens") or 0)
        cached = min(int(turn.get("num_cached_tokens") or 0), total)
        computed = total - cached
        pct = cached / total * 100 if total else 0.0
        parts.append(
            f'<div class="pg-stack" title="{cached} cached + {computed} computed">'
            f'<div class="seg-cached" style="width:{pct:.2f}%;background:#16a34a"></div>'
            f'<div class="seg-computed" style="width:{100 - pct:.2f}%;background:#6366f1"></div></div>'
            f'<div class="turn-text"><b class="cached-tokens">{cached}</b> of {total} prompt tokens '
            f"came from the prefix cache ({pct:.0f}%); <b class=\"computed-tokens\">{computed}</b> computed.</div>"
            f'<div class="kv-legend"><span class="kv-legend-item"><span class="kv-swatch" '
            f'style="background:#16a34a"></span>cached</span><span class="kv-legend-item">'
            f'<span class="kv-swatch" style="background:#6366f1"></span>computed</span></div>'
        )
    else:
        parts.append('<div class="turn-text">Send a message to see how much of its prompt is reused.</div>')
    rates = [
        (int(t.get("num_cached_tokens") or 0) / t["num_prompt_tokens"]) if t.get("num_prompt_tokens") else 0.0
        for t in history
    ]
    labels = [str(t.get("label", i + 1)) for i, t in enumerate(history)]
    titles = [
        f"turn {labels[i]}: {t.get('num_cached_tokens', 0)}/{t.get('num_prompt_tokens', 0)} "
        f"tokens cached ({rates[i] * 100:.0f}%)"
        for i, t in enumerate(history)
    ]
    parts.append('<div class="pg-sub">Hit rate per turn of this conversation</div>')
    parts.append(
        bar_chart_svg(rates, labels=labels, titles=titles, percent=True, color="#16a34a",
                      x_caption="turn", css_class="pg-chart hit-rate-chart", height=110)
    )
    stats = snapshot.get("prefix_cache") or {}
    kinds = [block_kind(b) for b in snapshot.get("blocks") or []]
    rows = [
        ("queried tokens", stats.get("queries", 0)),
        ("hit tokens", stats.get("hits", 0)),
        ("hit rate", f"{float(stats.get('hit_rate', 0.0)) * 100:.1f}%"),
        ("KV usage", f"{float(snapshot.get('kv_usage', 0.0)) * 100:.1f}%"),
        ("cached blocks", "not exposed" if snapshot.get("blocks_hidden") else kinds.count("cached")),
        ("resets", "not exposed" if snapshot.get("blocks_hidden") else stats.get("reset_count", 0)),
    ]
    parts.append('<div class="pg-sub">Engine-wide (since start or last reset)</div><table class="pg-stats">')
    parts.extend(f'<tr data-stat="{_e(k)}"><td>{_e(k)}</td><td><b>{_e(v)}</b></td></tr>' for k, v in rows)
    parts.append("</table></div>")
    return "".join(parts)


# --------------------------------------------------------------------------- #
# Logprobs
# --------------------------------------------------------------------------- #
def prob_color(prob: float | None) -> str:
    """Background colour for a token of probability ``prob``: red → yellow → green."""
    if prob is None:
        return "hsl(220,15%,90%)"
    hue = 120.0 * min(max(prob, 0.0), 1.0)
    return f"hsl({hue:.0f},75%,82%)"


def _visible(text: str) -> str:
    """Token text as shown: newlines as ↵ (a line break follows), empty as ∅."""
    return text.replace("\n", "↵") or "∅"


def _rank_color(rank: int | None) -> str:
    """Rank 1 green, 2 yellow, 3 orange, lower red."""
    if rank is None:
        return prob_color(None)
    return prob_color({1: 1.0, 2: 0.5, 3: 0.25}.get(int(rank), 0.0))


def logprob_html(records: Sequence[Mapping[str, Any]], *, selected: int | None = None,
                 metric: str = "probability", hint: str | None = None) -> str:
    """Render a reply's tokens coloured by their probability.

    Args:
        records: token records from ``playground.logprobs.token_records``
            (``index``, ``text``, ``prob``, ``alternatives``, ``entropy``, ``forced``).
        selected: index of the token picked for branching (outlined).
        metric: what colours the tokens and fills their hover tables:
            ``probability`` (red → green), ``logprob`` (raw values, same colours)
            or ``rank`` (the sampled token's rank among the alternatives).
        hint: the line's hint (HTML) where clicking a token does not branch
            (default: hover for alternatives, click to branch).

    A record marked ``stop`` (the token that ended the reply: the model's end
    of turn, which the reply's text never shows) is drawn as an ``end`` marker,
    with its probability and what the model could have said instead.

    Each token is a ``span.lp-tok`` with ``data-index``, ``data-token-id`` and
    ``data-prob``; hovering shows a ``span.lp-tip`` table of the top-k
    alternatives with probabilities and the entropy. The Gradio app hooks
    clicks on ``data-index`` to branch from that token.
    """
    if not records:
        return f'{_CSS}<div class="pg-panel lp-view"><i>The next reply\'s tokens will show here.</i></div>'
    spans = [_token_span(rec, metric, selected is not None and int(rec["index"]) == selected) for rec in records]
    ends = {"probability": ("0", "1"), "logprob": ("−∞", "0"), "rank": ("#4+", "#1")}.get(metric, ("0", "1"))
    scale = (
        f'<div class="lp-scale">{_e(metric)} <span>{ends[0]}</span><span class="bar"></span><span>{ends[1]}</span>'
        + (hint if hint is not None else BRANCH_HINT) + '</div>'
    )
    return f'{_CSS}<div class="pg-panel lp-view"><div class="lp-text">{"".join(spans)}</div>{scale}</div>'


# A streaming reply's logprob view is drawn again every half second or so with every token so far:
# each token's span (its colour and its table of alternatives) is drawn once per metric and kept,
# so an update draws only the new tokens. Keyed by the record object (kept alive beside its span,
# so its id cannot be reused meanwhile) and whether it ended the reply (set once it has).
_SPANS: OrderedDict = OrderedDict()
_SPANS_MAX = 8192
_SPANS_LOCK = threading.Lock()


def _token_span(rec: Mapping[str, Any], metric: str, selected: bool) -> str:
    """One token's span of the logprob view, from the cache unless it is the selected token."""
    if selected:
        return _draw_token_span(rec, metric, True)
    key = (id(rec), metric, bool(rec.get("stop")))
    with _SPANS_LOCK:
        hit = _SPANS.get(key)
    if hit is not None and hit[0] is rec:
        return hit[1]
    html = _draw_token_span(rec, metric, False)
    with _SPANS_LOCK:
        _SPANS[key] = (rec, html)
        while len(_SPANS) > _SPANS_MAX:
            _SPANS.popitem(last=False)
    return html


def _draw_token_span(rec: Mapping[str, Any], metric: str, selected: bool) -> str:
    idx = int(rec["index"])
    prob = rec.get("prob")
    classes = ["lp-tok"]
    if rec.get("forced"):
        classes.append("lp-forced")
    if selected:
        classes.append("lp-selected")
    if rec.get("stop"):
        classes.append("lp-end")
    rows = "".join(
        f'<tr class="{"lp-chosen" if row["chosen"] else "lp-alt"}" data-token-id="{_e(row["token_id"])}">'
        f'<td>{_e(row["text"])}</td><td>{_e(row["prob_text"])}</td></tr>'
        for row in token_tooltip_rows(rec, metric)
    )
    entropy = rec.get("entropy")
    ent_text = "" if entropy is None else (
        f'<div class="lp-entropy">entropy {"≥ " if rec.get("entropy_is_bound") else ""}{entropy:.2f} bits</div>'
    )
    forced = '<div>forced by branch</div>' if rec.get("forced") else ""
    prob_attr = "" if prob is None else f' data-prob="{prob:.6f}"'
    if metric == "rank":
        chosen = next((a for a in rec.get("alternatives") or [] if a["token_id"] == rec.get("token_id")), None)
        color = _rank_color(None if chosen is None else chosen.get("rank"))
    else:
        color = prob_color(prob)
    text = str(rec.get("text", ""))
    shown = "end" if rec.get("stop") else _visible(text)
    stop = f'<div>ended the reply: {_e(_visible(text))}</div>' if rec.get("stop") else ""
    return (
        f'<span class="{" ".join(classes)}" data-index="{idx}" data-token-id="{_e(rec.get("token_id"))}"'
        f'{prob_attr} style="background:{color}">{_e(shown)}'
        f'<span class="lp-tip">{forced}{stop}<table>{rows}</table>{ent_text}</span></span>'
        + ("<br>" if "\n" in text and not rec.get("stop") else "")
    )


BRANCH_HINT = ('<span class="lp-hint-hover">· hover a token for alternatives · click it to branch</span>'
               '<span class="lp-hint-tap">· tap a token for its alternatives and to branch from it</span>')


# --------------------------------------------------------------------------- #
# Engine panel
# --------------------------------------------------------------------------- #
def _card(key: str, value: str, name: str, wide: bool = False) -> str:
    return f'<div class="pg-card{" wide" if wide else ""}" data-card="{name}"><div class="k">{_e(key)}</div><div class="v">{_e(value)}</div></div>'


def engine_panel_html(
    snapshot: Mapping[str, Any],
    steps: Sequence[Mapping[str, Any]] = (),
    last_request: Mapping[str, Any] | None = None,
) -> str:
    """Render the engine panel.

    Args:
        snapshot: a snapshot dict (model, model_impl, device, kv_usage, step).
        steps: recent per-step records (``step``, ``batch_size`` and optionally
            ``num_tokens``, ``duration_s``, ``num_prefill`` and ``num_decode``:
            how many requests ran prompt tokens / one decode token), oldest first.
        last_request: stats of this chat's last reply: ``ttft`` (s),
            ``decode_tps`` (tokens/s), ``num_output_tokens``.
    """
    last = last_request or {}
    ttft = last.get("ttft")
    tps = last.get("decode_tps")
    running = sum(1 for r in snapshot.get("requests") or [] if r.get("status") == "running")
    # a server read through its metrics has no steps to show: each poll of its /metrics stands for one
    polled = bool(snapshot.get("blocks_hidden"))
    cards = [
        _card("model", str(snapshot.get("model", "?")), "model", wide=True),
        _card("backend (model_impl)", str(snapshot.get("model_impl", "?")), "model_impl"),
        _card("device", str(snapshot.get("device", "?")), "device"),
        _card("TTFT · your last reply", "–" if ttft is None else f"{ttft * 1000:.0f} ms", "ttft"),
        _card("decode · your last reply", "–" if tps is None else f"{tps:.1f} tok/s", "decode_tps"),
        _card("running requests", str(running), "running"),
        _card("KV usage", f"{float(snapshot.get('kv_usage', 0.0)) * 100:.1f}%", "kv_usage"),
        _card("polls with work" if polled else "engine step", str(snapshot.get("step", 0)), "step"),
    ]
    values = [int(s.get("batch_size", 0)) for s in steps]
    title = ("Requests running at each poll of the server's /metrics that saw work" if polled
             else "Batch size per engine step")
    colors = ["#d97706" if s.get("num_prefill") else "#6366f1" for s in steps]
    titles = []
    for s in steps:
        extra = f", {s['num_tokens']} tokens" if s.get("num_tokens") is not None else ""
        if s.get("duration_s") is not None:
            extra += f", {s['duration_s'] * 1000:.1f} ms"
        kinds = [f"{s[k]} {word}" for k, word in (("num_prefill", "prefilling"), ("num_decode", "decoding"))
                 if s.get(k)]
        pre = f" ({', '.join(kinds)})" if kinds else ""
        titles.append(f"step {s.get('step')}: batch {s.get('batch_size')}{pre}{extra}")
    chart = bar_chart_svg(
        values, labels=[str(s.get("step", "")) for s in steps], titles=titles, colors=colors,
        # an even y_max gives an integer middle label
        y_max=float(-(-max(values + [4]) // 2) * 2), x_caption="poll" if polled else "engine step",
        css_class="pg-chart batch-chart",
        empty_text="no engine steps yet", height=120,
    )
    legend = (
        '<div class="kv-legend"><span class="kv-legend-item"><span class="kv-swatch" style="background:#6366f1">'
        '</span>decode only</span><span class="kv-legend-item"><span class="kv-swatch" '
        'style="background:#d97706"></span>with prefill</span></div>'
    )
    from .tensor_parallel_view import tensor_parallel_html

    return (
        f'{_CSS}<div class="pg-panel engine-panel"><div class="pg-cards">{"".join(cards)}</div>'
        f'<div class="pg-sub">{title}</div>{chart}{legend}{tensor_parallel_html(snapshot)}</div>'
    )


# --------------------------------------------------------------------------- #
# Batch demo
# --------------------------------------------------------------------------- #
def batch_table_html(rows: Sequence[Mapping[str, Any]], colors: Mapping[str, str] | None = None,
                     names: Mapping[str, str] | None = None) -> str:
    """Render the batch demo: one row per concurrent request.

    Each row dict has ``request_id``, ``question``, ``text`` (reply so far),
    ``num_prompt_tokens``, ``num_cached_tokens``, ``finished`` and ``error``.
    ``colors`` are the block map's owner colours and ``names`` its legend names ("batch #1"), which the
    block inspector's owner list uses too (so the three agree).
    """
    if not rows:
        return f'{_CSS}<div class="pg-panel batch-view"><i>Fire a batch to see concurrent requests here.</i></div>'
    colors = colors or owner_colors(r["request_id"] for r in rows)
    body = []
    for r in rows:
        state = "error" if r.get("error") else "done" if r.get("finished") else "streaming…"
        cached = f'{r.get("num_cached_tokens", 0)}/{r.get("num_prompt_tokens", 0)}'
        reply = r.get("error") or r.get("text") or ""
        body.append(
            f'<tr class="batch-row" data-request="{_e(r["request_id"])}" data-state="{_e(state)}">'
            f'<td class="batch-name"><span class="kv-swatch" style="background:{colors[r["request_id"]]}"></span> '
            f'{_e((names or {}).get(r["request_id"], r["request_id"]))}</td>'
            f'<td>{_e(r.get("question", ""))}</td><td class="batch-reply">{_e(reply)}</td>'
            f"<td>{cached}</td><td>{_e(state)}</td></tr>"
        )
    return (
        f'{_CSS}<div class="pg-panel batch-view"><table class="pg-stats batch-table">'
        "<tr><th></th><th>question</th><th>reply</th><th>cached prompt tokens</th><th></th></tr>"
        f'{"".join(body)}</table></div>'
    )


# --------------------------------------------------------------------------- #
# Backend consistency
# --------------------------------------------------------------------------- #
def alignment_html(report: Mapping[str, Any] | None) -> str:
    """Render a backend-consistency report (two implementations of one checkpoint
    that share kernels and weights: it checks consistency, not accuracy) (``ConsistencyReport.to_dict()`` plus
    ``top1_agreement``/``max_abs_logprob_diff``/``all_greedy_identical``)."""
    if not report:
        return (f'{_CSS}<div class="pg-panel align-view"><i>Backend consistency: compare the serving backend '
                "with the other implementation of the same checkpoint on this conversation (they share kernels "
                "and weights, so this checks consistency, not accuracy).</i></div>")
    rows = []
    for r in report.get("rows", []):
        greedy = ("identical" if r["greedy_identical"]
                  else f"differs at token {r['first_divergence']}")
        rows.append(
            f'<tr class="align-row" data-identical="{str(r["greedy_identical"]).lower()}">'
            f'<td>{r["positions"]}</td><td>{r["top1_agreement"] * 100:.1f}%</td>'
            f'<td>{r["max_abs_logprob_diff"]:.2e}</td><td>{r["mean_kl"]:.2e}</td>'
            f"<td>{_e(greedy)} ({r['greedy_tokens']} tokens)</td></tr>"
        )
    verdict = "greedy outputs identical" if report.get("all_greedy_identical") else "greedy outputs differ"
    return (
        f'{_CSS}<div class="pg-panel align-view"><div class="pg-head"><span>Backend consistency: <b>{_e(report.get("impl_a"))}</b> vs '
        f'<b>{_e(report.get("impl_b"))}</b> on {_e(report.get("model"))}</span>'
        f'<span class="align-verdict">{verdict}</span></div>'
        '<table class="pg-stats batch-table"><tr><th>positions</th><th>top-1 agreement</th>'
        f'<th>max |Δ logprob|</th><th>mean KL</th><th>greedy</th></tr>{"".join(rows)}</table></div>'
    )


def engine_badges(snapshot: Mapping[str, Any]) -> list[str]:
    """What serves the page, for the header (Gradio) and the widget's title line: model, model
    implementation, device, attention kernels, decode and prefill paths, KV pool size. Plain text; escape it."""
    return [str(snapshot.get("model")), str(snapshot.get("model_impl")), str(snapshot.get("device")),
            f"attention: {snapshot.get('attention_backend')}", f"decode: {snapshot.get('decode_path')}",
            f"prefill: {snapshot.get('prefill_path', 'paddle')}",
            f"{snapshot.get('num_blocks')} KV blocks × {snapshot.get('block_size')} tokens"
            if snapshot.get("num_blocks") or not snapshot.get("blocks_hidden") else "KV blocks not exposed"]
