"""The sampler's pipeline for one reply token: each stage's distribution, what it kept, where the
sampled token fell.

``engine.sampler_pipeline.SamplerPipeline`` holds the stages in the sampler's order (raw →
penalties → temperature → top_k → min_p → top_p; greedy requests end at ``greedy``).
``sampler_pipeline_html`` draws one card per stage: the kept set's size, the token's probability
and rank there, and bars of the most likely tokens of the stage before (so a cut shows: a bar
that was there and is now struck through). The funnel line above the cards gives the kept
counts in order. ``reply_pipeline`` asks the engine for the pipeline of a token of a playground
``Reply`` (in process, in the engine's child process, or on our server: ``EngineClient``);
``pipeline_note`` says why there is none (a forced token, a foreign server, a restored reply).
The Gradio app, the notebook widget and ``SamplerPipeline._repr_html_`` share these.
"""

from __future__ import annotations

from collections.abc import Callable
from html import escape
from typing import Any

import numpy as np

from .render import _visible
from .styles import CSS

__all__ = ["sampler_pipeline_html", "reply_pipeline", "pipeline_note", "SAMPLER_EMPTY"]

SAMPLER_EMPTY = ("<div class='pg-panel sp-view'><i>Click a token of the reply: the sampler's stages for it "
                 "show here (raw logits → penalties → temperature → top-k → min-p → top-p).</i></div>")
BARS = 8

_STYLE = """<style>
.sp-funnel{display:flex;flex-wrap:wrap;gap:2px 6px;align-items:center;margin:4px 0 8px;color:#334155}
.sp-funnel b{color:#0f172a}
.sp-stages{display:grid;grid-template-columns:repeat(auto-fill,minmax(230px,1fr));gap:8px}
.sp-stage{border:1px solid #e2e8f0;border-radius:6px;padding:4px 8px;background:#f8fafc;min-width:0}
.sp-stage-head{font-size:12px;color:#334155;margin-bottom:3px}
.sp-bar{display:grid;grid-template-columns:minmax(0,7em) 1fr 4.2em;gap:4px;align-items:center;font-size:12px}
.sp-lbl{overflow:hidden;text-overflow:ellipsis;white-space:nowrap;font-family:ui-monospace,monospace}
.sp-track{height:10px;background:#e2e8f0;border-radius:2px;overflow:hidden}
.sp-fill{display:block;height:100%;background:#6366f1}
.sp-pct{text-align:right;font-variant-numeric:tabular-nums}
.sp-cut .sp-lbl,.sp-cut .sp-pct{text-decoration:line-through;color:#94a3b8}
.sp-token .sp-lbl{font-weight:700;color:#b45309}.sp-token .sp-fill{background:#f59e0b}
.sp-tokcut .sp-lbl{color:#b91c1c}
</style>"""


def _pct(p: float) -> str:
    return f"{p * 100:.1f}%" if p >= 0.001 else (f"{p * 100:.0e}%" if p > 0 else "0")


