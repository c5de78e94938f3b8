"""Rank 0 of a tensor-parallel engine: it starts the other ranks, holds its own shard, and runs
every step with them.

Who sends what:

1. ``TensorParallel.start`` (before any weight is read): the heads and MLP are checked against
   ``N`` (`sharding.check_shardable`), ranks 1..N-1 start (`group.LocalRanks`) and each gets
   ``("start", RankSpec)``: the engine config and the resolved model implementation and dtype.
   All ranks join the gloo group, then each loads its own slices from the same checkpoint file
   and says ``("ready", kv_layout)``.
2. ``TensorParallel.make_runner``: rank 0 has sized the KV cache (one block manager, on rank 0;
   every rank's cache has the same number of blocks, of its own KV heads) and sends
   ``("init", num_blocks, ...)``; then ``("warm_up",)``, which every rank runs together.
3. Every step, `TensorParallelRunner.run` sends ``("step", StepRecord)`` and runs the record
   itself; the layers all-reduce and gather inside the forward pass; the gathered logits
   are rank 0's to sample from. Workers send nothing back during a step.
4. A failure anywhere in a step (a rank's process gone, a collective failing, a rank's
   ``("error", text)`` report) stops every rank and fails that step and every later one with
   `RankFailure`, whose message names the rank and how it ended.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass

from ..config import EngineConfig
from ..model_runner import ModelRunner
from ..step_record import StepRecord
from .group import (STORE_TIMEOUT_S, CollectiveGroup, LaunchedRanks, LocalRanks, RankFailure, Ranks,
                    describe_exits, launched, next_group_id)
from .layers import build_sharded_model
from .sharding import ShardPlan, check_shardable

logger = logging.getLogger("engine")
READY_TIMEOUT_S = 600.0    # loading a shard on a busy machine


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to load its shard: the same settings rank 0 resolved."""

    config: EngineConfig
    model_impl: str
    dtype: str
    device: str


def load_rank_model(spec: RankSpec, rank: int, world: int, group, checkpoint=None):
    """Rank ``rank``'s shard of the checkpoint (opened here unless given), built and loaded."""
    from ..loader import load_checkpoint

    checkpoint = checkpoint if checkpoint is not None else load_checkpoint(spec.config.model)
    cfg = check_shardable(checkpoint.architecture, checkpoint.config, world, spec.model_impl)
    plan = ShardPlan(cfg, rank, world)
    if spec.model_impl == "paddleformers":
        from .fallback import build_sharded_paddleformers

        return build_sharded_paddleformers(checkpoint, spec.dtype, spec.device, plan, group)
    return build_sharded_model(checkpoint.architecture, checkpoint.config, checkpoint.weights(progress=rank == 0),
                               spec.dtype, plan, group)


