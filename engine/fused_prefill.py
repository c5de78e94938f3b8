"""The captured CPU prefill: a borrowed decoder's prefill and mixed steps on host arrays.

A prefill of the PaddleFormers backend on a CPU spends most of its time in
the float32 products, which already go to BLAS; around them each layer makes
some forty Paddle calls (norms, splits, reshapes, RoPE, residual adds), each
a Python dispatch. Gemma 3 270M, 257 tokens: 337 ms of products, 142 ms of
everything else. This step runs the same layers as one Python loop over
kernels on NumPy views: the products on the same weights through the same
routines the eager layers call (`engine.block_linear.BlockWeight.host_matmul`:
NumPy's BLAS on the float32 weight for more than ``SMALL_T`` rows, the
quantized blocks for fewer), the norms, RoPE and gated activation through the Numba kernels the
eager layers' speed-ups call (`engine.fallback.speedups`), and our paged
attention on the runner's cache.

It reads what the fused decode step reads (`engine.fused_decode.FusedDecode`:
the model's `DecoderSpec`, norm weights as multiplied, Q/K norms, the Q/K/V
bias, per-layer RoPE tables and windows, the KV cache) plus the linears of
the decoder's view. A decoder offers it with ``fused_prefill = True``
(``engine.fallback.captured.DecoderView``, checked against the eager forward
on a probe before it is used); native models keep their Paddle prefill.
"""

from __future__ import annotations

import numpy as np

import gpu_kernels
from gpu_kernels.cpu.gated import gated_rows
from gpu_kernels.cpu.norms import rms_norm
from gpu_kernels.cpu.rope import rope_rotate_half
from gpu_kernels.interop import host_view

from .step_record import StepRecord


def offers_fused_prefill(model) -> bool:
    """Whether ``model``'s fused decoder also offers the captured prefill."""
    decoder = getattr(model, "fused_decoder", None)
    return bool(getattr(decoder, "fused_prefill", False))


class FusedPrefill:
    """Runs steps that are not decode-only through the kernels, on the arrays ``decode`` prepared."""

    def __init__(self, decoder, decode):
        self.spec, d = decode.spec, decode   # the fused decode step's prepared arrays
        layers = range(len(decoder.layers))
        self.embed, self.final_norm, self.scale = d.embed, d.final_norm, float(d.scale)
        self.norms, self.qk_norms = list(d.norms), list(d.qk_norms)   # Python lists of the typed lists' arrays
        self.cos, self.sin = [d.cos[i] for i in layers], [d.sin[i] for i in layers]
        self.caches = [(d.k_caches[i], d.v_caches[i]) for i in layers]
        self.windows = [int(w) or None for w in d.windows]
        self.activation = d.activation
        self.linears = [[_Linear(lin) for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)]
                        for layer in decoder.layers]

    def forward(self, record: StepRecord) -> np.ndarray:
        """Hidden states ``[T, hidden]`` after the final norm; the step's K/V land in the cache."""
        spec = self.spec
        num_tokens = len(record.ids)
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        eps = spec.rms_norm_eps
        per_layer = 4 if spec.sandwich_norms else 2
        x = self.embed[record.ids] * np.float32(spec.embed_scale)
        h = np.empty_like(x)
        q = np.empty((1, heads, num_tokens, dim), np.float32)   # RoPE's layout; attention reads it as [T, H, D]
        k = np.empty((1, kv_heads, num_tokens, dim), np.float32)
        attn = np.empty((num_tokens, heads, dim), np.float32)
        act = np.empty((num_tokens, spec.intermediate_size), np.float32)
        qsl = record.starts.astype(np.int32)
        for layer, (qkv_proj, o_proj, gate_up_proj, down_proj) in enumerate(self.linears):
            norm = per_layer * layer
            rms_norm(x, self.norms[norm], eps, 0.0, h)
            q_raw, k_raw, v = _split(qkv_proj(h), heads, kv_heads, dim, spec.grouped_qkv)
            if self.qk_norms:
                q_raw = rms_norm(q_raw.reshape(-1, dim), self.qk_norms[2 * layer], eps, 0.0,
                                 np.empty((num_tokens * heads, dim), np.float32)).reshape(num_tokens, heads, dim)
                k_raw = rms_norm(k_raw.reshape(-1, dim), self.qk_norms[2 * layer + 1], eps, 0.0,
                                 np.empty((num_tokens * kv_heads, dim), np.float32)).reshape(num_tokens, kv_heads, dim)
            cos, sin = self.cos[layer][record.positions][None], self.sin[layer][record.positions][None]
            rope_rotate_half(q_raw.transpose(1, 0, 2)[None], cos, sin, q)
            rope_rotate_half(k_raw.transpose(1, 0, 2)[None], cos, sin, k)
            q_t, k_t = q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2)
            k_cache, v_cache = self.caches[layer]
            gpu_kernels.write_kv(k_t, np.ascontiguousarray(v), k_cache, v_cache, record.slots, backend="cpu")
            gpu_kernels.paged_prefill(q_t, k_cache, v_cache, record.block_tables, qsl, record.context_lens,
                                      self.scale, sliding_window=self.windows[layer], out=attn,
                                      backend="cpu")
            o = o_proj(attn.reshape(num_tokens, heads * dim))
            if spec.sandwich_norms:
                x += rms_norm(o, self.norms[norm + 1], eps, 0.0, h)
                rms_norm(x, self.norms[norm + 2], eps, 0.0, h)
            else:
                x += o
                rms_norm(x, self.norms[norm + 1], eps, 0.0, h)
            gated_rows(gate_up_proj(h), self.activation, act)
            down = down_proj(act)
            x += rms_norm(down, self.norms[norm + 3], eps, 0.0, h) if spec.sandwich_norms else down
        return rms_norm(x, self.final_norm, eps, 0.0, h)


def _split(qkv: np.ndarray, heads: int, kv_heads: int, dim: int, grouped: bool):
    """The product's queries ``[T, heads, dim]``, keys and values ``[T, kv_heads, dim]`` (views)."""
    num_tokens = qkv.shape[0]
    if grouped:  # per KV head: its query heads, its key, its value
        per = qkv.reshape(num_tokens, kv_heads, heads // kv_heads + 2, dim)
        return per[:, :, :-2].reshape(num_tokens, heads, dim), per[:, :, -2], per[:, :, -1]
    q_size, kv_size = heads * dim, kv_heads * dim
    return (qkv[:, :q_size].reshape(num_tokens, heads, dim),
            qkv[:, q_size:q_size + kv_size].reshape(num_tokens, kv_heads, dim),
            qkv[:, q_size + kv_size:].reshape(num_tokens, kv_heads, dim))


class _Linear:
    """A view's linear on host arrays, computed as its eager forward computes it (`engine.block_linear`)."""

    def __init__(self, linear):
        self.tensor = linear.weight                        # keeps the memory ``weight`` views alive
        self.weight = host_view(linear.weight)            # float32 [in, out]
        self.blocks = getattr(linear, "block_weight", None)
        self.bias = None if getattr(linear, "bias", None) is None else host_view(linear.bias)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = np.matmul(x, self.weight) if self.blocks is None else self.blocks.host_matmul(x, self.weight)
        return y if self.bias is None else y + self.bias
