"""The views of the sampler's pipeline (``playground/sampler_view.py``) and of where each token's K/V
came from (``playground/provenance_view.py``, ``playground/inside_views.py``): the counts a view
shows are the engine's own counters under chunked prefill, preemption and branching; the token a
pipeline view marks is in the sampler's kept set; names of other visitors' requests never show."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest

from engine import LLM, SamplingParams
from playground.chat import ChatSession, Reply, start_branch, stream_reply
from playground.provenance_view import batch_figure, block_source, provenance_html
from playground.sampler_view import reply_pipeline, sampler_pipeline_html
from test_app import handlers_on
from tiny_models import make_tiny_model, tiny_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM", seed=3)


def shown(html: str) -> dict[str, int]:
    """The counts a provenance view shows (its ``ps-counts`` line's data attributes) and the tokens it
    coloured per kind."""
    line = re.search(r'<div class="ps-counts"([^>]*)>', html).group(1)
    counts = {k: int(v) for k, v in re.findall(r'data-([a-z-]+)="(\d+)"', line)}
    for kind in ("cached", "prefill", "recompute"):
        counts[f"tokens-{kind}"] = len(re.findall(rf'class="ps-tok ps-{kind}[ "]', html))
    return counts


def view(out, name=lambda rid: "another visitor's request") -> str:
    texts = [f"t{t}" for t in out.prompt_token_ids]
    return provenance_html(out.provenance, texts, [f"r{t}" for t in out.outputs[0].token_ids], name=name)


def test_counts_shown_are_the_engines_under_chunked_prefill(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4, max_num_batched_tokens=7)
    outs = llm.generate(tiny_prompts(6), GREEDY)
    hits = 0
    for out in outs:
        c = shown(view(out))
        n = len(out.prompt_token_ids)
        assert c["cached"] == c["tokens-cached"] == out.num_cached_tokens
        assert c["prefill"] == c["tokens-prefill"] == n - out.num_cached_tokens
        assert c["reply"] == len(out.outputs[0].token_ids) and c["recompute"] == 0
        hits += c["cached"]
    assert hits == llm.engine.kv_cache_manager.stats.hits > 0
    assert any(shown(view(o))["chunks"] >= 2 for o in outs)


def test_counts_shown_under_preemption(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4, kv_cache_memory=14 * 2048)     # 14 blocks for ~64 wanted
    events = []
    unsubscribe = llm.subscribe(events.append)
    outs = llm.generate(tiny_prompts(8), GREEDY)
    unsubscribe()
    preempted = {e.data["request_id"] for e in events if e.kind == "request_preempted"}
    assert preempted
    counts = {o.request_id: shown(view(o)) for o in outs}
    assert {rid for rid, c in counts.items() if c["recompute"]} == preempted
    assert sum(c["cached"] for c in counts.values()) == llm.engine.kv_cache_manager.stats.hits
    for o in outs:      # a recomputed prompt position is drawn as recomputed, once
        c = counts[o.request_id]
        assert c["tokens-cached"] + c["tokens-prefill"] + c["tokens-recompute"] == len(o.prompt_token_ids)
        if o.request_id in preempted:
            assert c["tokens-recompute"] > 0


def test_a_branch_names_the_turn_that_stored_its_blocks(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4)
    prompt = tiny_prompts(1, length=18)[0]
    first = llm.generate(prompt, GREEDY)[0]
    branch = llm.generate({"prompt_token_ids": prompt["prompt_token_ids"] + first.outputs[0].token_ids[:3]},
                          GREEDY)[0]
    html = view(branch, name=lambda rid: "turn 1" if rid == first.request_id else "another visitor's request")
    c = shown(html)
    assert c["cached"] == c["tokens-cached"] == branch.num_cached_tokens == 20
    assert c["cached"] == llm.engine.kv_cache_manager.stats.hits
    assert "(stored by turn 1)" in html and html.count("computed by turn 1") == 20
    assert first.request_id not in html
    assert block_source(branch.provenance, 16, 20, lambda rid: "turn 1") == \
        "prefix-cache hit: its block was computed by turn 1"
    assert block_source(branch.provenance, 20, 21, str).startswith("computed in prefill chunk 1 at step")


def test_batch_figure_latency_and_who_shared_each_step(tiny_dir):
    from playground.monitor import EngineMonitor

    llm = LLM(model=tiny_dir, block_size=4, max_num_batched_tokens=7)
    monitor = EngineMonitor(llm, interval=0.05)
    try:
        outs = llm.generate(tiny_prompts(3), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        out = outs[0]
        batches = monitor.batches(t.step for t in out.provenance.reply)
    finally:
        monitor.close()
    assert set(batches) == {t.step for t in out.provenance.reply}
    names = {outs[1].request_id: "turn 2"}
    fig = batch_figure(out.provenance, batches, out.request_id, lambda rid: names.get(rid, "another visitor's request"))
    itl, decoding, prefilling = fig["data"]
    reply = out.provenance.reply
    assert list(itl["x"]) == list(range(1, len(reply)))
    np.testing.assert_allclose(itl["y"], [(batches[b.step][0] - batches[a.step][0]) * 1000
                                          for a, b in zip(reply, reply[1:])])
    assert [d + p for d, p in zip(decoding["y"], prefilling["y"])] == [t.batch_size for t in reply[1:]]
    text = " ".join(itl["customdata"])
    assert "turn 2" in text and "another visitor's request" in text
    assert not any(o.request_id in text for o in outs)


def click(index: int):
    return types.SimpleNamespace(_data={"index": index})


def test_the_pages_panels_on_a_chat_and_its_branch(smollm2_llm):
    from playground.inside_views import InsideViews

    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.8, min_p=0.02, seed=4,
                            repetition_penalty=1.2, logprobs=3, ignore_eos=True)
    # the engine is shared: another test may have stored this prompt's blocks, which the view rightly
    # names as not this chat's; start from an empty prefix cache so turn 1 stores them
    smollm2_llm.reset_prefix_cache()
    with handlers_on(smollm2_llm) as h:
        views, session = InsideViews(h), ChatSession()
        user = session.tree.add_user("Name a colour.")
        first = session.tree.add_reply(user.node_id, Reply(request_id=session.new_request_id("chat")))
        list(stream_reply(smollm2_llm, [{"role": "user", "content": "Name a colour."}], params, first.reply))
        reply = first.reply
        assert views.sampler(session, click(3)) is not None      # closed: skipped
        views.sampler_opened(session)
        for i in range(len(reply.token_ids)):
            html = views.sampler(session, click(i))
            assert f'data-token="{reply.token_ids[i]}"' in html and 'data-in-kept="true"' in html, i
            pipe = reply_pipeline(smollm2_llm, reply, i)
            assert reply.token_ids[i] in set(pipe.kept.tolist())
            kept = [int(k) for k in re.findall(r'class="sp-stage" data-stage="[a-z_]+" data-kept="(\d+)"', html)]
            assert kept == [s.kept.size for s in pipe.stages]
        html, plot = views.provenance(session)
        c = shown(html)
        assert c["cached"] == reply.num_cached_tokens and c["reply"] == len(reply.token_ids)
        assert c["tokens-cached"] + c["tokens-prefill"] == len(reply.prompt_token_ids)
        # a branch at token 4: the kept tokens are forced (no stages of their own), its prompt from the cache
        node = session.tree.add_reply(user.node_id, start_branch(reply, 4, reply.token_ids[4] ^ 1,
                                                                 session.new_request_id("chat"), ""))
        branch = node.reply
        list(stream_reply(smollm2_llm, {"prompt_token_ids": reply.prompt_token_ids + branch.prefix_token_ids},
                          params, branch))
        assert "was not sampled in this reply" in views.sampler(session, click(2))
        html = views.sampler(session, click(6))
        assert f'data-token="{branch.all_token_ids[6]}"' in html and 'data-in-kept="true"' in html
        html, _ = views.provenance(session)
        c = shown(html)
        assert c["cached"] == branch.num_cached_tokens > 0 and "stored by turn 1" in html
        assert c["tokens-cached"] + c["tokens-prefill"] == len(reply.prompt_token_ids) + 5
        assert reply.request_id not in html
    assert not smollm2_llm.snapshot().requests


def test_a_foreign_server_says_why_there_is_no_pipeline():
    from engine.client.openai_server import OpenAIServer

    server = object.__new__(OpenAIServer)
    server.server, server._ours = "llama.cpp's llama-server", False
    reply = Reply(request_id="r", prompt_token_ids=[1, 2, 3], token_ids=[4, 5], finished=True,
                  params=SamplingParams())
    with pytest.raises(ValueError, match="not available on llama.cpp's llama-server"):
        reply_pipeline(server, reply, 1)
    reply.params = None
    with pytest.raises(ValueError, match="sampling settings are not known"):
        reply_pipeline(server, reply, 1)


def test_the_pipeline_view_marks_a_token_the_last_stage_cut():
    from engine.sampler_pipeline import pipeline

    row = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0], np.float32)
    html = sampler_pipeline_html(pipeline(row, SamplingParams(temperature=1.0, top_k=2), token=4))
    assert 'data-in-kept="false"' in html and "cut here" in html
    html = sampler_pipeline_html(pipeline(row, SamplingParams(temperature=1.0, top_k=2), token=1))
    assert 'data-in-kept="true"' in html and "cut here" not in html


def test_the_block_inspector_says_what_computed_a_block_of_the_tabs_reply(tiny_dir):
    from playground.inspector import block_inspector_html

    llm = LLM(model=tiny_dir, block_size=4, max_num_batched_tokens=7)
    prompt = tiny_prompts(1, length=18)[0]
    first = llm.generate(prompt, GREEDY)[0]
    rid = "mine"
    events = []
    unsubscribe = llm.subscribe(events.append)
    stream = llm.stream({"prompt_token_ids": prompt["prompt_token_ids"] + first.outputs[0].token_ids[:3]},
                        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), request_id=rid)
    next(stream)                                       # running: its blocks are in the snapshot
    snap = llm.snapshot().to_dict()
    deltas = list(stream)
    unsubscribe()
    prov = deltas[-1].provenance
    table = next(r for r in snap["requests"] if r["request_id"] == rid)["block_table"]
    names = {first.request_id: "turn 1", rid: "turn 2"}
    html = block_inspector_html(snap, table[1], name=lambda r: names.get(r, r), provenance={rid: prov})
    assert "K/V computed" in html and "prefix-cache hit: its block was computed by turn 1" in html
    html = block_inspector_html(snap, table[5], name=lambda r: names.get(r, r), provenance={rid: prov})
    assert re.search(r"computed in prefill chunk \d+ at step \d+", html)
    assert "K/V computed" not in block_inspector_html(snap, table[1], name=str)     # without the record: no line
