"""Changing a conversation after the fact: edit and resend a user message, continue a cut reply.

* **Edit** (the pencil on a user message, ``gr.Chatbot(editable="user")``): the edited text becomes
  a sibling of the original message, a new branch with a reply of its own, as in llama.cpp's web UI;
  the original and its replies stay (``message ‹ 1/2 ›`` under the reply moves between them).
* **Edit the document** (completion mode's "edit ✎"): the whole document, the model's continuations
  too, becomes one text where it stands; edited, it is a new version of the document, continued from
  its end.
* **Continue** (under a reply that max tokens cut): the same reply grows; its tokens so far are
  sent back as the prompt's end, so the model goes on where it stopped. The tokens it had are
  counted apart from the new ones (``N tokens + K kept``), like a branch's kept tokens.

Both stream through ``Handlers._run`` like a sent message, and hold the tab's streaming slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gradio as gr

from . import inputs
from .chat import ChatSession, Reply
from .handlers import Handlers, checked

__all__ = ["Revise", "ACT_JS"]

# "Continue ↦" and "copy" under replies live inside the Chatbot's messages, which run no scripts:
# one document-level listener copies a reply's text (kept beside the link, since the Chatbot's own
# copy button would copy the meta line too) and sends Continue through this bridge's click event.
ACT_JS = """
if (!window.__pgAct) {
  window.__pgAct = true;
  document.addEventListener('click', async (e) => {
    const act = e.target.closest('#chat .pg-act');
    if (!act) return;
    if (act.classList.contains('pg-copy')) {
      const raw = act.parentElement.querySelector('.pg-raw');
      try { await navigator.clipboard.writeText(raw ? raw.textContent : ''); act.textContent = 'copied'; }
      catch (err) { act.textContent = 'copy failed'; }
      setTimeout(() => { act.textContent = 'copy'; }, 1500);
    } else if (act.classList.contains('pg-edit-doc')) {
      // Completion mode's document becomes one text where it stands: the text given and every
      // continuation, to edit anywhere and continue from its end (a new version of the document).
      const doc = act.closest('[data-testid="bot"]')?.querySelector('.pg-doc');
      if (!doc || doc.nextElementSibling?.classList.contains('pg-doc-editor')) return;
      const box = document.createElement('div');
      box.className = 'pg-doc-editor';
      box.innerHTML = '<textarea aria-label="the document"></textarea><div><button class="pg-act pg-doc-go">Continue ↦</button>'
        + '<button class="pg-act pg-doc-cancel">Cancel</button></div>';
      box.querySelector('textarea').value = act.parentElement.querySelector('.pg-doc-raw').textContent;
      box.dataset.node = [...act.classList].find((c) => c.startsWith('pg-node-')).slice(8);
      doc.style.display = 'none';
      doc.after(box);
      box.querySelector('textarea').focus();
    } else if (act.classList.contains('pg-doc-cancel')) {
      const box = act.closest('.pg-doc-editor');
      box.previousElementSibling.style.display = '';
      box.remove();
    } else if (act.classList.contains('pg-doc-go')) {
      const box = act.closest('.pg-doc-editor');
      act.disabled = true;
      trigger('click', {node: Number(box.dataset.node), action: 'edit', text: box.querySelector('textarea').value});
    } else if (act.classList.contains('pg-continue') || act.classList.contains('pg-cut')) {
      const id = [...act.classList].find((c) => c.startsWith('pg-node-'));
      const ti = [...act.classList].find((c) => c.startsWith('pg-ti-'));
      trigger('click', {node: Number(id.slice(8)), action: ti ? 'cut' : 'continue', index: ti ? Number(ti.slice(6)) : null});
    }
  });
}
"""


class Revise:
    """The edit and continue events, on the handlers' streaming."""

    def __init__(self, h: Handlers):
        self.h = h

    def _slot(self, session: ChatSession, reply: Reply) -> bool:
        with self.h._turn_lock:
            if session.active_request_id is not None:
                return False
            session.active_request_id = reply.request_id
            session.selected = session.selected_node = None
            return True

    @checked
    def continue_reply(self, session: ChatSession, system: Any, *sampling_and_mode_evt) -> Iterator[tuple]:
        """Generate more of a reply that max tokens (or the context) cut, in the same reply."""
        *values, evt = sampling_and_mode_evt
        h = self.h
        sampling, _mode = h._split_mode(tuple(values))
        data = (getattr(evt, "_data", None) or {}) if evt is not None else {}
        try:
            node = session.tree.nodes.get(int(data.get("node")))
        except (TypeError, ValueError):
            node = None
        if node is None or node.role != "assistant":
            raise gr.Error("That reply is no longer in this conversation.")
        h._refuse_while_streaming(session, "continuing a reply")
        if data.get("action") == "cut":
            yield from self._continue_from(session, node, data.get("index"), sampling)
            return
        if data.get("action") == "edit":
            yield from self._edit_document(session, node, data.get("text"), sampling)
            return
        old = node.reply
        if not old.finished or old.error or old.finish_reason != "length":
            raise gr.Error("Only a reply cut by max tokens can be continued.")
        if not old.prompt_token_ids:
            raise gr.Error("This reply was imported without its token ids: it cannot be continued.")
        params = h.sampling(*sampling)
        new = Reply(request_id=session.new_request_id("chat"), prompt_token_ids=list(old.prompt_token_ids),
                    prefix_token_ids=old.all_token_ids, text=old.text, records=[dict(r) for r in old.records])
        if not self._slot(session, new):
            h._refuse_while_streaming(session, "continuing a reply")
        node.reply = new
        prompt = {"prompt_token_ids": list(old.prompt_token_ids) + old.all_token_ids}
        yield from h._run(session, node, prompt, params, h._outputs(session, reset_controls=True))

    def _continue_from(self, session: ChatSession, node: Any, index: Any, sampling: tuple) -> Iterator[tuple]:
        """Completion mode's click on a token of the document: a new branch of that continuation that keeps
        the tokens before it and generates from there (the original stays: ‹ › under it)."""
        h, old = self.h, node.reply
        if not isinstance(index, int) or not 0 <= index < len(old.all_token_ids) or not old.prompt_token_ids:
            raise gr.Error("Click a token of a generated continuation to continue from there.")
        params = h.sampling(*sampling)
        kept = old.all_token_ids[:index]
        reply = Reply(request_id=session.new_request_id("chat"), prompt_token_ids=list(old.prompt_token_ids),
                      prefix_token_ids=kept, text=h.tokenizer.decode(kept) if kept else "",
                      records=[dict(r) for r in old.records[:index]])
        branch = h._claim(session, node.parent, reply)
        if branch is None:
            h._refuse_while_streaming(session, "continuing from a token")
        prompt = {"prompt_token_ids": list(old.prompt_token_ids) + kept}
        yield from h._run(session, branch, prompt, params, h._outputs(session, reset_controls=True))

    def _edit_document(self, session: ChatSession, node: Any, text: Any, sampling: tuple) -> Iterator[tuple]:
        """Completion mode's document edited as one text (the text given and the continuations alike): a new
        version of the document, continued from its end. It is a sibling of the document's first text
        (``version ‹ 1/2 ›`` moves between them); the edited text is all given text, not the model's."""
        h, tree = self.h, session.tree
        before = tree.text_before(node.node_id) + node.reply.text
        # An edit may add up to a message's length to the document (the document itself may be longer).
        text = inputs.text(text, "the document", max_chars=len(before) + h.limits.max_input_chars)
        if not text.strip():
            raise gr.Error("The document is empty: write the text the model should continue.")
        params = h.sampling(*sampling)
        first = next((n for n in tree.path() if n.role == "user"), None)
        with h._turn_lock:
            user = tree.edit_user(first.node_id, text) if first is not None else tree.add_user(text)
            branch = h._claim(session, user.node_id)
            if branch is None:
                tree.remove(user.node_id)
        if branch is None:
            h._refuse_while_streaming(session, "continuing the edited text")
        session.mode = "completion"
        prompt = h._prompt(session, branch, "", "completion")
        yield from h._run(session, branch, prompt, params, h._outputs(session, reset_controls=True))

    @checked
    def edit(self, session: ChatSession, system: Any, *sampling_and_mode_evt) -> Iterator[tuple]:
        """A user message edited in the chat: a new branch beside it, answered."""
        *values, evt = sampling_and_mode_evt
        h = self.h
        sampling, mode = h._split_mode(tuple(values))
        data = (getattr(evt, "_data", None) or {}) if evt is not None else {}
        index, value = data.get("index"), data.get("value")
        if isinstance(index, (list, tuple)):
            index = index[0]
        if isinstance(value, list):          # the Chatbot sends [{"type": "text", "text": ...}]
            value = "".join(part.get("text", "") for part in value if isinstance(part, dict))
        path = session.tree.path()
        if not isinstance(index, int) or not 0 <= index < len(path) or path[index].role != "user":
            yield h._outputs(session)        # a queued or unknown message: the chat as it is
            return
        if session.active_request_id is not None:
            yield h._outputs(session)        # undo the page's own edit of the shown text
            h._refuse_while_streaming(session, "editing a message")
        message = inputs.text(value, "message", max_chars=h.limits.max_input_chars)
        message = message.strip() if mode == "chat" else message
        system = inputs.text(system, "system prompt", max_chars=h.limits.max_input_chars)
        params = h.sampling(*sampling)
        original = path[index]
        if not message.strip() or message == original.content:
            yield h._outputs(session)
            return
        with h._turn_lock:
            user = session.tree.edit_user(original.node_id, message)
            node = h._claim(session, user.node_id)
            if node is None:
                session.tree.remove(user.node_id)
        if node is None:
            h._refuse_while_streaming(session, "editing a message")
        prompt = h._prompt(session, node, system, mode)
        yield from h._run(session, node, prompt, params, h._outputs(session, reset_controls=True))
