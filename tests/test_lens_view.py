"""The attention lens's views (``playground.lens_view``, ``playground.lens_panel``) drawn from real lenses:
SmolLM2 (the default model) and a tiny Gemma 3 with sliding-window layers."""

from __future__ import annotations

import html
import re

import gradio as gr
import numpy as np
import pytest
from tiny_models import make_tiny_model

from engine import LLM
from engine.lens import AttentionLens
from playground.app import DEFAULT_SYSTEM_PROMPT
from playground.chat import ChatSession
from playground.handlers import Handlers, Limits
from playground.lens_panel import LensPanel
from playground.lens_view import block_rows, head_choices, layer_choices, lens_html, parse_choice, stored_by
from playground.monitor import EngineMonitor


class Click:
    """What Gradio hands an ``event_data`` handler: the page's ``trigger('click', data)``."""

    def __init__(self, **data):
        self._data = data


def weights_drawn(page: str) -> np.ndarray:
    return np.array([float(w) for w in re.findall(r'class="lz-tok[^"]*" data-pos="\d+" data-weight="([0-9.]+)"', page)])


def masses_drawn(page: str) -> dict[int, float]:
    return {int(b): float(m) for b, m in re.findall(r'lz-row" data-block="(\d+)" data-mass="([0-9.]+)"', page)}


@pytest.fixture
def lens_panel(smollm2_llm):
    monitor = EngineMonitor(smollm2_llm, interval=0.1)
    try:
        yield LensPanel(Handlers(smollm2_llm, monitor, Limits()))
    finally:
        monitor.close()


def chat(panel: LensPanel, text: str, session: ChatSession | None = None, max_tokens: int = 12) -> ChatSession:
    session = session or ChatSession()
    list(panel.h.send(text, session, DEFAULT_SYSTEM_PROMPT, 0.0, 1.0, 0, max_tokens, 0, 3, "chat"))
    return session


def test_heat_and_block_mass_drawn_from_a_real_lens(smollm2_llm):
    ids = smollm2_llm.get_tokenizer().encode("A <b>paged</b> KV cache & its blocks, " * 3)
    lens = smollm2_llm.attention_lens(ids, len(ids) - 1)
    for layer, head in ((None, None), (3, None), (None, 2), (5, 1)):
        page = lens_html(lens, layer=layer, head=head)
        np.testing.assert_allclose(weights_drawn(page), lens.heat(layer, head), atol=1e-6)
        mass = masses_drawn(page)
        assert list(mass) == list(dict.fromkeys(lens.block_ids))            # every block, in table order
        for block, m in lens.block_mass(layer, head).items():
            assert abs(mass[block] - m) < 1e-6
            assert f'#kv-map .kv-cell[data-block="{block}"]' in page         # ringed on the live map
        assert f'data-pos="{lens.position}"' in page and page.count("lz-query") == 2   # the css rule and the token
    assert "&lt;" in page and "<b>paged" not in page and "&amp;" in page
    # another layer draws another heat: the view follows the selectors
    assert not np.allclose(weights_drawn(lens_html(lens, layer=0)), weights_drawn(lens_html(lens, layer=20)))
    assert lens_html(lens, on_map=False).count("#kv-map") == 0
    assert layer_choices(lens)[1:4] == ["layer 0", "layer 1", "layer 2"] and len(head_choices(lens)) == lens.num_heads + 1
    assert parse_choice("layer 7", "layer", 30) == 7 and parse_choice("all layers (mean)", "layer", 30) is None
    with pytest.raises(ValueError, match=r"layer must be an integer in \[0, 30\)"):
        parse_choice("layer 30", "layer", 30)


def test_the_repr_draws_heat_and_block_mass(smollm2_llm):
    ids = smollm2_llm.get_tokenizer().encode("<b>bold</b> & a heat strip over its blocks " * 3)
    lens = smollm2_llm.attention_lens(ids, len(ids) - 1, layer=2)
    page = lens._repr_html_()
    assert page.count("<span ") == len(ids)
    for block, m in lens.block_mass().items():
        assert f'data-block="{block}" data-mass="{m:.6f}"' in page


