"""Max tokens up to the context left: the slider's maximum follows the conversation.

A reply can have at most ``max_model_len`` minus the tokens the conversation already holds (its
prompt and the reply shown last, what the context gauge under the reply counts). After every event
that changes the conversation shown (a reply ended, Stop, Clear, a branch or conversation opened,
the page's restore), ``ContextLeft.slider`` sets the max tokens slider's maximum to that, capped by
the page's own limit. A value above it is lowered to it, and the slider's note says so and why;
the engine would otherwise end the reply at the full context, below the number asked for.
"""

from __future__ import annotations

from typing import Any

import gradio as gr

from .chat import ChatSession

__all__ = ["ContextLeft"]


class ContextLeft:
    """The max tokens slider of one page, kept within the context left of the tab's conversation."""

    def __init__(self, max_model_len: int, cap: int):
        self.max_model_len, self.cap = int(max_model_len), int(cap)

    def used(self, session: ChatSession) -> int:
        """Tokens of the conversation shown: the last reply's prompt and its tokens (0 before any)."""
        node = session.tree.last_reply()
        r = node.reply if node is not None else None
        return r.num_prompt_tokens + len(r.token_ids) if r is not None and r.num_prompt_tokens else 0

    def maximum(self, session: ChatSession) -> int:
        """The most tokens the next reply can have: the context left, at most the page's cap, at least 1."""
        return max(1, min(self.cap, self.max_model_len - self.used(session)))

    def info(self, session: ChatSession, lowered_from: int | None = None) -> str:
        used, top = self.used(session), self.maximum(session)
        if top == self.cap:
            why = f"up to {top}; the context has {self.max_model_len - used} tokens left (max_model_len {self.max_model_len})"
        else:
            why = (f"up to {top}: the context left (max_model_len {self.max_model_len} − {used} tokens "
                   "of this conversation)")
        return f"lowered from {lowered_from}: {why}" if lowered_from is not None else why

    def slider(self, session: ChatSession, value: Any) -> Any:
        """The slider's new maximum, and its value lowered to it if it was above (the note says so)."""
        top = self.maximum(session)
        try:
            current = int(float(value))
        except (TypeError, ValueError):
            return gr.update(maximum=top, info=self.info(session))
        if current > top:
            return gr.update(maximum=top, value=top, info=self.info(session, lowered_from=current))
        return gr.update(maximum=top, info=self.info(session))

    def follow(self, events: list, session: gr.State, max_tokens: gr.Slider, wrap=lambda fn: fn) -> None:
        """After each of ``events`` (each changes the conversation shown), the slider follows it
        (``wrap``: the handlers' way to the tab's own ``ChatSession``, ``Tabs.wrap``)."""
        for event in events:
            event.then(wrap(self.slider), [session, max_tokens], [max_tokens], api_visibility="private", queue=False,
                       show_progress="hidden", preprocess=False)
