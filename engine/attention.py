"""The engine's one attention op: every model (native or borrowed) calls ``paged_attention``.

The model runner packs the whole continuous batch into one sequence of
``num_tokens`` tokens and describes it once per step with ``AttentionMetadata``;
each layer then

1. scatters this step's K/V into its paged cache (``write_kv``, by slot), and
2. attends every query to its own sequence's cached tokens through the block
   table (``paged_decode`` when every sequence has one new token, else
   ``paged_prefill`` with bottom-right-aligned causal masks per chunk).

Both run in ``gpu_kernels`` (Numba), which reads Paddle tensors zero-copy,
on the engine's ``attention_backend`` (``meta.backend``; ``None`` follows the
tensors: CUDA kernels for GPU tensors, Numba CPU kernels else).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import numpy as np
import paddle

import gpu_kernels


@dataclass
class AttentionMetadata:
    """What every layer needs to know about this step's packed batch (built once per step)."""

    positions: paddle.Tensor        # int64 [num_tokens]: position of each token in its sequence
    slot_mapping: paddle.Tensor     # int64 [num_tokens]: cache slot each token's K/V goes to
    block_tables: paddle.Tensor     # int32 [num_seqs, max_blocks]
    context_lens: paddle.Tensor     # int32 [num_seqs]: tokens in the cache after this step
    query_start_loc: paddle.Tensor  # int32 [num_seqs + 1]: cumulative query counts
    decode_only: bool               # every sequence has exactly one new token
    num_tokens: int
    backend: str | None = None      # gpu_kernels backend ("cpu", "cuda", "reference"); None: by tensor


KVCache = tuple[paddle.Tensor, paddle.Tensor]  # ([num_blocks, kv_heads, block_size, head_dim]) × 2

_ATTENDED: contextvars.ContextVar[list | None] = contextvars.ContextVar("engine_attended", default=None)
_PROBE: contextvars.ContextVar = contextvars.ContextVar("engine_lens_probe", default=None)


@contextlib.contextmanager
def probing(probe):
    """While inside, every `paged_attention` call hands ``probe.record(q, k_cache, scale, window)`` its
    query rows and layer cache after attending (the attention lens, ``engine.lens``; one step only)."""
    token = _PROBE.set(probe)
    try:
        yield
    finally:
        _PROBE.reset(token)


@contextlib.contextmanager
def every_layer_attends(owner: str, kv_caches, why: str = ""):
    """Check that the body calls `paged_attention` exactly once on each of ``kv_caches``.

    Every model wrapper (native, PaddleFormers, PaddleFleet) runs its layers
    inside this block: a layer that attends some other way (a library falling
    back to its own attention, a layer left unpatched) would attend to this
    step's tokens only, which no output check would notice. ``why`` says what
    that means for ``owner``. ``kv_caches=None`` (no paged cache) checks nothing.
    """
    if kv_caches is None:
        yield
        return
    seen: list[int] = []
    token = _ATTENDED.set(seen)
    try:
        yield
    finally:
        _ATTENDED.reset(token)
    layer_of = {id(cache[0]): i for i, cache in enumerate(kv_caches)}
    layers = sorted(layer_of.get(key, -1) for key in seen)
    if layers != list(range(len(kv_caches))):
        raise RuntimeError(f"{owner}: {len(seen)} attention calls reached the engine's KV cache for "
                           f"{len(kv_caches)} layers (layers {layers}, -1: not one of the step's caches)"
                           + (f"; {why}" if why else ""))


def paged_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> paddle.Tensor:
    """q: [T, num_heads, D]; k, v: [T, num_kv_heads, D]. Returns [T, num_heads, D]."""
    k_cache, v_cache = kv_cache
    seen = _ATTENDED.get()
    if seen is not None:
        seen.append(id(k_cache))
    if k.dtype != k_cache.dtype:
        k, v = k.astype(k_cache.dtype), v.astype(k_cache.dtype)
    backend = meta.backend
    gpu_kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=backend)
    out = paddle.empty(q.shape, dtype=q.dtype)
    if meta.decode_only:
        gpu_kernels.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                 sliding_window=sliding_window, out=out, backend=backend)
    else:
        gpu_kernels.paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                  meta.context_lens, scale, sliding_window=sliding_window, out=out,
                                  backend=backend)
    probe = _PROBE.get()
    if probe is not None:
        probe.record(q, k_cache, scale, sliding_window)
    return out


def dense_causal_attention(q, k, v, *, scale: float, sliding_window: int | None = None) -> paddle.Tensor:
    """Plain full attention over one sequence, no cache: the reference the paged path must match."""
    t, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    if group > 1:
        k = paddle.repeat_interleave(k, group, axis=1)
        v = paddle.repeat_interleave(v, group, axis=1)
    scores = paddle.einsum("qhd,khd->hqk", q.astype("float32"), k.astype("float32")) * scale
    pos = np.arange(t)
    visible = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        visible &= pos[None, :] > pos[:, None] - sliding_window
    mask = paddle.to_tensor(np.where(visible, 0.0, -np.inf).astype("float32"))
    probs = paddle.nn.functional.softmax(scores + mask, axis=-1)
    return paddle.einsum("hqk,khd->qhd", probs, v.astype("float32")).astype(q.dtype)
