"""Per-request block tables on top of the ``BlockPool``, with prefix caching.

A request's block table is the list of physical blocks holding its tokens'
K/V, in order: token ``t`` lives in ``table[t // block_size]`` at offset
``t % block_size``, i.e. in slot ``table[t // block_size].block_id * block_size
+ t % block_size``.

Prefix caching: every *full* block of a request gets a chained hash (parent
hash + the block's token ids). A new request walks its own chain and reuses
every leading block already in the index; the last prompt token is always
recomputed, because its logits are needed to sample the first output token.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_pool import BlockEvents, BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from .kv_events import KVEventLog
from .request import Request


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters in tokens: ``queries`` looked up, ``hits`` found cached."""

    queries: int = 0
    hits: int = 0
    reset_count: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.log = self.pool.log = KVEventLog()
        self.stats = PrefixCacheStats()
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._req_to_hashes: dict[str, list[BlockHash]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def blocks(self) -> list[KVCacheBlock]:
        """Every physical block, indexed by block id (read-only use: snapshots)."""
        return self.pool.blocks

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = self._req_to_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, as (blocks, number of tokens)."""
        if not self.enable_caching:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size  # last token is always recomputed
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Count one admitted request's prefix lookup in ``stats``."""
        self.stats.queries += num_tokens
        self.stats.hits += num_cached

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] = ()
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens (after any prefix hits).

        Returns the newly allocated blocks, or ``None`` (changing nothing) when
        the pool cannot supply them.
        """
        table = self.req_to_blocks.setdefault(request.request_id, [])
        num_new_blocks = self.blocks_needed(request, num_new_tokens, new_computed_blocks)
        num_reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_reclaimed:
            if not table:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(list(new_computed_blocks))
        table.extend(new_computed_blocks)
        rid = request.request_id
        new_blocks = self.pool.get_new_blocks(num_new_blocks, rid)
        table.extend(new_blocks)
        if new_blocks or new_computed_blocks:       # a decode step inside its last block logs nothing
            hits = f", {len(new_computed_blocks)} from the prefix cache" if new_computed_blocks else ""
            self.log.add("allocate", rid, [b.block_id for b in new_blocks],
                         f"{rid} needed {num_new_blocks} block{'s' * (num_new_blocks != 1)} for {num_new_tokens} "
                         f"token{'s' * (num_new_tokens != 1)}{hits}",
                         shared=[b.block_id for b in new_computed_blocks])
        if self.enable_caching:
            num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
            self._cache_full_blocks(request, table, num_computed + num_new_tokens)
        return new_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int, new_computed_blocks=()) -> int:
        """New blocks ``allocate_slots`` would take for ``num_new_tokens`` more tokens."""
        table = self.req_to_blocks.get(request.request_id, ())
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        return max(0, num_required - len(table) - len(new_computed_blocks))

    def _cache_full_blocks(self, request: Request, table: list[KVCacheBlock], num_tokens: int) -> None:
        hashes = self._block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(hashes))
        for i in range(num_full):
            if table[i].block_hash is None:
                self.pool.cache_block(table[i], hashes[i])

    def free(self, request: Request, cause: str = "") -> None:
        """Release the request's blocks (tail first); hashed ones stay in the prefix cache."""
        table = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed(table))
        if table:
            self.log.add("free", request.request_id, [b.block_id for b in table],
                         cause or f"{request.request_id} ended",
                         cached=[b.block_id for b in table if b.ref_cnt == 0 and b.block_hash is not None])
        self._req_to_hashes.pop(request.request_id, None)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def uncache(self, block_ids: list[int]) -> None:
        """Withdraw blocks from the prefix cache (their K/V were never written: a failed step)."""
        for block_id in block_ids:
            self.pool.uncache(self.pool.blocks[block_id])

    def drain_events(self) -> BlockEvents:
        """Blocks published to / evicted from the prefix cache since the last drain."""
        return self.pool.drain_events()

    def reset_prefix_cache(self) -> int:
        self.stats = PrefixCacheStats(reset_count=self.stats.reset_count + 1)
        return self.pool.reset_prefix_cache()
