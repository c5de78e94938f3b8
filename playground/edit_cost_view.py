"""What an edit or a branch will cost, before it is sent, and the estimate beside the actual after.

While a user message is edited in the chat (the page's script sends the edited text as it is
typed, ``EDIT_WATCH_JS``) or a branch is picked in the logprob view, ``EditCost`` builds the
prompt the edit or branch would send and asks the engine what prefilling it costs
(``llm.estimate_prefill``: a read-only walk of the prefix-cache index, ``engine.prefill_estimate``):
tokens from the prefix cache and tokens to compute, which blocks are shared (and which a running
request holds now), the new blocks (none copied: this engine shares full blocks only), the cached
blocks the new ones would evict, and the expected prefill time at the rate this engine measured.
Once a reply with that prompt has run, the panel puts the engine's actual numbers beside the
estimate: cached tokens (the request's prefix hits), computed tokens, prefill time (first
scheduled to first token).
"""

from __future__ import annotations

from collections import OrderedDict
from html import escape
from typing import Any

__all__ = ["EditCost", "edit_cost_html", "EDIT_WATCH_JS", "EDIT_COST_EMPTY", "EDIT_COST_CSS"]

EDIT_COST_CSS = """<style>
.ec{font:13px/1.45 system-ui,sans-serif;color:#0f172a}.ec h4{margin:0 0 4px;font-size:14px}
.ec .ec-blocks{display:flex;flex-wrap:wrap;gap:3px;margin:6px 0}
.ec .ec-b{min-width:30px;height:24px;padding:0 3px;border-radius:4px;font-size:11px;display:flex;
 align-items:center;justify-content:center;box-sizing:border-box;border:1px solid transparent}
.ec .shared{background:#bbf7d0;color:#14532d}.ec .live{border:2px solid #15803d}
.ec .recomputed{background:#fde68a;color:#78350f}.ec .new{background:#c7d2fe;color:#312e81}
.ec .partial{background:linear-gradient(90deg,#c7d2fe var(--fill),#eef2ff var(--fill));color:#312e81}
.ec table{border-collapse:collapse;margin-top:6px;width:100%;max-width:560px}
.ec td,.ec th{padding:2px 8px 2px 0;text-align:left;vertical-align:top}.ec th{color:#475569;font-weight:600}
.ec .ok{color:#15803d}.ec .off{color:#b45309}.ec .note{color:#475569;margin:2px 0}
.ec .legend span{margin-right:10px;white-space:nowrap}#edit-cost-bridge{display:none}
</style>"""

EDIT_COST_EMPTY = (EDIT_COST_CSS + '<div class="ec"><p class="note">Edit a message (the pencil on it) or pick a '
                   "token to branch from: this panel says, before you send, how many tokens the prefix cache "
                   "will serve, which blocks are shared and what must be computed.</p></div>")

# The Chatbot's edit box is the page's own (a textarea in place of the message): one document-level
# listener sends its text, with the message's index, through this hidden bridge's click event,
# at most every 300 ms while typing.
EDIT_WATCH_JS = """
if (!window.__pgEditCost) {
  window.__pgEditCost = true;
  let timer = null;
  document.addEventListener('input', (e) => {
    const box = e.target.closest && e.target.closest('#chat textarea.edit-textarea');
    if (!box) return;
    const rows = [...document.querySelectorAll('#chat .message-row')];
    const index = rows.indexOf(box.closest('.message-row'));
    clearTimeout(timer);
    timer = setTimeout(() => trigger('click', {index: index, value: box.value}), 300);
  });
}
"""


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def _blocks(est: dict) -> str:
    bs, shared, live = est["block_size"], est["shared_block_ids"], set(est["live_block_ids"])
    cells = []
    for b in shared:
        cls = "shared live" if b in live else "shared"
        what = "held by a running request now: shared with it" if b in live else "cached: reused"
        cells.append(f'<span class="ec-b {cls}" title="block {b} · {what}">{b}</span>')
    recomputed = est["recomputed_cached_tokens"] // bs
    for i in range(est["new_blocks"]):
        last = i == est["new_blocks"] - 1
        if i < recomputed:
            cells.append('<span class="ec-b recomputed" title="cached, but computed again: it holds the last '
                         'prompt token, whose logits start the reply">↻</span>')
        elif last and est["partial_tail_tokens"]:
            fill = 100 * est["partial_tail_tokens"] // bs
            cells.append(f'<span class="ec-b partial" style="--fill:{fill}%" title="new block, '
                         f'{est["partial_tail_tokens"]} of {bs} tokens">+</span>')
        else:
            cells.append('<span class="ec-b new" title="new block, computed">+</span>')
    return f'<div class="ec-blocks">{"".join(cells)}</div>'


