"""The KV cache's event log (``engine/kv_events.py``): in a run that preempts, its counts equal the
engine's counters and its step events, every block allocated is freed once, and each event names
its cause."""

from __future__ import annotations

from collections import Counter

import pytest

from engine import LLM, SamplingParams
from tiny_models import make_tiny_model, tiny_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM", seed=3)


def test_counts_equal_the_engine_counters_in_a_run_that_preempts(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4, kv_cache_memory=14 * 2048)     # 14 blocks for ~64 wanted
    seen = []
    unsubscribe = llm.subscribe(seen.append)
    try:
        outs = llm.generate(tiny_prompts(8), GREEDY)
    finally:
        unsubscribe()
    log = llm.kv_events()
    events, counters = log["events"], log["counters"]
    assert log["dropped"] == 0 and log["next"] == len(events)
    kinds = Counter(e["kind"] for e in events)
    preempted = [e for e in seen if e.kind == "request_preempted"]
    removed = [b for e in seen if e.kind == "blocks_removed" for b in e.data["block_ids"]]
    assert kinds["preempt"] == counters["preemptions"] == len(preempted) > 0
    assert kinds["evict"] == counters["evictions"] == len(removed) > 0
    assert kinds["recompute"] == kinds["preempt"]              # every preempted request came back
    assert [e["request_id"] for e in events if e["kind"] == "preempt"] == [e.data["request_id"] for e in preempted]
    # every block a request took (new or shared) it gave back exactly once
    taken = Counter((e["request_id"], b) for e in events if e["kind"] == "allocate" for b in e["blocks"] + e["shared"])
    freed = Counter((e["request_id"], b) for e in events if e["kind"] == "free" for b in e["blocks"])
    assert taken == freed
    for e in events:
        assert e["cause"] and isinstance(e["step"], int)
        if e["kind"] == "preempt":
            assert f"{e['needed_by']} needed {e['needed_blocks']} block" in e["cause"]
        if e["kind"] == "evict":
            assert e["cause"].startswith(f"{e['request_id']} needed")
    # a reader asks only for what it has not seen
    tail = llm.kv_events(since=log["next"] - 3)
    assert [e["seq"] for e in tail["events"]] == [e["seq"] for e in events[-3:]]
    with pytest.raises(ValueError, match="non-negative integer"):
        llm.kv_events(since=-1)


def test_the_log_is_bounded_and_says_what_it_dropped(tiny_dir):
    from engine.kv_events import KVEventLog

    log = KVEventLog(maxlen=4)
    for i in range(10):
        log.add("allocate", f"r{i}", [i], f"r{i} needed 1 block for 1 token")
    out = log.since(0)
    assert [e["seq"] for e in out["events"]] == [6, 7, 8, 9] and out["dropped"] == 6 and out["next"] == 10
    assert log.since(8)["dropped"] == 0 and len(log.since(8)["events"]) == 2


def test_a_decode_inside_a_block_logs_nothing(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4)
    prompt = tiny_prompts(1, length=16, shared=0)[0]
    llm.generate(prompt, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    events = llm.kv_events()["events"]
    allocs = [e for e in events if e["kind"] == "allocate"]
    # 16 prompt tokens: 4 blocks at admission; 8 decoded tokens (the 9th is never written) need 2 more
    assert [len(e["blocks"]) for e in allocs] == [4, 1, 1]
    assert [e["kind"] for e in events] == ["allocate", "allocate", "allocate", "free"]
