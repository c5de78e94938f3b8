"""Issue 31, "Reliability v2": no caller can hang, slow or kill the engine for another.

One reproducer per numbered item of the issue (each failed on the code before its fix), on a tiny
random model (tests/tiny_models.py) through the public API. Bystanders' greedy outputs are
compared with the same prompt run alone, token for token. ``LLMProcess`` items are in
tests/test_llm_process.py, crafted model files in tests/test_loader.py.
"""

import dataclasses
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.llm_engine import _StopMatcher
from engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from test_reliability import ids, run_in_thread
from tiny_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(10, 30))}
OTHER = {"prompt_token_ids": list(range(100, 113))}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = LLM(model=make_tiny_model(str(tmp_path_factory.mktemp("llama-v2")), seed=3), block_size=4)
    yield llm
    assert not llm.snapshot().requests, "a test left requests running"


@pytest.fixture(scope="module")
def reference(llm):
    return {"prompt": llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids,
            "other": llm.generate(OTHER, GREEDY)[0].outputs[0].token_ids}


# -- 1. waiting for tokens inside `with llm.paused()` on the same thread ---------------------------

def test_generate_inside_paused_on_the_same_thread_is_refused_not_a_deadlock(llm, reference):
    def inside():
        with llm.paused():
            llm.generate(PROMPT, GREEDY)

    box = run_in_thread(inside, timeout=30)
    assert isinstance(box.get("error"), RuntimeError) and "paused()" in str(box["error"])
    for call in (lambda: llm.chat([{"role": "user", "content": "w1"}], GREEDY),
                 lambda: next(llm.stream(PROMPT, GREEDY))):
        def inside_call(call=call):
            with llm.paused():
                call()
        box = run_in_thread(inside_call, timeout=30)
        assert isinstance(box.get("error"), RuntimeError) and "same thread" in str(box["error"])
    assert not llm.snapshot().requests
    assert ids(llm.generate(PROMPT, GREEDY)[0]) == reference["prompt"]


def test_a_stream_opened_before_the_pause_and_read_inside_it_is_refused(llm, reference):
    def inside():
        stream = llm.stream(PROMPT, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        next(stream)
        with llm.paused():
            for _ in stream:
                pass

    box = run_in_thread(inside, timeout=30)
    assert isinstance(box.get("error"), RuntimeError) and "paused()" in str(box["error"])
    assert not llm.snapshot().requests


def test_submit_inside_paused_still_works_and_runs_after_the_block(llm, reference):
    got, done = [], threading.Event()

    def on_delta(delta):
        got.append(delta)
        if delta.finished:
            done.set()

    with llm.paused():
        llm.submit(PROMPT, GREEDY, on_delta=on_delta)
        assert llm.snapshot().requests
    assert done.wait(30)
    assert [t for d in got for t in d.token_ids] == reference["prompt"]


# -- 3. stop strings: O(new text) per step, capped -------------------------------------------------

def test_stop_strings_beyond_the_caps_are_refused_by_name():
    with pytest.raises(ValueError, match=f"stop has {MAX_STOP_STRINGS + 1} strings; at most {MAX_STOP_STRINGS}"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRING_CHARS} are accepted"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)     # the caps themselves are fine


def _naive(text, start, stops, by_end=False):
    """The definition: of the stop string occurrences ending after ``start``, the one that starts
    first (then ends first), or with ``by_end`` the one that ends first (then starts first)."""
    found = [(at, at + len(s), s) for s in stops for at in range(len(text) - len(s) + 1)
             if text.startswith(s, at) and at + len(s) > start]
    if not found:
        return None
    at, _, stop = min(found, key=lambda f: (f[1], f[0]) if by_end else (f[0], f[1]))
    return at, stop


def _naive_held(text, stops):
    return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
               default=0)


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.text("ab ", min_size=0, max_size=4), min_size=1, max_size=30),
       stops=st.lists(st.text("ab ", min_size=1, max_size=6), min_size=1, max_size=4), by_end=st.booleans())