def edit_cost_html(est: Any, actual: dict | None = None, *, title: str = "What this will cost") -> str:
    """The panel for one ``PrefillEstimate`` (or its dict), with ``actual`` (cached, computed,
    prefill_s) beside it once sent."""
    est = est.to_dict() if hasattr(est, "to_dict") else dict(est)
    n, cached, computed = est["num_tokens"], est["num_cached_tokens"], est["num_computed_tokens"]
    rate = est["prefill_tokens_per_s"]
    time = (f"≈ {_ms(est['expected_prefill_s'])} at {rate:,.0f} tok/s, measured over this engine's last "
            f"{est['rate_samples']} prefill step{'s' * (est['rate_samples'] != 1)}" if rate else
            "no prefill measured on this engine yet")
    a = actual or {}

    def cell(value, want):
        if not actual:
            return ""
        mark = "ok" if want is None or value == want else "off"
        return f'<td class="{mark}">{escape(str(value))}</td>'

    rows = [
        ("from the prefix cache", f"{cached:,} tokens ({len(est['shared_block_ids'])} "
                                  f"block{'s' * (len(est['shared_block_ids']) != 1)})",
         cell(f"{a.get('cached', 0):,} tokens", f"{cached:,} tokens")),
        ("to compute", f"{computed:,} tokens ({est['new_blocks']} new block{'s' * (est['new_blocks'] != 1)}, "
                       f"{est['num_chunks']} chunk{'s' * (est['num_chunks'] != 1)})",
         cell(f"{a.get('computed', 0):,} tokens", f"{computed:,} tokens")),
        ("prefill time", time, cell(_ms(a.get("prefill_s")), None)),
    ]
    head = "<tr><th></th><th>estimate</th>" + ("<th>actual</th>" if actual else "") + "</tr>"
    body = "".join(f"<tr><th>{k}</th><td>{escape(v)}</td>{c}</tr>" for k, v, c in rows)
    live = len(est["live_block_ids"])
    notes = ["Copied: none. This engine shares full blocks only (no copy-on-write): "
             + (f"the last {est['partial_tail_tokens']} tokens go into a new block."
                if est["partial_tail_tokens"] else "the prompt ends on a block boundary.")]
    if live:
        notes.append(f"{live} shared block{'s' * (live != 1)} held by a running request now (outlined).")
    if est["recomputed_cached_tokens"]:
        notes.append(f"{est['recomputed_cached_tokens']} cached tokens are computed again (↻): the last block "
                     "holds the last prompt token, whose logits start the reply.")
    if not est["fits"]:
        notes.append("It does not fit in the free blocks now: it waits for running requests to free theirs.")
    elif est["evicts_blocks"]:
        notes.append(f"The new blocks evict {est['evicts_blocks']} cached block{'s' * (est['evicts_blocks'] != 1)} "
                     "(the least recently used).")
    legend = ('<div class="legend note"><span><span class="ec-b shared" style="display:inline-flex">id</span> '
              'shared</span><span><span class="ec-b new" style="display:inline-flex">+</span> computed</span>'
              '<span><span class="ec-b recomputed" style="display:inline-flex">↻</span> recomputed</span></div>')
    return (f'{EDIT_COST_CSS}<div class="ec"><h4>{escape(title)}: {cached:,} of {n:,} prompt tokens from the cache, '
            f"{computed:,} to compute</h4>{_blocks(est)}{legend}<table>{head}{body}</table>"
            + "".join(f'<p class="note">{escape(t)}</p>' for t in notes) + "</div>")


