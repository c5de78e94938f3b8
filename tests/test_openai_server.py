"""The OpenAI-compatible server, on 127.0.0.1 only: the official ``openai`` client (sync and async,
streamed and not), curl with FastDeploy's body, raw SSE framing, greedy text equal to the
in-process ``LLM.chat``, 32 concurrent clients batched with nothing lost, a disconnect that frees
the blocks, metrics under vLLM's and FastDeploy's names, and hostile requests.

Most tests serve the suite's shared ``LLM`` from a uvicorn thread (the app is the one the command
line builds); ``test_fastdeploy_command_line_*`` start the real command in a child process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from engine import SamplingParams
from engine.entrypoints.openai.app import ServerState, build_app

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_llm):
    state = ServerState(served_model_name=MODEL, api_keys=[])
    state.attach(smollm2_llm)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server + "/metrics").text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_:]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def metrics_of(client) -> dict[str, float]:
    return metrics(str(client.base_url).removesuffix("/v1/"))


def wait_idle(server, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


# -- the openai client --------------------------------------------------------------------------
def test_greedy_chat_equals_in_process_llm_chat(client, smollm2_llm):
    want = smollm2_llm.chat(QUESTION, SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(want.token_ids) and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens_details.cached_tokens > 0      # the in-process chat left the prompt cached
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_logprobs_as_openai_gives_them(client, smollm2_llm):
    out = smollm2_llm.chat(QUESTION, SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0].outputs[0]
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(out.token_ids)
    for entry, tid, lps in zip(content, out.token_ids, out.logprobs):
        assert entry.logprob == pytest.approx(lps[tid].logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token      # greedy: the sampled token ranks first
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    alone = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in alone.choices[0].logprobs.content)


def test_prompt_logprobs_and_token_ids(server, smollm2_llm):
    body = {"messages": QUESTION, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2, "return_token_ids": True}
    reply = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()
    want = smollm2_llm.chat(QUESTION, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))[0]
    assert reply["prompt_token_ids"] == want.prompt_token_ids
    assert reply["choices"][0]["token_ids"] == want.outputs[0].token_ids
    got = reply["prompt_logprobs"]
    assert len(got) == len(want.prompt_token_ids) and got[0] is None
    for position, (entries, expected) in enumerate(zip(got[1:], want.prompt_logprobs[1:]), start=1):
        token = want.prompt_token_ids[position]
        assert entries[str(token)]["rank"] == expected[token].rank
        assert entries[str(token)]["logprob"] == pytest.approx(expected[token].logprob, abs=1e-3)


def test_completions_prompt_forms_echo_and_n(client, smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    ids = tok.encode("The capital of France is", add_special_tokens=True)
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text and by_text.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model=MODEL, prompt=["Hello", "The capital of France is"], max_tokens=5,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[1].text == by_text.choices[0].text
    echo = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                     echo=True, logprobs=2)
    assert echo.choices[0].text == "The capital of France is" + by_text.choices[0].text
    lp = echo.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 5
    assert "".join(lp.tokens) == echo.choices[0].text and lp.text_offset[1] == len(lp.tokens[0])
    sampled = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                        n=3, seed=7)
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                      n=3, seed=7)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]       # seeded: repeatable
    assert len({c.text for c in sampled.choices}) > 1                                # ... and the choices differ
    assert sampled.usage.completion_tokens == 24 and sampled.usage.prompt_tokens_details is not None
    before = metrics_of(client)["vllm:prefix_cache_hits_total"]
    story = "Once upon a time, in a village by the sea, there lived an old fisherman and his three daughters."
    shared = client.completions.create(model=MODEL, prompt=story, max_tokens=4, temperature=1.0, n=3, seed=1)
    n_prompt = shared.usage.prompt_tokens
    full_blocks = n_prompt // smollm2_llm.config.block_size * smollm2_llm.config.block_size
    # the second and third choices found the first one's prompt blocks in the prefix cache
    assert metrics_of(client)["vllm:prefix_cache_hits_total"] - before >= 2 * min(full_blocks, n_prompt - 1) - 32


def test_async_client_32_concurrent_streams_are_batched_and_complete(server):
    seen_running = []

    async def one(aclient, i):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}],
            max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True})
        return [c async for c in stream]

    async def watch(stop):
        async with httpx.AsyncClient(timeout=120) as h:
            while not stop.is_set():
                text = (await h.get(server + "/metrics")).text
                seen_running.append(float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1)))
                await asyncio.sleep(0.05)

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        results = await asyncio.gather(*(one(aclient, i) for i in range(32)))
        stop.set()
        await watcher
        return results

    results = asyncio.run(main())
    assert len(results) == 32
    for chunks in results:
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert max(seen_running) > 1, seen_running
    assert wait_idle(server)["vllm:kv_cache_usage_perc"] == 0


# -- the wire -----------------------------------------------------------------------------------
def test_curl_with_fastdeploys_body(server):
    body = json.dumps({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
    out = subprocess.run(["curl", "-s", "-X", "POST", server + "/v1/chat/completions", "-d", body],
                         capture_output=True, text=True, timeout=60)
    reply = json.loads(out.stdout)
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_raw_sse_framing(server):
    body = {"messages": QUESTION, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": True, "top_logprobs": 1}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    with_text = [p for p in payloads if p["choices"] and p["choices"][0]["delta"].get("content")]
    assert all(len(p["choices"][0]["logprobs"]["content"]) >= 1 for p in with_text)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5


def test_client_disconnect_mid_stream_frees_the_blocks(server):
    body = {"messages": QUESTION, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert metrics(server)["vllm:num_requests_running"] == 1
    m = wait_idle(server)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


def test_a_client_gone_before_a_non_streamed_reply_frees_its_blocks(server):
    body = {"messages": QUESTION, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/chat/completions", json=body, timeout=1.5)
    m = wait_idle(server)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:generation_tokens_total"] < 1000       # aborted long before its 400 tokens


def test_metrics_under_both_names(server, client):
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    m = metrics(server)
    for name in ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:cache_config_info", "fastdeploy:gpu_cache_usage_perc", "fastdeploy:free_gpu_block_num",
                 "fastdeploy:max_gpu_block_num", "fastdeploy:hit_token_rate", "fastdeploy:num_requests_running",
                 "fastdeploy:num_requests_waiting", "fastdeploy:time_to_first_token_seconds_count"):
        assert name in m, name
    assert m["vllm:time_to_first_token_seconds_count"] >= 1
    assert m["vllm:prefix_cache_hits_total"] <= m["vllm:prefix_cache_queries_total"]
    assert m["fastdeploy:free_gpu_block_num"] <= m["fastdeploy:max_gpu_block_num"]


# -- hostile and malformed requests -------------------------------------------------------------
@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ("[1, 2]", 400, None),
    ({"messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
    ({"messages": QUESTION, "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": QUESTION, "n": 0}, 400, "n"),
    ({"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": QUESTION, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ({"messages": QUESTION, "max_tokens": 10**6}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "word " * 20000}]}, 400, "messages"),
    ({"messages": QUESTION, "model": "gpt-4"}, 404, "model"),
    ({"messages": QUESTION, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"messages": QUESTION, "prompt_token_ids": [10**9]}, 400, "prompt_token_ids"),
    ({"messages": QUESTION, "seed": -3}, 400, "seed"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server + "/v1/chat/completions", content=data, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    if param:
        assert err["param"] == param, err
    assert wait_idle(server)["vllm:kv_cache_usage_perc"] == 0


def test_an_oversized_body_is_refused_before_it_is_read(server):
    r = httpx.post(server + "/v1/chat/completions", content=b'{"messages": "' + b"x" * (17 * 1024**2) + b'"}',
                   timeout=60)
    assert r.status_code == 413 and "at most" in r.json()["error"]["message"]


def test_a_failure_inside_the_engine_ends_the_stream_with_an_error_event(server, smollm2_llm, monkeypatch):
    runner = smollm2_llm.engine.runner
    execute, calls = runner.execute, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a broken kernel")
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", failing)
    body = {"messages": QUESTION, "max_tokens": 20, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 500 and "a broken kernel" in error["message"]
    monkeypatch.undo()
    ok = httpx.post(server + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200            # the engine goes on serving


def test_unknown_fields_are_ignored(server):
    r = httpx.post(server + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2,
                                                          "parallel_tool_calls": False, "foo": {"bar": 1}})
    assert r.status_code == 200, r.text


def test_request_id_in_use_is_refused_and_the_live_one_finishes(server):
    body = {"messages": QUESTION, "max_tokens": 40, "ignore_eos": True, "stream": True, "request_id": "mine"}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        clash = httpx.post(server + "/v1/chat/completions", json={**body, "stream": False}, timeout=60)
        assert clash.status_code == 400 and "already in use" in clash.json()["error"]["message"]
        rest = [line for line in lines if line.startswith("data: {")]
    assert json.loads(rest[-1][6:])["choices"][0]["finish_reason"] == "length"


def test_api_key_health_while_loading_and_concurrency_limit():
    from starlette.testclient import TestClient

    state = ServerState(served_model_name=MODEL, api_keys=["k1"], max_concurrency=1)
    app = TestClient(build_app(state))
    assert app.get("/health").status_code == 503
    assert app.post("/v1/chat/completions", json={"messages": QUESTION}).status_code == 401
    r = app.post("/v1/chat/completions", json={"messages": QUESTION}, headers={"Authorization": "Bearer k1"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "the model is loading"
    state.in_flight = 1
    r = app.post("/v1/chat/completions", json={"messages": QUESTION}, headers={"Authorization": "Bearer k1"})
    assert r.status_code == 429 and "max-concurrency" in r.json()["error"]["message"]


# -- the command line -----------------------------------------------------------------------------
def run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "engine.entrypoints.openai.api_server", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_busy_port_and_impossible_settings_fail_before_loading():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        out = run_cli("--port", str(busy.getsockname()[1]))
    assert out.returncode != 0 and "cannot listen on 127.0.0.1" in out.stderr and "loading" not in out.stderr
    out = run_cli("--tensor-parallel-size", "999")
    assert out.returncode == 2 and "tensor_parallel_size=999 is more ranks than" in out.stderr


@pytest.mark.slow
def test_fastdeploy_command_line_serves_curl_and_metrics_port():
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.entrypoints.openai.api_server", "--model", MODEL, "--port", str(port),
         "--metrics-port", str(metrics_port), "--max-model-len", "32768", "--max-num-seqs", "256",
         "--kv-cache-ratio", "0.75", "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9",
         "--model-impl", "paddleformers", "--engine-worker-queue-port", "8002"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        codes = set()
        while time.monotonic() < deadline:
            try:
                code = httpx.get(base + "/health").status_code
            except httpx.TransportError:
                code = None
            codes.add(code)
            if code == 200:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        assert 503 in codes and code == 200
        out = subprocess.run(["curl", "-s", "-X", "POST", base + "/v1/chat/completions", "-d",
                              '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}'],
                             capture_output=True, text=True, timeout=120)
        assert json.loads(out.stdout)["choices"][0]["message"]["content"]
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert "fastdeploy:max_gpu_block_num" in text and "vllm:kv_cache_usage_perc" in text
        assert httpx.get(base + "/metrics").status_code == 404        # metrics live on their own port
    finally:
        proc.terminate()
        log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, log
    assert "--engine-worker-queue-port: has no meaning here" in log and "Traceback" not in log
    assert "max_model_len=32768 is more than the model's 8192 positions" in log


def test_the_playgrounds_serve_command_runs_this_engines_settings(smollm2_llm):
    """"Take it further": the command shown for this project's server parses to the running engine's
    settings (it is pasted as is), and FastDeploy's is in the form FastDeploy documents."""
    import shlex

    from engine.config import config_from_args
    from engine.entrypoints.openai.api_server import make_arg_parser
    from playground.serve_commands import serve_commands

    commands = serve_commands(smollm2_llm, port=8123)
    words = shlex.split(commands["This engine"].replace("\\\n", " "))
    assert words[:3] == ["python", "-m", "engine.entrypoints.openai.api_server"]
    args = make_arg_parser().parse_args(words[3:])
    config, running = config_from_args(args), smollm2_llm.config
    for name in ("model", "block_size", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
        assert getattr(config, name) == getattr(running, name), name
    assert config.max_model_len == smollm2_llm.max_model_len and args.port == 8123
    assert commands["FastDeploy"].startswith("python -m fastdeploy.entrypoints.openai.api_server")
    assert "http://127.0.0.1:8123/v1/chat/completions" in commands["curl"]
