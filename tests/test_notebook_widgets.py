"""The Jupyter widgets (playground.notebook), driven from code on the real default model."""

import json
import os
import re
import threading
import time
from html import escape

import ipywidgets as widgets
import pytest
from conftest import unavailable

from engine import SamplingParams
from playground.chat import branch_prompt
from playground.clickable import CLICK_ESM
from playground.notebook import (DEFAULT_SYSTEM_PROMPT, Playground, show_blocks, show_logprobs, show_prefix_stats,
                                 show_prompt)

QUESTION = "What is the capital of France?"
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture
def pg(smollm2_llm):
    playground = Playground(smollm2_llm, max_tokens=16, temperature=0, refresh_interval=0)
    yield playground
    playground.close()


def _values(widget) -> list[tuple[str, str]]:
    """Record every value ``widget`` takes from now on, with the name of the thread that set it."""
    seen = []
    widget.observe(lambda change: seen.append((change["new"], threading.current_thread().name)), "value")
    return seen


def _legend_count(html: str, text: str) -> int:
    match = re.search(re.escape(text) + r" \((\d+)\)", html)
    return int(match.group(1)) if match else 0


def test_send_streams_the_reply_into_the_widgets(pg, smollm2_llm):
    block_map_before = pg.block_map.value
    block_maps, chats = _values(pg.block_map), _values(pg.chat)

    reply = pg.send(QUESTION)

    # the reply is the engine's greedy answer to the same conversation
    expected = smollm2_llm.chat([{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                 {"role": "user", "content": QUESTION}],
                                SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    assert reply.finished and reply.error is None
    assert reply.text == expected.text and reply.token_ids == expected.token_ids
    assert pg.messages == [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": reply.text}]

    # the chat grew token by token, from the streaming thread, then lost its cursor
    streaming = [v for v, thread in chats if "▌" in v]
    assert len(streaming) >= len(reply.token_ids) // 2
    assert all(thread == "playground-reply" for _, thread in chats)
    assert "▌" not in pg.chat.value and "Paris" in pg.chat.value

    # the block map changed while the reply streamed: this chat's request owned blocks
    assert pg.block_map.value != block_map_before
    live = [v for v, _ in block_maps if 'data-kind="owner"' in v and "this chat" in v]
    assert live, "no block map drawn while the request held blocks"
    assert _legend_count(pg.block_map.value, "cached, reusable") > 0   # and its full blocks stay cached

    # the logprob view shows every token of the reply, with alternatives on hover
    assert pg.logprob_view.value.count('class="lp-tok') == len(reply.token_ids)
    assert 'class="lp-tip"' in pg.logprob_view.value and "click it to branch" in pg.logprob_view.value
    assert f"{len(reply.token_ids)} tokens" in pg.status.value


def test_a_second_turn_reuses_the_first_turns_blocks(pg):
    first = pg.send(QUESTION)
    second = pg.send("And of Italy?")               # right after the first: no "still streaming" error
    assert second.num_prompt_tokens > first.num_prompt_tokens + len(first.token_ids)
    assert second.num_cached_tokens >= 16 and second.num_cached_tokens % 16 == 0
    assert len(pg.messages) == 4
    panel = pg.prefix_panel.value
    assert f'<b class="cached-tokens">{second.num_cached_tokens}</b> of {second.num_prompt_tokens}' in panel
    assert panel.count("<rect") >= 2                 # a hit-rate bar per turn


def test_stop_aborts_a_streaming_reply_and_frees_its_blocks(pg, smollm2_llm):
    pg.max_tokens.value = 400
    pending = pg.send("Tell me a long story about a dragon and a knight.", wait=False)
    deadline = time.monotonic() + 60
    while (pg.reply is None or len(pg.reply.token_ids) < 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(RuntimeError, match="still streaming"):
        pg.send("another one")
    assert pg.send_button.disabled and not pg.stop_button.disabled
    assert pg.stop()
    reply = pending.result(timeout=60)
    assert reply.finish_reason == "abort" and 2 <= len(reply.token_ids) < 400
    assert "(stopped)" in pg.chat.value
    assert not smollm2_llm.snapshot().requests     # the aborted request left the engine
    assert not pg.send_button.disabled and pg.stop_button.disabled


def test_the_send_button_sends_the_input_box(pg):
    pg.input.value = QUESTION
    pg.send_button.click()                         # returns at once: the reply streams in the background
    assert pg.input.value == ""
    deadline = time.monotonic() + 60
    while len(pg.messages) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pg.messages[0]["content"] == QUESTION and pg.messages[1]["content"]
    assert "tokens" in pg.status.value
    pg.clear()
    assert pg.messages == [] and "Type a message" in pg.chat.value
    assert pg.status.value == "ready"            # bug 9: the last reply's stats stayed after Clear


def test_the_app_is_plain_widgets_without_output_capture(pg):
    def walk(w):
        yield w
        for child in getattr(w, "children", ()):
            yield from walk(child)

    everything = list(walk(pg.widget))
    assert not any(isinstance(w, widgets.Output) for w in everything)
    for panel in (pg.chat, pg.block_map, pg.prefix_panel, pg.logprob_view, pg.engine_panel, pg.input):
        assert panel in everything
    assert "application/vnd.jupyter.widget-view+json" in pg._repr_mimebundle_()


def test_sliders_show_their_whole_label_and_share_the_row(pg):
    """Bug 9: JupyterLab gave the sliders a fixed 80 px label column and a ~40 px track."""
    for knob in (pg.max_tokens, pg.temperature, pg.top_p, pg.logprobs, pg.seed):
        assert knob.style.description_width == "initial"
        assert knob.layout.flex == "1 1 0" and knob.layout.min_width == "220px"


def test_logprob_tooltips_have_room_and_ignore_notebook_table_css(smollm2_llm):
    """Bug 9: tooltips were clipped by the output area and striped by JupyterLab's table CSS."""
    out = smollm2_llm.generate("Hi", SamplingParams(max_tokens=3, logprobs=3))[0]
    html = show_logprobs(out).data
    assert 'class="lp-room" style="padding-bottom:12em"' in html
    assert ".lp-tip tr:nth-child(odd)" in html and "background:transparent!important" in html


def test_show_functions_render_snapshots_and_outputs(smollm2_llm):
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3)
    outs = smollm2_llm.generate(["The capital of France is", "The capital of France is a city"], params)

    blocks = show_blocks(smollm2_llm).data
    assert 'class="pg-panel kv-map"' in blocks
    assert show_blocks(smollm2_llm.snapshot()).data.count("kv-cell") == blocks.count("kv-cell")

    lp = show_logprobs(outs[0]).data
    assert lp.count('class="lp-tok') == len(outs[0].outputs[0].token_ids)
    with pytest.raises(ValueError, match="logprobs"):
        show_logprobs(smollm2_llm.generate("Hi", SamplingParams(max_tokens=2))[0])

    stats = show_prefix_stats(smollm2_llm, outs).data
    last = outs[-1]
    assert f'<b class="cached-tokens">{last.num_cached_tokens}</b> of {len(last.prompt_token_ids)}' in stats
    assert 'data-stat="hit tokens"' in stats


def test_the_prompt_view_scores_the_last_replys_prompt(pg, smollm2_llm):
    with pytest.raises(ValueError, match="send a message first"):
        pg.score_prompt()
    reply = pg.send("The capital of Italy is banana. Is that right?")
    pg.prompt_button.click()
    html = pg.prompt_view.value
    assert len(re.findall(r'class="lp-tok[^"]*" data-index=', html)) == len(reply.prompt_token_ids)
    assert re.search(r'class="pv-worst" data-index="\d+"> banana</span>', html)
    # The same renderer serves the one-shot view, from text or chat messages.
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                {"role": "user", "content": "The capital of Italy is banana. Is that right?"}]
    assert show_prompt(smollm2_llm, messages).data == html
    pg.clear()
    assert "lp-tok" not in pg.prompt_view.value


def test_clicking_a_block_shows_what_it_holds(pg, smollm2_llm):
    pg.max_tokens.value = 200
    pending = pg.send(QUESTION, wait=False)
    deadline = time.monotonic() + 60
    while (pg.reply is None or len(pg.reply.token_ids) < 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    rid = pg.reply.request_id
    first = next(b for b in smollm2_llm.snapshot().blocks if rid in b.owners and b.token_range[0] == 0)
    pg.block_map.clicked = {"block": first.block_id, "n": 1}       # what the front end sends on a click
    html = pg.inspector.value
    pg.stop()
    pending.result(timeout=60)
    assert f'data-block="{first.block_id}"' in html and "this chat" in html
    # this chat's own tokens are shown: the first block starts with the chat template and system prompt
    text = smollm2_llm.get_tokenizer().decode(pg.reply.prompt_token_ids[:16])
    assert "Its tokens" in html and escape(text) in html
    pg.block_map.clicked = {"block": 10_000, "n": 2}
    assert "No block 10000" in pg.inspector.value


def test_clicking_a_token_branches_the_reply(pg, smollm2_llm):
    first = pg.send(QUESTION)
    pg.logprob_view.clicked = {"index": 1, "n": 1}                  # a click on the reply's second token
    choices = [value for _, value in pg.branch_choice.options]
    assert choices and first.token_ids[1] not in choices
    assert pg.branch_row.layout.display == "flex" and not pg.branch_button.disabled
    assert 'lp-selected" data-index="1"' in pg.logprob_view.value
    pg.branch_choice.value = choices[0]
    pg.branch_button.click()
    deadline = time.monotonic() + 60
    while (pg.reply is first or not pg.reply.finished) and time.monotonic() < deadline:
        time.sleep(0.05)
    branched = pg.reply
    assert branched.all_token_ids[:2] == [first.token_ids[0], choices[0]]
    # the engine's greedy continuation of the same tokens
    expected = smollm2_llm.generate({"prompt_token_ids": branch_prompt(first, 1, choices[0])},
                                    SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    assert branched.token_ids == expected.token_ids
    assert pg.replies[-1] is first and len(pg.messages) == 2 and pg.messages[1]["content"] == branched.text
    assert branched.text in pg.chat.value.replace("&#x27;", "'") or escape(branched.text) in pg.chat.value
    with pytest.raises(ValueError, match="token_id must be a token id"):
        pg.branch(1, -3)


def test_the_app_leaves_a_picture_of_its_last_state(pg):
    bundle = pg._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"].startswith("Playground(") and "VBox" not in bundle["text/plain"]
    reply = pg.send(QUESTION)
    picture = pg._repr_mimebundle_()["text/html"]
    assert 'class="pg-panel kv-map"' in picture and picture.count("kv-cell") >= 64
    assert escape(reply.text) in picture and 'class="lp-tok' in picture
    pg.close()                                                      # closed: the picture alone
    closed = pg._bundle(live=False)
    assert "application/vnd.jupyter.widget-view+json" not in closed and "kv-map" in closed["text/html"]


@pytest.mark.browser
def test_the_front_end_module_reports_clicks(tmp_path):
    """The widget's ES module in Chromium, given a model as anywidget passes it (``get``, ``set``,
    ``save_changes``, ``on``: https://anywidget.dev/en/afm/): clicks on a block and on a token."""
    from playwright.sync_api import sync_playwright

    from playground import render

    html = render.block_map_html({"blocks": [{"block_id": 0, "state": "free", "ref_cnt": 0, "owners": []},
                                             {"block_id": 1, "state": "used", "ref_cnt": 1, "owners": ["r"]}],
                                  "requests": [], "num_blocks": 2, "block_size": 16})
    html += render.logprob_html([{"index": 0, "token_id": 5, "text": "Hi", "prob": 0.5, "alternatives": []}])
    (tmp_path / "widget.js").write_text(CLICK_ESM)
    (tmp_path / "page.html").write_text(
        "<div id=el></div><script type=module>import w from './widget.js';"
        "const state = {value: " + json.dumps(html) + ", clicked: {}}; window.sent = [];"
        "const model = {get: (k) => state[k], set: (k, v) => { state[k] = v; }, on: () => {},"
        " save_changes: () => window.sent.push(state.clicked)};"
        "w.render({model, el: document.getElementById('el')}); window.ready = true;</script>")
    if not os.path.exists(CHROMIUM):
        unavailable(f"no {CHROMIUM}: install Debian's chromium (apt-get install -y chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox",
                                                                    "--allow-file-access-from-files"])
        try:
            page = browser.new_page()
            page.goto((tmp_path / "page.html").as_uri())
            page.wait_for_function("window.ready === true")
            page.click('.kv-cell[data-block="1"]')
            page.click('.lp-tok[data-index="0"]', position={"x": 2, "y": 2})
            page.click('.kv-cell[data-block="1"]')
            sent = page.evaluate("window.sent")
        finally:
            browser.close()
    assert sent == [{"block": 1, "n": 1}, {"index": 0, "n": 2}, {"block": 1, "n": 3}]


def test_a_clicked_token_shows_its_sampler_stages_and_the_reply_its_kv_sources(pg, smollm2_llm):
    pg.system_prompt.value = f"You answer in one line. Session {time.time_ns()}."     # no blocks cached before
    first = pg.send(QUESTION)
    second = pg.send("And of Italy?")
    counts = re.search(r'class="ps-counts" data-cached="(\d+)"', pg.provenance_view.value)
    assert counts and int(counts.group(1)) == second.num_cached_tokens > 0     # the first turn's blocks
    assert "stored by reply 1" in pg.provenance_view.value and first.request_id not in pg.provenance_view.value
    assert pg.batch_chart is not None and list(pg.batch_chart.data[0].x) == list(range(1, len(second.token_ids)))
    pg.logprob_view.clicked = {"index": 2, "n": 1}
    assert f'data-token="{second.token_ids[2]}"' in pg.sampler_view.value
    assert 'data-in-kept="true"' in pg.sampler_view.value and 'data-stage="greedy"' in pg.sampler_view.value
    pipe = pg.sampler_pipeline(2)
    assert pipe.kept.tolist() == [second.token_ids[2]]
    assert "Sampler pipeline" in pg.picture_html()
    pg.clear()
    assert "ps-counts" not in pg.provenance_view.value and "sp-stage" not in pg.sampler_view.value
