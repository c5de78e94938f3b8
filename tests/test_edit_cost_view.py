"""The edit-cost panel and the preemption replay on a tiny engine (``playground/edit_cost_view.py``,
``playground/replay_view.py``): the estimate shown while an edit is typed equals the prefix hits of the
reply the edit then gets, and the replay's counts equal the engine's counters in a run that preempts."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams
from playground.chat import ChatSession, Reply, stream_reply
from playground.edit_cost_view import EDIT_COST_EMPTY, EditCost, edit_cost_html
from playground.inputs import Limits
from playground.replay_view import Replay, held_after, replay_figure
from tiny_models import make_tiny_model, tiny_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM", seed=3)


def handlers(llm):
    tok = llm.get_tokenizer()
    return SimpleNamespace(llm=llm, tokenizer=tok, limits=Limits(), default_mode="chat", vocab_size=tok.vocab_size)


def reply_to(llm, session, node, prompt):
    for _ in stream_reply(llm, prompt, GREEDY, node.reply):
        pass
    return node.reply


def headline(html):
    cached, total, computed = re.search(r"([\d,]+) of ([\d,]+) prompt tokens from the cache, ([\d,]+) to compute",
                                        html).groups()
    return int(cached.replace(",", "")), int(total.replace(",", "")), int(computed.replace(",", ""))


def test_an_edit_typed_shows_what_its_reply_then_reads_from_the_cache(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4)
    cost, session = EditCost(handlers(llm)), ChatSession()
    system = "You answer in one word, please, always."
    user = session.tree.add_user("The quick brown fox jumps over the lazy dog")
    node = session.tree.add_reply(user.node_id, Reply(request_id="r1"))
    reply_to(llm, session, node, [{"role": "system", "content": system}] + session.tree.messages_before(node.node_id))
    # the page's bridge: {"index": path index of the message, "value": the edit box's text}
    typed = SimpleNamespace(_data={"index": 0, "value": "The quick brown cat jumps over the lazy dog"})
    html = cost.editing(session, system, "chat", typed)
    cached, total, computed = headline(html)
    assert 0 < cached < total and cached + computed == total and "Copied: none" in html
    # the edit sent as Revise.edit sends it: its reply's prefix hits are the estimate's cached tokens
    edited = session.tree.edit_user(user.node_id, typed._data["value"])
    node = session.tree.add_reply(edited.node_id, Reply(request_id="r2"))
    reply = reply_to(llm, session, node, [{"role": "system", "content": system}]
                     + session.tree.messages_before(node.node_id))
    assert len(reply.prompt_token_ids) == total and reply.num_cached_tokens == cached
    after = cost.after(session)
    assert "<th>actual</th>" in after and f'<td class="ok">{cached:,} tokens</td>' in after
    assert reply.prefill_s is not None and reply.prefill_s > 0
    # nothing to estimate: the hint; the engine's refusal is named in the panel
    assert cost.editing(session, system, "chat", SimpleNamespace(_data={"index": 1, "value": "x"})) == EDIT_COST_EMPTY


def test_a_branch_picked_is_an_exact_prefix_of_the_cache(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4)
    cost, session = EditCost(handlers(llm)), ChatSession()
    user = session.tree.add_user("Count: one two three four five six")
    node = session.tree.add_reply(user.node_id, Reply(request_id="r1"))
    reply = reply_to(llm, session, node, session.tree.messages_before(node.node_id))
    forced = (reply.token_ids[3] + 1) % 256          # any other token of the tiny vocabulary
    html = cost.branching(session, 3, forced)
    cached, total, _ = headline(html)
    p = len(reply.prompt_token_ids)
    assert total == p + 4 and cached == 4 * ((p + 3) // 4)
    from playground.chat import branch_prompt

    out = llm.generate({"prompt_token_ids": branch_prompt(reply, 3, forced)}, GREEDY)[0]
    assert out.num_cached_tokens == cached
    assert cost.branching(session, None, None) == EDIT_COST_EMPTY


def test_the_panel_marks_an_actual_that_differs():
    est = {"num_tokens": 10, "num_cached_tokens": 8, "num_computed_tokens": 2, "block_size": 4,
           "shared_block_ids": (3, 5), "live_block_ids": (5,), "new_blocks": 1, "copied_blocks": 0,
           "partial_tail_tokens": 2, "recomputed_cached_tokens": 0, "evicts_blocks": 1, "fits": True,
           "num_chunks": 1, "prefill_tokens_per_s": 1000.0, "rate_samples": 3, "expected_prefill_s": 0.002}
    html = edit_cost_html(est, {"cached": 4, "computed": 6, "prefill_s": 0.01})
    assert '<td class="off">4 tokens</td>' in html and "≈ 2 ms at 1,000 tok/s" in html
    assert 'class="ec-b shared live"' in html and "evict 1 cached block" in html


def test_the_replay_counts_equal_the_engine_counters_in_a_run_that_preempts(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4, kv_cache_memory=14 * 2048)
    llm.generate(tiny_prompts(8), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    replay, session = Replay(llm), ChatSession()
    figure, slider, state, summary = replay.load(session)
    log = llm.kv_events()
    counters = log["counters"]
    assert counters["preemptions"] > 0 and counters["evictions"] > 0
    import json

    fig = json.loads(figure.plot)
    per_kind = {t["meta"]: len(t["x"]) for t in fig["data"] if t["meta"] != "held"}
    assert per_kind["preempt"] == counters["preemptions"] and per_kind["evict"] == counters["evictions"]
    assert f"{counters['preemptions']} preemptions, {counters['evictions']} evictions" in summary
    assert held_after(log["events"])[-1] == {}              # every block given back at the end
    at = next(i for i, e in enumerate(log["events"]) if e["kind"] == "preempt")
    fig, state = replay.scrub(session, at)
    assert log["events"][at]["cause"] in state.replace("&#x27;", "'") and "preempt" in state
    assert json.loads(fig.plot)["layout"]["shapes"][0]["x0"] == log["events"][at]["seq"]
    assert replay_figure({"events": [], "counters": {}})["data"][0]["x"] == []


def test_in_jupyter_the_estimate_displays_itself_and_the_replay_scrubs(tiny_dir):
    from playground.notebook_inside_kv import ReplayWidget, show_edit_cost

    llm = LLM(model=tiny_dir, block_size=4, kv_cache_memory=14 * 2048)
    prompts = tiny_prompts(8)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    ids = prompts[0]["prompt_token_ids"]
    est = llm.estimate_prefill(ids)
    assert est._repr_html_() == edit_cost_html(est, title="Sending this prompt")
    assert f"{est.num_cached_tokens} of {len(ids)} prompt tokens" in show_edit_cost(llm, ids).data
    widget = ReplayWidget(llm)
    events = llm.kv_events()["events"]
    assert widget.slider.max == widget.slider.value == len(events) - 1
    at = next(i for i, e in enumerate(events) if e["kind"] == "preempt")
    widget.slider.value = at
    assert "preempt" in widget.state.value and widget.figure.layout.shapes[0].x0 == events[at]["seq"]
    assert sum(len(t.x) for t in widget.figure.data if t.meta == "preempt") == llm.kv_events()["counters"]["preemptions"]
