"""``LLMProcess``: the engine in a process of its own behaves as the ``LLM`` it holds.

Compared against the in-process ``LLM`` on the same model (the shared ``smollm2_llm``): the same
tokens and logprobs, the same errors for bad requests, streams that abort when closed, events
before tokens, snapshots that keep unchanged blocks' objects; and a dead engine process fails
every caller at once instead of leaving it waiting.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from tiny_models import make_tiny_model

from engine import LLM, LLMProcess, SamplingParams
from engine.llm import EngineDeadError

GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def remote():
    llm = LLMProcess(model="smollm2-135m-instruct")
    yield llm
    assert not llm.snapshot().requests, "a test left requests running in the engine process"
    llm.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), "LlamaForCausalLM", seed=1)


def _tokens(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs]


def test_generate_chat_and_stream_match_the_llm_in_this_process(remote, smollm2_llm):
    prompts = ["The capital of France is", {"prompt_token_ids": [1, 504, 3458, 282]}]
    here, there = smollm2_llm.generate(prompts, GREEDY), remote.generate(prompts, GREEDY)
    assert _tokens(there) == _tokens(here)
    # Logprobs to the tolerance the engine's two decode paths are held to (tests/test_fused_decode.py):
    # the shared LLM here has served the whole suite, the engine process starts fresh.
    for a, b in zip(here, there):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert max(abs(la[t].logprob - lb[t].logprob) for t in la.keys() & lb.keys()) <= 1e-4, (la, lb)
    assert _tokens(remote.chat(CHAT, GREEDY)) == _tokens(smollm2_llm.chat(CHAT, GREEDY))
    deltas = list(remote.stream(CHAT, GREEDY, request_id="process-stream"))
    assert deltas[-1].finished and {d.request_id for d in deltas} == {"process-stream"}
    (reply,) = smollm2_llm.chat(CHAT, GREEDY)
    assert [t for d in deltas for t in d.token_ids] == reply.outputs[0].token_ids
    assert "".join(d.text for d in deltas) == reply.outputs[0].text
    prompt_ids = smollm2_llm.get_tokenizer().apply_chat_template(CHAT)
    assert all(d.prompt_token_ids == smollm2_llm.get_tokenizer().encode(prompt_ids, add_special_tokens=False)
               for d in deltas)
    assert remote.model_name == smollm2_llm.model_name and remote.config == smollm2_llm.config
    assert remote.get_tokenizer().encode("Paris") == smollm2_llm.get_tokenizer().encode("Paris")


@pytest.mark.parametrize("call", [
    lambda llm: llm.generate({"prompt_token_ids": list(range(10)) * 1000}, GREEDY),
    lambda llm: llm.generate({"prompt_token_ids": [10**9]}, GREEDY),
    lambda llm: llm.generate({"prompt_token_ids": []}, GREEDY),
    lambda llm: llm.generate(42, GREEDY),
    lambda llm: llm.generate("hi", {"max_tokens": 3}),
    lambda llm: list(llm.stream([{"role": "user"}], GREEDY)),
    lambda llm: list(llm.stream("hi", GREEDY, request_id="")),
    lambda llm: llm.subscribe("not callable"),
])
def test_bad_requests_raise_what_the_llm_raises_and_the_engine_keeps_serving(remote, smollm2_llm, call):
    with pytest.raises(Exception) as here:
        call(smollm2_llm)
    with pytest.raises(type(here.value)) as there:
        call(remote)
    assert str(there.value) == str(here.value)
    assert remote.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_a_request_id_in_use_is_refused_and_the_live_request_is_untouched(remote):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    first = remote.stream("Tell me about rivers.", params, request_id="taken")
    next(first)
    with pytest.raises(ValueError, match="already in use"):
        list(remote.stream("Another.", params, request_id="taken"))
    rest = list(first)
    assert rest[-1].finished and rest[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in rest) == 19


def test_closing_a_stream_aborts_its_request_and_frees_its_blocks(remote):
    stream = remote.stream("Write a long story about the sea.",     # minutes of decoding unless aborted
                           SamplingParams(max_tokens=5000, temperature=0, ignore_eos=True))
    next(stream)
    assert any(b.state == "used" for b in remote.snapshot().blocks)
    stream.close()
    deadline = time.monotonic() + 10
    while (snap := remote.snapshot()).requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not snap.requests and all(b.ref_cnt == 0 for b in snap.blocks)


def test_events_reach_callbacks_before_the_tokens_of_their_step(remote):
    """As ``LLM``: when a stream yields a token, the callbacks have seen the step that made it
    (the request's ``request_finished`` before its last delta); a callback may take a snapshot
    and abort, and may not wait for generation."""
    seen, checks = [], []

    def callback(event):
        seen.append(event)
        if event.kind == "request_started" and not checks:
            checks.append(type(remote.snapshot()).__name__)
            try:
                remote.generate("Hi")
            except RuntimeError as exc:
                checks.append(str(exc))

    unsubscribe = remote.subscribe(callback)
    try:
        at_delta = []
        for delta in remote.stream("Count to five.", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                                   request_id="ordered"):
            at_delta.append([e.kind for e in seen if e.data.get("request_id") == "ordered"
                             or (e.kind == "step" and "ordered" in e.data["decode"] + list(e.data["prefill"]))])
    finally:
        unsubscribe()
    assert "request_finished" in at_delta[-1] and all("request_finished" not in k for k in at_delta[:-1])
    assert all(k.count("step") >= i + 1 for i, k in enumerate(at_delta))
    assert checks[0] == "EngineSnapshot" and "subscribe() callback" in checks[1]


def test_a_snapshot_keeps_the_blockinfo_objects_of_unchanged_blocks(remote):
    stream = remote.stream("Tell me about owls and the night.",
                           SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    snaps = [remote.snapshot() for _ in stream]
    kept = changed = 0
    for before, after in zip(snaps, snaps[1:]):
        for a, b in zip(before.blocks, after.blocks):
            assert (a is b) == (a == b)
            kept, changed = kept + (a is b), changed + (a is not b)
    assert kept and changed


def test_requests_submitted_while_paused_start_in_one_step(remote):
    steps, outs = [], {}
    unsubscribe = remote.subscribe(lambda e: steps.append(e.data) if e.kind == "step" else None)

    def one(i):
        outs[i] = list(remote.stream(f"Fact {i}:", SamplingParams(max_tokens=4, temperature=0),
                                     request_id=f"paused-{i}"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    try:
        with remote.paused():
            for t in threads:
                t.start()
            time.sleep(1.0)         # the three submissions reach the engine process and wait there
        for t in threads:
            t.join(60)
    finally:
        unsubscribe()
    assert sorted(outs) == [0, 1, 2] and all(o[-1].finished for o in outs.values())
    first = next(s for s in steps if any(r.startswith("paused-") for r in s["prefill"]))
    assert sorted(first["prefill"]) == ["paused-0", "paused-1", "paused-2"]


def test_a_killed_engine_process_fails_every_caller_at_once(tiny):
    llm = LLMProcess(model=tiny, kv_cache_memory=8 * 1024**2)
    stream = llm.stream("hello", SamplingParams(max_tokens=10_000, ignore_eos=True))
    next(stream)
    os.kill(llm.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="exited"):
        for _ in stream:
            pass
    assert time.monotonic() - started < 10
    for call in (lambda: llm.generate("hi"), llm.snapshot, lambda: list(llm.stream("hi")),
                 lambda: llm.abort("x")):
        with pytest.raises(EngineDeadError):
            call()
    llm.shutdown()


def test_shutdown_ends_the_process_and_its_live_streams(tiny):
    """As ``LLM.shutdown``: a live stream ends (its abort, or the engine's end if the abort is
    still on its way when the process exits); nothing waits for ever."""
    llm = LLMProcess(model=tiny, kv_cache_memory=8 * 1024**2)
    stream = llm.stream("hello", SamplingParams(max_tokens=10_000, ignore_eos=True))
    next(stream)
    llm.shutdown()
    assert not llm._process.is_alive() and llm._process.exitcode == 0
    try:
        last = list(stream)[-1]
        assert last.finished and last.finish_reason == "abort"
    except EngineDeadError:
        pass


def test_a_model_that_does_not_load_raises_the_llms_error_here(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(Exception) as here:
        LLM(model=missing)
    with pytest.raises(type(here.value)) as there:
        LLMProcess(model=missing)
    assert str(there.value) == str(here.value)


def test_the_app_serves_a_chat_from_the_engine_process(remote, smollm2_llm):
    """``python -m playground``'s arrangement: the app in this process, the engine in its own; the
    reply is the in-process engine's, and the monitor's block map sees the engine process's blocks."""
    from test_app import chat_through_app, reply_text

    (chat, *_), snap, expected = chat_through_app(remote, smollm2_llm)
    assert reply_text(chat) == expected, (reply_text(chat), expected)
    assert any(b["state"] == "cached" for b in snap["blocks"])


def test_the_engine_process_exits_when_its_parent_is_killed(tiny):
    """Nothing outlives the app: a parent killed without clean-up (SIGKILL, the OOM killer) closes
    its end of the pipe, and the engine process then stops by itself."""
    code = ("import sys, time\nfrom engine import LLMProcess\n"
            "if __name__ == '__main__':\n"
            f"    llm = LLMProcess(model={tiny!r}, kv_cache_memory=8 * 1024**2)\n"
            "    print(llm.pid, flush=True)\n    time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child), "the engine process outlived its parent"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- issue 31, "Reliability v2" -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_remote(tiny):
    llm = LLMProcess(model=tiny, kv_cache_memory=8 * 1024**2)
    yield llm
    llm.shutdown()


TINY_GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _only_here():
    """A SamplingParams subclass from a module that exists in this process only, as a class defined
    in a notebook's ``__main__`` is: it pickles here and cannot be unpickled in the engine process."""
    import types

    module = types.ModuleType("only_in_the_client")
    exec("from engine import SamplingParams\nclass Mine(SamplingParams):\n    pass\n", module.__dict__)
    sys.modules[module.__name__] = module
    return module.Mine(max_tokens=6, temperature=0, ignore_eos=True)


def test_an_argument_the_engine_process_cannot_unpickle_fails_that_call_only(tiny_remote):
    """Issue 31 item 2: the child's ``recv()`` raised ``ModuleNotFoundError`` and the engine process
    ended for every caller. Now that call gets a ValueError saying why; the engine keeps serving."""
    expected = tiny_remote.generate("w1 w2 w3", TINY_GREEDY)[0].outputs[0].token_ids
    mine = _only_here()
    for call in (lambda: tiny_remote.generate("w1 w2 w3", mine), lambda: list(tiny_remote.stream("w1", mine))):
        with pytest.raises(ValueError, match="cannot read the arguments.*only_in_the_client"):
            call()
    with pytest.raises(ValueError, match="cannot be sent to the engine process"):
        tiny_remote.generate(lambda: None)                   # does not even pickle here
    assert tiny_remote._process.is_alive()
    assert tiny_remote.generate("w1 w2 w3", TINY_GREEDY)[0].outputs[0].token_ids == expected
    assert not tiny_remote.snapshot().requests


def test_waiting_for_tokens_inside_paused_on_the_same_thread_is_refused(tiny_remote):
    """Issue 31 item 1: ``generate()`` inside ``with llm.paused()`` on the same thread waited for
    tokens that could not come until the block ended: every caller hung."""
    box = {}

    def inside():
        try:
            with tiny_remote.paused():
                for call in (lambda: tiny_remote.generate("w1", TINY_GREEDY),
                             lambda: next(tiny_remote.stream("w1", TINY_GREEDY))):
                    with pytest.raises(RuntimeError, match="paused"):
                        call()
                box["snapshot"] = tiny_remote.snapshot()     # what does not wait still works
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=inside, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "generate() inside paused() hung"
    assert "error" not in box, box.get("error")
    assert tiny_remote.generate("w1", TINY_GREEDY)[0].outputs[0].finish_reason == "length"


def test_a_frozen_engine_process_is_detected_and_fails_every_caller(tiny):
    """Issue 31 item 6: a child stopped with SIGSTOP kept its pipe open, so only an exited child was
    noticed and callers waited for ever. Now its silence (no heartbeat) fails them, and it is killed."""
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        LLMProcess(model=tiny, heartbeat_timeout=0)
    llm = LLMProcess(model=tiny, kv_cache_memory=8 * 1024**2, heartbeat_timeout=3)
    try:
        stream = llm.stream("hello", SamplingParams(max_tokens=10_000, ignore_eos=True))
        next(stream)
        os.kill(llm.pid, signal.SIGSTOP)
        box = {}

        def drain():
            try:
                for _ in stream:
                    pass
            except BaseException as exc:  # noqa: BLE001
                box["error"] = exc

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        t.join(120)
        assert not t.is_alive(), "the stream still waits on a frozen engine process"
        assert isinstance(box.get("error"), EngineDeadError) and "stopped answering" in str(box["error"])
        llm._process.join(30)
        assert not llm._process.is_alive()
        with pytest.raises(EngineDeadError):
            llm.generate("hi")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(llm.pid, signal.SIGCONT)
        llm.shutdown()


def test_a_callback_raising_a_base_exception_does_not_stop_the_streams(tiny_remote):
    """The client's event thread also hands every stream its tokens: a subscribe() callback raising
    KeyboardInterrupt ended it, and every stream then waited for ever."""
    def hostile(event):
        if event.kind == "step":
            raise KeyboardInterrupt("raised by a callback")

    unsubscribe = tiny_remote.subscribe(hostile)
    box = {}
    try:
        t = threading.Thread(target=lambda: box.update(deltas=list(tiny_remote.stream("w1 w2", TINY_GREEDY))),
                             daemon=True)
        t.start()
        t.join(60)
    finally:
        unsubscribe()
    assert not t.is_alive(), "the stream waited for ever"
    assert box["deltas"][-1].finished and len([t for d in box["deltas"] for t in d.token_ids]) == 6
