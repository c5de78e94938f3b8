"""The public API on the real default model: chat, streaming, abort, errors, snapshots."""

import json
import threading

import pytest

from engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0)


def test_factual_chat_answer(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")
    assert out.metrics.ttft is not None and out.metrics.ttft > 0
    assert out.metrics.num_output_tokens == len(out.outputs[0].token_ids)
    assert out.metrics.tpot is not None and 0 < out.metrics.tpot < 10


def test_second_turn_hits_prefix_cache(smollm2_llm):
    conv = [{"role": "system", "content": "You are a terse assistant who answers in one sentence."},
            {"role": "user", "content": "Name a color."}]
    first = smollm2_llm.chat(conv, GREEDY)[0]
    conv += [{"role": "assistant", "content": first.outputs[0].text}, {"role": "user", "content": "Another one."}]
    second = smollm2_llm.chat(conv, GREEDY)[0]
    bs = smollm2_llm.config.block_size
    assert second.num_cached_tokens >= (len(first.prompt_token_ids) // bs) * bs - bs
    assert second.num_cached_tokens % bs == 0 and second.num_cached_tokens > 0


def test_stream_matches_generate_and_logprobs(smollm2_llm):
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    msgs = [{"role": "user", "content": "Count from one to five."}]
    deltas = list(smollm2_llm.stream(msgs, params))
    full = smollm2_llm.chat(msgs, params)[0].outputs[0]
    assert "".join(d.text for d in deltas) == full.text
    assert sum((d.token_ids for d in deltas), []) == full.token_ids
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    for lp, tok in zip(full.logprobs, full.token_ids):
        assert tok in lp and lp[tok].rank == 1 and len(lp) == 3
        assert max(x.logprob for x in lp.values()) == lp[tok].logprob


def test_seeded_sampling_is_reproducible(smollm2_llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=123)
    a = smollm2_llm.generate("Once upon a time", p)[0].outputs[0].token_ids
    b = smollm2_llm.generate("Once upon a time", p)[0].outputs[0].token_ids
    c = smollm2_llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=1.0, seed=7))[0]
    assert a == b and c.outputs[0].token_ids != a


