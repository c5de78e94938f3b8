"""``RemoteLLM``: an engine served by ``python -m engine.entrypoints.openai.api_server`` elsewhere,
with ``LLM``'s surface (``engine.client.EngineClient``), over the server's ``/engine`` routes.

``stream`` yields the engine's own ``StreamDelta``s (token ids, logprobs with ranks); closing it
early closes the HTTP stream, which aborts the request on the server. ``generate``/``chat``
submit every prompt before reading any answer, so they are batched together as in-process.
``subscribe`` reads the server's step events on a thread of its own; ``snapshot`` keeps the
previous snapshot's ``BlockInfo`` objects for unchanged blocks, as ``LLM.snapshot`` does.
Errors come back as the engine's: a refused request is a ``ValueError`` with the server's
message; a server that cannot be reached or went away is an ``EngineDeadError``.

Unlike ``LLM``, events and tokens travel on two connections, so a step's events are not
guaranteed to reach callbacks before its tokens reach a stream.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from dataclasses import fields
from typing import Iterator

import httpx

from ..config import EngineConfig
from ..lens import AttentionLens
from ..llm import EngineDeadError, _conversations
from ..outputs import CompletionOutput, RequestOutput, StreamDelta
from ..prefill_estimate import PrefillEstimate
from ..sampler_pipeline import SamplerPipeline
from ..sampling_params import SamplingParams
from ..snapshot import keep_unchanged_blocks
from ..tokenizer import Tokenizer
from .wire import delta_from_dict, event_from_dict, params_to_dict, snapshot_from_dict

logger = logging.getLogger("engine")


class RemoteLLM:
    """``RemoteLLM("http://host:8000", api_key=None)``: fails at once if the server is not one of
    this project's engine servers (or is still loading)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, read=None))
        info = self._get("/engine/info")
        self.model_name: str = info["model_name"]
        self.model_impl: str = info["model_impl"]
        self.max_model_len: int = info["max_model_len"]
        known = {f.name for f in fields(EngineConfig)}
        self.config = EngineConfig(**{k: v for k, v in info["config"].items() if k in known})
        self._tokenizer = Tokenizer.from_dict(self._get("/engine/tokenizer"))
        self._last_snapshot = None
        self._closed = False

    # -- LLM's surface ----------------------------------------------------------------------------
    def get_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def stream(self, prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamDelta]:
        """As ``LLM.stream``: submitted when iteration starts; closing it early aborts the request."""
        with self._open(prompt, sampling_params, request_id) as response:
            yield from self._deltas(response)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        if not isinstance(prompts, (list, tuple)):
            prompts = [prompts]
        return self._batch(list(prompts), sampling_params)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        return self._batch(_conversations(messages), sampling_params)

    def abort(self, request_id: str) -> bool:
        return self._post("/engine/abort", {"request_id": request_id})["aborted"]

    def snapshot(self):
        snap = snapshot_from_dict(self._get("/engine/snapshot"))
        self._last_snapshot = keep_unchanged_blocks(snap, self._last_snapshot)
        return self._last_snapshot

    def subscribe(self, callback):
        """``callback(EngineEvent)`` for every engine event, in order, on a thread of this client's."""
        if not callable(callback):
            raise ValueError(f"subscribe() needs a callable; got {type(callback).__name__}")
        stop = threading.Event()
        ready = threading.Event()
        box: dict = {}

        def run():
            try:
                with self._http.stream("GET", "/engine/events") as response:
                    box["response"] = response
                    ready.set()
                    for line in response.iter_lines():
                        if stop.is_set():
                            return
                        if line.startswith("data: "):
                            try:
                                callback(event_from_dict(json.loads(line[6:])))
                            except Exception:   # noqa: BLE001  (as LLM: a failing listener is logged, skipped)
                                logger.exception("subscribe callback %r failed", callback)
            except httpx.HTTPError as exc:
                if not stop.is_set():
                    logger.warning("the engine's event stream at %s ended: %s", self.url, exc)
            finally:
                ready.set()

        thread = threading.Thread(target=run, name="engine-client-events", daemon=True)
        thread.start()
        ready.wait(10)

        def unsubscribe():
            stop.set()
            response = box.get("response")
            if response is not None:
                with contextlib.suppress(Exception):
                    response.close()

        return unsubscribe

    def reset_prefix_cache(self) -> int:
        return self._post("/engine/reset_prefix_cache", {})["freed"]

    def attention_lens(self, token_ids: list[int], position: int, layer: int | None = None,
                       head: int | None = None) -> AttentionLens:
        """As ``LLM.attention_lens``, computed by the server's engine (``POST /engine/attention_lens``)."""
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
            raise ValueError(f"token_ids must be a list of token ids; got {type(token_ids).__name__}")
        body = {"token_ids": [int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t for t in token_ids],
                "position": position, "layer": layer, "head": head}
        return AttentionLens.from_dict(self._post("/engine/attention_lens", body))

    def sampler_pipeline(self, token_ids: list[int], position: int, sampling_params: SamplingParams,
                         num_prompt_tokens: int | None = None) -> SamplerPipeline:
        """As ``LLM.sampler_pipeline``, computed by the server's engine (``POST /engine/sampler_pipeline``)."""
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
            raise ValueError(f"token_ids must be a list of token ids; got {type(token_ids).__name__}")
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams; got {type(sampling_params).__name__}")
        body = {"token_ids": [int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t for t in token_ids],
                "position": position, "sampling_params": params_to_dict(sampling_params),
                "num_prompt_tokens": num_prompt_tokens}
        return SamplerPipeline.from_dict(self._post("/engine/sampler_pipeline", body))

    def estimate_prefill(self, token_ids: list[int]) -> PrefillEstimate:
        """As ``LLM.estimate_prefill``, read by the server's engine (``POST /engine/estimate_prefill``)."""
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
            raise ValueError(f"token_ids must be a list of token ids; got {type(token_ids).__name__}")
        body = {"token_ids": [int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t for t in token_ids]}
        return PrefillEstimate.from_dict(self._post("/engine/estimate_prefill", body))

    def kv_events(self, since: int = 0) -> dict:
        """As ``LLM.kv_events``, from the server's engine (``GET /engine/kv_events?since=N``)."""
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise ValueError(f"since must be a non-negative integer (an event's seq); got {since!r}")
        return self._get(f"/engine/kv_events?since={since}")

    def shutdown(self) -> None:
        """Close this client's connections (the server goes on serving others)."""
        self._closed = True
        self._http.close()

    # -- internals ------------------------------------------------------------------------------------
    def _open(self, prompt, params, request_id):
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams; got {type(params).__name__}")
        body = {"prompt": prompt["prompt_token_ids"] if isinstance(prompt, dict) and "prompt_token_ids" in prompt
                else prompt, "sampling_params": params_to_dict(params), "request_id": request_id}
        return _checked(self._http.stream("POST", "/engine/generate", json=body), self.url)

    @staticmethod
    def _deltas(response) -> Iterator[StreamDelta]:
        prompt_ids = None
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            if isinstance(data.get("error"), dict):     # the server's error event, not a delta's error field
                raise EngineDeadError(data["error"]["message"])
            delta = delta_from_dict(data)
            if delta.prompt_token_ids is None:      # sent with the first delta only
                delta.prompt_token_ids = prompt_ids
            prompt_ids = delta.prompt_token_ids
            yield delta
            if delta.finished:
                return
        raise EngineDeadError("the server closed the stream before the request finished")

    def _batch(self, prompts: list, sampling_params) -> list[RequestOutput]:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        with contextlib.ExitStack() as stack:
            responses = [stack.enter_context(self._open(p, sp, None)) for p, sp in zip(prompts, params)]
            outputs = []
            for prompt, sp, response in zip(prompts, params, responses):
                deltas = list(self._deltas(response))
                outputs.append(_request_output(prompt if isinstance(prompt, str) else None, sp or SamplingParams(),
                                               deltas))
        return outputs

    def _get(self, path: str):
        return _json(_request(lambda: self._http.get(path), self.url))

    def _post(self, path: str, body: dict):
        return _json(_request(lambda: self._http.post(path, json=body), self.url))


