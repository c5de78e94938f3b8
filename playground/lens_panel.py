"""The attention lens's panel on the page (``playground.lens_view`` draws it).

``LensPanel(handlers)``: ``build()`` lays out the accordion (a layer and a head selector over the
view) where the page calls it; ``wire(...)`` connects it. While the accordion is open, a click on a
token of the reply (the logprob view), of the scored prompt (the prompt view) or of the lens's own
text asks the engine for that token's lens (``llm.attention_lens``, one request of its own, on
demand); switching layer or head redraws the lens the tab holds without asking the engine again.
Closed, the panel costs nothing: no click computes a lens and nothing polls.

A lens is computed only on a request of this tab's own conversation; the named API
(``attention_lens``: request id, position, layer, head) refuses any other request id, so another
visitor's tokens are never read. Bad input (a position outside the request, a request without
tokens, a layer or head out of range) is named in the panel, beside the lens shown before.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import gradio as gr

from .chat import ChatSession
from .lens_view import (MEAN_HEADS, MEAN_LAYERS, LensState, head_choices, layer_choices, lens_empty_html,
                        lens_error_html, lens_html, parse_choice, reply_sources, stored_by)

__all__ = ["LensPanel", "LENS_CLICK_JS"]

LENS_CLICK_JS = """
element.addEventListener('click', (e) => {
  const tok = e.target.closest('.lz-tok');
  if (tok) trigger('click', {position: Number(tok.dataset.pos)});
});
"""
MAX_AFTER = 512          # tokens drawn after the lens's position (to click on)
MAX_TABS = 1000


def turn_name(label: str) -> str:
    """A reply's label in the conversation ("2", "2b") as the lens names it."""
    return f"turn {label[:-1]}, branch {label[-1]}" if label[-1:].isalpha() else f"turn {label}"


class Refused(ValueError):
    """A lens this tab may not have (shown in the panel)."""


def why_unavailable(llm: Any) -> str | None:
    """Why ``llm`` has no lens (a server of another project says so at once), or None: an empty
    request is refused by every engine that has one, before any work."""
    try:
        llm.attention_lens([], 0)
    except NotImplementedError as exc:
        return str(exc)
    except AttributeError:
        return f"{type(llm).__name__} has no attention_lens"
    except Exception:  # noqa: BLE001 - the empty request's refusal: the lens is there
        return None
    return None