def test_sliding_window_layers_show_their_window(tmp_path):
    path = make_tiny_model(str(tmp_path / "gemma3"), "Gemma3ForCausalLM", sliding_window=4)
    llm = LLM(model=path, max_model_len=64, block_size=4)
    try:
        ids = list(range(10, 24))
        lens = llm.attention_lens(ids, 12)
    finally:
        llm.shutdown()
    assert lens.sliding_windows[0] == 4 and not lens.sliding_windows[1]
    local, full = lens_html(lens, layer=0), lens_html(lens, layer=1)
    hatched = [int(p) for p in re.findall(r'class="lz-tok lz-out" data-pos="(\d+)"', local)]
    assert hatched == list(range(0, 13 - 4))                        # positions 0..8: outside the 4-token window
    assert np.all(lens.heat(0, None)[hatched] == 0)
    assert "sliding-window layer (4 tokens)" in local and "lz-tok lz-out" not in full
    rows = block_rows(lens, layer=0, head=None)
    assert [r["outside"] for r in rows] == [True, True, False, False]   # blocks 0-3, 4-7 wholly outside
    assert "outside the window" in local and layer_choices(lens)[1] == "layer 0 · window 4"
    assert "Layers 0" in lens_html(lens)                          # the mean names its local layers


def test_a_chats_lens_names_the_turn_that_stored_each_block(lens_panel, smollm2_llm):
    # the engine is shared: another test may have stored this chat's first blocks (the view then names
    # them "a request that is not this chat's"); start from an empty prefix cache so turn 1 stores them
    smollm2_llm.reset_prefix_cache()
    session = chat(lens_panel, "Name three colours.")
    session = chat(lens_panel, "And three animals?", session)
    panel = lens_panel.state(session)
    panel.open = True
    second = session.tree.last_reply()
    index = len(second.reply.all_token_ids) - 2
    page, layer, head = lens_panel.on_reply_token(session, "all layers (mean)", "all heads (mean)", Click(index=index))
    lens = panel.lens
    assert lens.position == len(second.reply.prompt_token_ids) + index and panel.request_id == second.reply.request_id
    # each row's "stored by" / "computed by" part (a row of a block a live request holds adds "· held by ...")
    rows = re.findall(r'lz-row" data-block="\d+" data-mass="[0-9.]+">[^<]*?· ((?:stored|computed) by [^<·]+)', page)
    size = lens.block_size
    first_turn = (len(session.tree.replies()[0].reply.prompt_token_ids) - 1) // size   # blocks turn 1 computed
    assert rows[0].startswith("stored by turn 1") and rows[first_turn - 1].startswith("stored by turn 1")
    assert rows[-1].startswith("computed by this lens pass")
    assert any(r.startswith("stored by turn 2") for r in rows)
    assert "prefix-cache hit" in page and layer.choices[1][0] == "layer 0" and head.choices[0][0] == "all heads (mean)"
    # the tokens after the clicked one are drawn (greyed) to click on: the lens moves there
    assert page.count("lz-after") == len(second.reply.all_token_ids) - index - 1 + 1
    again, _, _ = lens_panel.on_lens_token(session, "layer 3", "head 1", Click(position=5))
    assert panel.lens.position == 5 and 'data-layer="3" data-head="1"' in again
    # switching layer / head redraws the lens held, without asking the engine
    steps = smollm2_llm.engine.step_count
    other = lens_panel.select(session, "layer 7", "all heads (mean)")
    np.testing.assert_allclose(weights_drawn(other), panel.lens.heat(7, None), atol=1e-6)
    assert smollm2_llm.engine.step_count == steps


