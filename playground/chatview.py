"""The chat as the page shows it: the shown path of the conversation tree.

``chat_messages`` turns the path into ``gr.Chatbot`` messages. Under each
reply sits one line (``div.pg-meta``): ``‹ 2/3 ›`` to move between the
reply's branches (when it has any), its state while it is generated (queued,
prefill n / m, decoding) and its stats once done: tokens, time to first
token, decode tok/s, prompt tokens from the prefix cache, why it ended, and a
context gauge (tokens used of ``max_model_len``). The arrows are
``span.pg-nav.pg-prev|pg-next.pg-node-<id>`` elements (classes, since the
Chatbot's sanitizer drops ``data-*`` attributes); a click listener of the
page (``app.NAV_JS``) sends them to the server.
"""

from __future__ import annotations

from html import escape

from .conversation import Conversation, Node

__all__ = ["chat_messages", "document_messages", "reply_meta_html", "compare_html", "CURSOR", "META_CSS", "strip_meta"]

CURSOR = "▌"
FINISH_TEXT = {"stop": "end of reply", "length": "length: max tokens reached", "abort": "stopped",
               "error": "error"}

# The Chatbot's own copy button under a reply would copy its meta line too: the line's "copy" link replaces it.
META_CSS = """
#chat .message-buttons-left{display:none}
.pg-meta{display:flex;flex-wrap:wrap;align-items:center;gap:2px 10px;margin-top:6px;font-size:12px;
 color:#64748b;font-variant-numeric:tabular-nums}
.pg-meta .pg-nav{cursor:pointer;user-select:none;padding:0 6px;border-radius:4px;font-weight:700;color:#4338ca}
.pg-meta .pg-nav:hover{background:#e0e7ff}.pg-meta .pg-nav.off{color:#cbd5e1;cursor:default;background:none}
.pg-meta .pg-state{color:#b45309;font-weight:600}.pg-meta .pg-finish-length{color:#b45309;font-weight:600}
.pg-meta .pg-finish-abort,.pg-meta .pg-finish-error{color:#b91c1c;font-weight:600}
.pg-meta .pg-act{cursor:pointer;user-select:none;padding:0 6px;border-radius:4px;font-weight:600;color:#4338ca;
 border:1px solid #c7d2fe}.pg-meta .pg-act:hover{background:#e0e7ff}.pg-meta .pg-raw{display:none}
.pg-meta .pg-what{margin-right:2px}.pg-meta .pg-doc-raw{display:none}
.pg-doc-editor textarea{width:100%;min-height:9em;font:inherit;line-height:1.5;padding:6px;border:1px solid #c7d2fe;
 border-radius:6px;resize:vertical;box-sizing:border-box}.pg-doc-editor div{display:flex;gap:8px;margin-top:4px}
.pg-doc-editor .pg-act{padding:2px 10px;min-height:28px;border-radius:4px;border:1px solid #c7d2fe;background:#eef2ff;
 color:#3730a3;font-weight:600;cursor:pointer}.pg-meta .pg-kept{color:#94a3b8}
.pg-doc{white-space:normal;line-height:1.6}.pg-doc .pg-doc-given{color:#0f172a}
.pg-doc .pg-tok{cursor:pointer;border-radius:3px;border:0;padding:0;font-weight:inherit;color:#0f172a}
.pg-doc .pg-tok:hover{outline:1px solid #6366f1}.pg-doc .pg-p4{background:#dcfce7}.pg-doc .pg-p3{background:#ecfccb}
.pg-doc .pg-p2{background:#fef9c3}.pg-doc .pg-p1{background:#ffedd5}.pg-doc .pg-p0{background:#fee2e2}
.pg-doc .pg-pf{background:#e0e7ff}
.pg-meta .pg-ctx{display:inline-flex;align-items:center;gap:4px}
.pg-meta .pg-ctx i{display:inline-block;width:60px;height:6px;border-radius:3px;background:#e2e8f0;overflow:hidden}
.pg-meta .pg-ctx i b{display:block;height:100%;background:#6366f1}
"""


def _count(r) -> str:
    """Tokens the engine generated for this reply; tokens kept from the reply it branched from (or forced,
    or generated before Continue) are counted apart, so the count stays within max tokens."""
    kept = f' <span class="pg-kept">+ {len(r.prefix_token_ids)} kept</span>' if r.prefix_token_ids else ""
    return f'<span class="pg-count">{len(r.token_ids)} tokens{kept}</span>'


