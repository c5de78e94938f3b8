"""Two views inside the engine on the page: the sampler's pipeline of a clicked reply token
(``sampler_view``) and where the shown reply's K/V came from, with the batches it was decoded in
(``provenance_view``). ``InsideViews(handlers)``: ``build()`` lays out their accordions where the
page calls it, ``wire(...)`` connects them. They read the tab's conversation, the shared engine
client and the monitor's step records through the page's ``Handlers``.

Closed, they cost nothing. Open, a click on a reply token asks the engine for that token's
pipeline (one request of its own, mostly read from the prefix cache); the provenance is drawn from
the record the finished reply brought (no engine work) when the accordion opens or on its button.
"""

from __future__ import annotations

from typing import Any

import gradio as gr

from .chat import ChatSession
from .provenance_view import PROVENANCE_EMPTY, batch_figure, provenance_html
from .sampler_view import SAMPLER_EMPTY, pipeline_note, reply_pipeline, sampler_pipeline_html

__all__ = ["InsideViews"]


class InsideViews:
    def __init__(self, handlers: Any):
        self.h = handlers
        self._open: set[str] = set()            # tabs (session ids) with the sampler's panel open

    # -- layout and wiring ---------------------------------------------------------------------
    def build(self) -> None:
        with gr.Accordion("Sampler pipeline: how a clicked reply token was picked", open=False,
                          elem_id="sampler-box") as box:
            self.sampler_view = gr.HTML(SAMPLER_EMPTY, apply_default_css=False, elem_id="sampler-view")
        self.sampler_box = box
        with gr.Accordion("KV provenance: where each token's K/V came from, and the reply's batches", open=False,
                          elem_id="provenance-box") as box:
            self.provenance_btn = gr.Button("Draw it for the shown reply", size="sm", elem_id="provenance-draw")
            self.provenance_view = gr.HTML(PROVENANCE_EMPTY, apply_default_css=False, elem_id="provenance-view")
            self.batch_plot = gr.Plot(show_label=False, elem_id="provenance-batches")
        self.provenance_box = box

    def wire(self, T, session, reply_view) -> None:
        private = dict(api_visibility="private", show_progress="hidden", preprocess=False)
        engine = dict(private, concurrency_limit=2, concurrency_id="sampler")
        self.sampler_box.expand(T(self.sampler_opened), [session], [self.sampler_view], **engine)
        self.sampler_box.collapse(T(self.sampler_closed), [session], [self.sampler_view], **private)
        reply_view.click(T(self.sampler, event_data=True), [session], [self.sampler_view], **engine)
        out = [self.provenance_view, self.batch_plot]
        self.provenance_box.expand(T(self.provenance), [session], out, **private)
        self.provenance_btn.click(T(self.provenance), [session], out, api_name="kv_provenance",
                                  show_progress="hidden")

    def sampler_opened(self, session: ChatSession) -> str:
        """Opened: the pipeline of the token picked in the logprob view, else the hint."""
        self._open.add(session.session_id)
        node = session.tree.last_reply()
        if session.selected is None or node is None or session.selected_node != node.node_id:
            return SAMPLER_EMPTY
        return self._sampler(session, session.selected)

    def sampler_closed(self, session: ChatSession) -> str:
        self._open.discard(session.session_id)
        return SAMPLER_EMPTY

    def names(self, session: ChatSession):
        """request id -> what this tab may call it: its own turns and batch requests by name, any other
        request as another visitor's (never its id)."""
        own = {n.reply.request_id: f"turn {n.label}" for n in session.tree.replies() if n.label}
        own.update((rid, label) for rid, label in session.labels.items() if rid not in own and label != "this chat")

        def name(rid: Any) -> str:
            if rid is None:
                return "a request from before this page's records"
            return own.get(rid) or "another visitor's request"
        return name

    def _decode(self, token_id: int) -> str:
        return self.h.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def sampler(self, session: ChatSession, evt: gr.EventData) -> str:
        """A click on a reply token while the panel is open: the sampler's stages for it."""
        data = (getattr(evt, "_data", None) or {}) if evt is not None else {}
        try:
            index = int(data.get("index"))
        except (TypeError, ValueError):
            return gr.skip()
        if session.session_id not in self._open:
            return gr.skip()
        return self._sampler(session, index)

    def _sampler(self, session: ChatSession, index: int) -> str:
        """The stages of reply token ``index`` under the reply's own settings, or why there are none."""
        node = session.tree.last_reply()
        if node is None:
            return pipeline_note("Send a message first: a click on a token of its reply shows the sampler's stages.")
        if session.active_request_id or not node.reply.finished:
            return pipeline_note("The reply is still streaming: click the token again once it has finished.")
        try:
            pipe = reply_pipeline(self.h.llm, node.reply, index)
        except ValueError as exc:
            return pipeline_note(str(exc))
        return sampler_pipeline_html(pipe, decode=self._decode, index=index)

    def provenance(self, session: ChatSession) -> tuple:
        """The shown reply's K/V sources (HTML) and its per-token batches (a Plotly figure)."""
        from .handlers import timeline_plot

        node = session.tree.last_reply()
        reply = node.reply if node is not None else None
        prov = getattr(reply, "provenance", None)
        if prov is None:
            why = ("Send a message first." if reply is None else
                   "The reply is still streaming: its record arrives when it ends." if not reply.finished else
                   "This reply has no record of its K/V (restored from a saved conversation, or served by a "
                   "server that does not send one).")
            return f"{PROVENANCE_EMPTY}<p class='ps-why'>{why}</p>", gr.skip()
        name = self.names(session)
        prompt = [*reply.prompt_token_ids, *reply.prefix_token_ids]     # what the engine was sent
        html = provenance_html(prov, [self._decode(t) for t in prompt], [self._decode(t) for t in reply.token_ids],
                               name=name)
        batches = self.h.monitor.batches(t.step for t in prov.reply)
        return html, timeline_plot(batch_figure(prov, batches, reply.request_id, name))
