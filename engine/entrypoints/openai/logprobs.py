"""The engine's per-token ``Logprob`` dicts in OpenAI's shapes.

The engine gives, for each sampled token, a dict of the k most likely tokens plus the sampled
one, each with its logprob and rank. OpenAI's ``top_logprobs`` are the k most likely tokens, so
the sampled token is among them when it ranks in the top k (and only then), as OpenAI answers.
A logprob of ``-inf`` (a token the model rules out) is sent as -9999.0, as vLLM does: JSON has
no infinity.
"""

from __future__ import annotations

import math


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else -9999.0


def _top(entries: dict, k: int) -> list[tuple[int, object]]:
    return sorted(((t, lp) for t, lp in entries.items() if lp.rank <= k), key=lambda x: x[1].rank)[:k]


def _token(lp, token_id: int, as_ids: bool = False) -> str:
    """The token as text, or as ``token_id:N`` with vLLM's ``return_tokens_as_token_ids``."""
    if as_ids:
        return f"token_id:{token_id}"
    return lp.decoded_token if lp.decoded_token is not None else f"<token {token_id}>"


def chat_logprobs(token_ids: list[int], logprobs: list[dict], k: int, *, as_ids: bool = False) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    content = []
    for tid, entries in zip(token_ids, logprobs):
        lp = entries[tid]
        tok = _token(lp, tid, as_ids)
        content.append({"token": tok, "logprob": _finite(lp.logprob), "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": [{"token": _token(a, t, as_ids), "logprob": _finite(a.logprob),
                                          "bytes": list(_token(a, t, as_ids).encode("utf-8"))}
                                         for t, a in _top(entries, k)]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], logprobs: list[dict], k: int, *, prompt=None,
                        prompt_ids: list[int] | None = None, decode=None, offset: int = 0,
                        as_ids: bool = False) -> dict:
    """The legacy completions shape: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per
    token) and ``text_offset``; with ``prompt`` (echo), the prompt's tokens first, the first of
    them with no logprob (nothing comes before it)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pairs = []
    if prompt is not None:
        pairs += [(tid, entries) for tid, entries in zip(prompt_ids, prompt)]
    pairs += list(zip(token_ids, logprobs))
    for tid, entries in pairs:
        offsets.append(offset)
        if entries is None:     # the prompt's first token: nothing before it to predict it
            tok = f"token_id:{tid}" if as_ids else decode(tid)
            tokens.append(tok)
            token_lps.append(None)
            tops.append(None)
            offset += len(tok)
            continue
        lp = entries[tid]
        tok = _token(lp, tid, as_ids)
        tokens.append(tok)
        token_lps.append(_finite(lp.logprob))
        tops.append({_token(a, t, as_ids): _finite(a.logprob) for t, a in _top(entries, k)})
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(prompt_logprobs) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt position ``None`` (the first) or
    ``{token_id: {logprob, rank, decoded_token}}``."""
    if prompt_logprobs is None:
        return None
    return [None if entries is None else {str(t): {"logprob": _finite(a.logprob), "rank": a.rank,
                                                   "decoded_token": a.decoded_token} for t, a in entries.items()}
            for entries in prompt_logprobs]
