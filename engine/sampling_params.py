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
    penalties, min_tokens, temperature / top-k / top-p), so they describe the
    model, not the sampling filter.

    The extras an OpenAI-compatible server passes through follow vLLM
    (``vllm/sampling_params.py``, ``vllm/model_executor/layers/utils.py``
    ``apply_penalties``, ``MinTokensLogitsProcessor``): they change only the
    logits a token is picked from, greedy included.

    - ``repetition_penalty`` (> 0, 1 = off; the HF / vLLM rule): a token seen in
      the prompt or the output so far has its logit divided by it if positive,
      multiplied by it if negative.
    - ``frequency_penalty`` and ``presence_penalty`` (in [-2, 2], 0 = off;
      OpenAI's rule): ``logit -= frequency_penalty * count + presence_penalty *
      (count > 0)``, ``count`` = times the token is in the output so far.
    - ``min_tokens`` (>= 0, <= ``max_tokens``): until that many tokens are out,
      the tokens that would end the request (EOS unless ``ignore_eos``, and
      ``stop_token_ids``) cannot be picked, and stop strings are not matched.
    - ``include_stop_str_in_output``: keep the matched stop string at the end of
      the text (the text is still cut right after it).

    Every field is checked here, so a bad value is a ``ValueError`` naming the
    field and what it accepts before anything is queued.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    _stop: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        self.max_tokens = _integer("max_tokens", self.max_tokens, 1, None, "an integer >= 1")
        self.temperature = _number("temperature", self.temperature, 0.0, None)
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.min_p = _number("min_p", self.min_p, 0.0, 1.0)
        self.top_k = _integer("top_k", self.top_k, -1, None, "an integer >= 0 (0 or -1 disables it)")
        self.presence_penalty = _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        self.min_tokens = _integer("min_tokens", self.min_tokens, 0, None, "an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}; got {self.min_tokens}")
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, 0, None, "None or an integer >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _integer(name, getattr(self, name), 0, MAX_LOGPROBS,
                                             f"None or an integer in [0, {MAX_LOGPROBS}]"))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
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
    def adjusts_logits(self) -> bool:
        """Whether a penalty or ``min_tokens`` is set (else the picking row is the raw one)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0)

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
