"""`StepRecord`: one scheduled step as plain arrays, what every rank of the model runs.

The scheduler's ``SchedulerOutput`` holds live ``Request`` objects; the model
needs only the packed batch: token ids, their positions, the KV-cache slot of
each new token, block tables, context lengths, where each request's chunk
starts, and which rows of the hidden states become logits (prompt-logprob rows
first, then one row per request that samples). ``StepRecord.from_batch``
derives exactly that, once, on the process that schedules; the record pickles
small (NumPy arrays, ints, strings), so under tensor parallelism rank 0 sends
the same record to every rank (``engine.parallel``) and each runs it on its
own shard and its own KV cache. ``ModelRunner.run`` executes a record in one
process too, so both paths share this one description of a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepRecord:
    ids: np.ndarray            # int64 [T]: the step's tokens, request after request
    positions: np.ndarray      # int64 [T]: each token's position in its sequence
    slots: np.ndarray          # int64 [T]: the KV-cache slot each token's K/V goes to
    block_tables: np.ndarray   # int32 [S, W]: each request's blocks, zero-padded
    context_lens: np.ndarray   # int32 [S]: tokens in the cache after this step
    starts: np.ndarray         # int32 [S + 1]: row where each request's chunk starts (cumulative)
    rows: np.ndarray           # int64 [R]: hidden rows that become logits, prompt rows first
    num_prompt_rows: int       # rows[:num_prompt_rows] are prompt-logprob rows, the rest sample
    sample_request_ids: tuple[str, ...] = ()           # one per sampled row, in order
    prompt_spans: tuple[tuple[str, int, int, int], ...] = ()  # (request id, first position, row, count)

    @property
    def num_tokens(self) -> int:
        return int(self.starts[-1])

    @property
    def decode_only(self) -> bool:
        """Every request runs exactly one new token."""
        return bool(np.all(np.diff(self.starts) == 1))

    @classmethod
    def from_batch(cls, batch: SchedulerOutput, block_size: int) -> "StepRecord":
        bs = block_size
        ids, positions, slots, starts = [], [], [], [0]
        context_lens, tables = [], []
        rows, sample_ids, prompt_spans = [], [], []
        for s in batch.scheduled:
            req, lo, hi = s.request, s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            table = np.asarray(s.block_ids, dtype=np.int64)
            pos = np.arange(lo, hi, dtype=np.int64)
            ids.append(np.asarray(req.all_token_ids[lo:hi], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            start = starts[-1]
            starts.append(start + s.num_new_tokens)
            context_lens.append(hi)
            tables.append(table)
            if req.sampling_params.prompt_logprobs is not None:
                # logits at position p predict prompt token p + 1
                last = min(hi, req.num_prompt_tokens - 1)
                if last > lo:
                    prompt_spans.append((req.request_id, lo, len(rows), last - lo))
                    rows.extend(range(start, start + last - lo))
            if s.completes_sequence:
                sample_ids.append(req.request_id)
        num_prompt_rows = len(rows)
        rows.extend(start + s.num_new_tokens - 1
                    for s, start in zip(batch.scheduled, starts) if s.completes_sequence)
        width = max(len(t) for t in tables)
        padded = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            padded[i, : len(t)] = t
        return cls(ids=np.concatenate(ids), positions=np.concatenate(positions), slots=np.concatenate(slots),
                   block_tables=padded, context_lens=np.asarray(context_lens, dtype=np.int32),
                   starts=np.asarray(starts, dtype=np.int32), rows=np.asarray(rows, dtype=np.int64),
                   num_prompt_rows=num_prompt_rows, sample_request_ids=tuple(sample_ids),
                   prompt_spans=tuple(prompt_spans))

    def packed(self) -> dict[str, np.ndarray]:
        """The arrays by the names ``ModelRunner.pack`` has always used."""
        return {"ids": self.ids, "positions": self.positions, "slots": self.slots,
                "block_tables": self.block_tables, "context_lens": self.context_lens, "starts": self.starts}
