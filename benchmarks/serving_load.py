"""The load generator of ``benchmarks.serving``: streaming chat clients and the metrics of their chunks.

Metrics follow ``vllm bench serve`` (vllm-project/vllm ``vllm/benchmarks/serve.py``
``calculate_metrics`` and ``vllm/benchmarks/lib/endpoint_request_func.py``
``async_request_openai_chat_completions``):

* **TTFT** -- from sending the request to the first chunk that carries generated text;
* **ITL** -- the gaps between consecutive such chunks (a chunk holding several tokens is one gap,
  as in vLLM); every request's gaps are pooled before taking percentiles;
* **TPOT** -- ``(latency - TTFT) / (output tokens - 1)`` per request, latency ending at the last
  text chunk (the usage chunk carries no token);
* **output tok/s** -- the ``usage.completion_tokens`` of the completed requests over the
  benchmark's duration (first send to last completion); **request throughput** -- completed
  requests over the same duration;
* percentiles -- ``numpy.percentile`` (linear interpolation), as vLLM.

One difference from vLLM: a chunk counts only when it carries text (``delta.content``), not any
chunk with ``choices``, so a server that sends the role chunk before its prefill, or a
``finish_reason`` chunk with an empty delta, is not credited with an early first token or an
extra short gap. A request is an error when its status is not 200, when the stream carries an
``error``, or when its ``completion_tokens`` differ from the ``max_tokens`` asked for (the
benchmark sends ``ignore_eos``, so every request must produce exactly that many).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """What one streamed request left: when it was sent, when its text chunks arrived, its usage."""

    start: float                                             # time.perf_counter() when sent
    chunk_times: list[float] = field(default_factory=list)   # arrival of each chunk with text
    output_tokens: int = 0                                   # usage.completion_tokens
    prompt_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunk_times)


def request_metrics(record: RequestRecord) -> dict:
    """TTFT, the inter-chunk gaps, latency and TPOT of one request (seconds)."""
    t = record.chunk_times
    ttft = t[0] - record.start
    latency = t[-1] - record.start
    tpot = (latency - ttft) / (record.output_tokens - 1) if record.output_tokens > 1 else 0.0
    return {"ttft": ttft, "itl": [b - a for a, b in zip(t, t[1:])], "latency": latency, "tpot": tpot}


def percentile(values: list[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if values else None


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    """The metrics of one setting: throughputs over ``duration_s`` and latency percentiles (ms)."""
    done = [r for r in records if r.ok]
    per = [request_metrics(r) for r in done]
    ttfts = [m["ttft"] for m in per]
    itls = [gap for m in per for gap in m["itl"]]
    tpots = [m["tpot"] for m in per if m["tpot"] > 0]
    output = sum(r.output_tokens for r in done)

    def ms(values, p):
        v = percentile(values, p)
        return None if v is None else v * 1000

    return {"completed": len(done), "errors": len(records) - len(done),
            "error_samples": sorted({r.error for r in records if r.error})[:3],
            "duration_s": duration_s, "output_tokens": output,
            "prompt_tokens": sum(r.prompt_tokens for r in done),
            "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
            "output_tok_s": output / duration_s if duration_s > 0 else 0.0,
            "ttft_ms_p50": ms(ttfts, 50), "ttft_ms_p99": ms(ttfts, 99),
            "itl_ms_p50": ms(itls, 50), "itl_ms_p99": ms(itls, 99),
            "tpot_ms_p50": ms(tpots, 50), "tpot_ms_p99": ms(tpots, 99),
            "ttft_s": ttfts, "itl_s": itls}


def chunk_text(data: dict) -> str:
    """The generated text of one ``chat.completion.chunk`` (all of its choices)."""
    return "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for c in data.get("choices") or [])


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the start) of ``n`` Poisson arrivals at ``rate``/s, rescaled as vLLM's
    ``get_request`` does so that the last one falls at ``n / rate`` whatever the seed."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    offsets = np.cumsum(gaps)
    return list(offsets * (n / rate) / offsets[-1])


async def stream_chat(client, url: str, model: str, messages: list[dict], max_tokens: int,
                      headers: dict | None = None) -> RequestRecord:
    """One streamed ``/v1/chat/completions`` request, greedy, ``ignore_eos``, usage included."""
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    record = RequestRecord(start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue                      # blank separators, SSE comments (pings)
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return record
                if text := chunk_text(chunk):
                    record.chunk_times.append(now)
                    record.text += text
                if usage := chunk.get("usage"):
                    record.output_tokens = usage.get("completion_tokens") or 0
                    record.prompt_tokens = usage.get("prompt_tokens") or 0
    except Exception as exc:  # noqa: BLE001  (a failed request is counted, not fatal)
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    if not record.chunk_times:
        record.error = "no text chunk"
    elif record.output_tokens != max_tokens:
        record.error = f"completion_tokens {record.output_tokens} != max_tokens {max_tokens}"
    return record


async def run_load(url: str, model: str, conversations: list[list[dict]], max_tokens: int,
                   concurrency: int | None = None, rate: float | None = None, seed: int = 0,
                   headers: dict | None = None) -> tuple[list[RequestRecord], float]:
    """Send every conversation once: all at once under ``concurrency`` clients (vLLM's
    ``--max-concurrency`` with an infinite rate), or at Poisson ``rate`` without a cap.
    Returns the records in request order and the duration (first send to last completion)."""
    import httpx

    offsets = poisson_offsets(len(conversations), rate, seed) if rate else [0.0] * len(conversations)
    gate = asyncio.Semaphore(concurrency or len(conversations))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        start = time.perf_counter()

        async def one(messages, offset):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with gate:
                return await stream_chat(client, url, model, messages, max_tokens, headers)

        records = await asyncio.gather(*(one(m, o) for m, o in zip(conversations, offsets)))
        return list(records), time.perf_counter() - start
