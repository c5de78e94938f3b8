"""One request can never hurt another, the engine thread never dies silently, bad input gets a clear error.

Each test drives a tiny random model (tests/tiny_models.py) through the public API and checks an
isolation or error guarantee from docs/RELIABILITY.md. Greedy outputs of bystander requests are
compared with the same prompt run alone, so "unaffected" means token for token.
"""

import math
import os
import threading

import numpy as np
import pytest

import engine.sampler
from engine import LLM, SamplingParams
from tiny_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(10, 30))}
OTHER = {"prompt_token_ids": list(range(100, 113))}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), seed=3)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4)
    yield llm
    assert not llm.snapshot().requests, "a test left requests running"


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy token ids of PROMPT and OTHER, each run alone."""
    return {"prompt": llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids,
            "other": llm.generate(OTHER, GREEDY)[0].outputs[0].token_ids}


def run_in_thread(fn, timeout=60.0):
    """``fn()``'s result or exception; fails the test if it does not return within ``timeout`` (a hang)."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"call still blocked after {timeout} s"
    return box


def ids(out):
    return out.outputs[0].token_ids


# -- 1. a subnormal temperature, and failures inside one request ------------------------------

def test_subnormal_temperature_is_greedy_and_harms_no_one(llm, reference):
    tiny = SamplingParams(max_tokens=8, temperature=5e-324, ignore_eos=True)
    a, b = llm.generate([PROMPT, OTHER], [GREEDY, tiny])
    assert (a.outputs[0].finish_reason, b.outputs[0].finish_reason) == ("length", "length")
    assert ids(a) == reference["prompt"] and ids(b) == reference["other"]


def test_sampling_failure_fails_only_that_request(llm, reference, monkeypatch):
    real = engine.sampler.sample_row

    def sample_row(logits, params, rng):
        if params.top_k == 7:
            raise FloatingPointError("injected sampling failure")
        return real(logits, params, rng)

    monkeypatch.setattr(engine.sampler, "sample_row", sample_row)
    bad = SamplingParams(max_tokens=8, temperature=0.5, top_k=7, ignore_eos=True)
    good, failed = llm.generate([PROMPT, OTHER], [GREEDY, bad])
    assert ids(good) == reference["prompt"] and good.outputs[0].finish_reason == "length"
    assert failed.outputs[0].finish_reason == "error"
    assert "FloatingPointError: injected sampling failure" in failed.outputs[0].error


def test_model_step_failure_fails_that_step_and_says_why(llm, reference, monkeypatch):
    model = llm.engine.runner.model
    real, calls = model.forward, []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("injected model failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    fresh = {"prompt_token_ids": list(range(200, 223))}  # never seen: its blocks are published in the failing step
    a, b = llm.generate([fresh, OTHER], GREEDY)
    for out in (a, b):
        assert out.outputs[0].finish_reason == "error" and out.finished
        assert "model step failed: MemoryError: injected model failure" in out.error
    monkeypatch.setattr(model, "forward", real)
    again = llm.generate(fresh, GREEDY)[0]
    assert again.num_cached_tokens == 0, "blocks of the failed step were left in the prefix cache"
    llm.reset_prefix_cache()
    assert ids(again) == ids(llm.generate(fresh, GREEDY)[0])
    assert ids(llm.generate(OTHER, GREEDY)[0]) == reference["other"]


# -- 2. the error text reaches RequestOutput ----------------------------------------------------

def test_request_output_carries_the_error(llm, monkeypatch):
    monkeypatch.setattr(engine.sampler, "sample_row", lambda *a: (_ for _ in ()).throw(ValueError("no luck")))
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=1.0))[0]
    assert out.outputs[0].finish_reason == "error"
    assert out.error == out.outputs[0].error and "ValueError: no luck" in out.error


# -- 3. callbacks: outside the lock, no re-entrant waits, a dying thread wakes everyone ------------

def test_callbacks_run_outside_the_engine_lock(llm, reference):
    seen = []

    def callback(event):
        if event.kind == "step" and not seen:  # another thread must be able to use the engine now
            box = run_in_thread(llm.snapshot, timeout=10)
            seen.append("value" in box)

    unsubscribe = llm.subscribe(callback)
    try:
        box = run_in_thread(lambda: llm.generate(PROMPT, GREEDY))
    finally:
        unsubscribe()
    assert seen == [True]
    assert ids(box["value"][0]) == reference["prompt"]


def test_waiting_for_tokens_inside_a_callback_is_refused(llm, reference):
    errors = []

    def callback(event):
        if event.kind == "step" and not errors:
            try:
                llm.generate(OTHER, GREEDY)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

    unsubscribe = llm.subscribe(callback)
    try:
        box = run_in_thread(lambda: llm.generate(PROMPT, GREEDY))
    finally:
        unsubscribe()
    assert isinstance(errors[0], RuntimeError) and "subscribe() callback" in str(errors[0])
    assert ids(box["value"][0]) == reference["prompt"]


