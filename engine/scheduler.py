"""Continuous batching with chunked prefill and preemption by recompute.

Every step the scheduler hands out a token budget (``max_num_batched_tokens``):

1. running requests first, decodes before unfinished prefill chunks, each
   getting ``min(tokens still to compute, budget left)`` tokens — so a long
   prompt is split across steps (chunked prefill) while decodes keep flowing;
2. when the KV pool cannot grow a running request, the newest running request
   is preempted: its blocks are freed (they stay in the prefix cache) and it
   goes back to the front of the waiting queue, to be recomputed later;
3. then waiting requests are admitted (up to ``max_num_seqs`` running, and while
   the KV cache is less than ``kv_cache_ratio`` full when something runs:
   FastDeploy's reserve for running requests to grow), each starting from its
   longest cached prefix.

The returned ``SchedulerOutput`` is the one record of a step: which requests
run how many tokens from where, their block tables, and which of them sample a
token. The scheduler is the only place that moves ``num_computed_tokens``
(admission, preemption and, once a step is scheduled, advancing it by the
scheduled tokens, as vLLM v1 does); the engine appends sampled tokens.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step, fixed when the step is scheduled."""

    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # tokens already in the cache before this step
    completes_sequence: bool  # after this step every known token is computed, so a token is sampled
    block_ids: list[int] = field(default_factory=list)  # the request's block table for this step

    @property
    def is_decode(self) -> bool:
        """One new token after the prompt (not a prompt chunk, not a recompute after preemption)."""
        return (self.num_new_tokens == 1 and self.completes_sequence
                and self.num_computed_tokens >= self.request.num_prompt_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    started: list[Request] = field(default_factory=list)

    @property
    def block_tables(self) -> dict[str, list[int]]:
        return {s.request.request_id: s.block_ids for s in self.scheduled}

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_cache_ratio: float = 1.0):
        self.kv_cache_manager = kv_cache_manager
        self.kv_cache_ratio = kv_cache_ratio
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._order: dict[str, int] = {}
        self._counter = itertools.count()
        self.num_preemptions = 0        # the engine's counter (vLLM's num_preemptions)

    def add_request(self, request: Request) -> None:
        self._order[request.request_id] = next(self._counter)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        chosen: dict[str, ScheduledRequest] = {}

        decodes_first = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in decodes_first:
            if req.status != RequestStatus.RUNNING or budget == 0:
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv_cache_manager.allocate_slots(req, num_new) is None:
                victim = max(self.running, key=lambda r: self._order[r.request_id])
                self._preempt(victim, req, num_new)
                out.preempted.append(victim)
                if victim.request_id in chosen:
                    budget += chosen.pop(victim.request_id).num_new_tokens
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            chosen[req.request_id] = self._scheduled(req, num_new, req.num_computed_tokens)
            budget -= num_new

        while not out.preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            if self.running and self.kv_cache_ratio < 1 and self.kv_cache_manager.usage >= self.kv_cache_ratio:
                break
            req = self.waiting[0]
            if req.sampling_params.prompt_logprobs is None:
                hits, num_cached = self.kv_cache_manager.get_computed_blocks(req)
            else:  # every prompt position's logits are needed, so nothing may come from the cache
                hits, num_cached = [], 0
            num_new = min(req.num_tokens - num_cached, budget)
            if self.kv_cache_manager.allocate_slots(req, num_new, hits) is None:
                break
            self.waiting.popleft()
            self.kv_cache_manager.record_lookup(req.num_tokens, num_cached)
            if req.num_preemptions:
                self.kv_cache_manager.log.add(
                    "recompute", req.request_id, self.kv_cache_manager.block_ids(req.request_id),
                    f"{req.request_id} resumes after {req.num_preemptions} preemption"
                    f"{'s' * (req.num_preemptions != 1)}: {req.num_tokens - num_cached} tokens to compute again, "
                    f"{num_cached} from the prefix cache", tokens=req.num_tokens - num_cached, cached=num_cached)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            self.running.append(req)
            out.started.append(req)
            chosen[req.request_id] = self._scheduled(req, num_new, num_cached)
            budget -= num_new

        out.scheduled = list(chosen.values())
        for s in out.scheduled:
            s.block_ids = self.kv_cache_manager.block_ids(s.request.request_id)
            s.request.num_computed_tokens += s.num_new_tokens
        return out

    @staticmethod
    def _scheduled(req: Request, num_new: int, num_computed: int) -> ScheduledRequest:
        return ScheduledRequest(req, num_new, num_computed, num_computed + num_new == req.num_tokens)

    def _preempt(self, req: Request, needer: Request, num_new: int) -> None:
        kv = self.kv_cache_manager
        need = kv.blocks_needed(needer, num_new)
        cause = (f"{needer.request_id} needed {need} block{'s' * (need != 1)} with {kv.pool.num_free_blocks} free: "
                 + ("it is the newest running request, so it gives its own blocks back" if req is needer else
                    f"{req.request_id}, the newest running request, gives its blocks back"))
        kv.log.add("preempt", req.request_id, kv.block_ids(req.request_id), cause, needed_by=needer.request_id,
                   needed_blocks=need)
        self.num_preemptions += 1
        self.running.remove(req)
        kv.free(req, f"{req.request_id} was preempted ({needer.request_id} needed {need} "
                     f"block{'s' * (need != 1)})")
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Retire a request (finished or aborted) and release its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv_cache_manager.free(req, f"{req.request_id} finished ({reason})")
        self._order.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
