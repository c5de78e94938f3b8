"""How one engine step reaches attention functions called from deep inside a borrowed model.

A PaddleFormers or PaddleFleet model is called the library's way
(``model(input_ids, position_ids=...)``); its attention layers then call our
attention function with only what the library passes (the layer module and
q/k/v). The step's ``AttentionMetadata`` and the paged KV caches travel
beside the call instead:

    with bind_step(meta, kv_caches):
        hidden = library_model(input_ids, position_ids=positions)

and inside the attention function::

    step = current_step()
    step.kv_caches[layer_idx], step.meta

The binding is a ``contextvars.ContextVar``: it is set only for the duration
of the ``with`` block and only in the calling thread, so two engines in two
threads never see each other's step. Calling an attention function outside a
binding is a bug and raises a ``RuntimeError`` that says so.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..attention import AttentionMetadata, KVCache


@dataclass(frozen=True)
class StepContext:
    """The current step's batch description and the per-layer paged caches."""

    meta: AttentionMetadata
    kv_caches: Sequence[KVCache]


_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("engine_step", default=None)


@contextlib.contextmanager
def bind_step(meta: AttentionMetadata, kv_caches: Sequence[KVCache]) -> Iterator[StepContext]:
    """Make ``meta`` and ``kv_caches`` the current step for the body of the ``with`` block."""
    step = StepContext(meta, kv_caches)
    token = _CURRENT.set(step)
    try:
        yield step
    finally:
        _CURRENT.reset(token)


def current_step() -> StepContext:
    """The step bound by the innermost enclosing `bind_step` (RuntimeError outside one)."""
    step = _CURRENT.get()
    if step is None:
        raise RuntimeError(
            "the engine's paged attention was called outside an engine step: a borrowed model must be run "
            "through its engine wrapper (e.g. PaddleFormersModel.forward), which binds the step's metadata "
            "and KV caches")
    return step
