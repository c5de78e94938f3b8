"""Block tables as the engine's own scheduler and block pool hand them out, for the GPU decode
benchmark (``python -m benchmarks.kernels --tables FILE``).

The kernel benchmark reads each sequence's KV pages through a *shuffled* block table: every page
anywhere in the cache. A serving engine's tables are not random: `engine.block_pool.BlockPool`
hands out free blocks from an LRU queue (initially in block order; freed blocks go to the back),
so a prompt's blocks come mostly in runs, while sequences decoding side by side take one block
each in turn. This runs the real `Scheduler` and `KVCacheManager` (no model: each step appends a
token to every request whose prompt is done) through a stream of requests of mixed lengths that
come and go, then admits ``batch`` requests that reach ``context`` tokens together (half prompt,
half decoded side by side), and saves their block tables.

    python -m benchmarks.engine_tables --out tables.npz    # (batch, context) pairs of the GPU table

The file holds ``tables_{batch}x{context}`` (int32 [batch, context / block_size]) and
``blocks_{batch}x{context}`` (the pool's size) for each pair.
"""

from __future__ import annotations

import itertools

import numpy as np

from engine.config import FlagParser
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

PAIRS = ((1, 8192), (16, 2048), (16, 8192), (64, 512), (64, 2048), (64, 8192))


def _step(scheduler: Scheduler, want: dict[str, int], rng: np.random.Generator) -> None:
    """One engine step without a model: requests whose prompt is computed get a token; those at
    their length finish."""
    batch = scheduler.schedule()
    for s in batch.scheduled:
        req = s.request
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(int(rng.integers(1, 50_000)), None)
            if req.num_output_tokens >= want[req.request_id]:
                scheduler.finish(req, "length")


def engine_tables(batch: int, context: int, block_size: int = 16, seed: int = 0,
                  churn_steps: int = 400) -> tuple[np.ndarray, int]:
    """``batch`` block tables of ``context`` tokens each, after ``churn_steps`` steps of other
    traffic, and the number of blocks of the pool they come from."""
    rng = np.random.default_rng(seed)
    target_blocks = batch * context // block_size
    num_blocks = target_blocks + target_blocks // 4 + 64
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=max(8, batch), max_num_batched_tokens=2048)
    ids, want = itertools.count(), {}

    def add(prompt: int, output: int, tag: str) -> Request:
        rid = f"{tag}-{next(ids)}"
        req = Request(rid, rng.integers(1, 50_000, prompt).tolist(), SamplingParams(max_tokens=output))
        want[rid] = output
        scheduler.add_request(req)
        return req

    # other traffic: prompts of 64-4096 tokens, replies of 16-512, arriving while others run,
    # sized so that the pool fills and blocks are freed and reused many times over
    mean_tokens = max(256, num_blocks * block_size // (2 * max(8, batch)))
    for _ in range(churn_steps):
        while len(scheduler.waiting) < 2:
            add(int(rng.integers(64, 2 * mean_tokens)), int(rng.integers(16, 512)), "other")
        _step(scheduler, want, rng)
    for req in list(scheduler.running) + list(scheduler.waiting):
        scheduler.finish(req, "abort")
    # the measured requests: half the context as prompt, the rest decoded side by side
    prompt = context // 2
    mine = [add(prompt, context, "measured") for _ in range(batch)]      # still running at the end
    while any(r.num_computed_tokens < context for r in mine):
        _step(scheduler, want, rng)
    tables = np.array([kv.block_ids(r.request_id)[: context // block_size] for r in mine], np.int32)
    return tables, num_blocks


def runs(tables: np.ndarray) -> float:
    """Mean length of the runs of consecutive block ids along each table (1: every page apart)."""
    steps = np.diff(tables, axis=1) == 1
    breaks = tables.shape[0] * tables.shape[1] - steps.sum()
    return tables.size / breaks


def main(argv: list[str] | None = None) -> None:
    parser = FlagParser(prog="python -m benchmarks.engine_tables", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the .npz to write")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    arrays = {}
    for batch, context in PAIRS:
        tables, num_blocks = engine_tables(batch, context, args.block_size)
        arrays[f"tables_{batch}x{context}"] = tables
        arrays[f"blocks_{batch}x{context}"] = np.array(num_blocks)
        ascending = float((np.diff(tables, axis=1) > 0).mean())
        print(f"{batch} x {context}: {num_blocks} blocks in the pool, mean run of consecutive blocks "
              f"{runs(tables):.1f}, {100 * ascending:.0f}% of steps along a table go up")
    np.savez(args.out, **arrays)


if __name__ == "__main__":
    main()
