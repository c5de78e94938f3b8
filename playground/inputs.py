"""Checking what a visitor sends, before anything reaches the engine.

The page's events take their inputs unprocessed (``preprocess=False``), so a
wrong-typed or out-of-range value sent through the HTTP API arrives here
instead of failing inside Gradio's component code with a generic error.
Every check raises ``InputError`` naming the field, what was given and what
is accepted; the handlers turn it into a ``gr.Error`` the visitor reads.
"""

from __future__ import annotations

import math
from html import escape
from dataclasses import dataclass
from typing import Any

from engine import SamplingParams

__all__ = ["InputError", "Limits", "text", "number", "sampling", "stop_sequences", "alternative_tokens",
           "SAMPLING_FIELDS", "FIELD_LABELS", "sampling_note"]

MAX_SEED = 2**63 - 1
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by a
# subnormal temperature overflows to inf and the probabilities become NaN.
GREEDY_BELOW = 1e-5
MAX_FORCED_TOKENS = 64


class InputError(ValueError):
    """A visitor's value that the page cannot accept; ``field`` names the control it came from."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


# The sampling controls, in the order the page passes them (the first six were the only ones once: a
# caller of the HTTP API that passes those six gets the defaults of the others).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "logprobs",
                   "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop")
# How the page labels each of SamplingParams' fields.
FIELD_LABELS = {"temperature": "temperature", "top_p": "top-p", "top_k": "top-k", "max_tokens": "max tokens",
                "seed": "seed", "logprobs": "logprobs", "min_p": "min-p", "repetition_penalty": "repetition penalty",
                "frequency_penalty": "frequency penalty", "presence_penalty": "presence penalty",
                "stop": "stop sequences"}


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


def _field_of(message: str) -> str | None:
    """The SamplingParams field an engine error names (its messages start with the field's name)."""
    name = message.split(" ", 1)[0]
    return name if name in FIELD_LABELS else None


def stop_sequences(value: Any) -> list[str] | None:
    """The stop sequences box: one sequence per line; ``\\n`` and ``\\t`` stand for a newline and a tab."""
    value = text(value, "stop sequences", max_chars=4096)
    stops = [line.replace("\\n", "\n").replace("\\t", "\t") for line in value.splitlines()]
    return [s for s in stops if s] or None


def sampling(temperature: Any, top_p: Any, top_k: Any, max_tokens: Any, seed: Any, n_logprobs: Any,
             min_p: Any = 0.0, repetition_penalty: Any = 1.0, frequency_penalty: Any = 0.0,
             presence_penalty: Any = 0.0, stop: Any = None,
             *, max_tokens_cap: int, vocab_size: int) -> SamplingParams:
    """SamplingParams from the sampling controls' values (the sliders' own ranges, then the engine's
    own checks). An ``InputError`` names the control (``.field``) and what it accepts."""
    def checked(name, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InputError as exc:
            raise InputError(str(exc), name) from None

    seed = checked("seed", number, seed, "seed", -1, MAX_SEED, integer=True, default=-1)
    k = checked("logprobs", number, n_logprobs, "logprobs", 0, 20, integer=True, default=0)
    temperature = checked("temperature", number, temperature, "temperature", 0.0, 2.0)
    values = dict(
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=checked("top_p", number, top_p, "top-p", 0.0, 1.0),
        top_k=checked("top_k", number, top_k, "top-k", 0, vocab_size, integer=True, default=0),
        max_tokens=checked("max_tokens", number, max_tokens, "max tokens", 1, max_tokens_cap, integer=True),
        seed=None if seed < 0 else seed,
        logprobs=k or None,
        min_p=checked("min_p", number, min_p, "min-p", 0.0, 1.0, default=0.0),
        repetition_penalty=checked("repetition_penalty", number, repetition_penalty, "repetition penalty",
                                   0.0, 2.0, default=1.0),
        frequency_penalty=checked("frequency_penalty", number, frequency_penalty, "frequency penalty",
                                  -2.0, 2.0, default=0.0),
        presence_penalty=checked("presence_penalty", number, presence_penalty, "presence penalty",
                                 -2.0, 2.0, default=0.0),
        stop=checked("stop", stop_sequences, stop),
    )
    try:    # the engine's own checks too (top-p 0 is in the slider's range, not in SamplingParams')
        return SamplingParams(**values)
    except ValueError as exc:
        message = str(exc)
        field = _field_of(message)
        if field:   # the engine's name for the field, as the page labels it
            message = FIELD_LABELS[field] + message[len(field):]
        raise InputError(message, field) from None


def sampling_note(*values: Any, max_tokens_cap: int, vocab_size: int) -> str:
    """What the page shows under the sampling controls: "" when ``sampling`` accepts ``values``, else the
    refused control's name and what it accepts (the controls' ``change`` event, before any send)."""
    try:
        sampling(*values, max_tokens_cap=max_tokens_cap, vocab_size=vocab_size)
    except InputError as exc:
        field = escape(FIELD_LABELS.get(exc.field or "", "sampling"))
        return (f'<div class="sampling-error" data-field="{escape(exc.field or "")}" role="alert" '
                f'style="color:#b91c1c;font-size:13px;padding:2px 4px">⚠ <b>{field}</b>: {escape(str(exc))}</div>')
    return ""


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