@pytest.mark.parametrize("request_kind, position, layer, head, message", [
    ("own", 10_000, None, None, r"position must be an integer in \[0, \d+\]"),
    ("own", -1, None, None, r"position must be an integer in \[0, \d+\]"),
    ("own", "three", None, None, r"position must be an integer"),
    ("own", 3, "layer 99", None, r"layer must be an integer in \[0, 30\)"),
    ("own", 3, None, "head 9", r"head must be an integer in \[0, 9\)"),
    ("own", 3, "top", None, r"layer must be a layer number"),
    ("empty", 0, None, None, r"token_ids is empty; the lens needs at least one token"),
])
def test_bad_input_is_named_in_the_panel(lens_panel, smollm2_llm, request_kind, position, layer, head, message):
    session = chat(lens_panel, "Hi!", max_tokens=4)
    rid = session.tree.last_reply().reply.request_id
    if request_kind == "empty":                       # a reply the engine has not started: no tokens yet
        node = session.tree.last_reply()
        node.reply.prompt_token_ids, node.reply.prefix_token_ids, node.reply.token_ids = [], [], []
    steps = smollm2_llm.engine.step_count
    page, layer_out, head_out = lens_panel.lens(session, rid, position, layer, head)
    error = re.search(r'<div class="lz-error">([^<]*)</div>', page)
    assert error and re.search(message, html.unescape(error.group(1))), page[-400:]
    assert "Traceback" not in page and lens_panel.state(session).lens is None
    assert smollm2_llm.engine.step_count == steps                   # named before any work


def test_a_lens_on_another_visitors_request_is_refused(lens_panel, smollm2_llm):
    alice = chat(lens_panel, "My secret word is pineapple.")
    bob = chat(lens_panel, "Hello!", max_tokens=4)
    theirs = alice.tree.last_reply().reply.request_id
    steps = smollm2_llm.engine.step_count
    page, _, _ = lens_panel.lens(bob, theirs, 3, None, None)
    assert "not one of this tab" in page and "pineapple" not in page.lower()
    assert smollm2_llm.engine.step_count == steps                   # refused before any work
    assert lens_panel.state(bob).lens is None
    # and a made-up id the same way
    assert "not one of this tab" in lens_panel.lens(bob, "chat-000000-1", 0, None, None)[0]


def test_a_closed_panel_computes_nothing(lens_panel, smollm2_llm):
    session = chat(lens_panel, "Hi!", max_tokens=4)
    steps = smollm2_llm.engine.step_count
    assert lens_panel.on_reply_token(session, None, None, Click(index=1)) == (gr.skip(),) * 3   # nothing changes
    assert smollm2_llm.engine.step_count == steps and lens_panel.state(session).lens is None
    # opened: the token picked in the logprob view gets its lens at once
    session.selected, session.selected_node = 1, session.tree.last_reply().node_id
    page, _, _ = lens_panel.expand(session, None, None)
    assert lens_panel.state(session).lens is not None and "lz-blocks" in page
    assert "#kv-map" not in lens_panel.collapse(session)            # closed: the map loses its rings


def test_a_foreign_server_says_why_there_is_no_lens():
    from engine.client.openai_server import OpenAIServer

    server = object.__new__(OpenAIServer)
    server.server, server._ours = "llama.cpp's llama-server", False

    class H:
        llm = server

    panel = LensPanel(H())
    assert "not available on llama.cpp's llama-server" in panel.unavailable
    page = html.unescape(panel.lens(ChatSession(), "chat-x-1", 0, None, None)[0])
    assert "No attention lens here" in page and "not available on llama.cpp's llama-server" in page


def test_stored_by_follows_the_last_request_that_computed_a_block():
    lens = AttentionLens(token_ids=tuple(range(10)), position=9, weights=np.full((1, 1, 10), 0.1, np.float32),
                         block_ids=(7, 7, 7, 7, 3, 3, 3, 3, 9, 9), block_size=4, num_cached_tokens=8,
                         sliding_windows=(None,), request_id="lens-1")
    sources = [("turn 1", list(range(6)), 0, 5), ("turn 2", list(range(9)), 4, 8), ("turn 3", [0, 1, 2, 3, 99], 4, 4)]
    assert stored_by(lens, sources) == ["stored by turn 1", "stored by turn 2", "computed by this lens pass"]
    assert stored_by(lens, [])[0] == "stored by a request that is not this chat's"


