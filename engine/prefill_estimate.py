"""What a prompt will cost before it is sent: a read-only query on the prefix cache.

``estimate_prefill(kv_cache_manager, token_ids, rate, max_num_batched_tokens)`` walks the prompt's
chain of block hashes (``block_pool.hash_block_tokens``, as admission does) and looks each one up in
the prefix-cache index with ``BlockPool.lookup`` (a dict read). Nothing is allocated, no reference
is taken, the LRU queue keeps its order and the prefix-cache counters do not move, so an estimate
can be asked for on every keystroke of an edit. Admission (``Scheduler.schedule`` through
``KVCacheManager.get_computed_blocks``) then reuses exactly the blocks the estimate names, as long
as none of them is evicted in between: the estimate's ``num_cached_tokens`` is the request's
``num_cached_tokens`` (``tests/test_prefill_estimate.py``).

This engine shares only *full* blocks and never copies one: a partial last block (and the last
prompt token, whose logits sample the first reply token) is computed into a block of its own
(``copied_blocks`` is always 0; ``partial_tail_tokens`` says how many tokens that block gets).

The time is the tokens to compute over the prefill rate this engine measured on its own recent
steps with prefill (``PrefillRate``, fed by ``LLMEngine.step``), not a constant.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import asdict, dataclass

from .block_pool import hash_block_tokens

__all__ = ["PrefillEstimate", "PrefillRate", "estimate_prefill"]


class PrefillRate:
    """Tokens per second of the engine's last ``window`` steps that computed prompt tokens (a mixed
    step's decodes included: they share its forward pass)."""

    def __init__(self, window: int = 32):
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self._steps.append((num_tokens, seconds))

    @property
    def samples(self) -> int:
        return len(self._steps)

    @property
    def tokens_per_s(self) -> float | None:
        seconds = sum(s for _, s in self._steps)
        return sum(n for n, _ in self._steps) / seconds if seconds > 0 else None


@dataclass(frozen=True)
class PrefillEstimate:
    num_tokens: int                   # the prompt
    num_cached_tokens: int            # read from the prefix cache (full blocks only)
    num_computed_tokens: int          # to compute: num_tokens - num_cached_tokens
    block_size: int
    shared_block_ids: tuple[int, ...]  # prefix-cache hits, in order
    live_block_ids: tuple[int, ...]    # of those, blocks a running request holds now (shared with it)
    new_blocks: int                   # fresh blocks the prompt needs (beyond the shared ones)
    copied_blocks: int                # always 0: no copy-on-write (a partial block is computed afresh)
    partial_tail_tokens: int          # tokens in the prompt's last, partial block (0: it ends on a block)
    recomputed_cached_tokens: int     # cached, but computed again: the last block holds the last token
    evicts_blocks: int                # cached blocks the new blocks would evict (LRU order, now)
    fits: bool                        # enough free or evictable blocks now
    num_chunks: int                   # prefill steps at max_num_batched_tokens
    prefill_tokens_per_s: float | None  # measured on this engine (None: no prefill step yet)
    rate_samples: int                 # steps the rate is measured over
    expected_prefill_s: float | None  # num_computed_tokens / prefill_tokens_per_s

    def to_dict(self) -> dict:
        return asdict(self)

    def _repr_html_(self) -> str:
        """The playground's edit-cost panel (Jupyter's rich display)."""
        from playground.edit_cost_view import edit_cost_html

        return edit_cost_html(self, title="Sending this prompt")

    @classmethod
    def from_dict(cls, data: dict) -> "PrefillEstimate":
        data = dict(data)
        for key in ("shared_block_ids", "live_block_ids"):
            data[key] = tuple(data[key])
        return cls(**data)


def estimate_prefill(kv_cache_manager, token_ids: list[int], rate: PrefillRate,
                     max_num_batched_tokens: int) -> PrefillEstimate:
    """The estimate for ``token_ids`` (checked by the caller) on the cache as it is now. Read-only."""
    bs, pool, n = kv_cache_manager.block_size, kv_cache_manager.pool, len(token_ids)
    max_blocks = (n - 1) // bs          # the last prompt token is always computed (as admission)
    hits, parent = [], None
    if kv_cache_manager.enable_caching:
        for i in range(n // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs])
            block = pool.lookup(parent)
            if block is None:
                break
            hits.append(block)
    recomputed = bs * max(0, len(hits) - max_blocks)
    hits = hits[:max_blocks]
    cached = len(hits) * bs
    needed = -(-n // bs) - len(hits)
    reclaimed = {b.block_id for b in hits if b.ref_cnt == 0}
    free_now = pool.num_free_blocks - len(reclaimed)
    # The blocks allocation would take: the LRU queue's front, the reclaimed hits taken out first.
    front = itertools.islice((b for b in pool._free.values() if b.block_id not in reclaimed), needed)
    evicts = sum(1 for b in front if b.block_hash is not None)
    tps = rate.tokens_per_s
    computed = n - cached
    return PrefillEstimate(
        num_tokens=n, num_cached_tokens=cached, num_computed_tokens=computed, block_size=bs,
        shared_block_ids=tuple(b.block_id for b in hits),
        live_block_ids=tuple(b.block_id for b in hits if b.ref_cnt > 0), new_blocks=needed, copied_blocks=0,
        partial_tail_tokens=n % bs, recomputed_cached_tokens=recomputed, evicts_blocks=evicts,
        fits=needed <= free_now, num_chunks=-(-computed // max_num_batched_tokens),
        prefill_tokens_per_s=tps, rate_samples=rate.samples,
        expected_prefill_s=computed / tps if tps else None)
