"""The playground on any OpenAI-compatible server: ``engine.client.OpenAIServer`` over the standard
routes only (``/v1/*``, ``/metrics``, the tokenizer's routes), against this project's server with
its ``/engine`` routes unused, and against llama.cpp's real ``llama-server`` where it is built
(``scripts/build_llama_server.sh``). No fakes: every answer read here is a real server's."""

from __future__ import annotations

import inspect
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from engine import SamplingParams
from engine.client import EngineClient, connect
from engine.client import server_metrics as sm
from engine.client.http import RemoteLLM
from engine.client.openai_server import OpenAIServer
from engine.client.server_tokenizer import UNKNOWN_VOCAB
from test_engine_client import CONVERSATION, serve
from test_openai_server import free_port

LLAMA_SERVER = Path(__file__).resolve().parents[1] / "build" / "llama-server" / "bin" / "llama-server"


@pytest.fixture(scope="module")
def served(smollm2_llm):
    srv, url = serve(smollm2_llm, api_keys=["secret"])
    yield url
    srv.should_exit = True


@pytest.fixture(scope="module")
def client(served):
    c = OpenAIServer(served, api_key="secret", poll_s=0.2)
    yield c
    c.shutdown()


def wait_idle(llm, timeout=10.0):
    deadline = time.monotonic() + timeout
    while llm.snapshot().requests and time.monotonic() < deadline:
        time.sleep(0.05)


def test_connect_finds_the_client_for_the_server(served, client):
    assert isinstance(connect(served, api_key="secret"), RemoteLLM)
    plain = connect(served, api_key="secret", openai_only=True)
    assert isinstance(plain, OpenAIServer) and isinstance(plain, EngineClient)
    plain.shutdown()
    for name in (n for n in dir(EngineClient) if not n.startswith("_") and callable(getattr(EngineClient, n))):
        ours, theirs = inspect.signature(getattr(EngineClient, name)), inspect.signature(getattr(OpenAIServer, name))
        assert list(theirs.parameters) == list(ours.parameters), name
    assert client.kind == "vllm" and client.server == "this project's engine server"
    with pytest.raises(ValueError, match="API key"):
        OpenAIServer(served)


def test_greedy_chat_and_logprobs_as_in_process(client, smollm2_llm):
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=3)
    want = smollm2_llm.chat(CONVERSATION, params)[0]
    got = client.chat(CONVERSATION, params)[0]
    assert got.outputs[0].text == want.outputs[0].text and got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
    for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()         # ids from the server (return_tokens_as_token_ids), not from text
        assert all(a[t].rank == b[t].rank and abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
        assert all(a[t].decoded_token == smollm2_llm.get_tokenizer().decode([t], skip_special_tokens=False) for t in a)
    deltas = list(client.stream(CONVERSATION, params))
    assert [t for d in deltas for t in d.token_ids] == want.outputs[0].token_ids and deltas[-1].finished
    assert deltas[-1].prompt_token_ids == want.prompt_token_ids
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)     # the prompt view's request
    got, want = (llm.generate({"prompt_token_ids": want.prompt_token_ids}, scored)[0] for llm in (client, smollm2_llm))
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(want.prompt_logprobs)
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
    text = client.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0))[0]
    assert text.outputs[0].text == smollm2_llm.generate("The capital of France is",
                                                        SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].text


def test_branch_from_a_token(client, smollm2_llm):
    """The playground's branch: the prompt's ids, the reply's first i tokens, then an alternative forced."""
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    first = list(client.stream(CONVERSATION, params))
    reply = [t for d in first for t in d.token_ids]
    lps = [lp for d in first for lp in d.logprobs]
    i = 2
    forced = next(t for t, lp in sorted(lps[i].items(), key=lambda x: x[1].rank) if t != reply[i])
    prompt = {"prompt_token_ids": first[-1].prompt_token_ids + reply[:i] + [forced]}
    branch = list(client.stream(prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=2)))
    want = smollm2_llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0))[0].outputs[0]
    assert [t for d in branch for t in d.token_ids] == want.token_ids
    assert branch[-1].prompt_token_ids == prompt["prompt_token_ids"] and branch[-1].finish_reason == "length"
    # typed text to force goes through the server's /tokenize
    tok, here = client.get_tokenizer(), smollm2_llm.get_tokenizer()
    assert tok.encode(" blue sky", add_special_tokens=False) == here.encode(" blue sky", add_special_tokens=False)


