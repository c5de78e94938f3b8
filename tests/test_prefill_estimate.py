"""What a prompt will cost before it is sent (``engine/prefill_estimate.py``): the estimate's cached
tokens equal the request's prefix hits once it is sent -- a fresh prompt, an exact repeat, an edit in
the middle, under chunked prefill -- and asking for it changes nothing in the cache."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tiny_models import make_tiny_model, tiny_prompts

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM", seed=3)


def cache_state(llm):
    """Everything an estimate must leave alone: each block's refs and hash, the LRU order, the counters."""
    kv = llm.engine.kv_cache_manager
    return ([(b.block_id, b.ref_cnt, b.block_hash) for b in kv.blocks], list(kv.pool._free),
            (kv.stats.queries, kv.stats.hits), kv.log.since(0)["next"], dict(kv.req_to_blocks))


def sent(llm, ids):
    """Estimate, send, and return (estimate, the request's output)."""
    before = cache_state(llm)
    est = llm.estimate_prefill(ids)
    assert cache_state(llm) == before
    out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    return est, out


@pytest.mark.parametrize("chunk", [None, 5])
def test_estimate_equals_the_hits_fresh_repeat_and_edit(tiny_dir, chunk):
    llm = LLM(model=tiny_dir, block_size=4, **({"max_num_batched_tokens": chunk} if chunk else {}))
    ids = tiny_prompts(1, length=22)[0]["prompt_token_ids"]

    est, out = sent(llm, ids)                       # fresh: nothing cached
    assert est.num_cached_tokens == out.num_cached_tokens == 0
    assert est.num_computed_tokens == 22 and est.new_blocks == 6 and est.partial_tail_tokens == 2
    assert est.shared_block_ids == () and est.copied_blocks == 0
    assert est.rate_samples == 0 and est.expected_prefill_s is None      # nothing measured yet
    if chunk:
        assert est.num_chunks == 5

    est, out = sent(llm, ids)                       # exact repeat: every full block but the last token's
    repeat = est
    assert est.num_cached_tokens == out.num_cached_tokens == 20
    assert len(est.shared_block_ids) == 5 and est.new_blocks == 1 and est.num_computed_tokens == 2
    assert est.prefill_tokens_per_s > 0 and est.expected_prefill_s == pytest.approx(2 / est.prefill_tokens_per_s)

    edited = ids[:9] + [(ids[9] + 1) % 64 or 7] + ids[10:]      # an edit in the middle (block 2)
    est, out = sent(llm, edited)
    assert est.num_cached_tokens == out.num_cached_tokens == 8
    assert est.shared_block_ids == repeat.shared_block_ids[:2] and est.num_computed_tokens == 14

    aligned = ids[:20]                              # ends on a block: the last block is computed again
    est, out = sent(llm, aligned)
    assert est.num_cached_tokens == out.num_cached_tokens == 16
    assert est.recomputed_cached_tokens == 4 and est.partial_tail_tokens == 0
    assert llm.engine.kv_cache_manager.stats.hits == 20 + 8 + 16


def test_live_blocks_and_evictions_are_named(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4, kv_cache_memory=12 * 2048)     # 12 blocks
    a, b = tiny_prompts(2, length=20, shared=0, seed=5)
    llm.generate(a, GREEDY)                         # a's 5 full blocks stay cached (ref 0)
    est = llm.estimate_prefill(a["prompt_token_ids"])
    assert est.live_block_ids == () and len(est.shared_block_ids) == 4 and est.fits
    # b needs 6 fresh blocks; the LRU front holds never-hashed blocks first, then a's cached ones
    free_plain = sum(1 for blk in llm.engine.kv_cache_manager.pool._free.values() if blk.block_hash is None)
    est_b = llm.estimate_prefill(b["prompt_token_ids"])
    assert est_b.evicts_blocks == max(0, est_b.new_blocks - free_plain)
    evictions = llm.engine.kv_cache_manager.pool.num_evictions
    llm.generate(b, GREEDY)
    assert llm.engine.kv_cache_manager.pool.num_evictions - evictions >= est_b.evicts_blocks


def test_bad_input_is_named(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4)
    for bad, words in (([], "empty"), ("abc", "list of token ids"), ([1, -2], "integers in"),
                       ([1, True], "integers in"), (list(range(5)) * 1000, "max_model_len")):
        with pytest.raises(ValueError, match=words):
            llm.estimate_prefill(bad)


def test_every_transport_gives_the_same_estimate_and_log(tiny_dir):
    """In process, in the engine's own process (``LLMProcess``) and over HTTP (``RemoteLLM`` on the
    server's ``/engine`` routes); a foreign server's client says why it cannot."""
    import httpx

    from engine import LLMProcess
    from engine.client.http import RemoteLLM
    from engine.client.openai_server import OpenAIServer
    from test_engine_client import serve

    ids = tiny_prompts(1, length=22)[0]["prompt_token_ids"]
    llm = LLM(model=tiny_dir, block_size=4)
    llm.generate({"prompt_token_ids": ids}, GREEDY)
    srv, url = serve(llm)
    remote = RemoteLLM(url)
    try:
        here, there = llm.estimate_prefill(ids), remote.estimate_prefill(ids)
        assert there == here and here.num_cached_tokens == 20
        assert remote.kv_events(since=1) == llm.kv_events(since=1)
        with pytest.raises(ValueError, match="token_ids is empty"):
            remote.estimate_prefill([])
        answer = httpx.get(f"{url}/engine/kv_events?since=x")
        assert answer.status_code == 400 and "since must be a non-negative integer" in answer.text
        foreign = OpenAIServer(url)
        try:
            with pytest.raises(NotImplementedError, match="prefix-cache hit counts"):
                foreign.estimate_prefill(ids)
            with pytest.raises(NotImplementedError, match="not each allocation"):
                foreign.kv_events()
        finally:
            foreign.shutdown()
    finally:
        remote.shutdown()
        srv.should_exit = True
    child = LLMProcess(model=tiny_dir, block_size=4)
    try:
        child.generate({"prompt_token_ids": ids}, GREEDY)
        est = child.estimate_prefill(ids)          # another engine: its own measured rate
        same = ("prefill_tokens_per_s", "expected_prefill_s")
        assert {k: v for k, v in est.to_dict().items() if k not in same} == \
            {k: v for k, v in here.to_dict().items() if k not in same}
        assert est.prefill_tokens_per_s > 0
        assert [e["kind"] for e in child.kv_events()["events"]] == [e["kind"] for e in llm.kv_events()["events"]]
    finally:
        child.shutdown()

