"""What each control of the page does (the Gradio event handlers).

``Handlers`` holds the shared ``LLM`` and ``EngineMonitor``; every method
takes the tab's ``ChatSession`` plus the raw values of its input components
(events run with ``preprocess=False``, so ``inputs`` checks them and a bad
value is a readable ``gr.Error``) and returns (or, for streaming, yields) the
new values of its outputs. The page layout and the wiring live in ``app.py``.

The chat outputs are always ``(chat, message box, logprob view, prefix
panel, branch token #, branch alternative)``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import gradio as gr
from gradio.components.plot import PlotData

from . import inputs, render
from .alignment import Aligner
from .batch_demo import run_batch
from .chat import ChatSession, Reply, branch_prompt, start_branch, stream_reply
from .chatview import chat_messages, compare_html
from .colors import OwnerColors
from .conversation import Node
from .inputs import InputError, Limits
from .inspector import block_inspector_html
from .live_map import LiveMap
from .live_panels import LivePanels, wrap
from .logprobs import METRICS
from .monitor import EngineMonitor
from .prompt_view import prompt_view_html, score_prompt
from .tabs import Tabs
from .timeline import WINDOWS
from .timeline_chart import timeline_figure

__all__ = ["Limits", "Handlers", "timeline_plot"]


def timeline_plot(figure: dict) -> PlotData:
    """The timeline's figure as ``gr.Plot`` takes it (Plotly's JSON as it is: no figure object built)."""
    return PlotData(type="plotly", plot=json.dumps(figure))

SKIP6 = (gr.skip(),) * 6
MAX_QUEUED = 8          # messages a tab may queue behind its streaming reply
# A streaming reply's updates to the page: each is a step of a Gradio event (the chat re-sent and
# diffed) on the cores the engine decodes with, so there is a budget for all tabs together:
# at most CHAT_UPDATES_PER_S a reply, CHAT_UPDATES_PER_S_ALL over every reply streaming at once.
CHAT_UPDATES_PER_S = 5
CHAT_UPDATES_PER_S_ALL = 12
# The compare view's strips are for reading: branching starts from the logprob view above it.
COMPARE_HINT = "<span>· hover (or tap) a token for its alternatives · branch from the logprob view above</span>"


MODES = ("chat", "completion")


def default_mode(tokenizer: Any) -> str:
    """Chat for models with a chat template; raw text completion for base models without one."""
    return "chat" if getattr(tokenizer, "chat_template", None) else "completion"


def _system(system: str) -> list[dict]:
    return [{"role": "system", "content": system}] if system and system.strip() else []


def checked(fn):
    """Turn an ``InputError`` raised by a handler (plain or streaming) into a ``gr.Error``."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except InputError as exc:
                raise gr.Error(str(exc)) from None
        return gen

    @functools.wraps(fn)
    def plain(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InputError as exc:
            raise gr.Error(str(exc)) from None
    return plain


class Handlers:
    """Event handlers bound to one ``LLM`` (shared by every tab)."""


    def __init__(self, llm: Any, monitor: EngineMonitor, limits: Limits, *, allow_engine_admin: bool = False,
                 map_every: float = 0.5):
        self.llm, self.monitor, self.limits = llm, monitor, limits
        self.allow_engine_admin = allow_engine_admin
        self.tokenizer = llm.get_tokenizer()
        self.vocab_size = int(self.tokenizer.vocab_size)
        self.aligner = Aligner(llm)
        self.colors = OwnerColors()
        self.max_model_len = llm.max_model_len
        self.default_mode = default_mode(self.tokenizer)
        self.tabs = Tabs(on_close=self._tab_closed)
        # The block map's own route (every ``map_every`` s per open tab), not a Gradio event.
        self.live_map = LiveMap(lambda session, css: self.block_map(session, css=css), map_every, key=self.map_key)
        # The other live panels' route (once a second per open tab), found by the map's token.
        self.live_panels = LivePanels(self.live_map.session, self.route_panels)
        self._turn_lock = threading.RLock()
        self._streaming = 0                      # replies streaming now, over every tab
        self._streaming_lock = threading.Lock()
        self._timeline_cache: dict[int, tuple[int, dict]] = {}     # window -> (second, figure)
        self._colors_cache: tuple[list, dict] | None = None

    def _tab_closed(self, session: ChatSession) -> None:
        self.live_map.forget(session)
        self._withdraw_queued(session)          # a closed tab's queued messages must not start later
        if session.active_request_id:
            self.llm.abort(session.active_request_id)

    # -- helpers ------------------------------------------------------------------
    def _mode(self, mode: Any) -> str:
        if mode is None or mode == "":
            return self.default_mode
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}; got {mode!r:.40}")
        return mode

    def _split_mode(self, values: tuple) -> tuple[tuple, str]:
        """(sampling values, mode): the page passes the sampling controls then the mode; an API caller may
        pass the first six sampling values alone (``inputs.SAMPLING_FIELDS``) or with the mode."""
        if len(values) in (7, len(inputs.SAMPLING_FIELDS) + 1):
            return values[:-1], self._mode(values[-1])
        return values, self.default_mode

    def _prompt(self, session: ChatSession, node: Node, system: str, mode: str) -> Any:
        """What the engine is asked for ``node``: chat messages, or the text so far (completion mode)."""
        if mode == "completion":
            return {"prompt": session.tree.text_before(node.node_id)}
        return _system(system) + session.tree.messages_before(node.node_id)

    def sampling(self, *values, cap: int | None = None):
        return inputs.sampling(*values, max_tokens_cap=cap or self.limits.max_tokens, vocab_size=self.vocab_size)

    def stop_token_ids(self, params: Any) -> frozenset[int]:
        """The ids that end a reply with ``params``: the tokenizer's end-of-turn ids and the request's own."""
        eos = () if getattr(params, "ignore_eos", False) else getattr(self.tokenizer, "eos_token_ids", ())
        return frozenset(eos) | frozenset(getattr(params, "stop_token_ids", ()) or ())

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)])

    def prefix_html(self, session: ChatSession) -> str:
        """The prefix-cache panel as Gradio shows it (in the wrapper ``live_panels`` refreshes)."""
        return wrap("prefix-panel", render.prefix_cache_html(self.monitor.snapshot(), self.turns(session)))

    @staticmethod
    def turns(session: ChatSession) -> list[dict]:
        """Prefix-cache history of the branch shown: each reply on it whose prompt the engine has read."""
        return [{"label": n.label, "num_prompt_tokens": n.reply.num_prompt_tokens,
                 "num_cached_tokens": n.reply.num_cached_tokens}
                for n in session.tree.path() if n.role == "assistant" and n.reply.num_prompt_tokens]

    def logprob_html(self, session: ChatSession) -> str:
        node = session.tree.last_reply()
        records = node.reply.records if node else []
        selected = session.selected if session.selected_node == (node.node_id if node else None) else None
        return render.logprob_html(records, selected=selected, metric=session.lp_metric)

    def chat(self, session: ChatSession) -> list[dict]:
        return chat_messages(session.tree, self.max_model_len, queued=[text for _, text in session.queued],
                             document=session.mode == "completion")

    def _outputs(self, session: ChatSession, *, msg: Any = gr.skip(), panels: bool = True,
                 reset_controls: bool = False) -> tuple:
        """The chat outputs; ``reset_controls`` empties the branch controls (a new reply is shown)."""
        controls = (None, gr.Dropdown(choices=[], value=None)) if reset_controls else (gr.skip(), gr.skip())
        return (self.chat(session), msg, self.logprob_html(session) if panels else gr.skip(),
                self.prefix_html(session) if panels else gr.skip(), *controls)

    def _reply_state(self, reply: Reply) -> None:
        """Queued (position) / prefill n / m / decoding, from the latest snapshot."""
        if reply.token_ids or reply.finished:
            reply.state = "decoding"
            return
        requests = self.monitor.snapshot().get("requests") or []
        waiting = [r["request_id"] for r in requests if r["status"] in ("waiting", "preempted")]
        mine = next((r for r in requests if r["request_id"] == reply.request_id), None)
        if mine is None or mine["request_id"] in waiting:
            ahead = waiting.index(reply.request_id) if reply.request_id in waiting else len(waiting)
            reply.state = f"queued ({ahead} ahead)" if ahead else "queued"
        else:
            reply.state = f"prefill {mine['num_computed_tokens']} / {mine['num_prompt_tokens']} tokens"

    # -- streaming one reply -------------------------------------------------------------
    def update_period(self) -> float:
        """Seconds between two updates of one streaming reply: the shared budget split between
        the replies streaming now (5 a second for one or two, 3 for four, 1.5 for eight)."""
        return max(1 / CHAT_UPDATES_PER_S, self._streaming / CHAT_UPDATES_PER_S_ALL)

    def _run(self, session: ChatSession, node: Node, prompt: Any, params: Any, first: tuple = ()) -> Iterator[tuple]:
        """Generate ``node``'s reply, yielding ``first`` and then the chat outputs as it grows; finish the
        turn however it ends (the tab's streaming slot is released even if cancelled at ``first``)."""
        reply: Reply = node.reply
        session.active_request_id = reply.request_id
        changed, done, cancelled = threading.Event(), threading.Event(), threading.Event()

        def consume() -> None:
            try:
                for _ in stream_reply(self.llm, prompt, params, reply, decode=self._decode,
                                      stop_token_ids=self.stop_token_ids(params)):
                    changed.set()
                    if cancelled.is_set():    # closing the stream aborts the request
                        break
            finally:
                done.set()
                changed.set()

        worker = threading.Thread(target=consume, name=f"stream-{reply.request_id}", daemon=True)
        worker.start()
        with self._streaming_lock:
            self._streaming += 1
        try:
            if first:
                yield first
            # Outputs that did not change are sent again rather than skipped: Gradio diffs a stream's
            # values (an unchanged one costs nothing on the wire), while every gr.skip() builds a new
            # component on the server. The message box stays skipped: the user may be typing there.
            lp = first[2] if first and isinstance(first[2], str) else gr.skip()
            prefix = first[3] if first and isinstance(first[3], str) else gr.skip()
            controls = (None, None) if first else (gr.skip(), gr.skip())    # reset by ``first``
            sent, lp_at, sent_at, prefix_at = None, 0.0, 0.0, 0.0
            while not done.is_set():
                changed.wait(0.25)
                # Paced (update_period): each update re-sends the chat, and a fast engine would
                # otherwise have the server send one per token for every streaming tab.
                period = self.update_period()
                # the pace's wait ends when the reply does: its last update goes out at once
                done.wait(max(0.0, sent_at + period - time.monotonic()))
                changed.clear()
                self._reply_state(reply)
                key = (len(reply.token_ids), reply.state, reply.num_prompt_tokens)
                if key == sent or done.is_set():
                    continue
                now = time.monotonic()
                if reply.records and now - lp_at >= max(0.5, 2 * period):   # the logprob view: every other update at most
                    lp, lp_at = render.logprob_html(reply.records, metric=session.lp_metric), now
                # The page re-applies a stream's every output on each update, so the prefix panel's
                # engine-wide stats would stay as first sent (over the panels' timer) unless redrawn.
                if sent is None or sent[2] != key[2] or now - prefix_at >= 1.0:
                    prefix, prefix_at = self.prefix_html(session), now
                sent, sent_at = key, time.monotonic()
                yield self.chat(session), gr.skip(), lp, prefix, *controls
        finally:
            with self._streaming_lock:
                self._streaming -= 1
            if not done.is_set():           # cancelled (Stop, closed tab): abort, let the stream end
                reply.stopped = True
                cancelled.set()
                self.llm.abort(reply.request_id)
                done.wait(10)
            if session.active_request_id == reply.request_id:
                session.active_request_id = None
            reply.state = "done"
        yield self._outputs(session)

    def _claim(self, session: ChatSession, parent_id: int, reply: Reply | None = None) -> Node | None:
        """A new reply under ``parent_id`` that holds the tab's one streaming slot, or None if it is taken.

        Checking and taking the slot happen under one lock, so two events of a tab never stream at once.
        """
        with self._turn_lock:
            if session.active_request_id is not None:
                return None
            node = session.tree.add_reply(parent_id, reply or Reply(request_id=session.new_request_id("chat")))
            session.active_request_id = node.reply.request_id
            session.selected = session.selected_node = None
            return node

    # -- chat controls -------------------------------------------------------------------
    @checked
    def send(self, message: Any, session: ChatSession, system: Any, *sampling_and_mode) -> Iterator[tuple]:
        """Send a user message and stream the reply (queued behind one still streaming).

        In completion mode the message is text for the model to continue (no chat template);
        it is not stripped, since a trailing space or newline changes the continuation.
        """
        sampling, mode = self._split_mode(sampling_and_mode)
        session.mode = mode                     # completion mode shows the conversation as one document
        message = inputs.text(message, "message", max_chars=self.limits.max_input_chars)
        message = message.strip() if mode == "chat" else message
        system = inputs.text(system, "system prompt", max_chars=self.limits.max_input_chars)
        params = self.sampling(*sampling)
        if not message.strip():
            yield SKIP6
            return
        with self._turn_lock:
            if session.active_request_id is not None or session.queued:
                if len(session.queued) >= MAX_QUEUED:
                    raise gr.Error(f"{MAX_QUEUED} messages are already waiting for the reply above: wait for "
                                   "them, or press Stop (it puts them back in the message box).")
                ticket = object()
                session.queued.append((ticket, message))
                node = None
            else:
                user = session.tree.add_user(message)
                node = self._claim(session, user.node_id)
        try:
            if node is None:                    # a reply is still streaming: wait behind it (and earlier messages)
                gr.Info("Your message is queued: it is sent when the reply above ends.")
                yield self._outputs(session, msg="", panels=False)
                node = self._wait_turn(session, ticket)
                if node is None:                # withdrawn by Stop: the message went back to the box
                    return
            prompt = self._prompt(session, node, system, mode)
            yield from self._run(session, node, prompt, params, self._outputs(session, msg="", reset_controls=True))
        finally:
            if node is None:                    # cancelled while queued: it never enters the conversation
                with self._turn_lock:
                    session.queued[:] = [q for q in session.queued if q[0] is not ticket]

    def _wait_turn(self, session: ChatSession, ticket: object, timeout: float = 600.0) -> Node | None:
        """Wait until the queued message ``ticket`` is the oldest waiting and the tab's streaming slot is free,
        then add it to the conversation with a reply that holds the slot; None if it was withdrawn (Stop)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._turn_lock:
                if not any(q[0] is ticket for q in session.queued):
                    return None
                if session.active_request_id is None and session.queued[0][0] is ticket:
                    _, text = session.queued.pop(0)
                    user = session.tree.add_user(text)
                    return self._claim(session, user.node_id)
            if time.monotonic() > deadline:
                raise gr.Error("The reply above did not end in time; your message was not sent.")
            time.sleep(0.05)

    @checked
    def regenerate(self, session: ChatSession, system: Any, *sampling_and_mode) -> Iterator[tuple]:
        """Generate another reply to the last message; the earlier ones stay as branches (‹ 1/2 ›)."""
        sampling, mode = self._split_mode(sampling_and_mode)
        session.mode = mode                     # completion mode shows the conversation as one document
        system = inputs.text(system, "system prompt", max_chars=self.limits.max_input_chars)
        params = self.sampling(*sampling)
        self._refuse_while_streaming(session, "regenerating")
        path = session.tree.path()
        user = next((n for n in reversed(path) if n.role == "user"), None)
        if user is None:
            raise gr.Error("Nothing to regenerate yet: send a message first.")
        node = self._claim(session, user.node_id)
        if node is None:
            self._refuse_while_streaming(session, "regenerating")
        prompt = self._prompt(session, node, system, mode)
        yield from self._run(session, node, prompt, params, self._outputs(session, reset_controls=True))

    def _refuse_while_streaming(self, session: ChatSession, what: str) -> None:
        if session.active_request_id is not None:
            raise gr.Error(f"A reply is still being generated: press Stop or wait for it to end before {what}.")

    def _withdraw_queued(self, session: ChatSession) -> str | None:
        """Take back the messages waiting for the streaming reply (their texts, one per line), before that
        reply ends: otherwise a waiting send would claim the freed slot and generate a reply nobody sees."""
        with self._turn_lock:
            texts = [text for _, text in session.queued]
            session.queued.clear()
        return "\n".join(texts) if texts else None

    def stop(self, session: ChatSession) -> tuple:
        """Abort this tab's running request (the reply keeps its text, marked "(stopped)"); the messages
        queued behind it are withdrawn and put back in the message box."""
        withdrawn = session.withdrawn = self._withdraw_queued(session)
        rid = session.active_request_id
        if rid:
            for node in session.tree.replies():
                if node.reply.request_id == rid:
                    node.reply.stopped = True
            self.llm.abort(rid)
        return self._outputs(session, msg=withdrawn if withdrawn is not None else gr.skip())

    def settled(self, session: ChatSession) -> tuple:
        """The chat as it stands once Stop has cancelled the tab's events: a streamed update computed just
        before Stop (showing the withdrawn message, or the reply still running) may reach the page after
        Stop's own answer, so Stop is followed by this one."""
        withdrawn, session.withdrawn = session.withdrawn, None     # the box again: a late update may have emptied it
        return self._outputs(session, msg=withdrawn if withdrawn is not None else gr.skip())

    def clear(self, session: ChatSession) -> tuple:
        self._withdraw_queued(session)
        if session.active_request_id:
            self.llm.abort(session.active_request_id)
        session.active_request_id = None
        session.reset()
        return self._outputs(session, msg="", reset_controls=True)

    # -- branching -------------------------------------------------------------------------
    def pick_token(self, session: ChatSession, evt: gr.EventData) -> tuple:
        """A click on a token of the logprob view: offer its alternatives."""
        index = int((getattr(evt, "_data", None) or {}).get("index", -1)) if evt is not None else -1
        node = session.tree.last_reply()
        if node is None or session.active_request_id or not 0 <= index < len(node.reply.records):
            return gr.skip(), gr.skip(), gr.skip()
        session.selected, session.selected_node = index, node.node_id
        rec = node.reply.records[index]
        choices = [(f"{a['text']!r} · {a['prob'] * 100:.1f}%", a["token_id"])
                   for a in rec["alternatives"] if a["token_id"] != rec["token_id"]]
        dropdown = gr.Dropdown(choices=choices, value=choices[0][1] if choices else None)
        return index, dropdown, self.logprob_html(session)

    @checked
    def branch(self, token_index: Any, alternative: Any, session: ChatSession, *sampling) -> Iterator[tuple]:
        """A new branch of the shown reply: its first ``token_index`` tokens, then ``alternative`` forced.

        The original reply stays (``‹ 1/2 ›`` under the reply moves between them).
        """
        self._refuse_while_streaming(session, "branching")
        target = session.tree.last_reply()
        if target is None or not target.reply.finished or target.reply.error:
            raise gr.Error("Nothing to branch from: chat first, then click a token of the reply.")
        if session.selected_node is not None and session.selected_node != target.node_id:
            raise gr.Error("The token you picked belongs to a reply that is no longer shown; pick a token "
                           "of the reply in the logprob view again.")
        last = target.reply
        if token_index is None or str(token_index).strip() == "":
            raise gr.Error("Click a token of the reply in the logprob view first: the branch starts at that token.")
        index = inputs.number(token_index, "branch token #", 0, len(last.all_token_ids) - 1, integer=True)
        forced = inputs.alternative_tokens(alternative, lambda t: self.tokenizer.encode(t, add_special_tokens=False),
                                           self.vocab_size)
        params = self.sampling(*sampling)
        prompt = {"prompt_token_ids": branch_prompt(last, index, forced)}
        kept = last.all_token_ids[:index] + forced
        reply = start_branch(last, index, forced, session.new_request_id("chat"), self.tokenizer.decode(kept),
                             decode=self._decode)
        node = self._claim(session, target.parent, reply)
        if node is None:
            self._refuse_while_streaming(session, "branching")
        yield from self._run(session, node, prompt, params, self._outputs(session, reset_controls=True))

    def navigate(self, session: ChatSession, evt: gr.EventData) -> tuple:
        """A click on ‹ or › under a reply: show its previous or next branch."""
        data = (getattr(evt, "_data", None) or {}) if evt is not None else {}
        try:
            node_id, step = int(data.get("node")), int(data.get("step"))
        except (TypeError, ValueError):
            return SKIP6
        if session.active_request_id is not None or not session.tree.navigate(node_id, step):
            return SKIP6
        session.selected = session.selected_node = None
        return self._outputs(session, reset_controls=True)

    def compare(self, session: ChatSession) -> str:
        """The shown reply beside another branch of it, with the token where they part."""
        return compare_html(session.tree, session.tree.last_reply(),
                            lambda records, selected: render.logprob_html(records, selected=selected,
                                                                          metric=session.lp_metric,
                                                                          hint=COMPARE_HINT))

    @checked
    def prompt_view(self, session: ChatSession) -> str:
        """The shown reply's prompt, scored: which of its tokens surprised the model."""
        node = session.tree.last_reply()
        if node is None or not node.reply.prompt_token_ids:
            raise InputError("Send a message first: the prompt view scores the prompt of the reply shown.")
        try:
            records = score_prompt(self.llm, node.reply.prompt_token_ids, top_k=5)
        except Exception as exc:  # the engine refused or failed the scoring request
            raise gr.Error(f"Scoring the prompt failed: {type(exc).__name__}: {exc}") from exc
        return prompt_view_html(records, metric=session.lp_metric)

    @checked
    def set_metric(self, session: ChatSession, metric: Any) -> str:
        """The logprob view's toggle: probability, raw logprob or rank."""
        if metric not in METRICS:
            raise InputError(f"the logprob view shows one of {', '.join(METRICS)}; got {metric!r:.40}")
        session.lp_metric = metric
        return self.logprob_html(session)

    # -- panels ------------------------------------------------------------------------------
    def labels(self, session: ChatSession, snap: dict) -> dict[str, str]:
        names = {rid: self.colors.name(rid, session.session_id) for rid in render.owner_order(snap)}
        names.update({rid: name for rid, name in session.labels.items() if rid in names and name != "this chat"})
        return names

    def block_map(self, session: ChatSession, *, css: bool = True) -> tuple[str, str]:
        """The tab's block map and its key (a string that changes whenever the map would).

        Every open tab asks for it several times a second (``live_map``), on the cores the
        engine decodes with: the grid of cells, the same for every tab, is drawn once per
        snapshot (``render.block_map_html`` keeps the last one); only the legend is per tab.
        """
        key = self.map_key(session)             # before the snapshot: a newer one only redraws again
        snap = self.monitor.snapshot()
        return render.block_map_html(snap, labels=self.labels(session, snap), colors=self._colors(snap), css=css), key

    def _colors(self, snap: dict) -> dict[str, str]:
        """The owners' colours in ``snap``, assigned once per snapshot for every tab's map."""
        order = render.owner_order(snap)
        cached = self._colors_cache
        if cached is None or cached[0] is not order:
            cached = self._colors_cache = (order, self.colors.colors(order))
        return cached[1]

    def map_key(self, session: ChatSession) -> str:
        """What the tab's block map is drawn from: the monitor's snapshot and the tab's conversation
        (its legend names). A view reading it keeps the monitor at its fast pace."""
        self.monitor.mark_read()
        return f"{self.monitor.version}.{len(session.tree.nodes)}.{id(session.tree.last_reply())}"

    def map_panel(self, session: ChatSession) -> str:
        """Page load: the tab's block map, with the token its script polls the map's route with."""
        return self.live_map.html(session)

    def panels(self, session: ChatSession) -> dict[str, str]:
        """The live panels' contents, ``{elem_id: html}``, as the panels' route sends them (once a
        second per open tab): prefix cache, engine, timeline, and the block inspector (the block
        clicked last, as the engine holds it now: a block clicked while a reply used it says
        "cached, reusable" once the reply has ended, like the map beside it). Drawn again only
        when the engine or the tab moved on; the timeline is drawn once a second for every tab."""
        last = session.tree.last_reply()
        key = (self.monitor.version, len(session.tree.nodes), id(last), self.monitor.num_steps, session.inspected)
        timeline = self._timeline(session.timeline_window)   # it moves on even when the engine idles
        if key != session.last_render_key or session.last_panels is None:
            snap = self.monitor.snapshot()
            reply = last.reply if last else None
            stats = {"ttft": reply.ttft, "decode_tps": reply.decode_tps} if reply else None
            session.last_render_key = key
            session.last_panels = (render.prefix_cache_html(snap, self.turns(session)),
                                   render.engine_panel_html(snap, self.monitor.steps(120), stats),
                                   self._inspector(session, snap))
        prefix, engine, inspector = session.last_panels
        return {"prefix-panel": prefix, "engine-panel": engine, "timeline": {"plotly": timeline},
                "block-inspector": inspector}

    def route_panels(self, session: ChatSession) -> dict:
        """The panels as the route sends them, and whether Stop has anything to stop in this tab
        (a reply running or a message waiting for one): the page's script disables it otherwise."""
        idle = session.active_request_id is None and not session.queued
        return {**self.panels(session), "stop": {"disabled": idle}}

    def refresh_panels(self, session: ChatSession) -> tuple:
        """Page load: the live panels as Gradio shows them (each in the wrapper the page's script
        refreshes from the panels' route; the timeline as the ``gr.Plot``'s value)."""
        panels = self.panels(session)
        return tuple(timeline_plot(v["plotly"]).model_dump() if k == "timeline" else wrap(k, v) for k, v in panels.items())

    def _timeline(self, window: int) -> dict:
        """The timeline's figure over the last ``window`` seconds, the same for every tab watching that
        window: drawn at most once per second."""
        second = int(time.time())
        cached = self._timeline_cache.get(window)
        if cached is None or cached[0] != second:
            cached = self._timeline_cache[window] = (second, timeline_figure(self.monitor.timeline.series(window)))
        return cached[1]

    def set_timeline_window(self, session: ChatSession, window: Any) -> Any:
        """The timeline's window (seconds, one of ``timeline.WINDOWS``), drawn at once."""
        try:
            window = int(str(window).split()[0])
        except (TypeError, ValueError, IndexError):
            window = None
        if window not in WINDOWS:
            raise gr.Error(f"the timeline's window is one of {', '.join(map(str, WINDOWS))} seconds; got {window!r:.40}")
        session.timeline_window = window
        return timeline_plot(self._timeline(window))

    def inspect_block(self, session: ChatSession, evt: gr.EventData) -> str:
        """A click on the block map: what that block holds."""
        data = (getattr(evt, "_data", None) or {}) if evt is not None else {}
        try:
            block_id = int(data.get("block"))
        except (TypeError, ValueError):
            return gr.skip()
        session.inspected = block_id
        return wrap("block-inspector", self._inspector(session, self.monitor.refresh()))

    def _inspector(self, session: ChatSession, snap: dict) -> str:
        """The block inspector of ``session.inspected`` in ``snap``."""
        if session.inspected is None:    # a server without blocks to click: the inspector says why
            return block_inspector_html(snap if snap.get("blocks_hidden") else None, None)
        own = {n.reply.request_id: list(n.reply.prompt_token_ids) + n.reply.all_token_ids
               for n in session.tree.replies()}
        names = self.labels(session, snap)
        return block_inspector_html(snap, session.inspected, name=lambda rid: names.get(rid, session.labels.get(rid, rid)),
                                    own_tokens=own, own_requests=session.labels,
                                    last_owner=self.monitor.last_owner(session.inspected),
                                    decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
                                    provenance={n.reply.request_id: n.reply.provenance for n in session.tree.replies()
                                                if getattr(n.reply, "provenance", None) is not None})

    def _admin(self, what: str) -> None:
        if not self.allow_engine_admin:
            raise gr.Error(f"{what} affects every visitor of this server; start the app with "
                           "--allow-engine-admin to enable it.")

    def reset_prefix_cache(self, session: ChatSession) -> str:
        self._admin("Resetting the prefix cache")
        self.llm.reset_prefix_cache()
        self.monitor.refresh()
        gr.Info("Prefix cache reset: cached blocks were evicted.")
        return self.prefix_html(session)

    @checked
    def batch_demo(self, n: Any, session: ChatSession, system: Any, *sampling) -> Iterator[str]:
        """Fire ``n`` concurrent requests that share the system prompt."""
        n = inputs.number(n, "requests", 1, self.limits.max_batch, integer=True)
        system = inputs.text(system, "system prompt", max_chars=self.limits.max_input_chars)
        params = self.sampling(*sampling)
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens, self.limits.batch_max_tokens))
        ids = [session.new_request_id("batch", f"batch #{i + 1}") for i in range(n)]
        for rows in run_batch(self.llm, system, params, ids):
            yield render.batch_table_html(rows, colors=self.colors.colors(r["request_id"] for r in rows),
                                          names=session.labels)

    @checked
    def align(self, session: ChatSession, system: Any) -> str:
        """Backend consistency: the serving backend vs the other one on this conversation."""
        self._admin("The backend-consistency check (it loads a second copy of the model)")
        system = inputs.text(system, "system prompt", max_chars=self.limits.max_input_chars)
        last = session.tree.last_reply()
        if last is None or not last.reply.finished or last.reply.error:
            raise gr.Error("Chat first: the backend-consistency check runs on the current conversation.")
        messages = session.tree.messages_before(last.node_id) + [{"role": "assistant", "content": last.reply.text}]
        prompt = self.tokenizer.apply_chat_template(_system(system) + messages, add_generation_prompt=True)
        gr.Info(f"Checking {self.llm.model_impl} against {self.aligner.impl} (the first run loads the second backend).")
        try:
            report = self.aligner.run(prompt)
        except Exception as exc:  # e.g. the other backend cannot load this model
            raise gr.Error(f"Backend-consistency check failed: {type(exc).__name__}: {exc}") from exc
        return render.alignment_html(report)
