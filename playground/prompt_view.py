"""The prompt view: how surprised the model was by each token of a reply's prompt.

``score_prompt`` sends the prompt once more with ``SamplingParams(prompt_logprobs=k)``: for every
position after the first the engine returns the logprob of the prompt's actual token and the
top-k it expected there. Such a request reads the whole prompt (each position's logits are
needed, so nothing comes from the prefix cache), which is why the view is computed on demand
rather than with every reply. ``prompt_view_html`` draws the tokens with the logprob view's
renderer (red = unlikely, i.e. surprising; hover for what the model expected instead) under a
line naming the most surprising tokens. The Gradio app and the notebook widgets share both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from engine import SamplingParams

from . import render
from .logprobs import token_records

__all__ = ["score_prompt", "prompt_view_html", "PROMPT_VIEW_EMPTY"]

PROMPT_VIEW_EMPTY = ("<div class='pg-panel pv-view'><i>Score a reply's prompt to see which of its tokens "
                     "the model found surprising.</i></div>")

_HINTS = ('<span class="lp-hint-hover">· hover a token for alternatives · click it to branch</span>'
          '<span class="lp-hint-tap">· tap a token for its alternatives and to branch from it</span>')
_PROMPT_HINT = "<span>· red: surprising · hover (or tap) a token for what the model expected there</span>"


def score_prompt(llm: Any, prompt_token_ids: Sequence[int], top_k: int = 5) -> list[dict]:
    """One record per prompt token (``playground.logprobs.token_records``) plus ``surprisal``:
    ``-log2 p`` of the token given the tokens before it (None for the first token)."""
    ids = [int(t) for t in prompt_token_ids]
    if not ids:
        raise ValueError("the prompt is empty: there is nothing to score")
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k))[0]
    if out.error:
        raise RuntimeError(f"scoring the prompt failed: {out.error}")
    tokenizer = llm.get_tokenizer()
    records = token_records(ids, out.prompt_logprobs,   # special tokens spelled out, as the engine does
                            decode=lambda t: tokenizer.decode([t], skip_special_tokens=False))
    for rec in records:
        rec["surprisal"] = None if rec["logprob"] is None else -rec["logprob"] / math.log(2)
    return records


def _summary(records: Sequence[Mapping[str, Any]], top: int) -> str:
    scored = [r for r in records if r.get("surprisal") is not None]
    if not scored:
        return f"{len(records)} prompt token(s), none scored (the first token has nothing before it)"
    mean = sum(r["surprisal"] for r in scored) / len(scored)
    worst = sorted(scored, key=lambda r: -r["surprisal"])[:top]
    names = ", ".join(f'<span class="pv-worst" data-index="{int(r["index"])}">'
                      f'{escape(render._visible(str(r["text"])))}</span> {r["surprisal"]:.1f}' for r in worst)
    return (f"{len(records)} prompt tokens · mean surprisal {mean:.2f} bits · "
            f"most surprising (bits): {names}")


def prompt_view_html(records: Sequence[Mapping[str, Any]] | None, *, metric: str = "probability",
                     top: int = 5) -> str:
    """The scored prompt: a summary line, then every token coloured by its probability."""
    if not records:
        return PROMPT_VIEW_EMPTY
    tokens = render.logprob_html(records, metric=metric).replace(_HINTS, _PROMPT_HINT)
    return (f'<div class="pv-view"><div class="pv-summary" style="font-size:13px;margin:4px 0">'
            f'{_summary(records, top)}</div>{tokens}</div>')
