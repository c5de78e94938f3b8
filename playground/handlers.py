"""What each control of the page does (the Gradio event handlers).

``Handlers`` holds the shared ``LLM`` and ``EngineMonitor``; every method
takes the tab's ``ChatSession`` plus the values of its input components and
returns (or, for streaming, yields) the new values of its outputs. The page
layout and the wiring live in ``app.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr

from engine import SamplingParams

from . import render
from .alignment import Aligner
from .batch_demo import run_batch
from .chat import ChatSession, Reply, branch_prompt, start_branch, stream_reply
from .monitor import EngineMonitor

__all__ = ["Limits", "Handlers"]


@dataclass
class Limits:
    """Caps that keep one visitor from monopolising the server."""

    max_input_chars: int = 4000
    max_tokens: int = 512
    max_batch: int = 8
    batch_max_tokens: int = 48


def _system(system: str) -> list[dict]:
    return [{"role": "system", "content": system}] if system and system.strip() else []


class Handlers:
    """Event handlers bound to one ``LLM`` (shared by every tab)."""

    def __init__(self, llm: Any, monitor: EngineMonitor, limits: Limits):
        self.llm, self.monitor, self.limits = llm, monitor, limits
        self.tokenizer = llm.get_tokenizer()
        self.aligner = Aligner(llm)

    # -- helpers ------------------------------------------------------------------
    def sampling(self, temperature, top_p, top_k, max_tokens, seed, n_logprobs, *, cap=None) -> SamplingParams:
        """SamplingParams from the controls; bad values become a visible error."""
        try:
            return SamplingParams(
                max_tokens=max(1, min(int(max_tokens), cap or self.limits.max_tokens)),
                temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                seed=None if seed in (None, "") or int(seed) < 0 else int(seed),
                logprobs=int(n_logprobs) if n_logprobs else None,
            )
        except (TypeError, ValueError) as exc:
            raise gr.Error(f"Invalid sampling setting: {exc}") from exc

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)])

    def prefix_html(self, session: ChatSession) -> str:
        return render.prefix_cache_html(self.monitor.snapshot(), session.turns)

    def logprob_html(self, session: ChatSession) -> str:
        records = session.last.records if session.last else []
        return render.logprob_html(records, selected=session.selected)

    # -- streaming one reply -------------------------------------------------------------
    def _run(self, session: ChatSession, prompt: Any, params: SamplingParams, reply: Reply,
             commit, label: str) -> Iterator[tuple]:
        """Stream ``reply`` into the last chat bubble; finish the turn however it ends."""
        session.active_request_id = reply.request_id
        gen = stream_reply(self.llm, prompt, params, reply, decode=self._decode)
        try:
            for i, _ in enumerate(gen):
                session.display[-1] = {"role": "assistant", "content": reply.text + " ▌"}
                lp = render.logprob_html(reply.records) if i % 8 == 0 else gr.skip()
                yield list(session.display), "", lp, gr.skip()
        finally:
            gen.close()
            session.active_request_id = None
            self._finish_turn(session, reply, commit, label)
        yield list(session.display), "", self.logprob_html(session), self.prefix_html(session)

    def _finish_turn(self, session: ChatSession, reply: Reply, commit, label: str) -> None:
        if reply.error:
            session.display[-1] = {"role": "assistant",
                                   "content": f"⚠️ **Engine error:** {reply.error}"}
            return
        stopped = not reply.finished or reply.finish_reason == "abort"
        session.display[-1] = {"role": "assistant",
                               "content": reply.text + (" ⏹ *(stopped)*" if stopped else "")}
        commit(reply.text)
        session.last, session.selected = reply, None
        session.record_turn(reply, label)

    # -- chat controls -------------------------------------------------------------------
    def send(self, message: str, session: ChatSession, system: str, *sampling) -> Iterator[tuple]:
        """Send a user message and stream the reply."""
        message = (message or "").strip()
        if not message:
            yield gr.skip(), gr.skip(), gr.skip(), gr.skip()
            return
        if len(message) > self.limits.max_input_chars:
            raise gr.Error(f"Your message is {len(message)} characters long; the limit is "
                           f"{self.limits.max_input_chars}. Please shorten it.")
        params = self.sampling(*sampling)
        user = {"role": "user", "content": message}
        session.display += [user, {"role": "assistant", "content": "▌"}]
        prompt = _system(system) + session.messages + [user]

        def commit(text: str) -> None:
            session.messages += [user, {"role": "assistant", "content": text}]

        reply = Reply(request_id=session.new_request_id("chat"))
        yield from self._run(session, prompt, params, reply, commit, str(len(session.turns) + 1))

    def regenerate(self, session: ChatSession, system: str, *sampling) -> Iterator[tuple]:
        """Drop the last reply and generate it again."""
        users = [i for i, m in enumerate(session.display) if m["role"] == "user"]
        if not users:
            yield gr.skip(), gr.skip(), gr.skip(), gr.skip()
            return
        message = session.display[users[-1]]["content"]
        del session.display[users[-1]:]
        if len(session.messages) >= 2 and session.messages[-2]["content"] == message:
            del session.messages[-2:]
        yield from self.send(message, session, system, *sampling)

    def stop(self, session: ChatSession) -> None:
        """Abort this tab's running request (its event is cancelled too)."""
        if session.active_request_id:
            self.llm.abort(session.active_request_id)

    def clear(self, session: ChatSession) -> tuple:
        self.stop(session)
        session.reset()
        session.display = []
        return [], "", self.logprob_html(session), self.prefix_html(session)

    # -- branching -------------------------------------------------------------------------
    def pick_token(self, session: ChatSession, evt: gr.EventData) -> tuple:
        """A click on a token of the logprob view: offer its alternatives."""
        index = int(getattr(evt, "_data", {}).get("index", -1)) if evt is not None else -1
        if session.last is None or not 0 <= index < len(session.last.records):
            return gr.skip(), gr.skip(), gr.skip()
        session.selected = index
        rec = session.last.records[index]
        choices = [(f"{a['text']!r} · {a['prob'] * 100:.1f}%", a["token_id"])
                   for a in rec["alternatives"] if a["token_id"] != rec["token_id"]]
        dropdown = gr.Dropdown(choices=choices, value=choices[0][1] if choices else None)
        return index, dropdown, self.logprob_html(session)

    def branch(self, token_index, alternative, session: ChatSession, *sampling) -> Iterator[tuple]:
        """Regenerate the last reply from ``token_index`` with ``alternative`` forced there."""
        last = session.last
        if last is None or alternative in (None, ""):
            raise gr.Error("Click a token of the last reply and choose an alternative first.")
        index, token_id = int(token_index), int(alternative)
        try:
            prompt = {"prompt_token_ids": branch_prompt(last, index, token_id)}
        except ValueError as exc:
            raise gr.Error(str(exc)) from exc
        params = self.sampling(*sampling)
        kept = last.all_token_ids[:index] + [token_id]
        reply = start_branch(last, index, token_id, session.new_request_id("chat"),
                             self.tokenizer.decode(kept))
        reply.records[-1]["text"] = reply.records[-1]["text"] or self._decode(token_id)
        session.display[-1] = {"role": "assistant", "content": reply.text + " ▌"}

        def commit(text: str) -> None:
            if session.messages and session.messages[-1]["role"] == "assistant":
                session.messages[-1] = {"role": "assistant", "content": text}

        yield from self._run(session, prompt, params, reply, commit, f"{len(session.turns)}↳")

    # -- panels ------------------------------------------------------------------------------
    def refresh(self, session: ChatSession) -> tuple:
        """Timer tick: re-render the live panels if the engine or this tab changed."""
        key = (self.monitor.version, len(session.turns), id(session.last))
        if key == session.last_render_key:
            return gr.skip(), gr.skip(), gr.skip()
        session.last_render_key = key
        snap = self.monitor.snapshot()
        last = session.last
        stats = {"ttft": last.ttft, "decode_tps": last.decode_tps} if last else None
        return (
            render.block_map_html(snap, labels=session.labels),
            render.prefix_cache_html(snap, session.turns),
            render.engine_panel_html(snap, self.monitor.steps(120), stats),
        )

    def reset_prefix_cache(self, session: ChatSession) -> str:
        self.llm.reset_prefix_cache()
        self.monitor.refresh()
        gr.Info("Prefix cache reset: cached blocks were evicted.")
        return self.prefix_html(session)

    def batch_demo(self, n, session: ChatSession, system: str, *sampling) -> Iterator[str]:
        """Fire ``n`` concurrent requests that share the system prompt."""
        n = max(1, min(int(n), self.limits.max_batch))
        params = self.sampling(*sampling, cap=self.limits.batch_max_tokens)
        ids = [session.new_request_id("batch", f"batch #{i + 1}") for i in range(n)]
        for rows in run_batch(self.llm, system, params, ids):
            yield render.batch_table_html(rows)

    def align(self, session: ChatSession, system: str) -> str:
        """Compare the serving backend with the other implementation on this conversation."""
        if not session.messages:
            raise gr.Error("Chat first: the alignment runs on the current conversation.")
        prompt = self.tokenizer.apply_chat_template(_system(system) + session.messages,
                                                    add_generation_prompt=True)
        gr.Info(f"Running {self.llm.model_impl} vs {self.aligner.impl} (the first run loads the second backend).")
        try:
            report = self.aligner.run(prompt)
        except Exception as exc:  # e.g. the other backend cannot load this model
            raise gr.Error(f"Alignment failed: {type(exc).__name__}: {exc}") from exc
        return render.alignment_html(report)
