"""One generation request and its lifecycle state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .provenance import Provenance
from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Logprob:
    """One candidate token: its logprob, its rank among all tokens (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, seconds."""
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass(eq=False)
class Request:
    """A prompt plus everything generated so far.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache (cached
    prefix included); the scheduler advances it, preemption resets it to 0.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # set when first scheduled; -1 = not yet
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why it failed, with finish_reason "error"
    output_text: str = ""
    metrics: RequestMetrics = None  # type: ignore[assignment]
    provenance: Provenance = field(default_factory=Provenance)  # where its tokens' K/V came from (engine.provenance)

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int, logprobs: dict[int, Logprob] | None) -> None:
        self.output_token_ids.append(token_id)
        self.metrics.num_output_tokens = len(self.output_token_ids)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