def _request(send, url):
    try:
        return send()
    except httpx.TransportError as exc:
        raise EngineDeadError(f"the engine server at {url} cannot be reached: {exc}") from None


def _json(response):
    _raise_for(response)
    return response.json()


def _raise_for(response) -> None:
    if response.status_code < 400:
        return
    try:
        message = response.json()["error"]["message"]
    except Exception:   # noqa: BLE001  (not this project's error body)
        message = response.text[:200]
    if response.status_code == 404 and response.request.url.path.startswith("/engine"):
        raise ValueError(f"{response.request.url} is not an engine server of this project (no /engine routes); "
                         "an OpenAI-compatible server is read with engine.client.OpenAIServer")
    if response.status_code == 400:
        raise ValueError(message)
    if response.status_code == 401:
        raise ValueError(f"the engine server wants an API key (give api_key, or --api-key): {message}")
    raise EngineDeadError(f"the engine server answered {response.status_code}: {message}")


@contextlib.contextmanager
def _checked(stream_cm, url):
    """An HTTP stream whose error status (a refused request: 400) is raised before any delta."""
    try:
        with stream_cm as response:
            if response.status_code >= 400:
                response.read()
                _raise_for(response)
            yield response
    except httpx.TransportError as exc:
        raise EngineDeadError(f"the engine server at {url} cannot be reached: {exc}") from None


def _request_output(prompt_text, params: SamplingParams, deltas: list[StreamDelta]) -> RequestOutput:
    last = deltas[-1]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    return RequestOutput(
        request_id=last.request_id, prompt=prompt_text, prompt_token_ids=list(deltas[0].prompt_token_ids or []),
        prompt_logprobs=last.prompt_logprobs, finished=True, num_cached_tokens=last.num_cached_tokens,
        metrics=last.metrics, provenance=last.provenance,
        outputs=[CompletionOutput(index=0, text="".join(d.text for d in deltas),
                                  token_ids=[t for d in deltas for t in d.token_ids],
                                  logprobs=logprobs if params.logprobs is not None else None,
                                  finish_reason=last.finish_reason, error=last.error)])
