"""The native Paddle decoder: one implementation, built from a `DecoderSpec` (``engine.models.spec``).

Every fact that separates one architecture from another is a field of the spec,
read here: Q/K/V bias (Qwen2), RMSNorm on each head of Q and K (Qwen3, Gemma 3),
interleaved RoPE served as rotate-half on rows permuted at load (ERNIE 4.5),
``(1 + w)`` norms, norms around attention and MLP, tanh-GELU, a scaled embedding,
a softmax scale, a sliding window and a RoPE base per layer, soft-capped logits
(Gemma 3). The fused CPU decode step (``engine.fused_decode``) reads the same
spec and these modules' parameters, and is tested against them.

Q/K/V are one fused projection and gate/up another, so a layer runs two
matmuls where HF runs five. Weights are stored Paddle-style, ``[in, out]``.
On the CPU, float32 inputs multiply on the checkpoint's quantized blocks when
the loader kept them (``engine.block_linear``). Attention goes through
``engine.attention.paged_attention`` (the paged KV cache) or, without metadata,
``dense_causal_attention`` (the reference).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from ..block_linear import head_matmul
from ..attention import AttentionMetadata, KVCache, dense_causal_attention, every_layer_attends, paged_attention
from .rope import LayerRopes, RotaryEmbedding
from .spec import DecoderSpec


class Linear(nn.Layer):
    """``y = x @ W (+ b)`` with ``W`` stored ``[in, out]``.

    Same parameters as ``paddle.nn.Linear``, but its forward calls ``paddle.matmul``
    directly: ``nn.Linear`` reads a global flag on every call, and a decode step
    makes four such calls per layer.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = self.create_parameter([in_features, out_features])
        self.bias = self.create_parameter([out_features], is_bias=True) if bias else None
        self.block_weight = None  # the checkpoint's quantized blocks, for CPU float32 inputs (engine.block_linear)

    def forward(self, x):
        if self.block_weight is not None and self.block_weight.accepts(x):
            y = self.block_weight.matmul(x)
        else:
            y = paddle.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Layer):
    """``x * rsqrt(mean(x^2) + eps) * (offset + w)`` (``offset``: the spec's ``norm_offset``)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        init = nn.initializer.Constant(1.0 - offset)
        self.weight = self.create_parameter([dim], default_initializer=init)

    def forward(self, x):
        weight = self.weight if not self.offset else self.weight.astype("float32") + self.offset
        if x.dtype == paddle.float32:
            return x * paddle.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * weight
        x32 = x.astype("float32")
        x32 = x32 * paddle.rsqrt((x32 * x32).mean(-1, keepdim=True) + self.eps)
        return (x32 * weight.astype("float32")).astype(x.dtype)


def _norm(spec: DecoderSpec, dim: int) -> RMSNorm:
    return RMSNorm(dim, spec.rms_norm_eps, spec.norm_offset)


class Attention(nn.Layer):
    def __init__(self, spec: DecoderSpec, layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.spec, self.rope = spec, rope
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size)
        if spec.qk_norm:
            self.q_norm = _norm(spec, spec.head_dim)
            self.k_norm = _norm(spec, spec.head_dim)
        self.scale = spec.softmax_scale
        self.window = spec.window(layer) or None

    def _split(self, qkv):
        """q [T, heads, d], k and v [T, kv_heads, d] from the fused product (as the spec lays it out)."""
        spec = self.spec
        nh, nkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        if not spec.grouped_qkv:  # all queries, all keys, all values
            return paddle.split(qkv.reshape([-1, nh + 2 * nkv, d]), [nh, nkv, nkv], axis=1)
        q, k, v = paddle.split(qkv.reshape([-1, nkv, nh // nkv + 2, d]), [nh // nkv, 1, 1], axis=2)
        return q.reshape([-1, nh, d]), k.squeeze(2), v.squeeze(2)

    def forward(self, x, cos, sin, meta: AttentionMetadata | None, kv_cache: KVCache | None):
        spec, qkv = self.spec, self.qkv_proj(x)
        if spec.qk_norm or spec.grouped_qkv:
            q, k, v = self._split(qkv)
            if spec.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        else:  # rotate Q and K heads in one go
            nh, nkv = spec.num_heads, spec.num_kv_heads
            qk, v = paddle.split(qkv.reshape([-1, nh + 2 * nkv, spec.head_dim]), [nh + nkv, nkv], axis=1)
            q, k = paddle.split(self.rope.apply(qk, cos, sin), [nh, nkv], axis=1)
        if meta is None:
            out = dense_causal_attention(q, k, v, scale=self.scale, sliding_window=self.window)
        else:
            out = paged_attention(q, k, v, kv_cache, meta, scale=self.scale, sliding_window=self.window)
        return self.o_proj(out.reshape([-1, self.q_size]))


class MLP(nn.Layer):
    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size)
        self.gelu = spec.activation == "gelu_pytorch_tanh"

    def forward(self, x):
        gate, up = paddle.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj((F.gelu(gate, approximate=True) if self.gelu else F.silu(gate)) * up)


class DecoderLayer(nn.Layer):
    def __init__(self, spec: DecoderSpec, layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.sandwich = spec.sandwich_norms
        self.input_layernorm = _norm(spec, spec.hidden_size)
        self.self_attn = Attention(spec, layer, rope)
        self.post_attention_layernorm = _norm(spec, spec.hidden_size)
        if self.sandwich:  # Gemma 2/3: attention and MLP outputs normed before their residual adds
            self.pre_feedforward_layernorm = _norm(spec, spec.hidden_size)
            self.post_feedforward_layernorm = _norm(spec, spec.hidden_size)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin, meta, kv_cache):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        if not self.sandwich:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class LlamaForCausalLM(nn.Layer):
    """Every native architecture: what differs is the `DecoderSpec` (module docstring)."""

    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.spec = spec
        self.rope = LayerRopes(spec)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.LayerList([DecoderLayer(spec, i, self.rope[i]) for i in range(spec.num_layers)])
        self.norm = _norm(spec, spec.hidden_size)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size)
        self.lm_head_blocks = None  # LM head (or tied embedding) in quantized blocks, see engine.block_linear

    @property
    def fused_decoder(self):
        """What the fused CPU decode step reads (``engine.fused_decode``): the model itself."""
        return self

    def forward(self, input_ids, positions, meta: AttentionMetadata | None = None, kv_caches=None):
        """Hidden states [num_tokens, hidden] after the final norm.

        With ``meta``/``kv_caches`` the packed batch runs on the paged cache;
        without, ``input_ids`` is one whole sequence and attention is dense.
        """
        x = self.embed_tokens(input_ids)
        if self.spec.embed_scale != 1.0:
            x = x * paddle.to_tensor(self.spec.embed_scale, dtype="float32").astype(x.dtype)
        tables = self.rope.tables(positions, x.dtype)
        with every_layer_attends(type(self).__name__, kv_caches):
            for i, layer in enumerate(self.layers):
                x = layer(x, *tables[i], meta, None if kv_caches is None else kv_caches[i])
        return self.norm(x)

    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, KV heads, head_dim): what the model runner sizes the paged cache by."""
        return self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim

    def compute_logits(self, hidden):
        if self.lm_head_blocks is not None and self.lm_head_blocks.accepts(hidden):
            logits = self.lm_head_blocks.matmul(hidden)
        elif self.spec.tie_word_embeddings:
            logits = head_matmul(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        logits = logits.astype("float32")
        cap = self.spec.final_logit_softcapping
        return logits if not cap else paddle.tanh(logits / cap) * cap
