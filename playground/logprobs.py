"""Per-token logprob records: the data behind the logprob view.

The engine streams, for every generated token, a dict
``{token_id: Logprob(logprob, rank, decoded_token)}`` holding the sampled
token and the top-k alternatives. ``token_records`` turns those into plain,
JSON-friendly dicts that ``render.logprob_html`` draws and the branching
feature reads (which alternatives a token had). Logprob values may be engine
``Logprob`` objects or dicts with the same fields.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["token_records", "forced_record", "entropy_bits", "token_tooltip_rows", "metric_text", "METRICS"]


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def entropy_bits(probs: Sequence[float]) -> tuple[float, bool]:
    """Entropy (bits) of a top-k distribution, plus whether it is only a bound.

    The probability mass outside the top-k is counted as one extra outcome, so
    the result is a lower bound on the true entropy whenever that mass is
    noticeable (``is_bound`` is then True).
    """
    probs = [p for p in probs if p > 0]
    rest = max(0.0, 1.0 - sum(probs))
    terms = probs + ([rest] if rest > 1e-9 else [])
    h = -sum(p * math.log2(p) for p in terms)
    return max(h, 0.0), rest > 1e-3


def token_records(
    token_ids: Sequence[int],
    logprobs: Sequence[Mapping[int, Any] | None] | None,
    *,
    start_index: int = 0,
    decode: Callable[[int], str] | None = None,
) -> list[dict]:
    """Build one record per generated token.

    Args:
        token_ids: the generated token ids, in order.
        logprobs: one ``{token_id: Logprob}`` dict per token (or None when the
            request asked for no logprobs).
        start_index: index of the first token within the reply.
        decode: fallback ``token_id -> text`` when a Logprob has no
            ``decoded_token``.

    Returns dicts with ``index``, ``token_id``, ``text``, ``logprob``,
    ``prob``, ``alternatives`` (top-k, most likely first, each with
    ``token_id``, ``text``, ``logprob``, ``prob``, ``rank``), ``entropy``,
    ``entropy_is_bound`` and ``forced`` (False).
    """
    records = []
    for i, tid in enumerate(token_ids):
        entry = logprobs[i] if logprobs is not None and i < len(logprobs) else None
        alternatives = []
        for alt_id, lp in (entry or {}).items():
            value = float(_field(lp, "logprob", float("-inf")))
            text = _field(lp, "decoded_token")
            if text is None and decode is not None:
                text = decode(int(alt_id))
            alternatives.append({
                "token_id": int(alt_id),
                "text": "" if text is None else str(text),
                "logprob": value,
                "prob": math.exp(value) if value > -1e30 else 0.0,
                "rank": _field(lp, "rank"),
            })
        alternatives.sort(key=lambda a: -a["logprob"])
        chosen = next((a for a in alternatives if a["token_id"] == int(tid)), None)
        if chosen is not None:
            text = chosen["text"]
        else:
            text = decode(int(tid)) if decode is not None else ""
        entropy, bound = entropy_bits([a["prob"] for a in alternatives]) if alternatives else (None, False)
        records.append({
            "index": start_index + i,
            "token_id": int(tid),
            "text": text,
            "logprob": None if chosen is None else chosen["logprob"],
            "prob": None if chosen is None else chosen["prob"],
            "alternatives": alternatives,
            "entropy": entropy,
            "entropy_is_bound": bound,
            "forced": False,
        })
    return records


def forced_record(index: int, token_id: int, text: str, source: Mapping[str, Any] | None = None) -> dict:
    """Record for a token forced by branching (chosen by the user, not sampled).

    ``source`` is the record of the token it replaced; its alternatives (and
    so the forced token's probability) are kept.
    """
    alternatives = list((source or {}).get("alternatives") or [])
    match = next((a for a in alternatives if a["token_id"] == token_id), None)
    return {
        "index": index,
        "token_id": int(token_id),
        "text": text if match is None or not match["text"] else match["text"],
        "logprob": None if match is None else match["logprob"],
        "prob": None if match is None else match["prob"],
        "alternatives": alternatives,
        "entropy": (source or {}).get("entropy"),
        "entropy_is_bound": bool((source or {}).get("entropy_is_bound")),
        "forced": True,
    }


def _show(text: str) -> str:
    return repr(text)[1:-1] if text.strip() == "" or "\n" in text else text


METRICS = ("probability", "logprob", "rank")


def metric_text(entry: Mapping[str, Any], metric: str = "probability") -> str:
    """One alternative's (or record's) value as the logprob view shows it."""
    if metric == "logprob":
        value = entry.get("logprob")
        return "?" if value is None else f"{value:.3f}"
    if metric == "rank":
        value = entry.get("rank")
        return "?" if value is None else f"#{value}"
    value = entry.get("prob")
    return "?" if value is None else f"{value * 100:.2f}%"


def token_tooltip_rows(record: Mapping[str, Any], metric: str = "probability") -> list[dict]:
    """Rows for a token's hover table: its alternatives, the chosen one marked.

    ``metric`` picks what each row shows: probability (%), raw logprob (nats) or rank.
    """
    rows = []
    seen = False
    for alt in record.get("alternatives") or []:
        chosen = alt["token_id"] == record.get("token_id")
        seen = seen or chosen
        rows.append({
            "token_id": alt["token_id"],
            "text": _show(alt["text"]),
            "prob_text": metric_text(alt, metric),
            "chosen": chosen,
        })
    if not seen:
        rows.insert(0, {
            "token_id": record.get("token_id"),
            "text": _show(str(record.get("text", ""))),
            "prob_text": metric_text(record, metric),
            "chosen": True,
        })
    return rows
