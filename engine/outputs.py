"""What callers get back: finished ``RequestOutput``s and streaming ``StreamDelta``s."""

from __future__ import annotations

from dataclasses import dataclass, field

from .provenance import Provenance
from .request import Logprob, Request, RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None
    error: str | None = None   # with finish_reason "error": what went wrong

    @property
    def cumulative_logprob(self) -> float | None:
        if not self.logprobs:
            return None
        return sum(lp[t].logprob for lp, t in zip(self.logprobs, self.token_ids))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    provenance: Provenance | None = None   # each step's share of the request (engine.provenance)

    @property
    def error(self) -> str | None:
        """Why the request failed (``finish_reason == "error"``), else None."""
        return self.outputs[0].error if self.outputs else None

    def _repr_html_(self) -> str:
        """The reply's logprob strip (Jupyter's rich display), as the playground draws it."""
        from playground.reprs import output_html

        return output_html(self)

    @classmethod
    def from_request(cls, req: Request, prompt: str | None = None) -> "RequestOutput":
        p = req.sampling_params
        return cls(
            request_id=req.request_id,
            prompt=prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            prompt_logprobs=list(req.prompt_logprobs) if p.prompt_logprobs is not None else None,
            outputs=[CompletionOutput(
                index=0,
                text=req.output_text,
                token_ids=list(req.output_token_ids),
                logprobs=list(req.output_logprobs) if p.logprobs is not None else None,
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
                error=req.error,
            )],
            finished=req.is_finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=req.metrics,
            provenance=req.provenance,
        )


@dataclass
class StreamDelta:
    """New tokens of one request since its previous delta (token-by-token streaming)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # on the finishing delta, when asked for
    provenance: Provenance | None = None    # on the finishing delta: where its tokens' K/V came from