def test_stop_string_cuts_output(smollm2_llm):
    base = smollm2_llm.chat([{"role": "user", "content": "List three fruits."}],
                            SamplingParams(max_tokens=24, temperature=0))[0].outputs[0].text
    stop = base.split()[2]
    out = smollm2_llm.chat([{"role": "user", "content": "List three fruits."}],
                           SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base[: base.index(stop)]


def test_closing_a_stream_aborts_and_frees_blocks(smollm2_llm):
    stream = smollm2_llm.stream("Write a long story about the sea.", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    next(stream)
    used = [b for b in smollm2_llm.snapshot().blocks if b.state == "used"]
    assert used
    stream.close()
    snap = smollm2_llm.snapshot()
    assert not snap.requests and all(b.ref_cnt == 0 for b in snap.blocks)


def test_concurrent_streams_are_batched(smollm2_llm):
    sizes = []
    unsubscribe = smollm2_llm.subscribe(lambda e: sizes.append(e.data["batch_size"]) if e.kind == "step" else None)
    results = {}

    def worker(i):
        results[i] = "".join(d.text for d in smollm2_llm.stream(f"Fact {i}:", SamplingParams(max_tokens=12, temperature=0)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    unsubscribe()
    assert len(results) == 4 and all(results.values())
    assert max(sizes) > 1


@pytest.mark.parametrize("call,message", [
    (lambda llm: llm.generate("x" * 1, SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda llm: llm.generate({"prompt_token_ids": list(range(10)) * 1000}, GREEDY), "max_model_len"),
    (lambda llm: llm.generate({"prompt_token_ids": [10**9]}, GREEDY), "prompt_token_ids"),
    (lambda llm: llm.generate({"prompt_token_ids": []}, GREEDY), "empty"),
    (lambda llm: llm.generate(42, GREEDY), "prompt must be"),
    (lambda llm: llm.generate("hi", {"max_tokens": 3}), "SamplingParams"),
])
def test_bad_requests_raise_and_engine_keeps_serving(smollm2_llm, call, message):
    with pytest.raises(ValueError, match=message):
        call(smollm2_llm)
    assert not smollm2_llm.snapshot().requests
    out = smollm2_llm.generate("The sky is", SamplingParams(max_tokens=2, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("kwargs,message", [
    ({"model": "/no/such/model.gguf"}, "zoo"),
    ({"model": "smollm2-135m-instruct", "block_size": 0}, "block_size"),
    ({"model": "smollm2-135m-instruct", "model_impl": "fastest"}, "model_impl"),
    ({"model": "smollm2-135m-instruct", "kv_cache_memory": -1}, "kv_cache_memory"),
    ({"model": "smollm2-135m-instruct", "max_num_seqz": 2}, "max_num_seqs"),
])
def test_bad_engine_arguments(kwargs, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        LLM(**kwargs)


def test_unsupported_architecture_lists_supported(tmp_path):
    from tiny_models import make_tiny_model

    d = make_tiny_model(str(tmp_path / "m"))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(model=d, model_impl="native")


def test_snapshot_is_json_and_consistent(smollm2_llm):
    events = []
    unsubscribe = smollm2_llm.subscribe(events.append)
    stream = smollm2_llm.stream("Tell me about owls.", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    next(stream)
    snap = smollm2_llm.snapshot()
    stream.close()
    unsubscribe()
    d = json.loads(json.dumps(snap.to_dict()))
    assert d["num_blocks"] == len(d["blocks"]) and d["model_impl"] == "native"
    (req,) = d["requests"]
    assert req["status"] == "running" and req["block_table"]
    for bid in req["block_table"]:
        assert req["request_id"] in d["blocks"][bid]["owners"] and d["blocks"][bid]["state"] == "used"
    kinds = {e.kind for e in events}
    assert {"request_added", "request_started", "step", "request_finished"} <= kinds
    assert d["last_step"]["batch_size"] == 1


def test_snapshots_share_the_blockinfo_of_unchanged_blocks(smollm2_llm):
    """The map is redrawn several times a second while requests run, and between two snapshots
    only the blocks they wrote to change: a snapshot keeps the ``BlockInfo`` object of every block
    that did not change (views find the changed ones by identity), and is equal to a snapshot
    built from scratch."""
    from engine.snapshot import take_snapshot

    engine = smollm2_llm.engine
    stream = smollm2_llm.stream("Tell me about owls and the night.",
                                SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    pairs = []
    for _ in stream:
        with smollm2_llm._lock:
            snap = engine.snapshot()
            fresh = take_snapshot(step=engine.step_count, model=engine.model_name, model_impl=engine.model_impl,
                                  device=engine.device, attention_backend=engine.attention_backend,
                                  kv_cache_manager=engine.kv_cache_manager,
                                  requests=list(engine.scheduler.running) + list(engine.scheduler.waiting),
                                  last_step=engine.last_step, decode_path=engine.runner.decode_path)
        assert snap == fresh
        pairs.append(snap)
    kept = changed = 0
    for before, after in zip(pairs, pairs[1:]):
        for a, b in zip(before.blocks, after.blocks):
            if a is b:
                kept += 1
            elif a != b:
                changed += 1
            else:
                raise AssertionError(f"block {a.block_id} did not change but got a new BlockInfo")
    assert changed >= len(pairs) - 1 and kept > 10 * changed     # each step writes one block of hundreds


def test_submit_hands_the_deltas_of_a_stream_to_a_callback(smollm2_llm, caplog):
    """``LLM.submit``: the deltas ``stream`` would yield, in order, to ``on_delta``; a callback that
    raises is logged and the engine goes on serving (it runs on the engine's thread)."""
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    streamed = list(smollm2_llm.stream("Name three rivers.", params))
    got, done = [], threading.Event()

    def on_delta(delta):
        got.append(delta)
        if delta.finished:
            done.set()

    rid = smollm2_llm.submit("Name three rivers.", params, on_delta=on_delta)
    assert done.wait(60) and all(d.request_id == rid for d in got)
    assert [d.token_ids for d in got] == [d.token_ids for d in streamed] and got[-1].finished

    def broken(delta):
        raise RuntimeError("receiver broke")

    smollm2_llm.submit("Hello", SamplingParams(max_tokens=3), on_delta=broken)
    assert smollm2_llm.generate("Hello", SamplingParams(max_tokens=3))[0].outputs[0].token_ids
    assert "receiver broke" in caplog.text
    with pytest.raises(ValueError, match="on_delta must be callable"):
        smollm2_llm.submit("Hello", on_delta=None)
    with pytest.raises(ValueError, match="prompt must be"):
        smollm2_llm.submit(42, on_delta=print)
