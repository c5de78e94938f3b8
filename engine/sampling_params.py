"""Per-request sampling settings (vLLM/FastDeploy names), validated on construction."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``, vllm/sampling_params.py): dividing
# logits by a subnormal temperature overflows to inf and the probabilities become NaN.
GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature < 1e-5`` (0 included) is greedy. ``top_k == 0`` (or -1) and
    ``top_p == 1`` disable those filters. ``logprobs=k`` returns, for every
    generated token, its logprob, its rank and the top-k alternatives;
    ``prompt_logprobs=k`` does the same for every prompt position after the
    first. Logprobs are computed from the model's raw logits (before
    temperature / top-k / top-p), so they describe the model, not the sampling
    filter. Every field is checked here, so a bad value is a ``ValueError``
    naming the field and what it accepts before anything is queued.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    _stop: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        self.max_tokens = _integer("max_tokens", self.max_tokens, 1, None, "an integer >= 1")
        self.temperature = _number("temperature", self.temperature, 0.0, None)
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.min_p = _number("min_p", self.min_p, 0.0, 1.0)
        self.top_k = _integer("top_k", self.top_k, -1, None, "an integer >= 0 (0 or -1 disables it)")
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, 0, None, "None or an integer >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _integer(name, getattr(self, name), 0, MAX_LOGPROBS,
                                             f"None or an integer in [0, {MAX_LOGPROBS}]"))
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if isinstance(self.stop, str):
            stop = [self.stop]
        elif self.stop is None or isinstance(self.stop, (list, tuple)):
            stop = list(self.stop or [])
        else:
            stop = [None]
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them; got {self.stop!r}")
        self._stop = tuple(stop)
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative token ids; got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(i) for i in ids]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop


def _integer(name, value, low, high, accepted) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or (
        high is not None and value > high
    ):
        raise ValueError(f"{name} must be {accepted}; got {value!r}")
    return int(value)


def _number(name, value, low, high, low_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        lo = "(" if low_open else "["
        hi = f"{high}]" if high is not None else "inf)"
        raise ValueError(f"{name} must be in {lo}{low}, {hi}; got {value!r}")
    return float(value)