def _nav(tree: Conversation, node: Node, what: str = "reply") -> str:
    pos, count = tree.siblings(node.node_id)
    if count < 2:
        return ""
    # The Chatbot's sanitizer drops data-* attributes but keeps classes: the target rides in them.
    prev_cls = f"pg-nav pg-prev pg-node-{node.node_id}" + ("" if pos > 1 else " off")
    next_cls = f"pg-nav pg-next pg-node-{node.node_id}" + ("" if pos < count else " off")
    label = "" if what == "reply" else f'<span class="pg-what">{what}</span>'
    return (f'<span class="pg-branches pg-{what}-branches">{label}<span class="{prev_cls}" title="previous {what}">‹</span>'
            f'<span class="pg-pos">{pos}/{count}</span>'
            f'<span class="{next_cls}" title="next {what}">›</span></span>')


def reply_meta_html(tree: Conversation, node: Node, max_model_len: int | None = None,
                    document: Node | None = None) -> str:
    """The line under one reply: branch navigation, state or stats, context gauge. ``document``: the
    completion document's first text, whose versions (edits of the whole text) the line moves between,
    with an "edit" link that opens the whole document as one text (``revise.ACT_JS``)."""
    r = node.reply
    user = document or tree.nodes.get(node.parent)
    parts = [_nav(tree, user, "version" if document else "message") if user is not None and user.role == "user" else "",
             _nav(tree, node, "reply")]
    if not r.finished and not r.stopped:
        parts.append(f'<span class="pg-state">{escape(r.state)}</span>')
        if r.token_ids:
            parts.append(_count(r))
    else:
        reason = "abort" if r.stopped else (r.finish_reason or "abort")
        parts.append(_count(r))
        if r.ttft is not None:
            parts.append(f"<span>TTFT {r.ttft * 1000:.0f} ms</span>")
        if r.decode_tps is not None:
            parts.append(f"<span>{r.decode_tps:.1f} tok/s</span>")
        if r.num_prompt_tokens:
            parts.append(f'<span title="prompt tokens read from the prefix cache">{r.num_cached_tokens}/'
                         f"{r.num_prompt_tokens} prompt tokens cached</span>")
        text = FINISH_TEXT.get(reason, reason)
        full = bool(max_model_len) and r.num_prompt_tokens + len(r.token_ids) >= max_model_len
        if reason == "length" and full:
            text = "length: the context is full (max_model_len)"
        parts.append(f'<span class="pg-finish pg-finish-{escape(reason)}">{escape(text)}</span>')
        if reason == "length" and not r.error and not full:
            parts.append(f'<span class="pg-act pg-continue pg-node-{node.node_id}" title="generate more after this '
                         'reply, in the same reply">Continue ↦</span>')
        # The reply's own text for the copy link (the Chatbot's copy button would copy this meta line too).
        raw = escape(r.text).replace("\n", "&#10;")
        parts.append(f'<span class="pg-act pg-copy" title="copy the reply\'s text">copy</span>'
                     f'<span class="pg-raw">{raw}</span>')
        if document is not None and not r.error:
            whole = escape(tree.text_before(node.node_id) + r.text).replace("\n", "&#10;")
            parts.append(f'<span class="pg-act pg-edit-doc pg-node-{node.node_id}" title="edit the whole text, the '
                         f'continuation too, and continue from the end">edit ✎</span><span class="pg-doc-raw">{whole}</span>')
    if max_model_len and r.num_prompt_tokens:
        used = r.num_prompt_tokens + len(r.token_ids)
        pct = min(used / max_model_len, 1.0) * 100
        left = max(max_model_len - used, 0)
        parts.append(f'<span class="pg-ctx" title="context: {used} of {max_model_len} tokens (max_model_len); the '
                     f'next reply can have at most {left} tokens">context <i><b style="width:{pct:.1f}%"></b></i>'
                     f'{used}/{max_model_len} · <span class="pg-left">{left} left</span></span>')
    return f'<div class="pg-meta">{"".join(p for p in parts if p)}</div>'


def _reply_text(node: Node) -> str:
    r = node.reply
    if r.error:
        return f"**Error:** {r.error}"
    if r.stopped or (r.finished and r.finish_reason == "abort"):
        return r.text + " *(stopped)*"
    if not r.finished:
        return r.text + CURSOR
    return r.text


def _bucket(prob: float | None) -> str:
    """The colour class of a token of probability ``prob`` (the logprob view's scale, in five steps)."""
    if prob is None:
        return "pg-pf"                       # forced, or no logprobs asked for
    return f"pg-p{min(int(prob * 5), 4)}"


def _doc_text(text: str) -> str:
    return escape(text).replace("\n", "<br>")


