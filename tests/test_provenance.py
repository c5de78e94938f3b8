"""Where every token's K/V came from (``engine/provenance.py``): the counts equal the engine's own
counters and step events under chunked prefill, preemption and branching."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tiny_models import make_tiny_model, tiny_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM", seed=3)


def run(llm, prompts, params=GREEDY):
    events = []
    unsubscribe = llm.subscribe(events.append)
    try:
        outs = llm.generate(prompts, params)
    finally:
        unsubscribe()
    return outs, events


def check_against_events(outs, events):
    steps = {e.step: e.data for e in events if e.kind == "step"}
    computed = {}                                   # (step, request) -> tokens the step computed for it
    for out in outs:
        prov = out.provenance
        for span in prov.spans:
            if span.kind != "cached":
                computed[(span.step, out.request_id)] = span.end - span.start
                data = steps[span.step]
                assert span.batch_size == data["batch_size"]
                if span.kind == "decode":
                    assert out.request_id in data["decode"] and span.end - span.start == 1
                else:
                    assert data["prefill"][out.request_id] == span.end - span.start
        assert len(prov.reply) == len(out.outputs[0].token_ids)
        for token in prov.reply:
            assert token.batch_size == steps[token.step]["batch_size"]
            assert token.decode == (out.request_id in steps[token.step]["decode"])
    for step, data in steps.items():                # every token every step computed is in some span
        ours = sum(n for (s, _), n in computed.items() if s == step)
        assert ours == data["num_tokens"]


def test_chunked_prefill_and_prefix_hits(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4, max_num_batched_tokens=7)
    outs, events = run(llm, tiny_prompts(6))
    check_against_events(outs, events)
    hits = 0
    for out in outs:
        prov, n = out.provenance, len(out.prompt_token_ids)
        cached = [s for s in prov.spans if s.kind == "cached"]
        assert sum(s.end - s.start for s in cached) == out.num_cached_tokens
        hits += out.num_cached_tokens
        prefill = [s for s in prov.spans if s.kind == "prefill"]
        assert [s.chunk for s in prefill] == list(range(len(prefill)))
        assert all(s.end - s.start <= 7 for s in prefill)
        # cached then prefill chunks cover the prompt once, in order; then one decode per later token
        covered = [(s.start, s.end) for s in cached + prefill]
        assert covered[0][0] == 0 and covered[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        assert prov.counts()["decode"] == len(out.outputs[0].token_ids) - 1
        assert [t.decode for t in prov.reply] == [False] + [True] * (len(prov.reply) - 1)
        assert all(src is not None for src in prov.sources(n))
    assert hits == llm.engine.kv_cache_manager.stats.hits > 0


def test_preemption_recomputes_and_counts_still_add_up(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4, kv_cache_memory=14 * 2048)     # 14 blocks for ~64 wanted
    outs, events = run(llm, tiny_prompts(8))
    check_against_events(outs, events)
    preempted = {e.data["request_id"] for e in events if e.kind == "request_preempted"}
    assert preempted
    recomputed = {o.request_id for o in outs if o.provenance.counts()["recompute"]}
    assert recomputed == preempted
    hits = sum(o.provenance.counts()["cached"] for o in outs)    # every admission, re-admissions included
    assert hits == llm.engine.kv_cache_manager.stats.hits


def test_a_branch_names_the_request_that_stored_its_blocks(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4)
    prompt = tiny_prompts(1, length=18)[0]
    first = llm.generate(prompt, GREEDY)[0]
    branch = llm.generate({"prompt_token_ids": prompt["prompt_token_ids"] + first.outputs[0].token_ids[:3]},
                          GREEDY)[0]
    cached = [s for s in branch.provenance.spans if s.kind == "cached"]
    assert len(cached) == 1 and cached[0].end == branch.num_cached_tokens == 20
    assert cached[0].stored_by == (first.request_id,) * 5
    assert llm.engine.kv_cache_manager.stats.hits == branch.num_cached_tokens


def test_the_finishing_delta_carries_it_and_it_crosses_the_wire(tiny_dir):
    from engine.client.wire import delta_from_dict, delta_to_dict

    llm = LLM(model=tiny_dir, block_size=4, max_num_batched_tokens=7)
    prompt = tiny_prompts(1, length=18)[0]
    deltas = list(llm.stream(prompt, GREEDY))
    assert all(d.provenance is None for d in deltas[:-1]) and deltas[-1].finished
    prov = deltas[-1].provenance
    assert prov.counts()["prefill"] == 18 and len(prov.reply) == GREEDY.max_tokens
    back = delta_from_dict(delta_to_dict(deltas[-1], with_prompt_ids=True)).provenance
    assert back == prov and back.spans[0].kind == "prefill"