def test_tokenizer_through_the_servers_routes(client, smollm2_llm):
    tok, here = client.get_tokenizer(), smollm2_llm.get_tokenizer()
    assert tok.routes and tok.chat_template
    assert tok.apply_chat_template(CONVERSATION) == here.apply_chat_template(CONVERSATION)
    ids = here.encode("Hello world! ü")
    assert tok.decode(ids) == here.decode(ids) and tok.decode([ids[0]]) == here.decode([ids[0]])
    # what the server does not say is approximated, as server_tokenizer says
    assert tok.vocab_size == UNKNOWN_VOCAB
    fresh = OpenAIServer(client.url, api_key="secret")
    try:
        assert fresh.get_tokenizer().eos_token_ids == frozenset()
        # until a reply ends on a token without text: the model's end of turn, learnt
        out = fresh.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=64, temperature=0))[0]
        assert out.outputs[0].finish_reason == "stop"
        assert fresh.get_tokenizer().eos_token_ids == {out.outputs[0].token_ids[-1]} <= here.eos_token_ids
    finally:
        fresh.shutdown()


def test_cached_tokens_and_reply_stats(client, smollm2_llm):
    params = SamplingParams(max_tokens=8, temperature=0)
    client.chat(CONVERSATION, params)
    last = list(client.stream(CONVERSATION, params))[-1]
    assert last.num_prompt_tokens == len(last.prompt_token_ids)
    # the prefix cache's hit, from usage.prompt_tokens_details.cached_tokens: every full block of the prompt
    block = smollm2_llm.config.block_size
    assert last.num_cached_tokens == (last.num_prompt_tokens - 1) // block * block > 0
    m = last.metrics
    assert m.arrival_time < m.first_token_time <= m.finished_time and m.num_output_tokens == 8


def test_snapshot_and_events_from_metrics(client, smollm2_llm):
    events = []
    unsubscribe = client.subscribe(events.append)
    stream = client.stream("Tell me a long story.", SamplingParams(max_tokens=60, ignore_eos=True),
                           request_id="story")
    try:
        next(stream)
        during = client.snapshot()
        engine = smollm2_llm.snapshot()
        assert [(r.request_id, r.status) for r in during.requests] == [("server:running:1", "running")]
        assert during.kv_usage > 0 and during.blocks == ()
        assert "carry counts and usage, not block tables" in during.blocks_hidden
        assert (during.num_blocks, during.block_size) == (engine.num_blocks, engine.block_size)
        deadline = time.monotonic() + 20
        while not any(e.kind == "step" and e.data["batch_size"] for e in events) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(e.kind == "step" and e.data["batch_size"] == 1 and e.data["polled"] for e in events)
        assert list(stream)[-1].finish_reason == "length"
        # the tokens generated reach the step events as the server counts them (ours: as they are produced)
        while sum(len(e.data["decode"]) for e in events if e.kind == "step") < 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(len(e.data["decode"]) for e in events if e.kind == "step") >= 60
    finally:
        stream.close()
        unsubscribe()
    wait_idle(smollm2_llm)
    after, engine = client.snapshot(), smollm2_llm.snapshot()
    assert after.requests == () and after.kv_usage == engine.kv_usage == 0
    pc, engine_pc = after.prefix_cache, engine.prefix_cache
    assert (pc.queries, pc.hits) == (engine_pc.queries, engine_pc.hits)
    # FastDeploy's names on the same scrape read the same gauges
    found = sm.samples(httpx.get(client.url + "/metrics").text)
    fd, vllm = sm.read(found, "fastdeploy", 0.0), sm.read(found, "vllm", 0.0)
    assert (fd.kv, fd.running, fd.waiting, fd.num_blocks) == (vllm.kv, vllm.running, vllm.waiting, vllm.num_blocks)


