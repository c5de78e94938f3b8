"""Rich displays of the engine's objects in Jupyter: what ``_repr_html_`` of ``LLM``,
``EngineSnapshot`` and ``RequestOutput`` return, drawn by the playground's renderers.

* ``llm_html``: the model, its backend (model implementation, device, attention kernels, decode
  path) and a summary of the KV cache (blocks in use, shared, cached, free; prefix-cache hits);
* ``snapshot_html``: the block map (``render.block_map_html``), as the app and widgets draw it;
* ``output_html``: a reply as its logprob strip (``render.logprob_html`` of
  ``logprobs.token_records``), or its text where it was generated without logprobs.

Plain data in, HTML out; nothing here imports the engine, ipywidgets or Gradio, so the engine's
objects can call these from their ``_repr_html_`` without a notebook dependency.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from . import render
from .logprobs import token_records
from .styles import CSS

__all__ = ["llm_html", "snapshot_html", "output_html", "logprob_strip_html", "HOVER_HINT"]

# In a notebook a click on a token does nothing (the widget's logprob view branches instead).
HOVER_HINT = "<span>· hover a token for its top-k alternatives</span>"


def _counts(snapshot: Mapping[str, Any]) -> dict[str, int]:
    counts = {"used": 0, "shared": 0, "cached": 0, "free": 0}
    for block in snapshot.get("blocks") or ():
        counts[render.block_kind(block)] += 1
    return counts


def snapshot_html(snapshot: Mapping[str, Any], *, labels: Mapping[str, str] | None = None) -> str:
    """The block map of a snapshot dict."""
    return render.block_map_html(snapshot, labels=labels)


def llm_html(snapshot: Mapping[str, Any], *, max_model_len: int | None = None) -> str:
    """An engine at a glance, from its snapshot: what serves it and how full its KV cache is."""
    badges = " · ".join(escape(b) for b in render.engine_badges(snapshot))
    c = _counts(snapshot)
    n = max(int(snapshot.get("num_blocks") or 0), 1)
    in_use = c["used"] + c["shared"]
    prefix = snapshot.get("prefix_cache") or {}
    rows = [
        ("KV blocks", f"{in_use} in use ({c['shared']} shared), {c['cached']} cached, {c['free']} free "
                      f"of {snapshot.get('num_blocks')} × {snapshot.get('block_size')} tokens"),
        ("requests", str(len(snapshot.get("requests") or ()))),
        ("prefix cache", f"{prefix.get('hits', 0)} of {prefix.get('queries', 0)} prompt tokens hit "
                         f"({float(prefix.get('hit_rate', 0.0)) * 100:.1f}%)"),
        ("engine step", str(snapshot.get("step", 0))),
    ]
    if max_model_len:
        rows.insert(1, ("max model len", f"{max_model_len} tokens"))
    bar = "".join(
        f'<span class="llm-kv-{kind}" style="display:inline-block;height:10px;width:{count / n * 100:.2f}%;'
        f'{style}" title="{kind} {count}"></span>'
        for kind, count, style in (("used", in_use, "background:#4e79a7"),
                                   ("cached", c["cached"], render.STATE_STYLE["cached"]),
                                   ("free", c["free"], "background:#e2e8f0"))
        if count)
    table = "".join(f'<tr data-field="{escape(k)}"><td>{escape(k)}</td><td><b>{escape(v)}</b></td></tr>'
                    for k, v in rows)
    return (f'{CSS}<div class="pg-panel llm-repr"><div><b>LLM</b> <span style="color:#64748b">'
            f'{badges}</span></div><div class="llm-kv-bar" style="display:flex;width:100%;max-width:520px;'
            f'margin:6px 0;border-radius:3px;overflow:hidden">{bar}</div>'
            f'<table class="pg-stats">{table}</table></div>')


def logprob_strip_html(records: Sequence[Mapping[str, Any]]) -> str:
    """The logprob view of ``records`` with room below for the hover table of its last line (a
    notebook's output area clips what overflows it)."""
    html = render.logprob_html(records, hint=HOVER_HINT)
    return f'<div class="lp-room" style="padding-bottom:{"12em" if records else "0"}">{html}</div>'


def output_html(output: Any) -> str:
    """A ``RequestOutput``: its first completion's logprob strip (or text), and a line of stats."""
    completion = output.outputs[0] if output.outputs else None
    if completion is None:
        return f"<div class='pg-panel'>{escape(output.request_id)}: no completion</div>"
    stats = (f"{escape(str(output.request_id))} · {len(output.prompt_token_ids)} prompt tokens "
             f"({output.num_cached_tokens} from the prefix cache) · {len(completion.token_ids)} generated · "
             f"finish reason {escape(str(completion.finish_reason))}")
    if completion.error:
        stats += f" · <span style='color:#b91c1c'>{escape(completion.error)}</span>"
    head = f'{CSS}<div class="pg-panel request-output"><div class="pg-head"><span>{stats}</span></div>'
    if completion.logprobs:
        body = logprob_strip_html(token_records(completion.token_ids, completion.logprobs))
    else:
        body = (f'<div class="lp-text" style="white-space:pre-wrap">{escape(completion.text)}</div>'
                '<div style="color:#64748b;font-size:12px">(generated without logprobs: '
                "SamplingParams(logprobs=k) colours each token by its probability)</div>")
    return f"{head}{body}</div>"
