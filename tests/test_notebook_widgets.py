"""The Jupyter widgets (playground.notebook), driven from code on the real default model."""

import re
import threading
import time

import ipywidgets as widgets
import pytest

from engine import SamplingParams
from playground.notebook import (DEFAULT_SYSTEM_PROMPT, Playground, show_blocks, show_logprobs, show_prefix_stats,
                                 show_prompt)

QUESTION = "What is the capital of France?"


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
    assert 'class="lp-tip"' in pg.logprob_view.value and "click it to branch" not in pg.logprob_view.value
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
