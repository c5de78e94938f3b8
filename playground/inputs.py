"""Checking what a visitor sends, before anything reaches the engine.

The page's events take their inputs unprocessed (``preprocess=False``), so a
wrong-typed or out-of-range value sent through the HTTP API arrives here
instead of failing inside Gradio's component code with a generic error.
Every check raises ``InputError`` naming the field, what was given and what
is accepted; the handlers turn it into a ``gr.Error`` the visitor reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine import SamplingParams

__all__ = ["InputError", "Limits", "text", "number", "sampling", "alternative_tokens"]

MAX_SEED = 2**63 - 1
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by a
# subnormal temperature overflows to inf and the probabilities become NaN.
GREEDY_BELOW = 1e-5
MAX_FORCED_TOKENS = 64


class InputError(ValueError):
    """A visitor's value that the page cannot accept."""


@dataclass
class Limits:
    """Caps that keep one visitor from monopolising the server."""

    max_input_chars: int = 4000
    max_tokens: int = 512
    max_batch: int = 8
    batch_max_tokens: int = 48


def text(value: Any, name: str, *, max_chars: int | None = None) -> str:
    """A string (None counts as empty), at most ``max_chars`` long."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InputError(f"{name} must be text; got {type(value).__name__} {value!r:.60}")
    if max_chars is not None and len(value) > max_chars:
        raise InputError(f"{name} is {len(value)} characters long; the limit is {max_chars}. Please shorten it.")
    return value


def number(value: Any, name: str, low: float, high: float, *, integer: bool = False,
           default: float | None = None) -> float | int:
    """A finite number in [low, high] (numeric strings accepted); ``default`` for None/""."""
    if value is None or (isinstance(value, str) and not value.strip()):
        if default is None:
            raise InputError(f"{name} is missing; give a number between {low:g} and {high:g}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InputError(f"{name} must be a number between {low:g} and {high:g}; got {type(value).__name__}")
    try:
        x = float(value)
    except ValueError:
        raise InputError(f"{name} must be a number between {low:g} and {high:g}; got {value!r:.40}") from None
    if not math.isfinite(x) or not low <= x <= high:
        raise InputError(f"{name} must be between {low:g} and {high:g}; got {value!r:.40}")
    if integer:
        if not x.is_integer():
            raise InputError(f"{name} must be a whole number between {low:g} and {high:g}; got {value!r:.40}")
        return int(x)
    return x


def sampling(temperature: Any, top_p: Any, top_k: Any, max_tokens: Any, seed: Any, n_logprobs: Any,
             *, max_tokens_cap: int, vocab_size: int) -> SamplingParams:
    """SamplingParams from the sampling controls' values (the sliders' own ranges)."""
    seed = number(seed, "seed", -1, MAX_SEED, integer=True, default=-1)
    k = number(n_logprobs, "logprobs", 0, 20, integer=True, default=0)
    temperature = number(temperature, "temperature", 0.0, 2.0)
    try:    # the engine's own checks too (top-p 0 is in the slider's range, not in SamplingParams')
        return SamplingParams(
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_p=number(top_p, "top-p", 0.0, 1.0),
            top_k=number(top_k, "top-k", 0, vocab_size, integer=True, default=0),
            max_tokens=number(max_tokens, "max tokens", 1, max_tokens_cap, integer=True),
            seed=None if seed < 0 else seed,
            logprobs=k or None,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None


def alternative_tokens(value: Any, encode, vocab_size: int) -> list[int]:
    """The token(s) a branch forces: a token id from the list, or typed text.

    Typed text is tokenized as it continues the reply (its leading space
    matters); it may be several tokens, up to ``MAX_FORCED_TOKENS``.
    """
    if value is None or value == "":
        raise InputError("choose an alternative from the list (or type the text to force) before branching")
    if isinstance(value, bool):
        raise InputError(f"alternative must be a token id or text; got {value!r}")
    if isinstance(value, (int, float)) or (isinstance(value, str) and value.strip().isdigit()):
        token_id = number(value, "alternative token id", 0, vocab_size - 1, integer=True)
        return [token_id]
    if not isinstance(value, str):
        raise InputError(f"alternative must be a token id or text; got {type(value).__name__}")
    ids = list(encode(value))
    if not ids:
        raise InputError(f"the alternative {value!r:.40} encodes to no tokens")
    if len(ids) > MAX_FORCED_TOKENS:
        raise InputError(f"the alternative is {len(ids)} tokens long; at most {MAX_FORCED_TOKENS} can be forced")
    return ids
