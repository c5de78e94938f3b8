"""Rotary position embeddings (HF "rotate half" convention) with the model's theta and scaling."""

from __future__ import annotations

import math

import numpy as np
import paddle

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


# Positions the tables cover until the engine says how many it serves (``RotaryEmbedding.resize``):
# a config's max_position_embeddings (10M in a crafted one) no longer sizes them.
TABLE_POSITIONS = 8192


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"rope_theta must be a finite number > 0; got {theta!r}")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be None or a dict; got {scaling!r:.80}")
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type in ("linear", "llama3"):
        factor = scaling.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"rope_scaling.factor must be a finite number > 0 for rope_type {rope_type!r}; "
                             f"got {factor!r}")
    if rope_type == "linear":
        inv_freq = inv_freq / factor
    elif rope_type == "llama3":
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq


class RotaryEmbedding:
    """Precomputed cos/sin tables, gathered by position each step.

    The tables cover ``min(max_position, TABLE_POSITIONS)`` positions when built, and exactly the
    positions the engine serves once it calls ``resize`` (before anything holds on to them): their
    size comes from what is used, not from the config's ``max_position_embeddings``."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)
        self.max_position = max_position
        self.half = head_dim // 2
        self.resize(TABLE_POSITIONS)

    def resize(self, positions: int) -> None:
        """Tables for positions ``[0, min(positions, max_position))``."""
        self.positions = max(1, min(int(positions), self.max_position))
        freqs = np.outer(np.arange(self.positions, dtype=np.float64), self.inv_freq)
        emb = np.concatenate([freqs, freqs], axis=-1)
        self.cos = paddle.to_tensor(np.cos(emb).astype(np.float32))
        self.sin = paddle.to_tensor(np.sin(emb).astype(np.float32))

    def tables(self, positions: paddle.Tensor, dtype) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos, sin as [num_tokens, 1, head_dim], ready to broadcast over heads."""
        cos = paddle.index_select(self.cos, positions).unsqueeze(1)
        sin = paddle.index_select(self.sin, positions).unsqueeze(1)
        return cos.astype(dtype), sin.astype(dtype)

    def apply(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        """x: [num_tokens, heads, head_dim]."""
        x1, x2 = x[..., : self.half], x[..., self.half:]
        rotated = paddle.concat([-x2, x1], axis=-1)
        return x * cos + rotated * sin


class LayerRopes:
    """Each layer's `RotaryEmbedding` (``spec.layer_rope``): one per distinct base, shared by the layers
    that rotate with it (Gemma 3's windowed layers with their local base, the others with the global).
    ``positions``, ``cos`` and ``sin`` are the first layer's; ``resize`` resizes every one."""

    def __init__(self, spec):
        by_base: dict[tuple, RotaryEmbedding] = {}
        self.by_layer = []
        for i in range(spec.num_layers):
            theta, scaling = spec.layer_rope(i)
            key = (theta, repr(scaling))
            if key not in by_base:
                by_base[key] = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, theta, scaling)
            self.by_layer.append(by_base[key])
        self.distinct = list(by_base.values())

    def __getitem__(self, layer: int) -> RotaryEmbedding:
        return self.by_layer[layer]

    def resize(self, positions: int) -> None:
        for rope in self.distinct:
            rope.resize(positions)

    positions = property(lambda self: self.by_layer[0].positions)
    cos = property(lambda self: self.by_layer[0].cos)
    sin = property(lambda self: self.by_layer[0].sin)

    def tables(self, positions, dtype) -> list:
        """Per layer: its ``(cos, sin)`` for ``positions`` (gathered once per distinct base)."""
        gathered = {id(r): r.tables(positions, dtype) for r in self.distinct}
        return [gathered[id(r)] for r in self.by_layer]
