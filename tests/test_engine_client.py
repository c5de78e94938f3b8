"""One engine-client protocol, three transports: ``RemoteLLM`` (HTTP, the server's ``/engine``
routes) answers as the in-process ``LLM`` does — the same greedy tokens, text and logprobs, a
closed stream aborted, events, snapshots that keep unchanged blocks — and the playground runs
on it as on an engine of its own (``python -m playground --server URL``)."""

from __future__ import annotations

import inspect
import threading
import time

import httpx
import pytest
import uvicorn

from engine import LLM, LLMProcess, SamplingParams
from engine.client import EngineClient
from engine.client.http import RemoteLLM
from engine.entrypoints.openai.app import ServerState, build_app
from engine.llm import EngineDeadError
from test_openai_server import free_port

CONVERSATION = [{"role": "user", "content": "Name three colours of the rainbow."}]


def serve(llm, api_keys=()):
    state = ServerState(served_model_name="smollm2-135m-instruct", api_keys=list(api_keys))
    state.attach(llm)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    return srv, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served(smollm2_llm):
    srv, url = serve(smollm2_llm, api_keys=["secret"])
    yield url
    srv.should_exit = True


@pytest.fixture(scope="module")
def remote(served):
    client = RemoteLLM(served, api_key="secret")
    yield client
    client.shutdown()


def test_every_transport_has_the_protocols_surface():
    members = [name for name in dir(EngineClient) if not name.startswith("_")]
    for cls in (LLM, LLMProcess, RemoteLLM):
        for name in members:
            if callable(getattr(EngineClient, name, None)):
                theirs, ours = inspect.signature(getattr(cls, name)), inspect.signature(getattr(EngineClient, name))
                assert list(theirs.parameters) == list(ours.parameters), (cls.__name__, name)


def test_remote_answers_as_in_process(remote, smollm2_llm):
    assert isinstance(remote, EngineClient) and isinstance(smollm2_llm, EngineClient)
    assert (remote.model_name, remote.model_impl, remote.max_model_len) == (
        smollm2_llm.model_name, smollm2_llm.model_impl, smollm2_llm.max_model_len)
    tok, here = remote.get_tokenizer(), smollm2_llm.get_tokenizer()
    text = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert text == here.apply_chat_template(CONVERSATION) and tok.encode(text) == here.encode(text)
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=3)
    want = smollm2_llm.chat(CONVERSATION, params)[0]
    got = remote.chat(CONVERSATION, params)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.outputs[0].text == want.outputs[0].text
    assert got.prompt_token_ids == want.prompt_token_ids and got.num_cached_tokens > 0
    for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
        assert a.keys() == b.keys()
        # the remote prompt hits the prefix cache the in-process chat left: the same numbers, summed in
        # another order (the suite's decode-path tolerance)
        assert all(a[t].rank == b[t].rank and abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
    deltas = list(remote.stream(CONVERSATION, params))
    assert [t for d in deltas for t in d.token_ids] == want.outputs[0].token_ids
    assert all(d.prompt_token_ids == want.prompt_token_ids for d in deltas) and deltas[-1].finished
    batch = remote.generate(["The capital of France is", {"prompt_token_ids": want.prompt_token_ids}],
                            SamplingParams(max_tokens=4, temperature=0))
    assert batch[1].outputs[0].token_ids == want.outputs[0].token_ids[:4]


def test_closing_a_remote_stream_aborts_it_and_frees_its_blocks(remote, smollm2_llm):
    stream = remote.stream("Tell me a long story.", SamplingParams(max_tokens=300, ignore_eos=True),
                           request_id="story")
    next(stream)
    assert [r.request_id for r in smollm2_llm.snapshot().requests] == ["story"]
    stream.close()
    deadline = time.monotonic() + 30
    while smollm2_llm.snapshot().requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not smollm2_llm.snapshot().requests and smollm2_llm.snapshot().kv_usage == 0


def test_events_and_snapshots_over_http(remote):
    events = []
    unsubscribe = remote.subscribe(events.append)
    try:
        remote.generate("Hello there", SamplingParams(max_tokens=3, temperature=0))
        deadline = time.monotonic() + 30
        while not any(e.kind == "request_finished" for e in events) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        unsubscribe()
    kinds = [e.kind for e in events]
    assert kinds.index("request_added") < kinds.index("step") < kinds.index("request_finished")
    first, second = remote.snapshot(), remote.snapshot()
    assert first.num_blocks == second.num_blocks and all(a is b for a, b in zip(first.blocks, second.blocks))
    assert remote.abort("no-such-request") is False


def test_remote_errors_are_the_engines(remote, served):
    with pytest.raises(ValueError, match=r"prompt_token_ids must be integers in \[0, 49152\)"):
        remote.generate({"prompt_token_ids": [10**9]})
    bad = httpx.post(served + "/engine/generate", json={"prompt": "hi", "sampling_params": {"max_tokens": 0}},
                     headers={"Authorization": "Bearer secret"})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("max_tokens must be")
    bad = httpx.post(served + "/engine/generate", json={"prompt": "hi", "sampling_params": {"temprature": 1}},
                     headers={"Authorization": "Bearer secret"})
    assert bad.status_code == 400 and "unknown sampling parameter(s) ['temprature']" in bad.text
    with pytest.raises(ValueError, match="API key"):
        RemoteLLM(served)
    with pytest.raises(EngineDeadError, match="cannot be reached"):
        RemoteLLM(f"http://127.0.0.1:{free_port()}")
    assert httpx.get(served + "/v1/models").status_code == 401


def test_the_playground_serves_a_chat_from_a_remote_engine(remote, smollm2_llm):
    """``python -m playground --server URL``: the reply is the engine's, the map sees its blocks."""
    from test_app import chat_through_app, reply_text

    (chat, *_), snap, expected = chat_through_app(remote, smollm2_llm)
    assert reply_text(chat) == expected
    assert any(b["state"] == "cached" for b in snap["blocks"])
