"""Where every token's K/V came from, and in which step each reply token was produced.

The engine records, per request, what each step did to it (``Provenance``), from the step's one
record, the ``SchedulerOutput``:

* ``cached``: a prefix-cache hit at admission -- positions whose blocks an earlier request
  computed (``stored_by`` names it, per block);
* ``prefill``: prompt positions computed in prefill chunk ``chunk`` (0, 1, ...) at ``step``;
* ``recompute``: positions computed again after a preemption (prompt and earlier reply tokens);
* ``decode``: the one position a decode step computes.

and, per reply token, the step that sampled it and that step's batch size (``reply``). A span is
one tuple per request per step, so a decode step costs one append per request. The counts add up
to the engine's own counters: cached spans = the prefix cache's hits (``tests/test_provenance.py``,
under chunked prefill, preemption and branching).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Span(NamedTuple):
    kind: str                  # cached | prefill | recompute | decode
    start: int                 # positions [start, end)
    end: int
    step: int                  # the engine step (for cached: the step that admitted the request)
    chunk: int = 0             # prefill: which chunk of the prompt (0-based)
    batch_size: int = 0        # requests in that step
    stored_by: tuple = ()      # cached: per block, the request that computed it (None: unknown)


class ReplyToken(NamedTuple):
    step: int
    batch_size: int
    decode: bool               # False: sampled at the end of a prefill (the first token, or after a recompute)


@dataclass
class Provenance:
    spans: list[Span] = field(default_factory=list)
    reply: list[ReplyToken] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Tokens per kind over every span (a recomputed position counts again)."""
        out = {"cached": 0, "prefill": 0, "recompute": 0, "decode": 0}
        for s in self.spans:
            out[s.kind] += s.end - s.start
        return out

    def to_dict(self) -> dict:
        return {"spans": [list(s) for s in self.spans], "reply": [list(t) for t in self.reply]}

    @classmethod
    def from_dict(cls, data: dict) -> "Provenance":
        return cls([Span(*s[:6], tuple(s[6])) for s in data["spans"]], [ReplyToken(*t) for t in data["reply"]])

    def _repr_html_(self) -> str:
        """Jupyter: each position coloured by its source, each reply token by its batch
        (``playground.provenance_view``; positions for text, which the record does not hold)."""
        from playground.provenance_view import provenance_html

        n = max((s.end for s in self.spans if s.kind != "decode"), default=0)
        n = min(n, max((s.start for s in self.spans if s.kind == "decode"), default=n))
        return provenance_html(self, [f"{p} " for p in range(n)], [f"{j} " for j in range(len(self.reply))],
                               name=lambda rid: str(rid))

    def sources(self, num_tokens: int) -> list[Span | None]:
        """For each position ``0..num_tokens - 1``, the span that last put its K/V in the cache."""
        out: list[Span | None] = [None] * num_tokens
        for s in self.spans:
            for p in range(s.start, min(s.end, num_tokens)):
                out[p] = s
        return out


class ProvenanceRecorder:
    """Owned by the engine: fills each request's ``provenance`` from every scheduled step, and
    remembers which request computed the current contents of each block (for cache hits)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._computed_by: dict[int, str] = {}    # block id -> the request that filled it

    def record_step(self, step: int, batch) -> None:
        bs, size = self.block_size, len(batch.scheduled)
        started = {id(r) for r in batch.started}
        for s in batch.scheduled:
            req = s.request
            prov, lo, hi = req.provenance, s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            if id(req) in started and lo:
                prov.spans.append(Span("cached", 0, lo, step, batch_size=size, stored_by=tuple(
                    self._computed_by.get(b) for b in s.block_ids[: lo // bs])))
            if s.is_decode:
                kind, chunk = "decode", 0
            elif req.num_preemptions:
                kind, chunk = "recompute", 0
            else:
                kind = "prefill"
                chunk = sum(1 for x in prov.spans if x.kind == "prefill")
            prov.spans.append(Span(kind, lo, hi, step, chunk, size))
            for b in range(lo // bs, hi // bs):      # blocks this step filled
                self._computed_by[s.block_ids[b]] = req.request_id

    @staticmethod
    def record_token(req, step: int, batch_size: int, decode: bool) -> None:
        req.provenance.reply.append(ReplyToken(step, batch_size, decode))
