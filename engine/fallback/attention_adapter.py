"""Our paged attention behind PaddleFormers' attention interface.

PaddleFormers models look their attention function up by name in
``paddleformers.nn.attention.interface.ALL_ATTENTION_FUNCTIONS`` (from
``config._attn_implementation``) and call it as

    attn_output, attn_weights = fn(module, query, key, value, attention_mask,
                                   scaling=..., dropout=..., **kwargs)

with ``query`` ``[batch, heads, seq, head_dim]`` and ``key``/``value``
``[batch, kv_heads, seq, head_dim]`` *after* RoPE, and expect
``attn_output`` as ``[batch, seq, heads * head_dim]``.

`paged_attention_forward` is that function for the engine: the batch
dimension is 1 (the wrapper packs the whole continuous batch into one
sequence), so the tensors are viewed as ``[T, heads, D]`` and handed to
``engine.attention.paged_attention`` together with the current step's
metadata and this layer's KV cache (see `step_context`). The library's
mask and its own KV cache are not used: causality, the packing of many
requests into one sequence and the sliding window are all expressed by the
metadata (block tables, context lengths, query start offsets).
"""

from __future__ import annotations

import paddle

from ..attention import paged_attention
from .step_context import current_step

ATTN_IMPLEMENTATION = "engine_paged"
"""The name our function is registered under; a model's ``config._attn_implementation``."""


def attend(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, layer_index: int, *, scale: float,
           sliding_window: int | None) -> paddle.Tensor:
    """Paged attention of packed ``[T, heads, D]`` tensors on layer ``layer_index``'s cache of the current step."""
    step = current_step()
    if not 0 <= layer_index < len(step.kv_caches):
        raise IndexError(f"attention layer index {layer_index} is outside the {len(step.kv_caches)} KV caches")
    return paged_attention(q, k, v, step.kv_caches[layer_index], step.meta, scale=scale,
                           sliding_window=sliding_window or None)


def paged_attention_forward(module, query, key, value, attention_mask=None, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs):
    """PaddleFormers attention-interface function running on the engine's paged KV cache.

    ``module`` is the library's attention layer: its ``layer_idx`` picks the KV
    cache, its ``sliding_window`` (Gemma 3 local layers; ``None`` elsewhere)
    the window, and its ``scaling`` the softmax scale when the caller passes none.
    """
    if query.shape[0] != 1:
        raise ValueError(f"the engine drives borrowed models with batch size 1 (one packed sequence); "
                         f"got a batch of {query.shape[0]}")
    if kwargs.get("sink") is not None:
        raise NotImplementedError("attention sinks are not supported by the engine's paged attention")
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    # [1, H, T, D] -> [T, H, D]  (strided views; the kernels read them in place)
    q = query[0].transpose([1, 0, 2])
    k = key[0].transpose([1, 0, 2])
    v = value[0].transpose([1, 0, 2])
    out = attend(q, k, v, module.layer_idx, scale=scaling, sliding_window=getattr(module, "sliding_window", None))
    num_tokens = out.shape[0]
    return out.reshape([1, num_tokens, -1]), None


def register() -> str:
    """Register `paged_attention_forward` with PaddleFormers (idempotent); returns its name."""
    from paddleformers.nn.attention.interface import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