def test_the_incremental_matcher_finds_what_a_full_rescan_finds(pieces, stops, by_end):
    """Fed the text piece by piece (a token's text at a time), the matcher reports the stop string
    a rescan of the whole text would (earliest start; or earliest end, for a stop string kept in
    the output) and holds back the longest end of the text that is the start of a stop string."""
    matcher, text = _StopMatcher(tuple(stops)), ""
    for piece in pieces:
        start, text = len(text), text + piece
        found = matcher.feed(text, start, by_end=by_end)
        assert found == _naive(text, start, stops, by_end), (text, start)
        if found is not None:
            return
        assert matcher.held == _naive_held(text, stops)


class CountingStr(str):
    """A str that counts the characters the matcher reads one by one."""

    reads = 0

    def __getitem__(self, key):
        CountingStr.reads += 1 if isinstance(key, int) else 0
        return str.__getitem__(self, key)


def test_the_matcher_reads_each_new_character_once_per_stop_string():
    """The issue's case, scaled: long stop strings that almost match (every prefix does) while the
    text grows a character per token; the old rescans read (text length)^2 per stop per token."""
    stops = tuple("a" * 500 + c for c in "bcd")
    matcher, text = _StopMatcher(stops), ""
    CountingStr.reads = 0
    for _ in range(2000):
        start, text = len(text), text + "a"
        assert matcher.feed(CountingStr(text), start) is None
    assert matcher.held == 500
    assert CountingStr.reads == 3 * 2000


def test_many_long_stop_strings_stop_where_they_should(llm, reference):
    text = llm.generate(PROMPT, GREEDY)[0].outputs[0].text
    stop = text.split()[3]
    decoys = ["w" + "x" * (MAX_STOP_STRING_CHARS - 4) + f"{i:02d}" for i in range(MAX_STOP_STRINGS - 1)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=decoys + [stop])
    hostile, bystander = llm.generate([PROMPT, OTHER], [params, GREEDY])
    assert hostile.outputs[0].text == text[:text.index(stop)] and hostile.outputs[0].stop_reason == stop
    assert ids(bystander) == reference["other"]


# -- 4. automatic request ids never collide with a caller's ---------------------------------------

def test_automatic_ids_skip_the_ids_callers_chose(llm, reference):
    last = llm.generate(PROMPT, GREEDY)[0].request_id                # "req-N": the next ones are N+1...
    n = int(last.split("-")[1])
    taken = [f"req-{n + i}" for i in range(1, 6)]
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    finished = []
    with llm.paused():                                               # all five live while generate() runs
        for rid in taken:
            llm.submit(OTHER, long, request_id=rid, on_delta=lambda d: d.finished and finished.append(d))
    outs = llm.generate([PROMPT, PROMPT], GREEDY)
    assert [ids(o) for o in outs] == [reference["prompt"]] * 2
    assert not {o.request_id for o in outs} & set(taken)
    assert run_in_thread(lambda: [threading.Event().wait(0.05) for _ in iter(lambda: len(finished) == 5, True)])


# -- 5. a callback raising a BaseException stays with its request ----------------------------------

@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_on_delta_raising_a_base_exception_harms_no_one(llm, reference, exc):
    calls = []

    def hostile(delta):
        calls.append(delta)
        raise exc("raised by on_delta")

    with llm.paused():
        llm.submit(OTHER, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), on_delta=hostile)
        box = {}
        bystander = threading.Thread(target=lambda: box.update(out=llm.generate(PROMPT, GREEDY)[0]))
        bystander.start()
    bystander.join(60)
    assert ids(box["out"]) == reference["prompt"]
    assert llm._dead is None and len(calls) == 6 and calls[-1].finished
    assert ids(llm.generate(OTHER, GREEDY)[0]) == reference["other"]


# -- 7. SamplingParams checked on assignment, frozen at submission ---------------------------------

