"""``/v1/chat/completions`` and ``/v1/completions``: OpenAI's semantics over the engine.

A request becomes one engine request per prompt and choice. Everything that can be wrong
with it is found before anything is queued: the body's fields (``protocol``), the prompt's
length against ``max_model_len``, ``max_tokens`` against what is left of it, ``top_logprobs``
against ``--max-logprobs``; a request id in use or a bad token id is the engine's own
``ValueError``, also before any work. All are HTTP 400.

``n > 1``: the first choice is queued alone and the others once it has produced its first
token, so the prompt's KV blocks are in the prefix cache by then and the other choices share
them instead of computing the prompt again.

Streams follow OpenAI's framing (``data: {json}\\n\\n``): a first chunk with the role (chat),
text with the logprobs of its tokens, a chunk with ``finish_reason``, the usage chunk
(``choices: []``) with ``stream_options.include_usage``, errors as ``data: {"error": ...}``,
and always ``data: [DONE]``. ``usage.prompt_tokens_details.cached_tokens`` is the prefix
cache's hit, always given.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from ...llm import EngineDeadError
from ...outputs import StreamDelta
from .engine_client import AsyncEngine
from .logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_json
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, param_named_in

logger = logging.getLogger("engine.server")


@dataclass
class _Choice:
    """What one choice has produced so far."""

    index: int
    prompt: int                         # which prompt (completions take a list)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    last: StreamDelta | None = None


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer, *, model_name: str, max_model_len: int, max_logprobs: int):
        self.engine, self.tokenizer = engine, tokenizer
        self.model_name, self.max_model_len, self.max_logprobs = model_name, max_model_len, max_logprobs

    # -- the two endpoints -----------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest):
        logprobs = req.engine_logprobs()
        if req.prompt_token_ids is not None:
            ids, text = req.prompt_token_ids, None
        else:
            text = self._render(req)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return await self._serve("chat", req, [(ids, None)], logprobs)

    async def completion(self, req: CompletionRequest):
        prompts = []
        for p in req.prompts():
            if isinstance(p, str):
                prompts.append((self.tokenizer.encode(p, add_special_tokens=True), p))
            else:
                prompts.append((p, None))
        engine_logprobs = req.logprobs
        if req.echo and req.logprobs is not None and req.stream:
            raise ApiError("echo with logprobs is served without streaming (the prompt's logprobs are known "
                           "only when the request ends); drop stream, echo or logprobs", param="echo")
        if req.echo and req.logprobs is not None:     # the prompt's tokens come with logprobs too
            req.prompt_logprobs = max(req.prompt_logprobs or 0, req.logprobs)
        return await self._serve("completion", req, prompts, engine_logprobs)

    # -- shared ----------------------------------------------------------------------------------
    def _render(self, req: ChatCompletionRequest) -> str:
        try:
            return self.tokenizer.apply_chat_template(req.conversation(), add_generation_prompt=req.add_generation_prompt,
                                                      **(req.chat_template_kwargs or {}))
        except ApiError:
            raise
        except Exception as exc:    # noqa: BLE001  (the template's own error, e.g. raise_exception)
            raise ApiError(f"the chat template could not render these messages: {exc}", param="messages") from None

    def _check(self, req, prompts, logprobs) -> int:
        if logprobs is not None and logprobs > self.max_logprobs:
            raise ApiError(f"at most {self.max_logprobs} logprobs a token are served (--max-logprobs); "
                           f"got {logprobs}", param="top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs")
        longest = max(len(ids) for ids, _ in prompts)
        wanted = req.requested_max_tokens()
        if longest >= self.max_model_len or (wanted is not None and longest + wanted > self.max_model_len):
            raise ApiError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                           f"{longest}" + (f" and max_tokens asks for {wanted} more" if wanted else ""),
                           param="max_tokens" if longest < self.max_model_len else "messages")
        return wanted if wanted is not None else self.max_model_len - longest

    async def _serve(self, kind, req, prompts, logprobs):
        max_tokens = self._check(req, prompts, logprobs)
        base = req.request_id or uuid.uuid4().hex
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + base
        into: asyncio.Queue = asyncio.Queue()
        run = _Run(self.engine, req, prompts, max_tokens, logprobs, base, into)
        await run.start()       # a bad request raises ApiError here, before any response is sent
        head = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if req.stream:
            return self._stream(kind, req, prompts, run, head)
        try:
            await run.drain()
        finally:
            await run.close()
        return self._response(kind, req, prompts, run, head)

    def _response(self, kind, req, prompts, run, head) -> dict:
        choices, as_ids = [], req.return_tokens_as_token_ids
        for c in run.choices:
            if c.finish_reason == "error":
                raise ApiError(f"the request failed in the engine: {c.last.error}", status=500)
            if kind == "chat":
                choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                          "logprobs": chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0, as_ids=as_ids)
                          if req.logprobs else None,
                          "finish_reason": c.finish_reason}
            else:
                echo = _echo_text(self.tokenizer, prompts[c.prompt]) if req.echo else ""
                choice = {"index": c.index, "text": echo + c.text, "finish_reason": c.finish_reason,
                          "logprobs": None if req.logprobs is None else completion_logprobs(
                              c.token_ids, c.logprobs, req.logprobs, prompt=c.last.prompt_logprobs if req.echo else None,
                              prompt_ids=prompts[c.prompt][0],
                              decode=lambda t: self.tokenizer.decode([t], skip_special_tokens=False), as_ids=as_ids)}
                if req.prompt_logprobs is not None and not req.echo:
                    choice["prompt_logprobs"] = prompt_logprobs_json(c.last.prompt_logprobs)
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
                if kind == "completion":
                    choice["prompt_token_ids"] = prompts[c.prompt][0]
            choices.append(choice)
        body = {**head, "object": "chat.completion" if kind == "chat" else "text_completion",
                "choices": choices, "usage": run.usage()}
        if kind == "chat" and req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(run.choices[0].last.prompt_logprobs)
        if kind == "chat" and req.return_token_ids:
            body["prompt_token_ids"] = prompts[0][0]
        return body

    async def _stream(self, kind, req, prompts, run, head) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        as_ids = req.return_tokens_as_token_ids

        def chunk(choices, **extra) -> str:
            return f"data: {json.dumps({**head, 'object': obj, 'choices': choices, **extra})}\n\n"

        try:
            if kind == "chat":
                first = {**({"prompt_token_ids": prompts[0][0]} if req.return_token_ids else {})}
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for c in run.choices], **first)
            echoed, ids_sent = set(), set()
            async for c, delta in run.deltas():
                if delta.finish_reason == "error":
                    raise ApiError(f"the request failed in the engine: {delta.error}", status=500)
                choice = {"index": c.index}
                if kind == "chat":
                    choice["delta"] = {"content": delta.text} if delta.text or not delta.finished else {}
                    choice["logprobs"] = (chat_logprobs(delta.token_ids, delta.logprobs, req.top_logprobs or 0, as_ids=as_ids)
                                          if req.logprobs and delta.logprobs else None)
                else:
                    text = delta.text
                    if req.echo and c.index not in echoed:
                        echoed.add(c.index)
                        text = _echo_text(self.tokenizer, prompts[c.prompt]) + text
                    choice["text"] = text
                    choice["logprobs"] = (completion_logprobs(delta.token_ids, delta.logprobs, req.logprobs, as_ids=as_ids)
                                          if req.logprobs is not None and delta.logprobs else None)
                choice["finish_reason"] = delta.finish_reason if delta.finished else None
                if req.return_token_ids:
                    choice["token_ids"] = delta.token_ids
                    if kind == "completion" and c.index not in ids_sent:    # vLLM: in the choice's first chunk
                        ids_sent.add(c.index)
                        choice["prompt_token_ids"] = prompts[c.prompt][0]
                if delta.finished and delta.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(delta.prompt_logprobs)
                yield chunk([choice])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage=run.usage())
        except ApiError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        except EngineDeadError as exc:
            yield f"data: {json.dumps(ApiError(str(exc), status=503).body())}\n\n"
        finally:
            await run.close()
        yield "data: [DONE]\n\n"


class _Run:
    """The engine requests of one API request: queued, read, aborted together."""

    def __init__(self, engine: AsyncEngine, req, prompts, max_tokens, logprobs, base: str, into: asyncio.Queue):
        self.engine, self.req, self.prompts = engine, req, prompts
        self.max_tokens, self.logprobs, self.base, self.into = max_tokens, logprobs, base, into
        n = req.n
        self.choices = [_Choice(index=p * n + j, prompt=p) for p in range(len(prompts)) for j in range(n)]
        self.live: dict[int, str] = {}          # choice index -> engine request id, until it finishes
        self.unforked = {p for p in range(len(prompts))} if n > 1 else set()
        self.single = len(self.choices) == 1

    async def _submit(self, index: int) -> None:
        c = self.choices[index]
        params = self.req.sampling_params(self.max_tokens, self.logprobs, seed_offset=index % self.req.n)
        rid = self.base if self.single else f"{self.base}-{index}"
        try:
            self.live[index] = await self.engine.submit({"prompt_token_ids": self.prompts[c.prompt][0]}, params, rid,
                                                        self.into, index)
        except ValueError as exc:
            raise ApiError(str(exc), param=param_named_in(str(exc))) from None

    async def start(self) -> None:
        try:
            for p in range(len(self.prompts)):
                await self._submit(p * self.req.n)
        except BaseException:
            await self.close()
            raise

    async def deltas(self) -> AsyncIterator[tuple[_Choice, StreamDelta]]:
        remaining = len(self.choices)
        while remaining:
            index, delta = await self.into.get()
            if isinstance(delta, BaseException):
                raise delta
            c = self.choices[index]
            if c.prompt in self.unforked:       # its prompt is cached now: the other choices share it
                self.unforked.discard(c.prompt)
                for j in range(1, self.req.n):
                    await self._submit(c.prompt * self.req.n + j)
            c.text += delta.text
            c.token_ids += delta.token_ids
            c.logprobs += delta.logprobs
            c.last = delta
            if delta.finished:
                c.finish_reason = delta.finish_reason
                self.live.pop(index, None)
                remaining -= 1
            yield c, delta

    async def drain(self) -> None:
        async for _ in self.deltas():
            pass

    async def close(self) -> None:
        """Abort whatever is still running (a client that went away, an error in another choice)."""
        live, self.live = list(self.live.values()), {}
        for rid in live:
            await asyncio.shield(self.engine.abort(rid))

    def usage(self) -> dict:
        firsts = [c for c in self.choices if c.index % self.req.n == 0 and c.last is not None]
        prompt = sum(len(ids) for ids, _ in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        cached = sum(c.last.num_cached_tokens for c in firsts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _echo_text(tokenizer, prompt) -> str:
    ids, text = prompt
    return text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)
