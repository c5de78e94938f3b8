"""Conversation documents (playground.persistence) and each browser's list (playground.library)."""

from __future__ import annotations

import copy
import json

import pytest

from playground.chat import Reply
from playground.conversation import Conversation
from playground.library import Libraries
from playground.persistence import FORMAT, DocumentError, dumps, from_document, loads, to_document


def _record(i, token_id, text):
    return {"index": i, "token_id": token_id, "text": text, "logprob": -0.1, "prob": 0.9,
            "alternatives": [{"token_id": token_id, "text": text, "logprob": -0.1, "prob": 0.9, "rank": 1}],
            "entropy": 0.5, "entropy_is_bound": False, "forced": False}


def _tree() -> Conversation:
    tree = Conversation()
    user = tree.add_user("Hi")
    tree.add_reply(user.node_id, Reply("a", prompt_token_ids=[1, 2], token_ids=[5, 6], text="Hello!",
                                       records=[_record(0, 5, "Hello"), _record(1, 6, "!")], finished=True,
                                       finish_reason="stop", num_prompt_tokens=2))
    second = tree.add_reply(user.node_id, Reply("b", prompt_token_ids=[1, 2], token_ids=[7], text="Hey",
                                                records=[_record(0, 7, "Hey")], finished=True,
                                                finish_reason="length"))
    tree.add_user("How are you?")
    tree.navigate(second.node_id, -1)          # the first reply shown: its branch has no follow-up
    return tree


def test_a_document_round_trips_the_tree_the_shown_path_and_the_logprobs():
    tree = _tree()
    doc = json.loads(dumps(to_document(tree, title="greeting", system="Be brief.", model="m")))
    assert doc["format"] == FORMAT and doc["version"] == 1
    assert doc["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello!"}]
    back, meta = from_document(doc)
    assert meta == {"title": "greeting", "model": "m", "system": "Be brief."}
    assert [n.text for n in back.path()] == ["Hi", "Hello!"]
    assert back.siblings(back.path()[1].node_id) == (1, 2)
    assert back.path()[1].reply.records == tree.path()[1].reply.records
    back.navigate(back.path()[1].node_id, 1)
    assert [n.text for n in back.path()] == ["Hi", "Hey", "How are you?"]
    assert back.add_user("next").node_id == max(tree.nodes) + 1      # new ids after the saved ones


def test_a_plain_openai_conversation_is_read_as_one_path():
    tree, meta = from_document({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                             {"role": "assistant", "content": "A"}]})
    assert meta["system"] == "S" and [n.text for n in tree.path()] == ["Q", "A"]


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(format="other"), ["format", FORMAT]),
    (lambda d: d.update(version=2), ["version", "1"]),
    (lambda d: d["tree"]["nodes"][2].update(parent=99), ["tree.nodes[2].parent", "99"]),
    (lambda d: d["tree"]["nodes"][2].update(role="bot"), ["tree.nodes[2].role", "user or assistant"]),
    (lambda d: d["tree"]["nodes"][2]["reply"].update(token_ids=["x"]), ["tree.nodes[2].reply.token_ids"]),
    (lambda d: d["tree"]["nodes"][2]["reply"].update(records=[{"token_id": 1}]), ["records[0].text"]),
    (lambda d: d["tree"]["nodes"][0].update(shown=7), ["shown", "between 0 and 0"]),
    (lambda d: d["tree"]["nodes"][1].update(id=2), ["used twice"]),
])
def test_a_wrong_document_is_refused_naming_the_field(change, words):
    doc = json.loads(dumps(to_document(_tree())))
    bad = copy.deepcopy(doc)
    change(bad)
    with pytest.raises(DocumentError) as info:
        from_document(bad)
    for word in words:
        assert word in str(info.value)


def test_loads_names_what_is_not_a_conversation():
    with pytest.raises(DocumentError, match="not JSON"):
        loads(b"{nope")
    with pytest.raises(DocumentError, match="JSON list"):
        loads(b"[]")


def test_each_browser_has_its_own_list_and_an_unknown_key_gets_a_new_one():
    libraries = Libraries(max_browsers=2, max_conversations=2)
    key, lib = libraries.get(None)
    assert libraries.get(key)[1] is lib
    other_key, other = libraries.get("guessed")
    assert other_key != "guessed" and other is not lib
    a = lib.open()
    a.tree.add_user("first question")
    b = lib.new()
    assert [name for name, _ in lib.choices()] == ["New conversation", "first question"]
    lib.rename(b.conversation_id, "  my   chat ")
    assert lib.choices()[0][0] == "my chat"
    lib.new()                                   # a third: the oldest untouched one goes
    assert len(lib.entries) == 2 and lib.current not in (a.conversation_id,)
    shown = lib.delete(lib.current)
    assert shown.conversation_id in lib.entries and lib.current == shown.conversation_id


def test_a_chat_sent_before_the_page_restored_is_kept_as_a_new_conversation():
    """Under load the page's load event (restore) can run after the first message was sent: it used
    to replace that chat with the browser's last conversation, so the reply streamed into nothing."""
    import gradio as gr

    from playground.chat import ChatSession
    from playground.sidebar import Sidebar

    libraries = Libraries()
    key, library = libraries.get(None)
    earlier = library.new()
    earlier.tree.add_user("an earlier conversation")
    session = ChatSession()
    session.tree.add_user("typed before the page finished loading")
    out = Sidebar(h=None, libraries=libraries).restore(key, session)
    assert out[0] == key and all(o is gr.skip() or o == gr.skip() for o in out[1:7])   # the chat is left as it is
    assert session.library is library and session.conversation_id != earlier.conversation_id
    assert library.get(session.conversation_id).tree is session.tree
    assert library.choices()[0][1] == session.conversation_id                    # listed first