def test_the_notebook_widget_shows_the_lens_of_a_clicked_token(smollm2_llm):
    from playground.notebook import Playground
    from playground.notebook_lens import show_lens

    pg = Playground(smollm2_llm, max_tokens=12, temperature=0, refresh_interval=0)
    try:
        reply = pg.send("Name three colours.")
        panel = pg.lens_panel
        pg.logprob_view.clicked = {"index": 2, "n": 1}
        assert panel.lens is None                                   # the lens is off: a click only picks the token
        panel.toggle.value = True
        pg.logprob_view.clicked = {"index": 2, "n": 2}
        lens = panel.lens
        assert lens.position == len(reply.prompt_token_ids) + 2
        np.testing.assert_allclose(weights_drawn(panel.view.value), lens.heat(None, None), atol=1e-6)
        assert masses_drawn(panel.view.value) and '.kv-map .kv-cell[data-block="' in panel.view.value
        assert "stored by reply 1" in panel.view.value or "stored by a request" in panel.view.value
        panel.layer.value, panel.head.value = "layer 4", "head 1"    # redrawn from the lens held
        assert 'data-layer="4" data-head="1"' in panel.view.value
        np.testing.assert_allclose(weights_drawn(panel.view.value), lens.heat(4, 1), atol=1e-6)
        panel.view.clicked = {"position": 3, "n": 1}                # a click on the lens's text moves it there
        assert panel.lens.position == 3 and 'data-position="3"' in panel.view.value
        assert pg.attention_lens(10_000) is None
        assert re.search(r'lz-error">position must be an integer in \[0, \d+\]', panel.view.value)
        assert panel.lens.position == 3                              # the lens held stays below the error
        assert 'data-position="3"' in pg.picture_html()              # the saved notebook's picture shows it
        page = show_lens(smollm2_llm, lens.token_ids, 5, layer=1).data
        np.testing.assert_allclose(weights_drawn(page), smollm2_llm.attention_lens(list(lens.token_ids), 5).heat(1, None),
                                   atol=1e-6)
    finally:
        pg.close()


def test_the_panel_on_our_server_draws_the_servers_lens(smollm2_llm):
    """Remote mode on this project's server: the panel's lens comes through ``RemoteLLM`` (the server's
    ``/engine/attention_lens``), the same as in process; bad input is named by the server, in the panel."""
    from test_engine_client import serve

    from engine.client.http import RemoteLLM

    srv, url = serve(smollm2_llm)
    remote = monitor = None
    try:
        remote = RemoteLLM(url)
        monitor = EngineMonitor(remote, interval=0.1)
        panel = LensPanel(Handlers(remote, monitor, Limits()))
        assert panel.unavailable is None
        session = chat(panel, "Name three colours.", max_tokens=8)
        reply = session.tree.last_reply().reply
        ids = list(reply.prompt_token_ids) + reply.all_token_ids
        page, _, _ = panel.lens(session, reply.request_id, len(ids) - 2, "layer 2", None)
        np.testing.assert_allclose(weights_drawn(page), smollm2_llm.attention_lens(ids, len(ids) - 2).heat(2, None),
                                   atol=1e-5)
        bad = html.unescape(panel.lens(session, reply.request_id, len(ids) + 5, None, None)[0])
        assert re.search(r'lz-error">position must be an integer in \[0, \d+\]', bad)
    finally:
        if monitor is not None:
            monitor.close()
        if remote is not None:
            remote.shutdown()
        srv.should_exit = True


def test_the_named_api_refuses_another_visitors_request(smollm2_llm):
    """``/attention_lens`` over HTTP (gradio_client): its parameters named; a request id of another
    client's conversation is refused in the panel's HTML, and the engine takes no step."""
    import gradio_client

    from playground.app import build_app, launch

    demo = build_app(smollm2_llm)
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True)
    try:
        client = gradio_client.Client(url, verbose=False)
        info = client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/attention_lens"]
        assert [p["parameter_name"] for p in info["parameters"]] == ["request_id", "position", "layer", "head"]
        added = []
        unsubscribe = smollm2_llm.subscribe(lambda e: added.append(e.data) if e.kind == "request_added" else None)
        try:
            gradio_client.Client(url, verbose=False).predict("My secret word is pineapple.", api_name="/chat")
        finally:
            unsubscribe()
        theirs = next(d["request_id"] for d in added if str(d.get("request_id", "")).startswith("chat-"))
        steps = smollm2_llm.engine.step_count
        page = client.predict(theirs, 3, "all layers (mean)", "all heads (mean)", api_name="/attention_lens")[0]
        assert "not one of this tab" in page and "pineapple" not in page.lower()
        assert smollm2_llm.engine.step_count == steps
    finally:
        demo.close()
        demo.playground_monitor.close()
