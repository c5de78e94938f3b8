"""``/engine/*``: what the playground's views need from an engine served over HTTP.

The OpenAI routes carry text and logprobs; the views also draw the engine's own records: token
ids and ranks of every delta, the KV block snapshot and the step events. These routes expose
the ``LLM`` surface itself, in the JSON of ``engine.client.wire``, so ``engine.client.RemoteLLM``
is the same engine client over HTTP:

* ``GET /engine/info``: model name, ``model_impl``, the engine's settings, ``max_model_len``;
* ``GET /engine/tokenizer``: the tokenizer, rebuilt by the client (no request per token);
* ``GET /engine/snapshot``; ``GET /engine/events``: the step events as server-sent events;
* ``POST /engine/generate`` ``{"prompt", "sampling_params", "request_id"}``: the deltas as
  server-sent events (a bad request is a 400 before the stream starts; a client that goes
  away aborts its request);
* ``POST /engine/abort`` ``{"request_id"}``; ``POST /engine/reset_prefix_cache``;
* ``POST /engine/attention_lens`` ``{"token_ids", "position", "layer", "head"}``: ``LLM.attention_lens``
  as ``AttentionLens.to_dict`` (the weights as base64 float32); bad input is a 400 before any work.
* ``POST /engine/estimate_prefill`` ``{"token_ids"}``: ``LLM.estimate_prefill`` (read-only) as
  ``PrefillEstimate.to_dict``; ``GET /engine/kv_events?since=N``: ``LLM.kv_events``.
* ``POST /engine/sampler_pipeline`` ``{"token_ids", "position", "sampling_params", "num_prompt_tokens"}``:
  ``LLM.sampler_pipeline`` as ``SamplerPipeline.to_dict`` (each stage's distribution as base64 float32,
  its kept set as a bit mask); bad input is a 400 before any work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ...llm import EngineDeadError
from .protocol import ApiError, read_json_object
from ...client.wire import delta_to_dict, params_from_dict

_SSE = {"media_type": "text/event-stream", "headers": {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}}
MAX_QUEUED_EVENTS = 10_000      # a subscriber further behind than this is dropped, not buffered forever


def add_engine_routes(app: FastAPI, state) -> None:
    @app.get("/engine/info")
    async def info():
        state.ready()
        llm = state.llm
        return {"model_name": llm.model_name, "served_model_name": state.served_model_name,
                "model_impl": llm.model_impl, "config": dataclasses.asdict(llm.config),
                "max_model_len": state.serving.max_model_len}

    @app.get("/engine/tokenizer")
    async def tokenizer():
        state.ready()
        return state.llm.get_tokenizer().to_dict()

    @app.get("/engine/snapshot")
    def snapshot():     # a worker thread: the snapshot takes the engine lock
        state.ready()
        return state.llm.snapshot().to_dict()

    @app.get("/engine/events")
    async def events(request: Request):
        state.ready()
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(event) -> None:
            if queue.qsize() < MAX_QUEUED_EVENTS:
                loop.call_soon_threadsafe(queue.put_nowait, event.to_dict())

        unsubscribe = state.llm.subscribe(on_event)

        async def stream():
            try:
                yield ": subscribed\n\n"
                while True:
                    yield f"data: {json.dumps(await queue.get())}\n\n"
            finally:
                await asyncio.to_thread(unsubscribe)

        return StreamingResponse(stream(), **_SSE)

    @app.post("/engine/generate")
    async def generate(request: Request):
        state.ready()
        body = await read_json_object(request)
        params = _params(body.get("sampling_params") or {})
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
            prompt = {"prompt_token_ids": prompt}
        into: asyncio.Queue = asyncio.Queue()
        try:
            rid = await state.serving.engine.submit(prompt, params, body.get("request_id"), into, None)
        except ValueError as exc:
            raise ApiError(str(exc)) from None

        async def stream():
            finished, first = False, True
            try:
                while not finished:
                    _, delta = await into.get()
                    if isinstance(delta, EngineDeadError):
                        yield f"data: {json.dumps(ApiError(str(delta), status=503).body())}\n\n"
                        return
                    finished = delta.finished
                    yield f"data: {json.dumps(delta_to_dict(delta, with_prompt_ids=first))}\n\n"
                    first = False
            finally:
                if not finished:
                    await asyncio.shield(state.serving.engine.abort(rid))

        return StreamingResponse(stream(), **_SSE)

    @app.post("/engine/abort")
    async def abort(request: Request):
        state.ready()
        rid = (await read_json_object(request)).get("request_id")
        if not isinstance(rid, str):
            raise ApiError("request_id must be a string", param="request_id")
        return {"aborted": await asyncio.to_thread(state.llm.abort, rid)}

    @app.post("/engine/attention_lens")
    async def attention_lens(request: Request):
        state.ready()
        body = await _known_fields(request, ("token_ids", "position", "layer", "head"))
        try:
            lens = await asyncio.to_thread(state.llm.attention_lens, body.get("token_ids"), body.get("position"),
                                           body.get("layer"), body.get("head"))
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        return lens.to_dict()

    @app.post("/engine/sampler_pipeline")
    async def sampler_pipeline(request: Request):
        state.ready()
        body = await _known_fields(request, ("token_ids", "position", "sampling_params", "num_prompt_tokens"))
        params = _params(body.get("sampling_params") or {})
        try:
            pipe = await asyncio.to_thread(state.llm.sampler_pipeline, body.get("token_ids"), body.get("position"),
                                           params, body.get("num_prompt_tokens"))
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        return pipe.to_dict()

    @app.post("/engine/estimate_prefill")
    async def estimate_prefill(request: Request):
        state.ready()
        body = await _known_fields(request, ("token_ids",))
        try:
            return (await asyncio.to_thread(state.llm.estimate_prefill, body.get("token_ids"))).to_dict()
        except ValueError as exc:
            raise ApiError(str(exc), param="token_ids") from None

    @app.get("/engine/kv_events")
    def kv_events(since: str = "0"):     # a worker thread: it takes the engine lock
        state.ready()
        try:
            return state.llm.kv_events(int(since))
        except ValueError as exc:
            raise ApiError(f"since must be a non-negative integer (an event's seq); got {since!r}" if
                           not since.isdigit() else str(exc), param="since") from None

    @app.post("/engine/reset_prefix_cache")
    async def reset_prefix_cache():
        state.ready()
        return {"freed": await asyncio.to_thread(state.llm.reset_prefix_cache)}


def _params(data):
    try:
        return params_from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ApiError(str(exc), param="sampling_params") from None


async def _known_fields(request: Request, accepted: tuple[str, ...]) -> dict:
    """The request's JSON object, refused (400) if it names a field outside ``accepted``, listing them."""
    body = await read_json_object(request)
    unknown = set(body) - set(accepted)
    if unknown:
        raise ApiError(f"unknown field(s) {sorted(unknown)}; accepted: {', '.join(accepted)}")
    return body