class EditCost:
    """The panel's events: an edit being typed, a branch picked, and after a reply ran."""

    def __init__(self, h: Any):
        self.h = h
        self._pending: OrderedDict[str, tuple[tuple[int, ...], dict, str]] = OrderedDict()   # tab -> ids, est, title

    # -- layout and wiring ---------------------------------------------------------------------
    def build(self) -> None:
        """The panel (open: it is read while editing) and the hidden bridge of the chat's edit box."""
        import gradio as gr

        with gr.Accordion("What an edit or a branch will cost", open=True, elem_id="edit-cost-box"):
            self.panel = gr.HTML(EDIT_COST_EMPTY, apply_default_css=False, elem_id="edit-cost")
            self.bridge = gr.HTML("", js_on_load=EDIT_WATCH_JS, apply_default_css=False, elem_id="edit-cost-bridge")

    def wire(self, T: Any, session: Any, system: Any, mode: Any, token_index: Any, alternative: Any,
             chat_events: list) -> None:
        """Typing in the chat's edit box, picking a branch, and every chat event's end (the actual)."""
        quiet = dict(api_visibility="private", show_progress="hidden", queue=False)
        self.bridge.click(T(self.editing, event_data=True), [session, system, mode], [self.panel],
                          trigger_mode="always_last", **quiet)
        for control in (token_index, alternative):
            control.change(T(self.branching), [session, token_index, alternative], [self.panel],
                           trigger_mode="always_last", **quiet)
        for event in chat_events:
            event.then(T(self.after), [session], [self.panel], **quiet)

    def _keep(self, session: Any, ids: list[int], est: Any, title: str) -> None:
        self._pending[session.session_id] = (tuple(ids), est.to_dict(), title)
        self._pending.move_to_end(session.session_id)
        while len(self._pending) > 512:
            self._pending.popitem(last=False)

    def _estimate(self, session: Any, ids: list[int], title: str) -> str:
        try:
            est = self.h.llm.estimate_prefill(ids)
        except NotImplementedError as exc:      # a foreign server: say why
            return f'{EDIT_COST_CSS}<div class="ec"><p class="note">{escape(str(exc))}</p></div>'
        except ValueError as exc:
            return f'{EDIT_COST_CSS}<div class="ec"><p class="note off">{escape(str(exc))}</p></div>'
        self._keep(session, ids, est, title)
        return edit_cost_html(est, title=title)

    def edit_ids(self, session: Any, index: int, text: str, system: str, mode: str) -> list[int] | None:
        """The prompt the edit of the path's message ``index`` to ``text`` would send."""
        path = session.tree.path()
        if not 0 <= index < len(path) or path[index].role != "user":
            return None
        tok, node = self.h.tokenizer, path[index]
        if mode == "completion":
            return tok.encode(session.tree.text_before(node.node_id) + text, add_special_tokens=True)
        sys = [{"role": "system", "content": system}] if system and system.strip() else []
        prompt = tok.apply_chat_template(sys + session.tree.messages_before(node.node_id)
                                         + [{"role": "user", "content": text.strip()}], add_generation_prompt=True)
        return tok.encode(prompt, add_special_tokens=False)

    def editing(self, session: Any, system: Any, mode: Any, evt: Any) -> str:
        """The Chatbot's edit box changed: the cost of sending it as it reads now."""
        data = (getattr(evt, "_data", None) or {}) if evt is not None else {}
        index, text = data.get("index"), data.get("value")
        if not isinstance(index, int) or not isinstance(text, str) or not text.strip():
            return EDIT_COST_EMPTY
        mode = mode if mode in ("chat", "completion") else self.h.default_mode
        ids = self.edit_ids(session, index, text[: self.h.limits.max_input_chars], system or "", mode)
        if ids is None:
            return EDIT_COST_EMPTY
        path_id = session.tree.path()[index].node_id
        return self._estimate(session, ids, f"Sending this edit of message {session.tree.turn_number(path_id)}")

    def branching(self, session: Any, token_index: Any, alternative: Any) -> str:
        """A token picked to branch from (and its alternative): the cost of that branch."""
        target = session.tree.last_reply()
        from . import inputs

        try:
            index = int(token_index)
            forced = inputs.alternative_tokens(alternative, lambda t: self.h.tokenizer.encode(t, add_special_tokens=False),
                                               self.h.vocab_size)
        except (TypeError, ValueError, inputs.InputError):
            return EDIT_COST_EMPTY
        if target is None or not target.reply.prompt_token_ids or not 0 <= index < len(target.reply.all_token_ids):
            return EDIT_COST_EMPTY
        from .chat import branch_prompt

        ids = branch_prompt(target.reply, index, forced)
        return self._estimate(session, ids, f"Branching at token #{index}")

    def after(self, session: Any) -> Any:
        """After a chat event: the estimate beside the actual, when a reply sent that prompt."""
        pending = self._pending.get(session.session_id)
        if pending is None:
            return EDIT_COST_EMPTY
        ids, est, title = pending
        for node in reversed(session.tree.replies()):
            reply = node.reply
            if reply.finished and tuple(reply.prompt_token_ids) == ids and not reply.error:
                actual = {"cached": reply.num_cached_tokens, "computed": reply.num_prompt_tokens - reply.num_cached_tokens,
                          "prefill_s": getattr(reply, "prefill_s", None)}
                return edit_cost_html(est, actual, title=f"{title}: sent")
        return edit_cost_html(est, title=title)
