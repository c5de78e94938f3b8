"""Per-request sampling settings (vLLM/FastDeploy names), validated on construction and on assignment."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64          # stop strings per request, and characters per stop string: each is
MAX_STOP_STRING_CHARS = 4096   # matched at every token (tests/test_reliability.py times the worst case)
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
    - ``logprobs_mode`` (FastDeploy's and vLLM's name): ``"raw"`` (the default, as
      above) or ``"processed"``: the logprobs of the distribution the token was
      drawn from, after penalties, temperature, top-k, min-p and top-p, over the
      tokens those kept (``engine.sampler_pipeline``); FastDeploy's spellings
      ``raw_logprobs`` / ``processed_logprobs`` are accepted.

    Every field is checked here, and again when it is set later, so a bad value
    is a ``ValueError`` naming the field and what it accepts before anything is
    queued; the engine takes a checked copy at submission, so changing (or
    mutating in place) a ``SamplingParams`` later never touches a queued request.
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
    logprobs_mode: str = "raw"
    _stop: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        for name in _CHECKS:
            object.__setattr__(self, name, _CHECKS[name](getattr(self, name)))
        object.__setattr__(self, "_stop", _stop_tuple(self.stop))
        _check_together(self)
        object.__setattr__(self, "_checked", True)

    def __setattr__(self, name: str, value) -> None:
        """A field set after construction is checked as on construction (and with the fields it
        depends on), so a bad value is a ``ValueError`` here and the old value stays."""
        if name not in _CHECKS or not self.__dict__.get("_checked"):
            object.__setattr__(self, name, value)
            return
        value, old = _CHECKS[name](value), getattr(self, name)
        object.__setattr__(self, name, value)
        try:
            _check_together(self)
        except ValueError:
            object.__setattr__(self, name, old)
            raise
        if name == "stop":
            object.__setattr__(self, "_stop", _stop_tuple(value))

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


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({type(value).__name__}, {len(text)} characters)"


def _integer(name, value, low, high, accepted) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or (
        high is not None and value > high
    ):
        raise ValueError(f"{name} must be {accepted}; got {_short(value)}")
    return int(value)


def _number(name, value, low, high, low_open=False) -> float:
    try:
        finite = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    except OverflowError:                           # an int beyond float's range: 10**400
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number; got {_short(value)}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        lo = "(" if low_open else "["
        hi = f"{high}]" if high is not None else "inf)"
        raise ValueError(f"{name} must be in {lo}{low}, {hi}; got {_short(value)}")
    return float(value)


def _flag(name):
    def check(value):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False; got {_short(value)}")
        return value
    return check


def _optional(check):
    return lambda value: None if value is None else check(value)


def _stop_tuple(stop) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def _check_stop(value):
    """``stop``: None, a non-empty string or a list / tuple of them, at most ``MAX_STOP_STRINGS`` of
    at most ``MAX_STOP_STRING_CHARS`` characters (each is matched at every token)."""
    stops = [value] if isinstance(value, str) else (list(value) if isinstance(value, (list, tuple)) else
                                                     [None] if value is not None else [])
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them; got {_short(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are accepted")
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_STRING_CHARS:
        raise ValueError(f"stop has a string of {len(longest)} characters; at most {MAX_STOP_STRING_CHARS} "
                         f"are accepted")
    return value


def _check_stop_token_ids(value) -> list[int]:
    ids = value if value is not None else []
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise ValueError(f"stop_token_ids must be a list of non-negative token ids; got {_short(value)}")
    return [int(i) for i in ids]


def _check_together(params: SamplingParams) -> None:
    if params.min_tokens > params.max_tokens:
        raise ValueError(f"min_tokens must be <= max_tokens={params.max_tokens}; got {params.min_tokens}")


_LOGPROBS = f"None or an integer in [0, {MAX_LOGPROBS}]"
# Each field's check: returns the value to store (normalized) or raises a ValueError naming the field.
_CHECKS = {
    "max_tokens": lambda v: _integer("max_tokens", v, 1, None, "an integer >= 1"),
    "temperature": lambda v: _number("temperature", v, 0.0, None),
    "top_p": lambda v: _number("top_p", v, 0.0, 1.0, low_open=True),
    "top_k": lambda v: _integer("top_k", v, -1, None, "an integer >= 0 (0 or -1 disables it)"),
    "min_p": lambda v: _number("min_p", v, 0.0, 1.0),
    "seed": _optional(lambda v: _integer("seed", v, 0, None, "None or an integer >= 0")),
    "stop": _check_stop,
    "stop_token_ids": _check_stop_token_ids,
    "ignore_eos": _flag("ignore_eos"),
    "logprobs": _optional(lambda v: _integer("logprobs", v, 0, MAX_LOGPROBS, _LOGPROBS)),
    "prompt_logprobs": _optional(lambda v: _integer("prompt_logprobs", v, 0, MAX_LOGPROBS, _LOGPROBS)),
    "skip_special_tokens": _flag("skip_special_tokens"),
    "presence_penalty": lambda v: _number("presence_penalty", v, -2.0, 2.0),
    "frequency_penalty": lambda v: _number("frequency_penalty", v, -2.0, 2.0),
    "repetition_penalty": lambda v: _number("repetition_penalty", v, 0.0, None, low_open=True),
    "min_tokens": lambda v: _integer("min_tokens", v, 0, None, "an integer >= 0"),
    "include_stop_str_in_output": _flag("include_stop_str_in_output"),
    "logprobs_mode": lambda v: _logprobs_mode(v),
}


def _logprobs_mode(value) -> str:
    modes = {"raw": "raw", "processed": "processed", "raw_logprobs": "raw", "processed_logprobs": "processed"}
    if not isinstance(value, str) or value not in modes:
        raise ValueError(f"logprobs_mode must be 'raw' or 'processed' (or FastDeploy's 'raw_logprobs' / "
                         f"'processed_logprobs'); got {_short(value)}")
    return modes[value]
