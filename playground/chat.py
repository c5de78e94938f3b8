"""One browser tab's conversation and the streaming of one reply.

``ChatSession`` is the per-tab state (kept in a ``gr.State``): the
conversation as the model sees it, the prefix-cache history of its turns, the
last reply's tokens/logprobs (for the logprob view and branching) and the
request currently streaming. ``stream_reply`` runs one request through
``llm.stream`` and keeps a ``Reply`` up to date; closing it early (Stop, a
closed browser tab) closes the engine stream, which aborts the request and
frees its KV blocks.
"""

from __future__ import annotations

import itertools
import secrets
import time
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from .conversation import Conversation
from .logprobs import forced_record, token_records

__all__ = ["ChatSession", "Reply", "stream_reply", "reply_stats", "branch_prompt", "start_branch"]

_counter = itertools.count(1)


@dataclass
class Reply:
    """One generated reply, as it streams."""

    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    prefix_token_ids: list[int] = field(default_factory=list)   # forced by branching
    token_ids: list[int] = field(default_factory=list)          # sampled by the engine
    text: str = ""
    records: list[dict] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    ttft: float | None = None
    decode_tps: float | None = None
    state: str = "queued"                                       # queued · prefill n / m · decoding · done
    stopped: bool = False                                       # ended by Stop (or a closed tab)
    prefill_s: float | None = None                              # first scheduled to first token (the engine's)
    params: Any = None                                          # the SamplingParams it was sampled with
    provenance: Any = None                                      # where its K/V came from (engine.provenance), once finished

    @property
    def all_token_ids(self) -> list[int]:
        """Every token of the reply: the forced prefix and the sampled tokens."""
        return self.prefix_token_ids + self.token_ids


@dataclass
class ChatSession:
    """Everything one browser tab remembers between events."""

    session_id: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    messages: list[dict] = field(default_factory=list)   # user/assistant turns sent to the model
    display: list[dict] = field(default_factory=list)    # what the chatbot shows (errors included)
    turns: list[dict] = field(default_factory=list)      # prefix-cache history, one per reply
    last: Reply | None = None
    selected: int | None = None                          # token picked in the logprob view
    selected_node: int | None = None                     # the reply that token belongs to (app)
    active_request_id: str | None = None
    queued: list[tuple[object, str]] = field(default_factory=list)   # messages waiting for the streaming
                                                          # reply, oldest first: (ticket, text) (app)
    tree: Conversation = field(default_factory=Conversation)   # every reply and branch (app)
    labels: dict[str, str] = field(default_factory=dict)  # this tab's recent requests → legend name
    last_render_key: Any = None                           # what the panels were last drawn from
    last_panels: Any = None                               # and what they were: (prefix, engine, inspector) HTML
    inspected: int | None = None                          # the block last clicked in the map (app)
    lp_metric: str = "probability"                        # the logprob view's probability / logprob / rank
    timeline_window: int = 120                            # seconds the engine timeline shows (app)
    # Names the tab to the block map's route (unguessable: one visitor cannot ask for another's legend).
    map_token: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    mode: str = "chat"                                    # of the last message sent: completion shows a document
    withdrawn: str | None = None                          # what Stop put back in the message box (app)
    library: Any = None                                   # this browser's conversations (playground.library)
    conversation_id: str | None = None                    # which of them ``tree`` is

    def new_request_id(self, kind: str = "chat", label: str = "this chat") -> str:
        """A fresh engine request id for this tab, remembered with its legend name."""
        rid = f"{kind}-{self.session_id}-{next(_counter)}"
        self.labels[rid] = label
        for old in list(self.labels)[:-50]:
            del self.labels[old]
        return rid

    def record_turn(self, reply: Reply, label: str) -> None:
        self.turns.append({
            "label": label,
            "num_prompt_tokens": reply.num_prompt_tokens,
            "num_cached_tokens": reply.num_cached_tokens,
        })

    def reset(self) -> None:
        self.messages, self.display, self.turns, self.last, self.selected = [], [], [], None, None
        self.selected_node = None
        self.queued.clear()
        self.tree.clear()   # in place: the tab's conversation list holds this tree


def _field(obj: Any, name: str) -> Any:
    return None if obj is None else getattr(obj, name, None)


