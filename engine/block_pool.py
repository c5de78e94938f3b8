"""Physical KV-cache blocks: a ref-counted pool with an LRU free queue and a prefix-hash index.

A block is in exactly one of three states:

* **used**   – ``ref_cnt > 0``: one or more requests' block tables point at it;
* **cached** – ``ref_cnt == 0`` but it carries a ``block_hash``: its K/V are still
  valid and a later request with the same prefix may reuse it; it sits in the
  free queue and is evicted (hash dropped) only when the pool hands it out again;
* **free**   – ``ref_cnt == 0`` and no hash.

The free queue is an LRU: freed blocks go to the back, allocation takes from the
front, so the most recently used cached blocks survive longest.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids) -> BlockHash:
    """Chained hash of one full block: it identifies the whole prefix, not just the block."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass
class BlockEvents:
    """Block stored/removed events since the last ``drain``."""

    stored: list[tuple[int, BlockHash]] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least 1 block; got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.events = BlockEvents()
        self.num_evictions = 0       # cached blocks whose hash an allocation dropped (the engine's counter)
        self.log = None              # a ``KVEventLog`` (engine.kv_events), set by the KVCacheManager

    # -- queries -----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or cached-but-evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    # -- allocation ----------------------------------------------------------
    def get_new_blocks(self, n: int, request_id: str | None = None) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the front of the LRU queue, evicting their hashes (for ``request_id``)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self.num_evictions += 1
                if self.log is not None:
                    self.log.add("evict", request_id, [block.block_id],
                                 f"{request_id} needed {n} block{'s' * (n != 1)}; cached block {block.block_id} "
                                 "was the least recently used", hash=block.block_hash.hex()[:16])
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits (pulling cached blocks out of the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks) -> None:
        """Drop one reference each; blocks reaching 0 go to the back of the LRU queue.

        Callers pass a request's blocks tail-first so that a prefix's later
        blocks are evicted before its earlier (more shareable) ones.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    # -- prefix cache ----------------------------------------------------------
    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Publish a full block under its chained hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already published; this one stays private
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self.events.stored.append((block.block_id, block_hash))

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop the block's hash (it stays allocated to whoever holds it)."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
        self.events.removed.append(block.block_id)

    def reset_prefix_cache(self) -> int:
        """Forget every hash (used blocks keep serving their requests). Returns blocks un-hashed."""
        dropped = [b for b in self.blocks if b.block_hash is not None]
        for block in dropped:
            self._evict(block)
        if self.log is not None and dropped:
            self.log.add("reset", None, [b.block_id for b in dropped], "the prefix cache was reset")
        return len(dropped)

    def drain_events(self) -> BlockEvents:
        events, self.events = self.events, BlockEvents()
        return events