def test_engine_thread_death_wakes_every_caller(tiny_dir):
    doomed = LLM(model=tiny_dir, block_size=4)

    def callback(event):
        if event.kind == "step":
            raise SystemExit("a callback asked to exit")

    doomed.subscribe(callback)
    long = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    boxes = []
    threads = [threading.Thread(target=lambda: boxes.append(run_in_thread(lambda: doomed.generate(PROMPT, long))))
               for _ in range(3)]
    [t.start() for t in threads]
    [t.join(90) for t in threads]
    assert len(boxes) == 3
    for box in boxes:
        assert isinstance(box.get("error"), RuntimeError), box
        assert "engine thread stopped: SystemExit: a callback asked to exit" in str(box["error"])
    later = run_in_thread(lambda: doomed.generate(PROMPT, GREEDY), timeout=10)
    assert isinstance(later.get("error"), RuntimeError) and "create a new one" in str(later["error"])
    assert not doomed.snapshot().requests


def test_callers_notice_an_engine_thread_that_vanished_without_its_handler(tiny_dir, monkeypatch):
    from engine.llm import LLM as LLMClass

    monkeypatch.setattr(LLMClass, "_die", lambda self, exc: None)  # the last-resort handler is bypassed
    doomed = LLM(model=tiny_dir, block_size=4)
    doomed.subscribe(lambda event: (_ for _ in ()).throw(SystemExit("gone")) if event.kind == "step" else None)
    box = run_in_thread(lambda: doomed.generate(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True)), timeout=30)
    assert isinstance(box.get("error"), RuntimeError) and "engine thread is gone" in str(box["error"])


# -- 4. stop strings: the stream never shows text that generate() cuts ----------------------------

def test_stream_equals_generate_for_stop_strings_across_tokens(llm):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    text = llm.generate(PROMPT, params)[0].outputs[0].text
    boundaries = [i for i, ch in enumerate(text) if ch == " "]
    assert len(boundaries) >= 3
    stops = [text[b - 1:b + 2] for b in boundaries[:3]]          # "<end of a token> <start of the next>"
    stops.append(text[-2:] + " never")                            # a partial match still open at the end
    for stop in stops:
        p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=stop)
        final = llm.generate(PROMPT, p)[0].outputs[0]
        streamed = list(llm.stream(PROMPT, p))
        assert "".join(d.text for d in streamed) == final.text, stop
        assert streamed[-1].finish_reason == final.finish_reason
        assert stop not in "".join(d.text for d in streamed)


# -- 5. abort from a callback takes effect between steps -------------------------------------------

def test_abort_from_a_callback_between_steps(llm, reference):
    added = []

    def callback(event):
        if event.kind == "request_added":
            added.append(event.data["request_id"])
        if event.kind == "request_started" and len(added) == 2 and event.data["request_id"] == added[1]:
            llm.abort(added[0])  # the victim is scheduled in the step the bystander starts in

    unsubscribe = llm.subscribe(callback)
    try:
        victim, bystander = llm.generate([OTHER, PROMPT], [SamplingParams(max_tokens=40, ignore_eos=True), GREEDY])
    finally:
        unsubscribe()
    assert victim.outputs[0].finish_reason == "abort" and len(added) == 2
    assert bystander.outputs[0].finish_reason == "length" and ids(bystander) == reference["prompt"]
    assert not llm.snapshot().requests


# -- 6. kv_cache_memory -----------------------------------------------------------------------------

def test_kv_fraction_is_of_total_memory(tiny_dir):
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    per_block = 2 * 2 * 2 * 4 * 16 * 4  # K+V x 2 layers x 2 KV heads x 4 tokens x 16 dims x fp32
    small = LLM(model=tiny_dir, block_size=4, kv_cache_memory=2e-5)
    assert small.snapshot().num_blocks == int(2e-5 * total) // per_block


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5, 0, True, "1GB"])
def test_bad_kv_cache_memory_is_rejected_before_loading(value):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(model="/no/such/model.gguf", kv_cache_memory=value)


def test_kv_budget_too_small_names_the_minimum(tiny_dir):
    with pytest.raises(ValueError, match=r"max_model_len=64 tokens needs 16 blocks.*at least 32,768 bytes"):
        LLM(model=tiny_dir, block_size=4, kv_cache_memory=4096, max_model_len=64)
    assert LLM(model=tiny_dir, block_size=4, kv_cache_memory=32768, max_model_len=64).snapshot().num_blocks == 16