def _while_alive(ranks: Ranks, what: str, fn, timeout_s: float = STORE_TIMEOUT_S):
    """``fn()`` on a helper thread (Paddle's rendezvous releases the GIL), failing as soon as a rank dies
    or after ``timeout_s`` (gloo's rendezvous waits on the store without a limit of its own)."""
    box = {}

    def call():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=call, name=f"tp-{what}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        thread.join(0.2)
        dead = ranks.dead()
        if dead and thread.is_alive():
            raise RankFailure(f"{describe_exits(dead)} while {what}")
        if time.monotonic() > deadline and thread.is_alive():
            raise RankFailure(f"the ranks were still {what} after {timeout_s:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class TensorParallel:
    """Rank 0's handle on the group: the other ranks, the collectives, rank 0's shard."""

    def __init__(self, world: int, ranks: Ranks, group: CollectiveGroup, model, spec: RankSpec,
                 layouts: dict[int, tuple[int, int, int]] | None = None):
        self.world, self.ranks, self.group, self.model, self.spec = world, ranks, group, model, spec
        self.layouts = layouts or {0: model.kv_layout()}   # each rank's (layers, KV heads, head_dim)
        self.runner: TensorParallelRunner | None = None
        self.lock = threading.Lock()  # one conversation with the ranks at a time: a step, stats or a probe
        self._finalizer = weakref.finalize(self, _stop, ranks, group)

    @classmethod
    def start(cls, config: EngineConfig, checkpoint, model_impl: str, dtype: str, device: str) -> "TensorParallel":
        world = config.tensor_parallel_size
        if device != "cpu":
            raise ValueError(f"tensor_parallel_size={world} runs CPU ranks over gloo; device={device!r} ranks "
                             "(NCCL) are not built here (docs/DISTRIBUTED.md); use device='cpu'")
        cfg = check_shardable(checkpoint.architecture, checkpoint.config, world, model_impl)  # before anything starts
        if model_impl == "paddleformers":
            from .fallback import check_buildable

            check_buildable(checkpoint, ShardPlan(cfg, 0, world), device)
        if config.quantization == "auto" and checkpoint.format == "gguf" and dtype == "float32":
            logger.info("tensor_parallel_size=%d: ranks compute on float32 slices; the GGUF's quantized blocks "
                        "are not kept under tensor parallelism", world)
        spec = RankSpec(config, model_impl, dtype, device)
        t0 = time.perf_counter()
        ranks = LaunchedRanks(world) if launched() else LocalRanks(world)
        group = None
        try:
            gid = next_group_id()   # the group's id (its rendezvous keys' prefix) is rank 0's to choose
            ranks.send_all(("start", spec, gid))
            group = _while_alive(ranks, "joining the gloo group", lambda: CollectiveGroup(
                0, world, ranks.store_address, ranks.store_rank, gid=gid))
            model = load_rank_model(spec, 0, world, group, checkpoint)
            replies = ranks.gather_reports(READY_TIMEOUT_S)
            layouts = {0: model.kv_layout()}
            for rank, reply in replies.items():
                if not (isinstance(reply, tuple) and reply[0] == "ready"):
                    raise RankFailure(f"tensor-parallel rank {rank} failed loading its shard: "
                                      f"{reply[1] if isinstance(reply, tuple) else reply!r}")
                layouts[rank] = tuple(reply[1])
        except BaseException:
            _stop(ranks, group)
            raise
        logger.info("tensor_parallel_size=%d: %d ranks hold their shards (%.1f s)", world, world,
                    time.perf_counter() - t0)
        return cls(world, ranks, group, model, spec, layouts)

    def make_runner(self, num_blocks: int, block_size: int, attention_backend, cpu_decode: str) -> "TensorParallelRunner":
        """Every rank allocates its KV cache (``num_blocks`` of its own KV heads) and runs the warm-up
        step together; returns rank 0's runner."""
        from ..device import warm_up

        dtype, device = self.spec.dtype, self.spec.device
        positions = self.model.rope.positions if hasattr(self.model, "rope") else None  # native: RoPE table length
        runner = TensorParallelRunner(self, num_blocks, block_size, dtype, attention_backend, device)
        if cpu_decode == "fused":
            runner.decode_path = (f"paddle (tensor_parallel_size={self.world}: the fused CPU decode step is one "
                                  f"process's kernel; decode runs through the Paddle layers between the collectives)")
        try:
            self.ranks.send_all(("init", num_blocks, block_size, dtype, attention_backend, positions))
            self.ranks.send_all(("warm_up",))
            warm_up(runner, device)
        except BaseException as exc:
            runner.fail(exc)
        self.runner = runner
        return runner

    def stats(self) -> dict[int, dict]:
        """Each rank's seconds in collectives and in its steps so far (rank 0's from here)."""
        with self.lock:
            out = {0: {"comm_s": self.group.comm_s, "calls": self.group.calls}}
            self.ranks.send_all(("stats",))
            for rank, reply in self.ranks.gather_reports(30).items():
                out[rank] = reply[1]
        return out

    def probe(self, count: int, width: int) -> float:
        """Seconds of one bare all-reduce of ``[1, width]`` float32 (the mean of ``count``, every rank
        taking part): the floor under each collective of a step."""
        with self.lock:
            self.ranks.send_all(("probe", count, width))
            return probe_all_reduce(self.group, count, width)

    def close(self) -> None:
        """Stop the other ranks and drop the group; the ports are released."""
        self._finalizer()


def probe_all_reduce(group: CollectiveGroup, count: int, width: int) -> float:
    import paddle

    t = paddle.ones([1, width], dtype="float32")
    comm_s, calls = group.comm_s, group.calls
    group.all_reduce(t)
    t0 = time.perf_counter()
    for _ in range(count):
        group.all_reduce(t)
    seconds = (time.perf_counter() - t0) / count
    group.comm_s, group.calls = comm_s, calls   # a probe is not a step's communication
    return seconds


def _stop(ranks: Ranks, group: CollectiveGroup | None) -> None:
    try:
        ranks.stop()
    finally:
        if group is not None:
            group.close()


class TensorParallelRunner(ModelRunner):
    """Rank 0's `ModelRunner`: each step's record goes to every rank, then runs here on rank 0's
    shard. ``last_times`` splits the last step: ``compute_s`` (rank 0's own work, the record
    included) and ``comm_s`` (sending the record and waiting in collectives, which includes
    waiting for the slowest rank)."""

    def __init__(self, tp: TensorParallel, num_blocks: int, block_size: int, kv_dtype: str, attention_backend,
                 device: str):
        super().__init__(tp.model, num_blocks, block_size, kv_dtype, attention_backend, "paddle", device)
        self.tp, self.num_blocks = tp, num_blocks
        self.failure: str | None = None
        self.last_times = {"compute_s": 0.0, "comm_s": 0.0, "collectives": 0}
        self.totals = {"steps": 0, "compute_s": 0.0, "comm_s": 0.0, "collectives": 0}

    @property
    def tensor_parallel_size(self) -> int:
        return self.tp.world

    def run(self, record: StepRecord, probe=None):
        if self.failure is not None:
            raise RankFailure(self.failure)
        group = self.tp.group
        with self.tp.lock:
            t0, c0, n0 = time.perf_counter(), group.comm_s, group.calls
            try:
                self.tp.ranks.send_all(("step", record))
                t1 = time.perf_counter()
                logits = super().run(record) if probe is None else super().run(record, probe)  # probe: rank 0's heads
            except BaseException as exc:
                self.fail(exc)
        total = time.perf_counter() - t0
        comm = (t1 - t0) + group.comm_s - c0
        calls = group.calls - n0
        self.last_times = {"compute_s": total - comm, "comm_s": comm, "collectives": calls}
        self.totals["steps"] += 1
        self.totals["compute_s"] += total - comm
        self.totals["comm_s"] += comm
        self.totals["collectives"] += calls
        return logits

    def info(self) -> dict:
        """The group as a snapshot shows it (plain JSON, ``EngineSnapshot.tensor_parallel``): each rank's
        KV heads and paged-cache bytes (the block table is rank 0's, the same for every cache, so a
        block's bytes on rank ``r`` are its ``bytes_per_block``), and rank 0's split of the last step
        and of all steps so far (seconds; no round trip to the other ranks)."""
        itemsize = self.kv_caches[0][0].element_size() if self.kv_caches else 4
        ranks = []
        for rank, (layers, kv_heads, head_dim) in sorted(self.tp.layouts.items()):
            per_block = 2 * layers * kv_heads * head_dim * self.block_size * itemsize
            ranks.append({"rank": rank, "kv_heads": kv_heads, "bytes_per_block": per_block,
                          "kv_bytes": per_block * self.num_blocks})
        return {"size": self.tp.world, "ranks": ranks, "last_step": dict(self.last_times), "totals": dict(self.totals),
                "failure": self.failure}

    def fail(self, exc: BaseException):
        """Stop every rank and raise `RankFailure` naming what happened (later steps raise it too)."""
        ranks = self.tp.ranks
        deadline = time.monotonic() + 2.0   # a killed rank's exit code arrives a moment after its sockets close
        while not ranks.dead() and time.monotonic() < deadline:
            time.sleep(0.05)
        reports = ranks.errors(wait=0.2)
        parts = [describe_exits(ranks.dead())]
        parts += [f"tensor-parallel rank {r} failed: {text}" for r, text in sorted(reports.items())]
        parts.append(f"the step failed on rank 0 with {type(exc).__name__}: {exc}")
        self.failure = ("; ".join(p for p in parts if p) + ". Every rank is stopped; the engine cannot run "
                        "another step (start a new one)")
        logger.error("%s", self.failure)
        self.tp.close()
        raise RankFailure(self.failure) from exc

    def close(self) -> None:
        self.tp.close()
