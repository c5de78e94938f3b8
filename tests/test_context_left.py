"""Max tokens up to the context left (playground.context_left): the slider's maximum and note."""

from __future__ import annotations

from playground.chat import ChatSession, Reply
from playground.context_left import ContextLeft


def _session(prompt: int, generated: int) -> ChatSession:
    session = ChatSession()
    user = session.tree.add_user("hi")
    session.tree.add_reply(user.node_id, Reply("r", token_ids=[1] * generated, num_prompt_tokens=prompt,
                                               finished=True, finish_reason="stop"))
    return session


def test_the_maximum_is_the_context_left_capped_by_the_pages_limit():
    ctx = ContextLeft(max_model_len=1000, cap=512)
    assert ctx.maximum(ChatSession()) == 512                    # a new conversation: the page's cap
    assert ctx.maximum(_session(300, 100)) == 512               # 600 left
    assert ctx.maximum(_session(600, 100)) == 300               # the context left
    assert ctx.maximum(_session(900, 100)) == 1                 # full: the slider keeps its minimum


def test_a_value_above_the_context_left_is_lowered_and_the_note_says_why():
    ctx = ContextLeft(max_model_len=1000, cap=512)
    update = ctx.slider(_session(600, 100), 400)
    assert update["maximum"] == 300 and update["value"] == 300
    assert update["info"] == ("lowered from 400: up to 300: the context left (max_model_len 1000 − 700 tokens "
                              "of this conversation)")
    update = ctx.slider(_session(600, 100), "128")
    assert update["maximum"] == 300 and "value" not in update and "lowered" not in update["info"]
    assert ctx.slider(ChatSession(), None)["maximum"] == 512    # an unreadable value is left to the field's check