@pytest.mark.parametrize("field,value,message", [
    ("temperature", float("nan"), "temperature must be a finite number"),
    ("top_p", float("nan"), "top_p must be a finite number"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("stop", [""], "stop must be a non-empty string"),
    ("stop", 5, "stop must be a non-empty string"),
    ("stop_token_ids", [-1], "stop_token_ids must be a list of non-negative"),
    ("temperature", 10**400, "temperature must be a finite number"),
    ("min_tokens", 500, "min_tokens must be <= max_tokens=128"),
    ("max_tokens", 2, "min_tokens must be <= max_tokens=2"),
    ("presence_penalty", 3.0, r"presence_penalty must be in \[-2.0, 2.0\]"),
    ("ignore_eos", "yes", "ignore_eos must be True or False"),
])
def test_a_field_set_after_construction_is_checked_and_keeps_its_old_value(field, value, message):
    params = SamplingParams(min_tokens=3) if field == "max_tokens" and value == 2 else SamplingParams()
    before = getattr(params, field)
    with pytest.raises(ValueError, match=message):
        setattr(params, field, value)
    assert getattr(params, field) == before


def test_a_stop_set_after_construction_is_used(llm, reference):
    text = llm.generate(PROMPT, GREEDY)[0].outputs[0].text
    params = dataclasses.replace(GREEDY)
    params.stop = [text.split()[2]]
    params.stop_token_ids = None
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(text.split()[2])]


def test_a_list_changed_in_place_is_checked_at_submission(llm, reference):
    params = SamplingParams(max_tokens=4, stop_token_ids=[5])
    params.stop_token_ids.append(-1)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(PROMPT, params)
    assert not llm.snapshot().requests


def test_params_changed_after_submission_do_not_touch_the_request(llm, reference):
    params = dataclasses.replace(GREEDY)
    got = []
    with llm.paused():
        llm.submit(PROMPT, params, on_delta=got.append)
        params.max_tokens, params.temperature = 1, 1.5
    out = llm.generate(OTHER, GREEDY)[0]                   # the submitted one runs alongside
    assert ids(out) == reference["other"]
    while not (got and got[-1].finished):
        threading.Event().wait(0.05)
    assert [t for d in got for t in d.token_ids] == reference["prompt"]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=4, top_k=2**63, seed=1), SamplingParams(max_tokens=4, top_k=2**70, seed=1),
    SamplingParams(max_tokens=4, temperature=1e308, seed=1),
    SamplingParams(max_tokens=4, temperature=1e308, top_p=0.5, min_p=0.5, seed=1),
], ids=["top_k=2**63", "top_k=2**70", "temperature=1e308", "temperature=1e308-filters"])
def test_extreme_but_valid_values_sample_normally(llm, reference, params):
    out, bystander = llm.generate([PROMPT, OTHER], [params, GREEDY])
    assert out.outputs[0].finish_reason == "length" and len(ids(out)) == 4, out.outputs[0].error
    assert ids(bystander) == reference["other"]


# -- 10. the rest of the API's unclear errors -------------------------------------------------------

@pytest.mark.parametrize("call,message", [
    (lambda llm: llm.abort(["x"]), "request_id must be a string"),
    (lambda llm: llm.abort(None), "request_id must be a string"),
    (lambda llm: llm.generate({"prompt_token_ids": {10, 11, 12}}, GREEDY), "ordered sequence"),
    (lambda llm: llm.generate({"prompt_token_ids": {10: 1}}, GREEDY), "ordered sequence"),
    (lambda llm: llm.generate({"prompt_token_ids": np.ones((2, 3), int)}, GREEDY), "ordered sequence"),
    (lambda llm: llm.chat([{"role": "us\udce9r", "content": "hi"}], GREEDY), "message 0 role .* lone surrogate"),
])
def test_more_bad_input_gets_a_clear_error_and_leaves_no_trace(llm, reference, call, message):
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert not llm.snapshot().requests
    assert ids(llm.generate(PROMPT, GREEDY)[0]) == reference["prompt"]
