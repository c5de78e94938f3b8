"""One engine-client protocol, three transports.

``EngineClient`` is the surface every caller of the engine uses (the playground, notebooks,
benchmarks): ``LLM`` runs the engine in this process, ``LLMProcess`` in a child process over a
pipe, ``RemoteLLM`` on a server over HTTP (``python -m engine.entrypoints.openai.api_server``).
Views written against it work the same on all three. ``OpenAIServer`` speaks it to any
OpenAI-compatible server (vLLM, FastDeploy, llama.cpp) with what such a server tells: no KV
blocks, metrics instead of engine events (``openai_server``).
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol, runtime_checkable

from ..config import EngineConfig
from ..outputs import RequestOutput, StreamDelta
from ..sampling_params import SamplingParams
from ..snapshot import EngineEvent, EngineSnapshot


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig
    model_name: str
    model_impl: str
    max_model_len: int

    def get_tokenizer(self): ...

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]: ...

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]: ...

    def stream(self, prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamDelta]: ...

    def abort(self, request_id: str) -> bool: ...

    def snapshot(self) -> EngineSnapshot: ...

    def subscribe(self, callback: Callable[[EngineEvent], None]) -> Callable[[], None]: ...

    def reset_prefix_cache(self) -> int: ...

    def attention_lens(self, token_ids: list[int], position: int, layer: int | None = None,
                       head: int | None = None): ...

    def sampler_pipeline(self, token_ids: list[int], position: int, sampling_params: SamplingParams,
                         num_prompt_tokens: int | None = None): ...

    def estimate_prefill(self, token_ids: list[int]): ...

    def kv_events(self, since: int = 0) -> dict: ...

    def shutdown(self) -> None: ...


def connect(url: str, api_key: str | None = None, *, openai_only: bool = False):
    """The engine client for a server, found by asking it once for ``/engine/info``: ``RemoteLLM`` for
    this project's engine server (every view, the KV blocks included), ``OpenAIServer`` for any other
    OpenAI-compatible server (vLLM, FastDeploy, llama.cpp's llama-server), or for ours with
    ``openai_only`` (its standard routes only, as any other server)."""
    import httpx

    from .http import RemoteLLM
    from .openai_server import OpenAIServer

    if not openai_only:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            probe = httpx.get(url.rstrip("/") + "/engine/info", headers=headers, timeout=30.0)
        except httpx.TransportError as exc:
            from ..llm import EngineDeadError

            raise EngineDeadError(f"the server at {url} cannot be reached: {exc}") from None
        if probe.status_code == 200 and "model_impl" in probe.text:
            return RemoteLLM(url, api_key=api_key)
    return OpenAIServer(url, api_key=api_key)


def __getattr__(name: str):
    if name == "OpenAIServer":
        from .openai_server import OpenAIServer

        return OpenAIServer
    if name == "RemoteLLM":
        from .http import RemoteLLM

        return RemoteLLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EngineClient", "connect", "OpenAIServer", "RemoteLLM"]