def reply_stats(metrics: Any, num_tokens: int) -> tuple[float | None, float | None]:
    """(TTFT in s, decode tokens/s) from a stream's ``RequestMetrics``."""
    arrival, first = _field(metrics, "arrival_time"), _field(metrics, "first_token_time")
    finished = _field(metrics, "finished_time") or time.time()
    ttft = first - arrival if first is not None and arrival is not None else None
    tps = None
    if first is not None and num_tokens > 1 and finished > first:
        tps = (num_tokens - 1) / (finished - first)
    return ttft, tps


def stream_reply(
    llm: Any,
    prompt: Any,
    params: Any,
    reply: Reply,
    *,
    decode: Any = None,
    stop_token_ids: Collection[int] = (),
) -> Iterator[Reply]:
    """Stream one request into ``reply``, yielding it after every delta.

    ``prompt`` is whatever ``llm.stream`` accepts (chat messages, or
    ``{"prompt_token_ids": [...]}`` when branching). Engine errors do not
    raise: they end the stream with ``reply.error`` set, so the caller can show
    them in the chat while the app keeps serving. When the reply ends on one
    of ``stop_token_ids`` (the tokenizer's end-of-turn ids), that token's
    record is marked ``stop``: the logprob view draws it as the reply's end.
    """
    stream = None
    reply.params = params
    try:
        stream = llm.stream(prompt, params, request_id=reply.request_id)
        for delta in stream:
            if getattr(delta, "provenance", None) is not None:
                reply.provenance = delta.provenance
            if delta.prompt_token_ids and not reply.prompt_token_ids:
                reply.prompt_token_ids = list(delta.prompt_token_ids)
            reply.num_prompt_tokens = delta.num_prompt_tokens or reply.num_prompt_tokens
            reply.num_cached_tokens = delta.num_cached_tokens or reply.num_cached_tokens
            if delta.token_ids:
                start = len(reply.prefix_token_ids) + len(reply.token_ids)
                reply.records.extend(token_records(
                    delta.token_ids, delta.logprobs or None, start_index=start, decode=decode))
                reply.token_ids.extend(int(t) for t in delta.token_ids)
                reply.text += delta.text or ""
            if delta.finished:
                if delta.finish_reason == "stop" and reply.records and reply.token_ids \
                        and reply.token_ids[-1] in stop_token_ids:
                    reply.records[-1]["stop"] = True
                reply.finished = True
                reply.finish_reason = delta.finish_reason
                reply.error = getattr(delta, "error", None) or (
                    "the engine failed this request" if delta.finish_reason == "error" else None)
            reply.ttft, reply.decode_tps = reply_stats(delta.metrics, len(reply.token_ids))
            scheduled, first = _field(delta.metrics, "first_scheduled_time"), _field(delta.metrics, "first_token_time")
            if scheduled is not None and first is not None:
                reply.prefill_s = first - scheduled
            yield reply
    except Exception as exc:  # invalid prompt/params, or anything the engine raises
        reply.finished, reply.finish_reason = True, "error"
        reply.error = f"{type(exc).__name__}: {exc}"
        yield reply
    finally:
        if stream is not None:
            stream.close()   # aborts the request if it is still running


def branch_prompt(last: Reply, index: int, token_ids: int | list[int]) -> list[int]:
    """Token ids that regenerate ``last`` from token ``index``, with ``token_ids`` forced there."""
    if not 0 <= index < len(last.all_token_ids):
        raise ValueError(f"token index {index} is outside the last reply ({len(last.all_token_ids)} tokens)")
    forced = [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
    return list(last.prompt_token_ids) + last.all_token_ids[:index] + forced


def start_branch(last: Reply, index: int, token_ids: int | list[int], request_id: str, text: str,
                 decode: Any = None) -> Reply:
    """A new ``Reply`` that already holds the kept tokens and the forced one(s).

    ``text`` is the decoded text of those tokens. The new request's prompt is
    ``branch_prompt(...)``; its tokens stream after them.
    """
    forced = [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
    kept = last.all_token_ids[:index] + forced
    records = [dict(r) for r in last.records[:index]]
    source = last.records[index] if index < len(last.records) else None
    for j, tid in enumerate(forced):
        piece = decode(tid) if decode is not None else ""
        records.append(forced_record(index + j, tid, piece, source if j == 0 else None))
    return Reply(request_id=request_id, prompt_token_ids=list(last.prompt_token_ids),
                 prefix_token_ids=kept, text=text, records=records)
