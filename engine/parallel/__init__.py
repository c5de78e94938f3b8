"""Tensor parallelism: one model sharded over ``tensor_parallel_size`` ranks (processes), which run
every step together over Paddle's collectives (gloo on CPU).

* `group` -- the ranks' gloo group (``all_reduce`` / ``gather``, timed), the step channel
  from rank 0 to the others, and starting the ranks on this machine;
* `sharding` -- which slice of each weight a rank holds, and the checks made before loading;
* `layers` -- the native decoder with row-parallel ``o_proj`` / ``down_proj``, a vocab-parallel
  embedding and LM head;
* `runner` -- rank 0: start the ranks, send each step's `engine.step_record.StepRecord`;
* `worker` -- every other rank's loop (``python -m engine.parallel.worker``).

``LLM(model=..., tensor_parallel_size=N)`` makes the calling process rank 0 (it schedules,
holds the one block manager and samples) and starts ranks 1..N-1 on 127.0.0.1. See
docs/DISTRIBUTED.md.
"""

from .group import RankFailure

__all__ = ["RankFailure", "TensorParallel"]


def __getattr__(name: str):
    if name == "TensorParallel":
        from .runner import TensorParallel

        return TensorParallel
    raise AttributeError(f"module 'engine.parallel' has no attribute {name!r}")
