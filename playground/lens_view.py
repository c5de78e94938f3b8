"""The attention lens on the page: click a token, see where its attention went.

``lens_html`` draws an ``engine.lens.AttentionLens`` for one layer and head (or their mean):

* **heat on the text** -- every token of the conversation up to the clicked one shaded by the
  weight its key got (tokens after it are greyed: causal attention never sees them); on a
  sliding-window layer (Gemma 3's local layers) the tokens outside its window are hatched;
* **mass per physical block** -- one row per block of the lens pass's block table: its id, its
  share of the attention, who stored it (a turn or branch of this chat, this lens pass, or a request
  that is not this chat's: never its text), and whether it came from the prefix cache, is shared
  or is cached now. The same masses ring the cells of the live block map (a ``<style>`` of the
  panel's own, so the map's redraws keep them).

``LensView`` is the page's side: an accordion with a layer and a head selector; while it is open a
click on a token of the reply (the logprob view), of the scored prompt or of the lens's own text
asks the engine for a lens (``llm.attention_lens``: on demand, a request of its own, never a
decode step). A lens is computed only on this tab's own conversation; a request of anyone else is
refused. Bad input is named in the panel, not raised. On a server that has no lens (an
OpenAI-compatible server of another project) the panel says why.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

from engine.lens import AttentionLens, check_layer_head

__all__ = ["lens_html", "lens_error_html", "lens_empty_html", "block_rows", "stored_by", "reply_sources", "layer_choices", "head_choices",
           "parse_choice", "LENS_CSS", "LensState"]

MEAN_LAYERS, MEAN_HEADS = "all layers (mean)", "all heads (mean)"
HEAT = "230,80,20"

LENS_CSS = """<style>
.lz-view{font-family:ui-sans-serif,system-ui,sans-serif;font-size:13px;color:#0f172a}
.lz-head{color:#334155;margin:2px 0 6px}.lz-head b{color:#0f172a}
.lz-text{line-height:1.9;white-space:pre-wrap;word-break:break-word;max-height:260px;overflow-y:auto;
 border:1px solid #e2e8f0;border-radius:6px;padding:4px 6px}
.lz-tok{cursor:pointer;border-radius:3px;box-shadow:inset -1px 0 0 #fff}.lz-tok:hover{outline:1px solid #0f172a}
.lz-tok.lz-query{outline:2px solid #4f46e5;outline-offset:1px}.lz-tok.lz-after{color:#94a3b8}
.lz-tok.lz-out{background:repeating-linear-gradient(45deg,#e2e8f0 0 2px,#fff 2px 5px)!important;color:#64748b}
.lz-note{margin:4px 0;padding:4px 8px;border-radius:6px;background:#eef2ff;color:#3730a3;font-size:12px}
.lz-blocks{display:grid;grid-template-columns:auto min(220px,28%) minmax(0,1fr);gap:2px 8px;align-items:center;margin-top:6px;
 max-height:240px;overflow-y:auto}
.lz-bid{font-variant-numeric:tabular-nums;font-weight:600;cursor:pointer}
.lz-bar{height:12px;border-radius:3px;background:#f1f5f9;overflow:hidden}.lz-bar i{display:block;height:100%}
.lz-who{font-size:12px;color:#334155;white-space:nowrap;font-variant-numeric:tabular-nums}
.lz-tag{display:inline-block;margin-left:4px;padding:0 5px;border-radius:8px;font-size:11px;background:#e2e8f0}
.lz-tag.lz-shared{background:#0f172a;color:#fff}.lz-tag.lz-cached{background:#cbd5e1}
.lz-tag.lz-hit{background:#dcfce7;color:#166534}.lz-tag.lz-window{background:#fef3c7;color:#78350f}
.lz-error{margin:4px 0;padding:6px 10px;border-radius:6px;background:#fee2e2;color:#991b1b}
.lz-why{padding:8px 10px;border:1px dashed #94a3b8;border-radius:6px;background:#f8fafc;color:#334155}
@media (max-width:640px){.lz-who{white-space:normal}}
</style>"""


@dataclass
class LensState:
    """The lens one tab has open: on which of its requests (``request_id``) and the lens itself."""

    open: bool = False
    request_id: str | None = None
    lens: AttentionLens | None = None
    error: str | None = None
    passes: list = field(default_factory=list)      # this tab's lens passes, as `stored_by` sources


def layer_choices(lens: AttentionLens | None) -> list[str]:
    if lens is None:
        return [MEAN_LAYERS]
    windows = lens.sliding_windows or (None,) * lens.num_layers
    return [MEAN_LAYERS] + [f"layer {i}" + (f" · window {w}" if w else "") for i, w in enumerate(windows)]


def head_choices(lens: AttentionLens | None) -> list[str]:
    return [MEAN_HEADS] + ([f"head {h}" for h in range(lens.num_heads)] if lens is not None else [])


def parse_choice(value: Any, what: str, count: int | None) -> int | None:
    """A selector's value (``"layer 3 · window 512"``, ``3``, ``"3"``; the mean: None, ``""`` or the
    ``all ...`` choice) as an index, or ``ValueError`` naming what is accepted."""
    if value is None or (isinstance(value, str) and (not value.strip() or value.startswith("all "))):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
        index = int(value)
    else:
        match = re.fullmatch(rf"\s*(?:{what}\s+)?(-?\d+)\b.*", str(value)) if isinstance(value, str) else None
        if match is None:
            raise ValueError(f"{what} must be a {what} number, '{what} N' or '{MEAN_LAYERS if what == 'layer' else MEAN_HEADS}'; "
                             f"got {value!r:.40}")
        index = int(match.group(1))
    if count is not None:
        check_layer_head(index if what == "layer" else None, index if what == "head" else None,
                         count if what == "layer" else 1, count if what == "head" else 1)
    return index


def _visible(text: str) -> str:
    return text.replace("\n", "↵") or "∅"


def _window_start(lens: AttentionLens, layer: int | None) -> int:
    """First position inside ``layer``'s sliding window (0 where it sees every position)."""
    window = lens.sliding_windows[layer] if layer is not None and lens.sliding_windows else None
    return max(0, lens.position + 1 - window) if window else 0


def stored_by(lens: AttentionLens, sources: Sequence[tuple[str, Sequence[int], int, int]]) -> list[str]:
    """Who stored each block of the lens pass's table: the last of ``sources`` (requests of this
    conversation, oldest first: ``(name, token ids, positions read from the prefix cache, positions
    whose K/V it computed)``) that computed the block with the same tokens before it; blocks past
    the lens's cache hits were computed by the lens pass itself."""
    size, ids = lens.block_size, tuple(lens.token_ids)
    out = []
    for j in range(-(-len(ids) // size)):
        end = (j + 1) * size
        if end > lens.num_cached_tokens:
            out.append("computed by this lens pass")
            continue
        who = None
        for name, seq, cached, computed in sources:
            if cached < end <= computed and tuple(seq[:end]) == ids[:end]:
                who = name
        out.append(f"stored by {who}" if who else "stored by a request that is not this chat's")
    return out


def reply_sources(named: Sequence[tuple[str, Any]]) -> list[tuple[str, list[int], int, int]]:
    """`stored_by` sources from ``(name, Reply)`` pairs, oldest first: a reply holds the K/V of its prompt
    and of every token of it but the last (sampled, never fed back)."""
    out = []
    for name, reply in named:
        seq = list(reply.prompt_token_ids) + list(reply.all_token_ids)
        if reply.prompt_token_ids:
            out.append((name, seq, int(reply.num_cached_tokens or 0), len(seq) - 1))
    return out


def block_rows(lens: AttentionLens, *, layer: int | None, head: int | None,
               snapshot: Mapping[str, Any] | None = None, stored_by: Sequence[str] = (),
               name: Callable[[str], str] = str) -> list[dict]:
    """One row per block of the lens pass's table, in table order: ``block_id``, ``mass``, ``first``
    and ``last`` position, ``stored_by``, ``hit`` (from the prefix cache), ``state`` now (``shared``,
    ``used``, ``cached``, ``free`` in ``snapshot``), ``owners`` now (named by ``name``), ``outside``
    (wholly outside the layer's sliding window)."""
    heat = lens.heat(layer, head).tolist()          # Python floats: a loop over a NumPy array is slower
    start = _window_start(lens, layer)
    blocks = {b.get("block_id"): b for b in (snapshot or {}).get("blocks") or ()}
    rows: list[dict] = []
    for p, (block, w) in enumerate(zip(lens.block_ids, heat)):
        if rows and rows[-1]["block_id"] == block:
            rows[-1]["mass"] += w
            rows[-1]["last"] = p
            continue
        j = len(rows)
        now = blocks.get(block) or {}
        ref = int(now.get("ref_cnt", 0))
        state = ("shared" if ref > 1 else "used") if ref else ("cached" if now.get("hashed") else "free")
        rows.append({"block_id": int(block), "mass": w, "first": p, "last": p,
                     "stored_by": stored_by[j] if j < len(stored_by) else "",
                     "hit": (j + 1) * lens.block_size <= lens.num_cached_tokens, "state": state if now else None,
                     "owners": [name(str(o)) for o in now.get("owners") or ()]})
    for row in rows:
        row["outside"] = row["last"] < start
    return rows


def _what(lens: AttentionLens, layer: int | None, head: int | None) -> str:
    return (f"layer {layer}" if layer is not None else f"mean of {lens.num_layers} layers") + " · " + \
           (f"head {head}" if head is not None else f"mean of {lens.num_heads} heads")


def _window_note(lens: AttentionLens, layer: int | None) -> str:
    windows = lens.sliding_windows or ()
    local = [i for i, w in enumerate(windows) if w]
    if not local:
        return ""
    if layer is None:
        return (f'<div class="lz-note">Layers {", ".join(map(str, local))} are sliding-window layers (window '
                f'{windows[local[0]]} tokens): their share of the mean lies within their window. Pick one to see it.</div>')
    start = _window_start(lens, layer)
    if not windows[layer]:
        return f'<div class="lz-note">Layer {layer} attends to every position (a global layer).</div>'
    return (f'<div class="lz-note lz-window-note">Layer {layer} is a sliding-window layer ({windows[layer]} tokens): '
            + (f"positions 0–{start - 1} are outside its window (hatched), it cannot attend to them.</div>"
               if start else "the whole context fits in its window.</div>"))


def lens_html(lens: AttentionLens, *, layer: int | None = None, head: int | None = None,
              after: Sequence[str] = (), snapshot: Mapping[str, Any] | None = None, stored_by: Sequence[str] = (),
              name: Callable[[str], str] = str, on_map: bool = True, error: str | None = None,
              map_cells: str = "#kv-map .kv-cell") -> str:
    """The lens for ``layer`` / ``head`` (None: the mean): heat on the text, then mass per block.

    ``after``: the texts of the conversation's tokens after the lens's position (drawn greyed, to
    click on); ``snapshot``, ``stored_by``, ``name``: see `block_rows`; ``on_map``: ring the block
    map's cells (``map_cells``, a CSS selector) by mass; ``error``: a refusal to show above the lens."""
    check_layer_head(layer, head, lens.num_layers, lens.num_heads)
    heat = lens.heat(layer, head).tolist()
    top = max(heat) or 1.0
    start = _window_start(lens, layer)
    texts = lens.tokens or tuple(str(t) for t in lens.token_ids)
    spans = []
    for p, (text, w, block) in enumerate(zip(texts, heat, lens.block_ids)):
        cls = "lz-tok" + (" lz-query" if p == lens.position else "") + (" lz-out" if p < start else "")
        spans.append(f'<span class="{cls}" data-pos="{p}" data-weight="{w:.6f}" title="position {p} · block '
                     f'{block} · weight {w:.4f}" style="background:rgba({HEAT},{(w / top) ** 0.5:.3f})">'
                     f'{escape(_visible(text))}</span>' + ("<br>" if "\n" in text else ""))
    for q, text in enumerate(after, lens.position + 1):
        spans.append(f'<span class="lz-tok lz-after" data-pos="{q}" title="position {q}: after the token, '
                     f'unseen by it">{escape(_visible(text))}</span>' + ("<br>" if "\n" in text else ""))
    rows = block_rows(lens, layer=layer, head=head, snapshot=snapshot, stored_by=stored_by, name=name)
    top_mass = max(r["mass"] for r in rows) or 1.0
    cells, ring = [], []
    for r in rows:
        tags = "".join(f'<span class="lz-tag lz-{k}">{t}</span>' for k, t in (
            ("hit", "prefix-cache hit" if r["hit"] else ""), ("shared", "shared now" if r["state"] == "shared" else ""),
            ("cached", "cached now" if r["state"] == "cached" else ""),
            ("window", "outside the window" if r["outside"] else "")) if t)
        owners = f' · held by {escape(", ".join(r["owners"]))}' if r["owners"] else ""
        share = r["mass"] / top_mass
        cells.append(f'<span class="lz-bid" data-block="{r["block_id"]}" title="positions {r["first"]}–{r["last"]}">'
                     f'#{r["block_id"]}</span><span class="lz-bar"><i style="width:{100 * share:.1f}%;background:'
                     f'rgba({HEAT},{0.25 + 0.75 * share:.3f})"></i></span><span class="lz-who lz-row" '
                     f'data-block="{r["block_id"]}" data-mass="{r["mass"]:.6f}">{100 * r["mass"]:.1f}%'
                     f'{" · " + escape(r["stored_by"]) if r["stored_by"] else ""}{owners}{tags}</span>')
        ring.append(f'{map_cells}[data-block="{r["block_id"]}"]{{box-shadow:inset 0 0 0 3px '
                    f'rgba({HEAT},{0.2 + 0.8 * share:.3f})}}')
    style = f"<style>{''.join(ring)}</style>" if on_map else ""
    query = texts[lens.position] if lens.position < len(texts) else ""
    head_line = (f'<div class="lz-head">Attention of token <b>#{lens.position}</b> <code>{escape(_visible(query))}'
                 f'</code> · {_what(lens, layer, head)} · {lens.position + 1} tokens in <b>{len(rows)}</b> blocks, '
                 f'{lens.num_cached_tokens} from the prefix cache · {lens.seconds * 1000:.0f} ms</div>')
    problem = f'<div class="lz-error">{escape(error)}</div>' if error else ""
    return (f'{LENS_CSS}{style}<div class="lz-view" data-position="{lens.position}" data-layer="{"" if layer is None else layer}" '
            f'data-head="{"" if head is None else head}">{problem}{head_line}{_window_note(lens, layer)}'
            f'<div class="lz-text">{"".join(spans)}</div><div class="pg-sub" style="font-weight:600;margin:8px 0 2px">'
            f'Attention mass per physical KV block (ringed on the block map)</div><div class="lz-blocks">{"".join(cells)}'
            f'</div><div class="lz-scale" style="font-size:11px;color:#64748b;margin-top:4px">shade ∝ √(weight / '
            f'largest weight) · click a token to move the lens there</div></div>')


def lens_empty_html(why: str | None = None) -> str:
    if why:
        return f'{LENS_CSS}<div class="lz-view lz-unavailable"><div class="lz-why"><b>No attention lens here.</b> {escape(why)}</div></div>'
    return (f'{LENS_CSS}<div class="lz-view lz-empty"><i>Click a token of the reply (the logprob view), of the scored '
            "prompt or of this panel's text: its attention shows here, per token and per KV block.</i></div>")


def lens_error_html(message: str) -> str:
    """A refusal or bad input, named where the lens would be (``lens_html(error=...)`` keeps a lens below it)."""
    return f'{LENS_CSS}<div class="lz-view lz-empty"><div class="lz-error">{escape(message)}</div></div>'
