"""``OpenAIServer``: any OpenAI-compatible server (vLLM, FastDeploy, llama.cpp's ``llama-server``, this
project's own) as an ``EngineClient``, over the standard routes only: ``/v1/models``,
``/v1/chat/completions``, ``/v1/completions``, ``/metrics``, and the tokenizer's routes where the
server has them (``server_tokenizer``). This project's ``/engine`` routes are never used.

What the playground gets, and from where:

* chat and streaming: ``stream`` yields ``StreamDelta``s with token ids and ``{id: Logprob}`` dicts
  (``openai_wire``: ids from the server where it sends them, else from their text); a branch, a
  prompt of token ids, goes to ``/v1/completions`` with the ids as the prompt;
* per-reply stats: TTFT and tokens/s timed here, at the client (network included); cached tokens
  from ``usage.prompt_tokens_details.cached_tokens`` (vLLM sends it with
  ``--enable-prompt-tokens-details`` only); the prompt's ids from ``return_token_ids`` (vLLM,
  FastDeploy), else tokenized through the server (llama.cpp) once the reply has ended;
* ``snapshot``/``subscribe``: the server's Prometheus metrics polled every ``poll_s`` seconds
  (``server_metrics``): KV usage, running/waiting, prefix-cache hits; no blocks, and the snapshot
  says why (``blocks_hidden``), which the block map and the inspector show in their place;
* ``abort`` closes the request's HTTP stream, which every one of these servers takes as an abort;
  ``reset_prefix_cache`` is vLLM's dev-mode ``POST /reset_prefix_cache`` where it is served.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from typing import Iterator

import httpx

from ..config import EngineConfig
from ..llm import EngineDeadError, _conversations
from ..outputs import RequestOutput, StreamDelta
from ..request import RequestMetrics
from ..sampling_params import SamplingParams
from . import openai_wire as wire
from . import server_metrics as sm
from .server_tokenizer import ServerTokenizer

logger = logging.getLogger("engine")
_ids = itertools.count(1)
SERVERS = {"vllm": "vLLM", "fastdeploy": "FastDeploy", "llamacpp": "llama.cpp's llama-server",
           "fleet-playground": "this project's engine server"}
SHORT = {"vllm": "vLLM", "fastdeploy": "FastDeploy", "llamacpp": "llama.cpp", "fleet-playground": "engine server"}
# What each kind of server is asked beyond OpenAI's fields (vLLM's extras: the ids of every token)
EXTRAS = {"vllm": {"return_token_ids": True, "return_tokens_as_token_ids": True},
          "fastdeploy": {"return_token_ids": True}, "llamacpp": {}, "openai": {}}


class OpenAIServer:
    """``OpenAIServer("http://host:8000", api_key=None)``: fails at once if ``/v1/models`` does not answer."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0, poll_s: float = 1.0):
        self.url, self.poll_s = url.rstrip("/"), poll_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, read=None))
        models = self._checked(self._send("GET", "/v1/models")).json()
        entry = (models.get("data") or [{}])[0]
        if not entry.get("id"):
            raise ValueError(f"{self.url}/v1/models lists no model")
        self._served, owner = entry["id"], str(entry.get("owned_by", "")).lower()
        self._metrics = sm.MetricsPoller(self._http, poll_s)
        self._flavour = self._metrics.flavour
        self.kind = next((k for k in ("llamacpp", "fastdeploy", "vllm") if owner == k or self._flavour == k),
                         "vllm" if owner == "fleet-playground" else "openai")
        self.server = SERVERS.get(owner) or SERVERS.get(self.kind) or f"an OpenAI-compatible server ({owner or '?'})"
        meta = entry.get("meta") or {}
        props = self._http.get("/props").json() if self.kind == "llamacpp" else {}
        self.model_name = os.path.basename(self._served) if os.sep in self._served else self._served
        self._ours = owner == "fleet-playground"
        self.model_impl = f"{SHORT.get(owner) or SHORT.get(self.kind) or owner or 'server'} · OpenAI API"
        self.max_model_len = int(entry.get("max_model_len") or meta.get("n_ctx") or 0)
        self._tokenizer = ServerTokenizer(self._http, "llamacpp" if self.kind == "llamacpp" else "vllm",
                                          model=self._served, name=self.model_name, vocab_size=meta.get("n_vocab"))
        self.config = EngineConfig(model=str(entry.get("root") or self._served),
                                   max_model_len=self.max_model_len or None,
                                   block_size=self._metrics.latest()[0].block_size or 16,
                                   max_num_seqs=props.get("total_slots") or 16)
        self._live: dict[str, httpx.Response] = {}
        self._aborted: set[str] = set()

    # -- LLM's surface ----------------------------------------------------------------------------
    def get_tokenizer(self) -> ServerTokenizer:
        return self._tokenizer

    def stream(self, prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamDelta]:
        """As ``LLM.stream``: sent when iteration starts; closing it early (or ``abort``) aborts it."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams; got {type(params).__name__}")
        rid = request_id or f"openai-{next(_ids)}"
        streamed = params.prompt_logprobs is None      # vLLM serves prompt logprobs without streaming only
        route, body, ids = wire.request(prompt, params, model=self._served, extras=EXTRAS[self.kind],
                                        stream=streamed)
        metrics = RequestMetrics(arrival_time=time.time())
        with self._open(route, body) as response:
            self._live[rid] = response
            try:
                yield from self._deltas(rid, prompt, params, ids, response, streamed, metrics)
            finally:
                self._live.pop(rid, None)
                self._aborted.discard(rid)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        return self._batch(list(prompts) if isinstance(prompts, (list, tuple)) else [prompts], sampling_params)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        return self._batch(_conversations(messages), sampling_params)

    def abort(self, request_id: str) -> bool:
        response = self._live.get(request_id)
        if response is None:
            return False
        self._aborted.add(request_id)
        with contextlib.suppress(Exception):
            response.close()
        return True

    def snapshot(self):
        reading, step, last = self._metrics.latest()
        return sm.snapshot(reading, step, last, model=self.model_name, model_impl=self.model_impl,
                           device="remote", why=self._why())

    def subscribe(self, callback):
        """``callback(EngineEvent)`` for each poll of ``/metrics`` that saw work, on this client's thread."""
        if not callable(callback):
            raise ValueError(f"subscribe() needs a callable; got {type(callback).__name__}")
        return self._metrics.subscribe(callback)

    def reset_prefix_cache(self) -> int:
        response = self._send("POST", "/reset_prefix_cache")
        if response.status_code >= 400:
            raise ValueError(f"{self.server} does not reset its prefix cache over HTTP (vLLM does, started with "
                             f"VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache); it answered {response.status_code}")
        return 0

    def estimate_prefill(self, token_ids):
        """Not available: the estimate reads the engine's prefix-cache index, which such a server does not expose."""
        raise NotImplementedError(
            f"what a prompt will cost is not available on {self.server}: an OpenAI-compatible server exposes its "
            "prefix-cache hit counts, not the index of cached blocks. It works in process (LLM, LLMProcess) and on "
            "this project's engine server read through its /engine routes" + (" (drop --openai-only)" if self._ours else ""))

    def kv_events(self, since=0):
        """Not available: such a server exposes aggregate counters, not its KV cache's events."""
        raise NotImplementedError(
            f"the KV event log is not available on {self.server}: an OpenAI-compatible server exposes aggregate "
            "metrics (preemptions, KV usage), not each allocation, eviction and preemption with its cause. It works "
            "in process (LLM, LLMProcess) and on this project's engine server read through its /engine routes"
            + (" (drop --openai-only)" if self._ours else ""))

    def attention_lens(self, token_ids, position, layer=None, head=None):
        """Not available: the lens reads the engine's queries and KV cache, which an OpenAI-compatible server
        does not expose."""
        raise NotImplementedError(
            f"the attention lens is not available on {self.server}: an OpenAI-compatible server exposes neither "
            "its attention nor its KV blocks. It works in process (LLM, LLMProcess) and on this project's engine "
            "server (python -m engine.entrypoints.openai.api_server) read through its /engine routes"
            + (" (drop --openai-only)" if self._ours else ""))

    def sampler_pipeline(self, token_ids, position, sampling_params, num_prompt_tokens=None):
        """Not available: the stages need the logits before sampling, which an OpenAI-compatible server
        does not expose (its logprobs are one stage's top-k)."""
        raise NotImplementedError(
            f"the sampler's pipeline is not available on {self.server}: an OpenAI-compatible server returns at "
            "most the top-k logprobs of one stage, not the logits before its penalties and filters. It works in "
            "process (LLM, LLMProcess) and on this project's engine server (python -m "
            "engine.entrypoints.openai.api_server) read through its /engine routes"
            + (" (drop --openai-only)" if self._ours else ""))

    def shutdown(self) -> None:
        self._metrics.close()
        self._http.close()

    # -- metrics ----------------------------------------------------------------------------------
    def _why(self) -> str:
        if self._ours:
            why = ("This project's engine server is read here through its OpenAI routes and /metrics only "
                   "(--openai-only), as any other server: they carry counts and usage, not block tables. Without "
                   "--openai-only the playground reads its /engine routes, and this map shows every block.")
        else:
            why = (f"{self.server} does not expose its block tables, only counts and usage in its /metrics: the KV "
                   "blocks can be drawn only for this project's engine server (its /engine routes).")
        if self._flavour is None:
            why += " Its /metrics is not served either, so KV usage and requests read as 0" + (
                " (start llama-server with --metrics)." if self.kind == "llamacpp" else ".")
        elif self._flavour == "llamacpp":
            why += " llama-server exports no KV-usage gauge: KV usage reads as 0."
        return why

    # -- requests ---------------------------------------------------------------------------------
    def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise EngineDeadError(f"the server at {self.url} cannot be reached: {exc}") from None

    def _checked(self, response: httpx.Response) -> httpx.Response:
        if response.status_code < 400:
            return response
        try:
            message = response.json()["error"]["message"]
        except Exception:   # noqa: BLE001  (not OpenAI's error body)
            message = response.text[:200]
        if response.status_code == 401:
            raise ValueError(f"the server wants an API key (give api_key, or --api-key): {message}")
        if response.status_code in (400, 404, 422):
            raise ValueError(f"{response.request.url.path}: {message}")
        raise EngineDeadError(f"the server answered {response.status_code}: {message}")

    @contextlib.contextmanager
    def _open(self, route: str, body: dict):
        try:
            with self._http.stream("POST", route, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    self._checked(response)
                yield response
        except httpx.TransportError as exc:
            raise EngineDeadError(f"the server at {self.url} cannot be reached: {exc}") from None

    def _deltas(self, rid, prompt, params, ids, response, streamed, metrics) -> Iterator[StreamDelta]:
        """The deltas of one answer. The prompt's length and cached tokens come with the last one: the
        servers tell the cached tokens in the usage at the end, and a count shown before would read as
        "nothing cached"."""
        finish = error = usage = prompt_lps = last = None
        try:
            for data in wire.chunks(response, streamed):
                if isinstance(data.get("error"), dict):
                    error = data["error"].get("message", str(data["error"]))
                    break
                usage = data.get("usage") or usage
                ids = ids or data.get("prompt_token_ids")
                prompt_lps = data.get("prompt_logprobs") or prompt_lps
                for choice in data.get("choices") or []:
                    ids = ids or choice.get("prompt_token_ids")
                    prompt_lps = choice.get("prompt_logprobs") or prompt_lps
                    text, tids, lps = wire.tokens(choice, self._tokenizer)
                    finish = choice.get("finish_reason") or finish
                    if text or tids:
                        metrics.first_token_time = metrics.first_token_time or time.time()
                        metrics.num_output_tokens += len(tids)
                        last = (text, tids)
                        yield StreamDelta(rid, text, tids, lps if params.logprobs is not None else [],
                                          prompt_token_ids=list(ids or ()), metrics=metrics)
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            if rid not in self._aborted:
                raise EngineDeadError(f"the stream from {self.url} broke: {exc}") from None
        if rid in self._aborted:
            finish = "abort"
        elif error is None and finish is None:
            error = "the server closed the stream before the request finished"
        elif error is None and params.prompt_logprobs is not None and prompt_lps is None:
            error = f"{self.server} does not return prompt logprobs (vLLM's prompt_logprobs extra)"
        metrics.finished_time = time.time()
        if finish == "stop" and last and last[1] and not last[0] and not (params.stop or params.stop_token_ids):
            # ended by a token without text and no stop the caller set: the model's end of turn (vLLM-like
            # servers do not name their EOS ids; the playground marks a reply's end with these)
            self._tokenizer.eos_token_ids = self._tokenizer.eos_token_ids | {last[1][-1]}
        ids = list(ids or self._prompt_ids(prompt, usage))
        usage = usage or {}
        yield StreamDelta(rid, "", [], [], finished=True, finish_reason="error" if error else finish,
                          num_prompt_tokens=int(usage.get("prompt_tokens") or len(ids)), prompt_token_ids=ids,
                          num_cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                          metrics=metrics, error=error, prompt_logprobs=wire.prompt_logprobs(prompt_lps))

    def _prompt_ids(self, prompt, usage) -> list[int]:
        """The prompt's ids through the server's tokenizer, where the answer did not carry them."""
        if not self._tokenizer.routes:
            return []
        try:
            if isinstance(prompt, (list, tuple)):
                text = self._tokenizer.apply_chat_template(list(prompt))
            else:
                text = prompt["prompt"] if isinstance(prompt, dict) else prompt
            chat = isinstance(prompt, (list, tuple))    # vLLM adds no special tokens to a chat's; llama.cpp does
            ids = self._tokenizer.encode(text, add_special_tokens=self.kind == "llamacpp" or not chat)
        except (ValueError, EngineDeadError) as exc:
            logger.warning("the prompt's token ids are unknown (%s): branching from this reply is off", exc)
            return []
        if usage and usage.get("prompt_tokens") not in (None, len(ids)):
            logger.warning("%s counted %s prompt tokens, its tokenizer gave %d", self.server,
                           usage["prompt_tokens"], len(ids))
        return ids

    def _batch(self, prompts: list, sampling_params) -> list[RequestOutput]:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        results: list = [None] * len(prompts)

        def run(i):
            try:
                results[i] = list(self.stream(prompts[i], params[i]))
            except BaseException as exc:  # noqa: BLE001  (raised in the caller's thread below)
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [wire.output(p if isinstance(p, str) else None, sp or SamplingParams(), d)
                for p, sp, d in zip(prompts, params, results)]