# -- 7. validation up front --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    ({"seed": -1}, "seed"), ({"temperature": math.inf}, "temperature"), ({"top_p": math.nan}, "top_p"),
    ({"max_tokens": True}, "max_tokens"), ({"ignore_eos": "no"}, "ignore_eos"), ({"stop": 5}, "stop"),
    ({"logprobs": 2.0}, "logprobs"), ({"skip_special_tokens": None}, "skip_special_tokens"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("call,message", [
    (lambda llm: llm.chat("hi"), "messages must be"),
    (lambda llm: llm.chat([{"role": "user"}]), "messages must be"),
    (lambda llm: llm.generate({"prompt_token_ids": [True, 5]}, GREEDY), "prompt_token_ids"),
    (lambda llm: llm.generate({"prompt_token_ids": "12"}, GREEDY), "prompt_token_ids"),
    (lambda llm: llm.generate({"prompt_token_ids": [5, 6.0]}, GREEDY), "prompt_token_ids"),
    (lambda llm: llm.generate([PROMPT, PROMPT], [GREEDY, None]), "SamplingParams"),
    (lambda llm: next(llm.stream(PROMPT, GREEDY, request_id=7)), "request_id"),
])
def test_bad_requests_leave_no_trace(llm, reference, call, message):
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert not llm.snapshot().requests
    assert ids(llm.generate(PROMPT, GREEDY)[0]) == reference["prompt"]


def test_request_id_is_free_again_after_a_rejected_request(llm):
    stream = llm.stream(PROMPT, SamplingParams(max_tokens=2), request_id="mine")
    assert "".join(d.text for d in stream)
    assert list(llm.stream(PROMPT, SamplingParams(max_tokens=2), request_id="mine"))[-1].finished


@pytest.mark.parametrize("kwargs,message", [
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching"), ({"seed": -3}, "seed"),
    ({"max_num_seqs": 2.5}, "max_num_seqs"),
])
def test_bad_engine_settings_are_rejected_before_loading(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model="/no/such/model.gguf", **kwargs)


def test_numpy_token_ids_are_accepted(llm, reference):
    out = llm.generate({"prompt_token_ids": np.asarray(PROMPT["prompt_token_ids"])}, GREEDY)[0]
    assert ids(out) == reference["prompt"]


def test_one_token_prompt_has_prompt_logprobs_of_its_length(llm):
    """Found by tests/test_fuzz_engine.py: a 1-token prompt came back with ``prompt_logprobs == []``."""
    out = llm.generate({"prompt_token_ids": [12]}, SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert out.prompt_logprobs == [None]


def test_a_callback_raising_on_the_callers_thread_leaves_no_request(llm, reference):
    def callback(event):
        if event.kind == "request_added":
            raise KeyboardInterrupt("raised by a callback")

    unsubscribe = llm.subscribe(callback)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(OTHER, SamplingParams(max_tokens=50, ignore_eos=True))
    finally:
        unsubscribe()
    assert not llm.snapshot().requests
    assert ids(llm.generate(PROMPT, GREEDY)[0]) == reference["prompt"]


@pytest.mark.parametrize("prompt", ["caf\udce9", {"prompt": "\ud800 hi"}, [{"role": "user", "content": "x\udcff"}]],
                         ids=["text", "prompt dict", "chat message"])
def test_text_with_a_lone_surrogate_is_refused_by_name(llm, reference, prompt):
    """A lone surrogate (what ``json.loads('"\\\\udce9"')`` gives) cannot be UTF-8: the tokenizer
    refused it with a bare ``TypeError: TextInputSequence must be str``; now a ValueError says what."""
    call = llm.chat if isinstance(prompt, list) else llm.generate
    with pytest.raises(ValueError, match="lone surrogate; send UTF-8 text"):
        call(prompt, GREEDY)
    assert ids(llm.generate(PROMPT, GREEDY)[0]) == reference["prompt"]


def test_a_listener_failing_on_every_event_logs_one_traceback(llm, reference, caplog):
    """A broken view used to log a traceback per event (several per token); now its first failure
    is logged with the traceback, later ones at debug level, and the other listeners still run."""
    seen = []

    def broken(event):
        raise RuntimeError("broken view")

    unsubscribe = [llm.subscribe(broken), llm.subscribe(seen.append)]
    try:
        with caplog.at_level("DEBUG", logger="engine"):
            assert ids(llm.generate(PROMPT, GREEDY)[0]) == reference["prompt"]
    finally:
        for u in unsubscribe:
            u()
    failures = [r for r in caplog.records if "event listener" in r.getMessage()]
    assert len(failures) >= len(seen) > 8                 # it failed on every event of the request
    assert [r.levelname for r in failures if r.exc_info and r.levelname == "ERROR"] == ["ERROR"]
    assert all(r.levelname == "DEBUG" for r in failures[1:])


def test_a_listener_subscribed_again_gets_its_first_traceback_again(llm, caplog):
    """Failures are remembered per subscription: once unsubscribed, a listener (or a new one that
    happens to get its id) that fails again is logged with its traceback again."""
    def broken(event):
        raise RuntimeError("broken view")

    for _ in range(2):
        unsubscribe = llm.subscribe(broken)
        try:
            with caplog.at_level("DEBUG", logger="engine"):
                llm.generate(PROMPT, GREEDY)
        finally:
            unsubscribe()
    tracebacks = [r for r in caplog.records if "event listener" in r.getMessage() and r.levelname == "ERROR"]
    assert len(tracebacks) == 2