def document_messages(tree: Conversation, max_model_len: int | None = None, queued: list[str] = ()) -> list[dict]:
    """Completion mode: the shown path as one document, the text given in plain and each continuation's
    tokens coloured by their probability (a click on one continues from there: ``pg-cut``), with the last
    continuation's meta line under it; not a chat of user and assistant bubbles."""
    parts, last = [], None
    for node in tree.path():
        if node.role == "user":
            parts.append(f'<span class="pg-doc-given">{_doc_text(node.content)}</span>')
            continue
        last, r = node, node.reply
        if r.error:
            parts.append(f'<span class="pg-doc-error">[{escape(r.error)}]</span>')
            continue
        # The token that ended the reply (the model's end of text) is no text of the document.
        texts = [rec.get("text", "") if not rec.get("stop") else "" for rec in r.records]
        if r.records and "".join(texts) == r.text:        # one span per token, coloured
            parts += [f'<span class="pg-tok pg-act pg-cut pg-node-{node.node_id} pg-ti-{i} {_bucket(rec.get("prob"))}" '
                      f'title="continue from here">{_doc_text(t)}</span>' for i, (rec, t) in enumerate(zip(r.records, texts))
                      if not rec.get("stop")]
        else:                                              # no per-token records (imported, or logprobs off)
            parts.append(f'<span class="pg-doc-reply">{_doc_text(r.text)}</span>')
        if not r.finished and not r.stopped:
            parts.append(CURSOR)
    out = []
    if parts:
        body = f'<span class="pg-doc">{"".join(parts)}</span>'
        first = next((n for n in tree.path() if n.role == "user"), None)
        meta = "\n\n" + reply_meta_html(tree, last, max_model_len, document=first) if last is not None else ""
        out.append({"role": "assistant", "content": body + meta})
    out += [{"role": "user", "content": text} for text in queued]
    return out


def chat_messages(tree: Conversation, max_model_len: int | None = None, queued: list[str] = (),
                  document: bool = False) -> list[dict]:
    """``gr.Chatbot`` messages of the shown path, each reply followed by its meta line, then the
    ``queued`` messages (sent while a reply streams, waiting for it); ``document``: completion mode's
    one document (``document_messages``)."""
    if document:
        return document_messages(tree, max_model_len, queued)
    out = []
    for node in tree.path():
        if node.role == "user":
            out.append({"role": "user", "content": node.content})
        else:
            out.append({"role": "assistant",
                        "content": _reply_text(node) + "\n\n" + reply_meta_html(tree, node, max_model_len)})
    out += [{"role": "user", "content": text} for text in queued]
    return out


def strip_meta(content: str) -> str:
    """A reply's text without its meta line (what an API client usually wants)."""
    return content.split('\n\n<div class="pg-meta"', 1)[0]


def compare_html(tree: Conversation, node: Node | None, render_logprobs) -> str:
    """The shown reply beside its previous (or next) branch: both logprob strips, and where they part.

    ``render_logprobs(records, selected=i)`` draws one strip (``render.logprob_html``);
    the first token where the two differ is outlined in both.
    """
    if node is None or tree.siblings(node.node_id)[1] < 2:
        return ('<div class="pg-panel compare-view" style="font-family:ui-sans-serif,system-ui,sans-serif;'
                'font-size:13px"><i>Branch or regenerate a reply to compare two of its branches here.</i></div>')
    pos, count = tree.siblings(node.node_id)
    brothers = tree.nodes[node.parent].children
    other = tree.nodes[brothers[pos - 2] if pos > 1 else brothers[1]]
    a, b = (other, node) if pos > 1 else (node, other)
    ids_a, ids_b = a.reply.all_token_ids, b.reply.all_token_ids
    split = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
    same = split == len(ids_a) == len(ids_b)
    cols = "".join(
        f'<div class="compare-col" data-branch="{tree.siblings(n.node_id)[0]}"><div class="pg-sub">branch '
        f'{tree.siblings(n.node_id)[0]}/{count} · {len(n.reply.all_token_ids)} tokens</div>'
        f'{render_logprobs(n.reply.records, selected=None if same else split)}</div>'
        for n in (a, b))
    verdict = "identical tokens" if same else f"they share {split} tokens and part at token #{split}"
    return ('<div class="pg-panel compare-view" style="font-family:ui-sans-serif,system-ui,sans-serif;'
            f'font-size:13px"><div class="compare-split" data-split="{split}">{escape(verdict)}</div>'
            f'<div style="display:grid;grid-template-columns:1fr 1fr;gap:10px">{cols}</div></div>')
