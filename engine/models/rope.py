"""Rotary position embeddings (HF "rotate half" convention) with the model's theta and scaling."""

from __future__ import annotations

import math

import numpy as np
import paddle

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq


class RotaryEmbedding:
    """Precomputed cos/sin tables, gathered by position each step."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
        emb = np.concatenate([freqs, freqs], axis=-1)
        self.cos = paddle.to_tensor(np.cos(emb).astype(np.float32))
        self.sin = paddle.to_tensor(np.sin(emb).astype(np.float32))
        self.half = head_dim // 2

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