def sampler_pipeline_html(pipe: Any, *, decode: Callable[[int], str] | None = None, index: int | None = None) -> str:
    """The stages of ``pipe`` (a ``SamplerPipeline``) for its ``token``; ``decode`` names ids the pipeline's
    ``texts`` lack; ``index`` is the token's place in the reply (for the heading)."""
    def text(t: int) -> str:
        s = pipe.texts.get(int(t))
        if s is None and decode is not None:
            s = decode(int(t))
        if s is None:
            return f"#{int(t)}"
        return _visible(s.replace(" ", "·")) if s.strip() == "" else _visible(s)   # a bar of spaces still reads

    token = pipe.token
    stages = pipe.stages
    funnel = " → ".join(f'<span data-stage="{escape(s.name)}">{escape(s.name)} <b>{s.kept.size:,}</b></span>'
                        for s in stages)
    cards, before = [], None
    for s in stages:
        ref = before if before is not None else s
        k = min(BARS, ref.probs.size)
        best = np.argpartition(-ref.probs, k - 1)[:k]           # not a sort of the whole vocabulary
        ids = [int(t) for t in best[np.argsort(-ref.probs[best], kind="stable")]]
        if token is not None and token not in ids:
            ids.append(int(token))
        rows = []
        for t in ids:
            p = float(s.probs[t])
            i = int(np.searchsorted(s.kept, t))                   # kept is ascending
            alive = i < s.kept.size and int(s.kept[i]) == t
            cls = ["sp-bar"] + ([] if alive else ["sp-cut"]) + (["sp-token"] if t == token else [])
            if t == token and not alive:
                cls.append("sp-tokcut")
            rows.append(f'<div class="{" ".join(cls)}" data-token-id="{t}" title="id {t}"><span class="sp-lbl">'
                        f'{escape(text(t))}</span><span class="sp-track"><span class="sp-fill" '
                        f'style="width:{min(p, 1) * 100:.1f}%"></span></span><span class="sp-pct">{_pct(p)}</span></div>')
        where = ""
        if token is not None:
            r = s.rank(token)
            where = (f" · token: <b>{_pct(s.prob(token))}</b>, rank {r}" if r is not None
                     else " · token: <b style='color:#b91c1c'>cut here</b>")
        cards.append(f'<div class="sp-stage" data-stage="{escape(s.name)}" data-kept="{s.kept.size}" '
                     f'data-token-rank="{"" if token is None or s.rank(token) is None else s.rank(token)}">'
                     f'<div class="sp-stage-head"><b>{escape(s.name)}</b> · {s.kept.size:,} kept{where}</div>'
                     f'{"".join(rows)}</div>')
        before = s
    head = ""
    if token is not None:
        last = stages[-1]
        fell = (f"drawn from the <b>{last.kept.size:,}</b> token(s) the last stage kept, with probability "
                f"<b>{_pct(last.prob(token))}</b> (rank {last.rank(token)})" if last.rank(token) is not None else
                "<b>not in the last stage's kept set</b>: the sampler could not have drawn it with these settings "
                "(a forced token, or settings changed since)")
        at = f"token #{index} " if index is not None else ""
        head = (f'<div class="sp-head">{at}<b>{escape(text(token))}</b> (id {int(token)}): {fell}</div>')
    in_kept = token is not None and stages[-1].rank(token) is not None
    return (f'{CSS}{_STYLE}<div class="pg-panel sp-view" data-token="{"" if token is None else int(token)}" '
            f'data-in-kept="{str(in_kept).lower()}">{head}<div class="sp-funnel">kept: {funnel}</div>'
            f'<div class="sp-stages">{"".join(cards)}</div></div>')


def pipeline_note(message: str) -> str:
    """Why there is no pipeline to show, in the panel's place."""
    return f"{CSS}<div class='pg-panel sp-view sp-none'><i>{escape(message)}</i></div>"


def reply_pipeline(llm: Any, reply: Any, index: int):
    """The engine's pipeline for token ``index`` of ``reply`` (a ``playground.chat.Reply``) under the
    settings it was sampled with; ``ValueError`` saying why when it has none."""
    if not 0 <= index < len(reply.all_token_ids):
        raise ValueError(f"token #{index} is outside the reply (0..{len(reply.all_token_ids) - 1})")
    if index < len(reply.prefix_token_ids):
        raise ValueError(f"token #{index} was not sampled in this reply: the branch kept or forced it. Click it "
                         "in the reply it came from (‹ › under the reply) for its stages there.")
    params = getattr(reply, "params", None)
    if params is None:
        raise ValueError("this reply's sampling settings are not known (it was restored from a saved "
                         "conversation): send or regenerate it to see its sampler's stages.")
    if not hasattr(llm, "sampler_pipeline"):
        raise ValueError("this engine client has no sampler_pipeline()")
    prompt = list(reply.prompt_token_ids)
    ids = prompt + list(reply.all_token_ids)
    try:
        return llm.sampler_pipeline(ids, len(prompt) + index, params,
                                    num_prompt_tokens=len(prompt) + len(reply.prefix_token_ids))
    except NotImplementedError as exc:       # a foreign OpenAI-compatible server: it says why
        raise ValueError(str(exc)) from None
