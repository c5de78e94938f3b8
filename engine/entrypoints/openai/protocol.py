"""The OpenAI-compatible request bodies, validated; their mapping onto ``SamplingParams``.

Field names and ranges are OpenAI's (``/v1/chat/completions``, ``/v1/completions``) plus the
extras FastDeploy and vLLM accept (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``include_stop_str_in_output``, ``ignore_eos``, ``logprobs_mode``, ``chat_template_kwargs``,
``return_token_ids``, ``return_tokens_as_token_ids``, ``prompt_token_ids``, ``prompt_logprobs``,
``request_id``). Unknown fields are accepted and ignored, as vLLM does (clients send extras);
``unknown_fields`` names them so the server can log them. A bad value is an ``ApiError`` (HTTP 400) naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError  # noqa: F401  (re-exported)

from ...sampling_params import MAX_LOGPROBS, SamplingParams


class ApiError(Exception):
    """An error a client can act on: OpenAI's ``{"error": {message, type, param, code}}`` body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.type = type or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                             413: "RequestTooLargeError", 429: "RateLimitError",
                             503: "ServiceUnavailableError"}.get(status, "InternalServerError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Request(BaseModel):
    """What chat and completion requests share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False    # vLLM: logprobs name tokens "token_id:N", not by text
    prompt_token_ids: list[int] | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    skip_special_tokens: bool = True
    logprobs_mode: str | None = None             # FastDeploy's / vLLM's: raw or processed (after the filters)
    user: str | None = None

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed_offset: int = 0) -> SamplingParams:
        """The engine's ``SamplingParams`` for one of the ``n`` choices (``seed + index``, so
        seeded choices differ from each other and repeat from run to run)."""
        given = {k: v for k, v in {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }.items() if v is not None}
        extras = {}
        if self.min_tokens:
            extras["min_tokens"] = self.min_tokens
        if self.include_stop_str_in_output:
            extras["include_stop_str_in_output"] = True
        if self.logprobs_mode is not None:
            extras["logprobs_mode"] = self.logprobs_mode
        try:
            return SamplingParams(
                max_tokens=max_tokens, seed=None if self.seed is None else self.seed + seed_offset,
                stop=self.stop or None, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens, **given, **extras)
        except (TypeError, ValueError) as exc:
            raise ApiError(str(exc), param=param_named_in(str(exc))) from None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self, index: int) -> str:
        """The message's text; content parts must all be text (this server has no image input)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                               f"are accepted; got a part of type {part.get('type')!r}", param="messages")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict]:
        if not self.messages and self.prompt_token_ids is None:
            raise ApiError("messages must be a non-empty list of {'role', 'content'} objects", param="messages")
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    def engine_logprobs(self) -> int | None:
        """``logprobs: true`` alone gives the sampled token's logprob; ``top_logprobs`` needs it."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids (one prompt or a list of them)."""
        if self.suffix:
            raise ApiError("suffix is not supported by this server", param="suffix")
        p = self.prompt if self.prompt_token_ids is None else self.prompt_token_ids
        if p is None or p == [] or p == "":
            raise ApiError("prompt must be a non-empty string, a list of token ids, or a list of either",
                           param="prompt")
        if isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            return [p]
        if any(x == [] or x == "" for x in p):
            raise ApiError("prompt: every prompt in the list must be non-empty", param="prompt")
        return list(p)


MAX_BODY_BYTES = 16 * 1024**2     # ~100x the longest prompt this engine's context holds


async def read_json_object(request) -> dict:
    """A request's body as a JSON object: 413 past ``MAX_BODY_BYTES`` (before it is all read), 400 for
    anything that is not a JSON object. Every route that takes a body reads it here."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(f"the body has {int(declared):,} bytes; at most {MAX_BODY_BYTES:,} are accepted", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(f"the body is over {MAX_BODY_BYTES:,} bytes, the most accepted", status=413)
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(f"the body must be a JSON object; got {type(data).__name__}")
    return data


def param_named_in(message: str) -> str | None:
    """``"temperature must be ..."`` -> ``"temperature"`` (the engine's messages start with the field)."""
    head = message.split(" ", 1)[0]
    return head if head.isidentifier() else None


def validation_error(exc: ValidationError) -> ApiError:
    """Pydantic's first error as a 400 naming the field (FastAPI would answer 422)."""
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
    return ApiError(f"{loc or 'body'}: {err.get('msg')} (got {_short(err.get('input'))})", param=loc or None)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