class LensPanel:
    def __init__(self, handlers: Any):
        self.h = handlers
        self.unavailable = why_unavailable(handlers.llm)
        self._states: OrderedDict[str, LensState] = OrderedDict()     # tab (session id) -> its lens

    # -- layout and wiring ---------------------------------------------------------------------
    def build(self) -> None:
        with gr.Accordion("Attention lens: where a token's attention went", open=False, elem_id="lens-box") as box:
            with gr.Row():
                self.layer = gr.Dropdown([MEAN_LAYERS], value=MEAN_LAYERS, label="layer", elem_id="lens-layer",
                                         allow_custom_value=True, min_width=140)
                self.head = gr.Dropdown([MEAN_HEADS], value=MEAN_HEADS, label="head", elem_id="lens-head",
                                        allow_custom_value=True, min_width=140)
            self.view = gr.HTML(lens_empty_html(self.unavailable), js_on_load=LENS_CLICK_JS,
                                apply_default_css=False, elem_id="lens-view")
            # The named API's inputs (attention_lens: request_id, position, layer, head); not on the page.
            self.request = gr.Textbox(label="request id", visible=False, elem_id="lens-request")
            self.position = gr.Number(label="position", visible=False, precision=0, elem_id="lens-position")
        self.box = box

    def wire(self, T, session, reply_view, prompt_view) -> None:
        out = [self.view, self.layer, self.head]
        run = dict(concurrency_limit=2, concurrency_id="lens", show_progress="hidden", preprocess=False)
        inputs = [session, self.layer, self.head]
        private = dict(run, api_visibility="private")
        self.box.expand(T(self.expand), inputs, out, **private)
        self.box.collapse(T(self.collapse), [session], [self.view], **private)
        reply_view.click(T(self.on_reply_token, event_data=True), inputs, out, **private)
        prompt_view.click(T(self.on_prompt_token, event_data=True), inputs, out, **private)
        self.view.click(T(self.on_lens_token, event_data=True), inputs, out, **private)
        for selector in (self.layer, self.head):
            selector.input(T(self.select), inputs, [self.view], **private)
        self.request.submit(T(self.lens), [session, self.request, self.position, self.layer, self.head], out,
                            api_name="attention_lens", **run)

    # -- events --------------------------------------------------------------------------------
    def state(self, session: ChatSession) -> LensState:
        """The tab's lens (the last ``MAX_TABS`` tabs' are kept)."""
        state = self._states.get(session.session_id)
        if state is None:
            state = self._states[session.session_id] = LensState()
            while len(self._states) > MAX_TABS:
                self._states.popitem(last=False)
        self._states.move_to_end(session.session_id)
        return state

    def expand(self, session: ChatSession, layer: Any, head: Any) -> tuple:
        """Opened: the lens of the token picked in the logprob view, else the lens held, else the hint."""
        state = self.state(session)
        state.open = True
        node = session.tree.last_reply()
        if session.selected is not None and node is not None and session.selected_node == node.node_id:
            return self.lens(session, node.reply.request_id, len(node.reply.prompt_token_ids) + session.selected,
                             layer, head)
        return self.select(session, layer, head), gr.skip(), gr.skip()

    def collapse(self, session: ChatSession) -> str:
        """Closed: the block map loses the lens's rings (the panel's HTML stays on the page, hidden)."""
        state = self.state(session)
        state.open = False
        return lens_empty_html(self.unavailable)

    def on_reply_token(self, session: ChatSession, layer: Any, head: Any, evt: gr.EventData) -> tuple:
        node = session.tree.last_reply()
        index = (getattr(evt, "_data", None) or {}).get("index")
        if not self.state(session).open or node is None or index is None:
            return gr.skip(), gr.skip(), gr.skip()
        return self.lens(session, node.reply.request_id, len(node.reply.prompt_token_ids) + int(index), layer, head)

    def on_prompt_token(self, session: ChatSession, layer: Any, head: Any, evt: gr.EventData) -> tuple:
        node = session.tree.last_reply()
        index = (getattr(evt, "_data", None) or {}).get("index")
        if not self.state(session).open or node is None or index is None:
            return gr.skip(), gr.skip(), gr.skip()
        return self.lens(session, node.reply.request_id, int(index), layer, head)

    def on_lens_token(self, session: ChatSession, layer: Any, head: Any, evt: gr.EventData) -> tuple:
        state = self.state(session)
        position = (getattr(evt, "_data", None) or {}).get("position")
        if state.request_id is None or position is None:
            return gr.skip(), gr.skip(), gr.skip()
        return self.lens(session, state.request_id, int(position), layer, head)

    def select(self, session: ChatSession, layer: Any, head: Any) -> str:
        """Another layer or head: the lens held, drawn again (no engine work)."""
        state = self.state(session)
        if state.lens is None:
            return lens_error_html(state.error) if state.error else lens_empty_html(self.unavailable)
        try:
            return self.draw(session, parse_choice(layer, "layer", state.lens.num_layers),
                             parse_choice(head, "head", state.lens.num_heads))
        except ValueError as exc:
            return self.draw(session, None, None, error=str(exc))

    def lens(self, session: ChatSession, request_id: Any, position: Any, layer: Any, head: Any) -> tuple:
        """The lens of ``position`` in ``request_id`` (a request of this tab), for ``layer`` / ``head``."""
        state = self.state(session)
        if self.unavailable:
            return lens_empty_html(self.unavailable), gr.skip(), gr.skip()
        try:
            ids, node = self.own_tokens(session, request_id)
            if isinstance(position, float) and position.is_integer():
                position = int(position)
            picked = (parse_choice(layer, "layer", None), parse_choice(head, "head", None))
            lens = self.h.llm.attention_lens(ids, position, *picked)     # every check before any work
        except NotImplementedError as exc:
            return lens_empty_html(str(exc)), gr.skip(), gr.skip()
        except ValueError as exc:         # refused, or bad input named by the engine before any work
            state.error = str(exc)
            return (self.draw(session, None, None, error=str(exc)) if state.lens else lens_error_html(str(exc)),
                    gr.skip(), gr.skip())
        state.request_id, state.lens, state.error = node.reply.request_id, lens, None
        state.passes = [*state.passes[-20:], ("an earlier lens of this tab", lens.token_ids, lens.num_cached_tokens,
                                             len(lens.token_ids))]
        return (self.draw(session, *picked), gr.Dropdown(choices=layer_choices(lens), value=layer_choices(lens)[
                    0 if picked[0] is None else picked[0] + 1]),
                gr.Dropdown(choices=head_choices(lens), value=head_choices(lens)[0 if picked[1] is None else picked[1] + 1]))

    # -- helpers -------------------------------------------------------------------------------
    def own_tokens(self, session: ChatSession, request_id: Any) -> tuple[list[int], Any]:
        """The tokens (prompt and reply) of ``request_id`` if it is a reply of this tab's conversation."""
        rid = str(request_id or "").strip()
        node = next((n for n in session.tree.replies() if n.reply.request_id == rid), None)
        if node is not None:
            return list(node.reply.prompt_token_ids) + node.reply.all_token_ids, node
        if rid in session.labels:
            raise Refused(f"{rid} is a batch-demo request of this tab, whose tokens the tab does not keep: the lens "
                          "opens on the replies of the conversation")
        raise Refused(f"request {rid!r:.60} is not one of this tab's conversation: the lens opens only on your own "
                      "requests (another visitor's are refused, and their text is never read)")

    def draw(self, session: ChatSession, layer: int | None, head: int | None, error: str | None = None) -> str:
        state = self.state(session)
        lens, h = state.lens, self.h
        node = next((n for n in session.tree.replies() if n.reply.request_id == state.request_id), None)
        seq = list(node.reply.prompt_token_ids) + node.reply.all_token_ids if node is not None else []
        after = [h.tokenizer.decode([t], skip_special_tokens=False)
                 for t in seq[lens.position + 1: lens.position + 1 + MAX_AFTER]] if seq[:len(lens.token_ids)] == \
            list(lens.token_ids) else []
        turns = reply_sources([(turn_name(n.label), n.reply) for n in sorted(session.tree.replies(),
                                                                               key=lambda n: n.node_id)])
        snap = h.monitor.snapshot()
        names = h.labels(session, snap)
        return lens_html(lens, layer=layer, head=head, after=after, snapshot=snap,
                         stored_by=stored_by(lens, state.passes + turns), name=lambda rid: names.get(rid, rid),
                         on_map=state.open, error=error)
