"""The chat as the page shows it (playground.chatview): counts, the context gauge, queued messages, the
completion document."""

from __future__ import annotations

from playground.chat import Reply
from playground.chatview import chat_messages, reply_meta_html
from playground.conversation import Conversation


def _one(reply: Reply) -> tuple[Conversation, object]:
    tree = Conversation()
    user = tree.add_user("The sea is")
    return tree, tree.add_reply(user.node_id, reply)


def test_a_branch_counts_its_own_tokens_and_the_kept_ones_apart():
    """133 tokens at max tokens 128: a branch counted the tokens it kept and forced as its own."""
    tree, node = _one(Reply("r", prefix_token_ids=[1] * 5, token_ids=[2] * 128, finished=True,
                            finish_reason="length", num_prompt_tokens=20))
    meta = reply_meta_html(tree, node, 1000)
    assert '<span class="pg-count">128 tokens <span class="pg-kept">+ 5 kept</span></span>' in meta
    assert "pg-continue" in meta and "852 left" in meta


def test_a_reply_that_filled_the_context_says_so_and_offers_no_continue():
    tree, node = _one(Reply("r", token_ids=[2] * 10, finished=True, finish_reason="length", num_prompt_tokens=90))
    meta = reply_meta_html(tree, node, 100)
    assert "the context is full" in meta and "pg-continue" not in meta and "0 left" in meta


def test_queued_messages_follow_the_path_and_completion_mode_is_one_document():
    tree, node = _one(Reply("r", token_ids=[3, 4], text=" blue\n<b>", finished=True, finish_reason="stop",
                            records=[{"text": " blue", "prob": 0.95}, {"text": "\n<b>", "prob": 0.05}]))
    chat = chat_messages(tree, 100, queued=["next?", "and then?"])
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "user"]
    doc = chat_messages(tree, 100, document=True)
    assert [m["role"] for m in doc] == ["assistant"]
    body = doc[0]["content"]
    assert body.startswith('<span class="pg-doc"><span class="pg-doc-given">The sea is</span>')
    assert "pg-ti-0 pg-p4" in body and "pg-ti-1 pg-p0" in body and "<br>&lt;b&gt;" in body


def test_the_completion_document_offers_its_whole_text_to_edit_and_moves_between_its_versions():
    tree, node = _one(Reply("r", token_ids=[3], text=" blue", finished=True, finish_reason="stop",
                            num_prompt_tokens=3, records=[{"text": " blue", "prob": 0.9}]))
    first = tree.path()[0]
    body = chat_messages(tree, 100, document=True)[0]["content"]
    assert f'pg-edit-doc pg-node-{node.node_id}' in body
    assert '<span class="pg-doc-raw">The sea is blue</span>' in body
    assert "pg-version-branches" not in body            # one version so far
    edited = tree.edit_user(first.node_id, "The sky is blue and")
    tree.add_reply(edited.node_id, Reply("r2", token_ids=[4], text=" wide", finished=True, finish_reason="stop",
                                         num_prompt_tokens=5, records=[{"text": " wide", "prob": 0.5}]))
    body = chat_messages(tree, 100, document=True)[0]["content"]
    assert '<span class="pg-doc-given">The sky is blue and</span>' in body
    assert f'pg-nav pg-prev pg-node-{edited.node_id}' in body and '<span class="pg-pos">2/2</span>' in body
    assert '<span class="pg-doc-raw">The sky is blue and wide</span>' in body
