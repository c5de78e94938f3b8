"""The engine's requests as OpenAI request bodies, and the servers' answers as the engine's records.

``request(prompt, params, ...)`` picks the route the way the playground's prompts mean it: chat
messages go to ``/v1/chat/completions``; text and ``{"prompt": text}`` to ``/v1/completions``;
``{"prompt_token_ids": ids}`` (a branch: the prompt, the kept tokens, the forced one) to
``/v1/completions`` with the ids as the prompt. Logprobs are always asked for (``top_logprobs`` 0 when
the caller wants none): they are where every server names the tokens it generated.

``tokens(choice, ...)`` reads one choice of a chunk (streamed) or of a whole answer, in any of the
shapes servers send:

* chat ``logprobs.content[]`` entries ``{token, logprob, bytes, top_logprobs[]}``, which llama.cpp
  also sends for ``/v1/completions`` and where each entry carries its token ``id``;
* the legacy completions shape ``{tokens, token_logprobs, top_logprobs: [{text: logprob}]}``;
* tokens named ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``, which this client asks of
  vLLM-like servers), and the sampled ids in ``token_ids`` (vLLM's and FastDeploy's
  ``return_token_ids``).

A token's id comes from the answer where it is there, else from its text (``ServerTokenizer.piece_id``).
Ranks are counted within the top-k sent: a token outside it ranks k + 1 or later and is given k + 1.
A logprob of -9999 or below (vLLM's stand-in for -inf) is -inf.
"""

from __future__ import annotations

import json
import math
from typing import Iterator

from ..outputs import CompletionOutput, RequestOutput, StreamDelta
from ..request import Logprob
from ..sampling_params import SamplingParams

TOKEN_ID = "token_id:"


def request(prompt, params: SamplingParams, *, model: str, extras: dict, stream: bool = True
            ) -> tuple[str, dict, list[int] | None]:
    """``(route, body, the prompt's ids when they are known already)``."""
    ids = None
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        route, body = "/v1/chat/completions", {"messages": [dict(m) for m in prompt]}
    elif isinstance(prompt, str):
        route, body = "/v1/completions", {"prompt": prompt}
    elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        route, body = "/v1/completions", {"prompt": prompt["prompt"]}
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = [int(t) for t in prompt["prompt_token_ids"]]
        route, body = "/v1/completions", {"prompt": ids}
    else:
        raise ValueError("a prompt is text, {'prompt': text}, {'prompt_token_ids': [...]} or a list of chat "
                         f"messages; got {type(prompt).__name__}")
    p = params
    body.update(model=model, stream=stream, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p)
    k = p.logprobs or 0
    body.update({"logprobs": True, "top_logprobs": k} if route.endswith("chat/completions") else {"logprobs": k})
    if stream:
        body["stream_options"] = {"include_usage": True}
    optional = {"top_k": p.top_k or None, "min_p": p.min_p or None, "seed": p.seed,
                "stop": [p.stop] if isinstance(p.stop, str) else (list(p.stop) if p.stop else None),
                "stop_token_ids": list(p.stop_token_ids) if p.stop_token_ids else None,
                "ignore_eos": p.ignore_eos or None, "presence_penalty": p.presence_penalty or None,
                "frequency_penalty": p.frequency_penalty or None,
                "repetition_penalty": p.repetition_penalty if p.repetition_penalty != 1.0 else None,
                "min_tokens": p.min_tokens or None, "include_stop_str_in_output": p.include_stop_str_in_output or None,
                "skip_special_tokens": False if not p.skip_special_tokens else None,
                "prompt_logprobs": p.prompt_logprobs}
    body.update({key: value for key, value in optional.items() if value is not None})
    body.update(extras)
    return route, body, ids


def _logprob(value) -> float:
    value = -math.inf if value is None else float(value)
    return -math.inf if value <= -9999.0 else value


