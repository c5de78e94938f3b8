"""The server's FastAPI app: routes, API keys, the concurrency limit, OpenAI's error bodies.

``ServerState`` holds what the routes share: the engine (``None`` while it loads, so ``/health``
answers 503), the serving logic and the metrics. Every error a client can cause is a JSON body
``{"error": {"message", "type", "param", "code"}}`` with its status: 400 for a bad body or
parameter (FastAPI's 422 included), 401 without the key, 404 for an unknown model, 429 over
``--max-concurrency``, 503 while loading.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine_routes import add_engine_routes
from .tokenize_routes import add_tokenize_routes
from .protocol import (ApiError, ChatCompletionRequest, CompletionRequest, ValidationError, read_json_object,
                       validation_error)

logger = logging.getLogger("engine.server")


class ServerState:
    def __init__(self, *, served_model_name: str, api_keys: list[str], max_concurrency: int = 512,
                 max_logprobs: int = 20, metrics_on_main: bool = True):
        self.served_model_name, self.api_keys = served_model_name, list(api_keys or [])
        self.max_concurrency, self.max_logprobs, self.metrics_on_main = max_concurrency, max_logprobs, metrics_on_main
        self.llm = self.serving = self.metrics = None
        self.failed: str | None = None
        self.in_flight = 0
        self.created = int(time.time())

    def load(self, config) -> None:
        from ...llm import LLM

        self.attach(LLM(**vars(config)))

    def attach(self, llm) -> None:
        """Serve an engine that is already loaded (tests, notebooks)."""
        from .engine_client import AsyncEngine
        from .metrics import ServerMetrics
        from .serving import OpenAIServing

        self.metrics = ServerMetrics(llm, self.served_model_name)
        self.serving = OpenAIServing(AsyncEngine(llm, observe=self.metrics.observe), llm.get_tokenizer(),
                                     model_name=self.served_model_name, max_model_len=llm.max_model_len,
                                     max_logprobs=self.max_logprobs)
        self.llm = llm

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()

    def ready(self):
        if self.llm is None:
            raise ApiError("the model is loading" if self.failed is None else f"the model failed to load: "
                           f"{self.failed}", status=503)
        return self.serving


class _ApiKeys:
    """401 for ``/v1`` and ``/engine`` without a key of ``--api-key``. A plain ASGI middleware:
    Starlette's ``BaseHTTPMiddleware`` would hide a client's disconnect from the routes."""

    def __init__(self, app, state: "ServerState"):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.state.api_keys and scope["path"].startswith(("/v1", "/engine")):
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not any(hmac.compare_digest(token.encode(), k.encode()) for k in self.state.api_keys):
                response = _error(ApiError("missing or wrong API key: send 'Authorization: Bearer <key>'", status=401))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Fleet Playground engine", docs_url=None, redoc_url=None)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        return _error(ApiError(str(exc.errors()[0].get("msg", exc)), status=400))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return _error(ApiError(str(exc.detail), status=exc.status_code))

    app.add_middleware(_ApiKeys, state=state)

    @app.get("/health")
    @app.get("/ping")
    async def health():
        state.ready()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        max_len = state.serving.max_model_len if state.serving else None
        return {"object": "list", "data": [{"id": state.served_model_name, "object": "model",
                                            "created": state.created, "owned_by": "fleet-playground",
                                            "root": state.llm.config.model if state.llm else None,
                                            "max_model_len": max_len}]}

    async def body_of(request: Request, model):
        serving = state.ready()
        data = await read_json_object(request)
        try:
            req = model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if req.model is not None and req.model != state.served_model_name:
            raise ApiError(f"the model {req.model!r} does not exist; this server serves "
                           f"{state.served_model_name!r}", status=404, param="model")
        if req.unknown_fields():
            logger.info("ignored unknown request fields: %s", ", ".join(req.unknown_fields()))
        return serving, req

    async def serve(request: Request, model, handler):
        if state.in_flight >= state.max_concurrency:
            raise ApiError(f"too many requests in flight (--max-concurrency {state.max_concurrency}); retry later",
                           status=429)
        state.in_flight += 1
        try:
            serving, req = await body_of(request, model)
            result = await _unless_disconnected(request, getattr(serving, handler)(req))
        except BaseException:
            state.in_flight -= 1
            raise
        if isinstance(result, dict):
            state.in_flight -= 1
            return JSONResponse(result)
        return StreamingResponse(_counted(result, state), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serve(request, ChatCompletionRequest, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, CompletionRequest, "completion")

    if state.metrics_on_main:
        _add_metrics_route(app, state)
    add_engine_routes(app, state)
    add_tokenize_routes(app, state)
    return app


async def _unless_disconnected(request: Request, work):
    """Run ``work``; a client that goes away meanwhile cancels it (its engine requests are aborted and
    their blocks freed), as for a stream. Streams themselves are cancelled by Starlette."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ApiError("the client went away", status=499)
    finally:
        if not task.done():
            task.cancel()


async def _counted(stream, state: ServerState):
    try:
        async for item in stream:
            yield item
    finally:
        state.in_flight -= 1
        await stream.aclose()


def _add_metrics_route(app: FastAPI, state: ServerState) -> None:
    @app.get("/metrics")
    def metrics():     # a plain def: FastAPI runs it on a worker thread (the snapshot takes the engine lock)
        if state.metrics is None:
            return Response(status_code=503)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def build_metrics_app(state: ServerState) -> FastAPI:
    """``/metrics`` alone, for ``--metrics-port``."""
    app = FastAPI(docs_url=None, redoc_url=None)
    _add_metrics_route(app, state)
    return app