def test_abort_closes_the_stream_and_frees_the_blocks(client, smollm2_llm):
    stream = client.stream("Tell me a long story.", SamplingParams(max_tokens=300, ignore_eos=True), request_id="long")
    next(stream)
    assert client.abort("long") and not client.abort("no-such-request")
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    wait_idle(smollm2_llm)
    assert not smollm2_llm.snapshot().requests and smollm2_llm.snapshot().kv_usage == 0


def test_the_playground_on_an_openai_server(client, smollm2_llm):
    """A chat served from the OpenAI routes; the block map and the inspector say why they are empty."""
    from test_app import chat_through_app, reply_text

    from playground import render

    (chat, _, lp_html, *_), snap, expected = chat_through_app(client, smollm2_llm)
    assert reply_text(chat) == expected and 'class="lp-tok' in lp_html
    shown = render.block_map_html(snap)
    assert "No block map for this server" in shown
    assert "through its OpenAI routes and /metrics only" in shown and 'class="kv-cell' not in shown
    from playground.inspector import block_inspector_html
    assert "No block to inspect" in block_inspector_html(snap, None)


# -- llama.cpp's real llama-server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_server():
    if not LLAMA_SERVER.is_file():
        pytest.skip(f"llama.cpp's llama-server is not built ({LLAMA_SERVER} is missing): build it with "
                    "scripts/build_llama_server.sh")
    from engine.loader.zoo import zoo_path

    port = free_port()
    proc = subprocess.Popen([str(LLAMA_SERVER), "-m", zoo_path("smollm2-135m-instruct"), "-t", "2", "-tb", "2",
                             "--parallel", "2", "-c", "4096", "--metrics", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "llama-server did not start"
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_chat_through_llama_server(llama_server, smollm2_llm):
    c = connect(llama_server)
    assert isinstance(c, OpenAIServer) and c.kind == "llamacpp" and c.max_model_len == 2048
    try:
        tok, here = c.get_tokenizer(), smollm2_llm.get_tokenizer()
        assert tok.vocab_size == here.vocab_size and tok.eos_token_ids == {2}
        assert tok.apply_chat_template(CONVERSATION) == here.apply_chat_template(CONVERSATION)
        deltas = list(c.stream(CONVERSATION, SamplingParams(max_tokens=8, temperature=0, logprobs=3)))
        last, ids = deltas[-1], [t for d in deltas for t in d.token_ids]
        assert last.finished and last.finish_reason in ("length", "stop") and len(ids) == 8
        assert "".join(d.text for d in deltas) == here.decode(ids)      # ids from llama.cpp's logprob entries
        assert last.prompt_token_ids == here.encode(here.apply_chat_template(CONVERSATION), add_special_tokens=False)
        assert last.num_prompt_tokens == len(last.prompt_token_ids) and last.metrics.ttft > 0
        lps = [lp for d in deltas for lp in d.logprobs]
        assert all(len(lp) >= 3 and lp[t].rank == 1 for lp, t in zip(lps, ids))     # greedy: rank 1
        again = list(c.stream(CONVERSATION, SamplingParams(max_tokens=2, temperature=0)))[-1]
        assert again.num_cached_tokens > 0
        # a branch: the prompt's ids, the first token, the second-best alternative forced
        forced = next(t for t, lp in lps[1].items() if lp.rank == 2)
        branch = list(c.stream({"prompt_token_ids": last.prompt_token_ids + ids[:1] + [forced]},
                               SamplingParams(max_tokens=3, temperature=0, logprobs=2)))
        assert branch[-1].finish_reason == "length" and len([t for d in branch for t in d.token_ids]) == 3
        scored = c.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
        assert "does not return prompt logprobs" in scored.error    # the prompt view says why
        snap = c.snapshot()
        assert snap.prefix_cache.queries > 0 and snap.prefix_cache.hits > 0
        assert "no KV-usage gauge" in snap.blocks_hidden
    finally:
        c.shutdown()
