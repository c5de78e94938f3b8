"""Immutable, JSON-serialisable views of the engine's state, and its step events.

Views (Gradio, Jupyter) draw only from ``EngineSnapshot`` and ``EngineEvent``;
the schema is documented in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class BlockInfo:
    block_id: int
    state: str                       # "free" | "used" | "cached"
    ref_cnt: int
    owners: tuple[str, ...]
    hashed: bool
    token_range: tuple[int, int] | None  # token positions in the first owner's sequence
    block_hash: str | None = None        # first 16 hex digits of the prefix-cache hash (as blocks_stored names it)


@dataclass(frozen=True)
class RequestInfo:
    request_id: str
    status: str
    block_table: tuple[int, ...]
    num_prompt_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class PrefixCacheInfo:
    queries: int
    hits: int
    hit_rate: float
    reset_count: int


@dataclass(frozen=True)
class StepInfo:
    step: int
    batch_size: int
    num_tokens: int
    prefill: dict[str, int]
    decode: tuple[str, ...]
    duration_s: float


@dataclass(frozen=True)
class EngineSnapshot:
    step: int
    model: str
    model_impl: str
    device: str
    block_size: int
    num_blocks: int
    kv_usage: float
    blocks: tuple[BlockInfo, ...]
    requests: tuple[RequestInfo, ...]
    prefix_cache: PrefixCacheInfo
    last_step: StepInfo | None
    attention_backend: str = "cpu"   # gpu_kernels backend of the attention calls: cpu, cuda, reference
    decode_path: str = "paddle"      # what runs decode-only steps: "fused" or "paddle" (with the reason)
    prefill_path: str = "paddle"     # what runs the other steps: "fused" (engine.fused_prefill) or "paddle"
    # Why ``blocks`` is empty: an engine seen only through a server's metrics (engine.client.OpenAIServer),
    # whose ``requests`` are then the server's running/waiting counts (placeholder ids), not its requests.
    blocks_hidden: str | None = None
    # tensor_parallel_size > 1: each rank's KV heads and cache bytes, the collectives' time (TensorParallelRunner.info)
    tensor_parallel: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def __repr__(self) -> str:
        # the dataclass repr would list every block (tens of thousands of characters)
        kinds = Counter("shared" if b.ref_cnt > 1 else b.state for b in self.blocks)
        blocks = ("blocks not exposed" if self.blocks_hidden else
                  f"{self.num_blocks} blocks x {self.block_size} tokens: {kinds['used'] + kinds['shared']} in use "
                  f"({kinds['shared']} shared), {kinds['cached']} cached, {kinds['free']} free")
        return (f"EngineSnapshot(step={self.step}, model={self.model!r}, model_impl={self.model_impl!r}, "
                f"device={self.device!r}, {blocks}, {len(self.requests)} requests)")

    def _repr_html_(self) -> str:
        """The block map (Jupyter's rich display), as the playground draws it."""
        from playground.reprs import snapshot_html

        return snapshot_html(self.to_dict())


@dataclass(frozen=True)
class EngineEvent:
    """``kind``: request_added, request_started, request_preempted, request_finished,
    blocks_stored, blocks_removed, step."""

    kind: str
    step: int
    data: dict = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return asdict(self)


class BlockInfos:
    """Every block's ``BlockInfo``, kept from one snapshot to the next.

    A block whose fields did not change since the last snapshot keeps its ``BlockInfo``
    object, so a view can tell the blocks that changed by identity instead of comparing
    every field of every block (the map of a few hundred blocks is redrawn several times a
    second while requests run, and only the blocks they write to change between two
    snapshots). One per engine; used under the engine's lock, like the blocks it reads.
    """

    def __init__(self) -> None:
        self._keys: list[tuple] = []
        self._infos: list[BlockInfo] = []

    def build(self, blocks, owners: dict[int, list[str]], ranges: dict[int, tuple[int, int]]) -> tuple[BlockInfo, ...]:
        keys, infos = self._keys, self._infos
        if len(keys) != len(blocks):
            keys[:], infos[:] = [None] * len(blocks), [None] * len(blocks)
        for i, b in enumerate(blocks):
            own = tuple(owners.get(b.block_id, ()))
            key = (b.ref_cnt, own, ranges.get(b.block_id), b.block_hash)
            if keys[i] != key:
                hashed = b.block_hash is not None
                state = "used" if b.ref_cnt > 0 else ("cached" if hashed else "free")
                keys[i] = key
                infos[i] = BlockInfo(b.block_id, state, b.ref_cnt, own, hashed, key[2],
                                     b.block_hash.hex()[:16] if hashed else None)
        return tuple(infos)


def keep_unchanged_blocks(snapshot: EngineSnapshot, previous: EngineSnapshot | None) -> EngineSnapshot:
    """``snapshot`` with the ``BlockInfo`` objects of ``previous`` where a block did not change, as
    ``LLM.snapshot`` gives them: for a snapshot that crossed a process or the network, so views
    find the changed blocks by identity there too."""
    before = previous.blocks if previous is not None else ()
    if len(before) == len(snapshot.blocks):
        object.__setattr__(snapshot, "blocks", tuple(a if a == b else b for a, b in zip(before, snapshot.blocks)))
    return snapshot


def take_snapshot(*, step, model, model_impl, device, kv_cache_manager, requests, last_step,
                  attention_backend="cpu", decode_path="paddle", prefill_path="paddle",
                  block_infos: BlockInfos | None = None,
                  tensor_parallel: dict | None = None) -> EngineSnapshot:
    """Build a snapshot from the KV cache manager and the live requests (O(blocks)); with
    ``block_infos`` (the engine's), unchanged blocks keep the ``BlockInfo`` of the last one."""
    bs = kv_cache_manager.block_size
    owners: dict[int, list[str]] = {}
    ranges: dict[int, tuple[int, int]] = {}
    infos = []
    for req in requests:
        table = kv_cache_manager.req_to_blocks.get(req.request_id, [])
        for i, block in enumerate(table):
            owners.setdefault(block.block_id, []).append(req.request_id)
            if block.block_id not in ranges:
                ranges[block.block_id] = (i * bs, min((i + 1) * bs, max(req.num_computed_tokens, i * bs)))
        infos.append(RequestInfo(
            request_id=req.request_id,
            status=req.status.value,
            block_table=tuple(b.block_id for b in table),
            num_prompt_tokens=req.num_prompt_tokens,
            num_computed_tokens=req.num_computed_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens,
        ))
    blocks = (block_infos or BlockInfos()).build(kv_cache_manager.blocks, owners, ranges)
    s = kv_cache_manager.stats
    return EngineSnapshot(
        step=step, model=model, model_impl=model_impl, device=device, block_size=bs,
        num_blocks=kv_cache_manager.num_blocks, kv_usage=kv_cache_manager.usage, blocks=blocks,
        requests=tuple(infos),
        prefix_cache=PrefixCacheInfo(s.queries, s.hits, s.hit_rate, s.reset_count),
        last_step=last_step, attention_backend=attention_backend, decode_path=decode_path,
        prefill_path=prefill_path, tensor_parallel=tensor_parallel,
    )
