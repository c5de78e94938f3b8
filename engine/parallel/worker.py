"""A rank other than 0: ``python -m engine.parallel.worker``, started by rank 0 on one machine
(`group.LocalRanks`) with the trainer environment Paddle's launcher sets:

* ``PADDLE_TRAINER_ID`` (this rank), ``PADDLE_TRAINERS_NUM`` (the ranks);
* the store's address: ``MASTER_ADDR``/``MASTER_PORT``, else ``PADDLE_MASTER``, else the first of
  ``PADDLE_TRAINER_ENDPOINTS`` (``init_parallel_env``'s order); ``ENGINE_TP_STORE_RANK``: which
  rank hosts the store server (default 0);
* ``ENGINE_TP_CHANNEL`` (rank 0's step channel, ``host:port``) and ``ENGINE_TP_TOKEN``.

Its loop: wait on the channel for rank 0's next message and do it -- ``start`` (join the group,
load this rank's shard, answer ``ready``), ``init`` (allocate the KV cache), ``warm_up``,
``step`` (run the `StepRecord` on this rank's shard and cache: ``ModelRunner.run``, the same
code rank 0 runs), ``stats``, ``probe`` (bare all-reduces, timed by rank 0), ``stop``.
End-of-file on the channel (rank 0 is gone) ends it. Any
failure is reported to rank 0 as ``("error", text)`` and the process exits at once, closing its
sockets, so the other ranks' collectives fail instead of waiting.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from .group import ENV_CHANNEL, ENV_STORE_HOST_RANK, ENV_TOKEN, Channel, CollectiveGroup

logger = logging.getLogger("engine")


def store_address() -> str:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return f"{addr}:{port}"
    if os.environ.get("PADDLE_MASTER"):
        return os.environ["PADDLE_MASTER"]
    endpoints = os.environ.get("PADDLE_TRAINER_ENDPOINTS", "")
    if endpoints:
        return endpoints.split(",")[0]
    raise RuntimeError("no store address: set MASTER_ADDR and MASTER_PORT, PADDLE_MASTER or PADDLE_TRAINER_ENDPOINTS")


def serve(channel: Channel, rank: int, world: int) -> None:
    import paddle

    from ..device import warm_up
    from ..model_runner import ModelRunner
    from .runner import load_rank_model, probe_all_reduce

    kind, spec, gid = channel.recv()
    if kind != "start":
        raise RuntimeError(f"expected start, got {kind!r}")
    paddle.set_device(spec.device)
    group = CollectiveGroup(rank, world, store_address(), int(os.environ.get(ENV_STORE_HOST_RANK, "0")), gid=gid)
    model = load_rank_model(spec, rank, world, group)
    channel.send(("ready", model.kv_layout()))
    runner, step_s, steps = None, 0.0, 0
    while True:
        message = channel.recv()
        kind = message[0]
        if kind == "step":
            t0 = time.perf_counter()
            runner.run(message[1])
            step_s += time.perf_counter() - t0
            steps += 1
        elif kind == "init":
            num_blocks, block_size, dtype, backend, positions = message[1:]
            if positions is not None:
                model.rope.resize(positions)
            runner = ModelRunner(model, num_blocks, block_size, dtype, backend, "paddle", spec.device)
        elif kind == "warm_up":
            warm_up(runner, spec.device)
        elif kind == "stats":
            channel.send(("stats", {"comm_s": group.comm_s, "calls": group.calls, "step_s": step_s, "steps": steps}))
        elif kind == "probe":
            probe_all_reduce(group, *message[1:])
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown message {kind!r}")


def main() -> int:
    rank, world = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["PADDLE_TRAINERS_NUM"])
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(name)s: %(message)s")
    import paddle  # noqa: F401  (imported before connecting: once rank 0 says start, the group forms at once)

    from ..logs import undo_paddle_root_logging

    undo_paddle_root_logging()
    channel = Channel.connect(os.environ[ENV_CHANNEL])
    channel.send((rank, os.environ.get(ENV_TOKEN, "")))
    try:
        serve(channel, rank, world)
    except EOFError:
        pass  # rank 0 closed the channel: the engine stopped
    except BaseException as exc:  # noqa: BLE001  (report, then leave at once: peers must not wait on us)
        logger.exception("tensor-parallel rank %d failed", rank)
        try:
            channel.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    channel.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (Paddle's static destructors can stall at exit)


if __name__ == "__main__":
    sys.exit(main())