def _entries(logprobs) -> list[tuple[str, float, int | None, list[tuple[str, float, int | None]]]]:
    """``[(token text, logprob, id or None, [(alternative's text, logprob, id or None)])]``."""
    if not logprobs:
        return []
    if "content" in logprobs:       # the chat shape (llama.cpp's completions too)
        return [(e["token"], _logprob(e["logprob"]), e.get("id"),
                 [(a["token"], _logprob(a["logprob"]), a.get("id")) for a in e.get("top_logprobs") or []])
                for e in logprobs["content"] or []]
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs.get("tokens") or [])
    return [(t, _logprob(lp), None, [(a, _logprob(v), None) for a, v in (top or {}).items()])
            for t, lp, top in zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [], tops)]


def tokens(choice: dict, tokenizer) -> tuple[str, list[int], list[dict[int, Logprob]]]:
    """``(text, token ids, one {id: Logprob} per token)`` of one choice (a chunk's or a whole answer's)."""
    message = choice.get("delta") or choice.get("message") or {}
    text = choice.get("text") if "text" in choice else message.get("content")
    sampled = choice.get("token_ids")
    ids, lps = [], []
    for i, (token, logprob, tid, alternatives) in enumerate(_entries(choice.get("logprobs"))):
        tid = _id(token, tid, tokenizer, sampled[i] if sampled and i < len(sampled) else None)
        if tid is None:
            continue
        entry: dict[int, Logprob] = {}
        for rank, (alt, value, alt_id) in enumerate(sorted(alternatives, key=lambda a: -a[1]), start=1):
            alt_id = _id(alt, alt_id, tokenizer, None)
            if alt_id is not None and alt_id not in entry:
                entry[alt_id] = Logprob(value, rank, _text(alt, alt_id, tokenizer))
        if tid not in entry:
            entry[tid] = Logprob(logprob, 1 + sum(v > logprob for _, v, _ in alternatives),
                                 _text(token, tid, tokenizer))
        ids.append(tid)
        lps.append(entry)
    if sampled and not ids:         # ids without logprobs
        ids = [int(t) for t in sampled]
    return text or "", ids, lps


def _id(token: str, given, tokenizer, sampled) -> int | None:
    if given is not None:
        tid = int(given)
    elif sampled is not None:
        tid = int(sampled)
    elif token.startswith(TOKEN_ID):
        return int(token[len(TOKEN_ID):])
    else:
        return tokenizer.piece_id(token)
    if not token.startswith(TOKEN_ID):
        tokenizer.learn(tid, token)
    return tid


def _text(token: str, tid: int, tokenizer) -> str:
    return tokenizer.decode([tid]) if token.startswith(TOKEN_ID) else token


def prompt_logprobs(data) -> list[dict[int, Logprob] | None] | None:
    """vLLM's ``prompt_logprobs``: ``[None, {"id": {logprob, rank, decoded_token}}, ...]``."""
    if data is None:
        return None
    return [None if pos is None else {int(t): Logprob(_logprob(v.get("logprob")), int(v.get("rank") or 0),
                                                      v.get("decoded_token")) for t, v in pos.items()}
            for pos in data]


def chunks(response, streamed: bool) -> Iterator[dict]:
    """The JSON objects of an answer: its SSE events up to ``[DONE]``, or the one body."""
    if not streamed:
        yield json.loads(response.read())
        return
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def output(prompt_text, params: SamplingParams, deltas: list[StreamDelta]) -> RequestOutput:
    """A finished request's ``RequestOutput`` from its deltas (as ``LLM.generate`` returns it)."""
    last = deltas[-1]
    return RequestOutput(
        request_id=last.request_id, prompt=prompt_text, prompt_token_ids=list(last.prompt_token_ids),
        prompt_logprobs=last.prompt_logprobs, finished=True, num_cached_tokens=last.num_cached_tokens,
        metrics=last.metrics,
        outputs=[CompletionOutput(index=0, text="".join(d.text for d in deltas),
                                  token_ids=[t for d in deltas for t in d.token_ids],
                                  logprobs=[lp for d in deltas for lp in d.logprobs] if params.logprobs is not None
                                  else None, finish_reason=last.finish_reason, error=last.error)])
