"""The serving benchmark's load generator: its metrics on hand-built chunk timings, and its client
against a fake SSE server on 127.0.0.1 (no timing is asserted)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from benchmarks.serving_load import (RequestRecord, chunk_text, poisson_offsets, request_metrics, run_load,
                                     summarize)


def test_request_metrics_of_one_request():
    m = request_metrics(RequestRecord(start=10.0, chunk_times=[10.5, 10.6, 10.8, 11.1], output_tokens=4))
    assert m["ttft"] == pytest.approx(0.5)
    assert m["itl"] == pytest.approx([0.1, 0.2, 0.3])
    assert m["latency"] == pytest.approx(1.1)
    assert m["tpot"] == pytest.approx((1.1 - 0.5) / 3)          # vLLM: (latency - ttft) / (tokens - 1)


def test_summarize_pools_gaps_and_counts_errors():
    records = [RequestRecord(start=0.0, chunk_times=[0.5, 0.6, 0.8, 1.1], output_tokens=4),
               RequestRecord(start=1.0, chunk_times=[1.2, 1.3], output_tokens=2),
               RequestRecord(start=0.0, error="HTTP 500: boom")]
    s = summarize(records, duration_s=2.0)
    assert (s["completed"], s["errors"], s["output_tokens"]) == (2, 1, 6)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_tok_s"] == pytest.approx(3.0)
    assert s["ttft_ms_p50"] == pytest.approx(350.0)               # TTFTs 0.5 and 0.2 s
    assert s["ttft_ms_p99"] == pytest.approx(200.0 + 0.99 * 300.0)  # numpy's linear interpolation
    assert s["itl_ms_p50"] == pytest.approx(150.0)                # gaps 0.1 0.1 0.2 0.3 from both requests
    assert s["itl_ms_p99"] == pytest.approx(200.0 + 0.97 * 100.0)
    assert s["tpot_ms_p50"] == pytest.approx(150.0)               # 0.2 and 0.1 s
    assert s["error_samples"] == ["HTTP 500: boom"]


def test_summarize_with_nothing_completed():
    s = summarize([RequestRecord(start=0.0, error="x")], duration_s=1.0)
    assert s["completed"] == 0 and s["ttft_ms_p50"] is None and s["output_tok_s"] == 0.0


def test_chunk_text_counts_only_generated_text():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]}
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"completion_tokens": 3}}
    assert chunk_text(role) == chunk_text(finish) == chunk_text(usage) == ""
    assert chunk_text({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}) == "Hi"
    assert chunk_text({"choices": [{"index": 0, "text": "Hi"}]}) == "Hi"     # /v1/completions chunks


def test_poisson_offsets_are_seeded_and_end_at_n_over_rate():
    a, b = poisson_offsets(20, 4.0, seed=3), poisson_offsets(20, 4.0, seed=3)
    assert a == b and a != poisson_offsets(20, 4.0, seed=4)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert a[-1] == pytest.approx(20 / 4.0)


# -- a fake server with llama.cpp's streaming framing ---------------------------------------------
# Mirrors llama.cpp tools/server (the sources vendored in llama-cpp-python 0.3.36):
# server-common.cpp format_oai_sse writes "data: <json>\n\n" per event; server-task.cpp sends the
# first update as a {"role": "assistant", "content": null} delta followed by the text delta,
# to_json_oaicompat_chat_stream ends with an empty delta carrying finish_reason and, with
# stream_options.include_usage, a chunk with "choices": [] and "usage"; server-context.cpp ends
# the stream with "data: [DONE]\n\n".

def _fake_app():
    app = FastAPI()

    def chunk(delta=None, finish=None, usage=None):
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                "choices": [] if usage else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
        if usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if body["messages"][-1]["content"] == "fail":
            return JSONResponse({"error": {"message": "bad", "type": "invalid_request_error"}}, status_code=400)
        n = 2 if body["messages"][-1]["content"] == "short" or not body.get("ignore_eos") else body["max_tokens"]

        async def events():
            yield chunk({"role": "assistant", "content": None}) + chunk({"content": "t0"})
            for i in range(1, n):
                await asyncio.sleep(0.001)
                yield chunk({"content": f" t{i}"})
            yield chunk(finish="length")
            if (body.get("stream_options") or {}).get("include_usage"):
                yield chunk(usage={"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1/chat/completions"
    server.should_exit = True
    thread.join(timeout=10)


def _chats(*users):
    return [[{"role": "user", "content": u}] for u in users]


def test_client_reads_the_stream_at_fixed_concurrency(fake_server):
    records, duration = asyncio.run(run_load(fake_server, "fake", _chats("a", "b", "c", "d"), 5, concurrency=2))
    assert duration > 0
    for r in records:
        assert r.ok, r.error
        assert r.text == "t0 t1 t2 t3 t4"
        assert len(r.chunk_times) == 5          # the role and finish chunks are not tokens
        assert (r.output_tokens, r.prompt_tokens) == (5, 7)
    s = summarize(records, duration)
    assert (s["completed"], s["errors"], s["output_tokens"]) == (4, 0, 20)
    assert len(s["itl_s"]) == 4 * 4


def test_client_counts_errors_and_short_replies(fake_server):
    records, duration = asyncio.run(run_load(fake_server, "fake", _chats("fail", "ok", "short"), 5, rate=50.0,
                                             seed=1))
    assert records[0].error.startswith("HTTP 400")
    assert records[1].ok and records[1].output_tokens == 5
    assert records[2].error == "completion_tokens 2 != max_tokens 5"   # ignore_eos not honoured
    assert summarize(records, duration)["errors"] == 2
