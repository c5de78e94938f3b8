"""One engine-client protocol, three transports.

``EngineClient`` is the surface every caller of the engine uses (the playground, notebooks,
benchmarks): ``LLM`` runs the engine in this process, ``LLMProcess`` in a child process over a
pipe, ``RemoteLLM`` on a server over HTTP (``python -m engine.entrypoints.openai.api_server``).
Views written against it work the same on all three.
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

    def shutdown(self) -> None: ...


def connect(url: str, api_key: str | None = None):
    """The engine client for a server: ``RemoteLLM`` for this project's server."""
    from .http import RemoteLLM

    return RemoteLLM(url, api_key=api_key)


__all__ = ["EngineClient", "connect"]
