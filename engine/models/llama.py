"""Native Paddle decoder for Llama, Qwen2 and Qwen3 — one implementation, three flag sets.

| architecture | differences from Llama |
|---|---|
| ``Qwen2ForCausalLM`` | bias on the Q/K/V projections |
| ``Qwen3ForCausalLM`` | RMSNorm on each head of Q and K before RoPE; explicit ``head_dim`` |
| ``Ernie4_5ForCausalLM`` | interleaved ("GLM-style") RoPE, served as rotate-half on Q/K rows permuted at load (`engine.models.interleaved_to_half`); tied embeddings by default |

Q/K/V are one fused projection and gate/up another, so a layer runs two
matmuls where HF runs five. Weights are stored Paddle-style, ``[in, out]``.
On the CPU, float32 inputs multiply on the checkpoint's quantized blocks when
the loader kept them (``engine.block_linear``). Attention goes through
``engine.attention.paged_attention`` (the paged KV cache) or, without metadata,
``dense_causal_attention`` (the reference). Decode-only CPU steps can also run
as one fused kernel over these same parameters (``engine.fused_decode``); this
module stays the definition that path is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle
import paddle.nn.functional as F
from paddle import nn

from ..attention import AttentionMetadata, KVCache, dense_causal_attention, every_layer_attends, paged_attention
from .rope import RotaryEmbedding


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    # what only borrowed decoders have (``engine.fallback.captured`` reads them; the native
    # decoder refuses configs that need them, `from_hf`), as the fused decode step takes them:
    embed_scale: float = 1.0                    # embedding rows times this (Gemma: sqrt(hidden))
    attn_scale: float | None = None             # softmax scale; None: head_dim ** -0.5
    activation: str = "silu"                    # the gated MLP's: "silu" or "gelu_pytorch_tanh"
    sandwich_norms: bool = False                # attention and MLP outputs normed before their residual adds
    sliding_windows: tuple[int, ...] = ()       # per layer (0: the whole context); () none anywhere
    grouped_qkv: bool = False                   # the QKV product per KV head: its query heads, key, value
    final_logit_softcapping: float | None = None

    @classmethod
    def from_hf(cls, architecture: str, c: dict) -> "DecoderConfig":
        ernie = architecture == "Ernie4_5ForCausalLM"
        if ernie and c.get("use_bias"):
            raise ValueError("Ernie4_5ForCausalLM with use_bias=true (biased linears and norms) has no native "
                             "implementation; use model_impl='paddleformers'")
        windowed = _sliding_layers(c)
        if windowed:
            raise ValueError(f"{architecture} with sliding-window layers ({windowed[:4]}..., sliding_window="
                             f"{c.get('sliding_window')}) has no native implementation: the native decoder "
                             f"attends to the whole context")
        act = c.get("hidden_act") or c.get("hidden_activation") or "silu"
        if act not in ("silu", "swish"):
            raise ValueError(f"{architecture} with hidden_act={act!r} has no native implementation: the native "
                             "decoder's MLP is SiLU-gated; use model_impl='paddleformers'")
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta", 10000.0),
            rope_scaling=c.get("rope_scaling"),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=c.get("tie_word_embeddings", ernie),  # ERNIE 4.5's config defaults to tied
            qkv_bias=architecture == "Qwen2ForCausalLM" or c.get("attention_bias", False),
            qk_norm=architecture == "Qwen3ForCausalLM",
        )


def _sliding_layers(c: dict) -> list[int]:
    """Layers an HF config makes attend through a sliding window (Qwen2's ``use_sliding_window``,
    ``max_window_layers``, ``layer_types``), as HF transformers decides them."""
    if not c.get("sliding_window"):
        return []
    types = c.get("layer_types")
    if types:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not c.get("use_sliding_window"):
        return []
    n = c["num_hidden_layers"]
    return [i for i in range(n) if i >= c.get("max_window_layers", n)]


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
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x):
        if x.dtype == paddle.float32:
            return x * paddle.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight
        x32 = x.astype("float32")
        x32 = x32 * paddle.rsqrt((x32 * x32).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.astype("float32")).astype(x.dtype)


class Attention(nn.Layer):
    def __init__(self, cfg: DecoderConfig, rope: RotaryEmbedding):
        super().__init__()
        self.cfg, self.rope = cfg, rope
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, cos, sin, meta: AttentionMetadata | None, kv_cache: KVCache | None):
        cfg = self.cfg
        nh, nkv = cfg.num_heads, cfg.num_kv_heads
        qkv = self.qkv_proj(x).reshape([-1, nh + 2 * nkv, cfg.head_dim])
        if cfg.qk_norm:
            q, k, v = paddle.split(qkv, [nh, nkv, nkv], axis=1)
            q, k = self.rope.apply(self.q_norm(q), cos, sin), self.rope.apply(self.k_norm(k), cos, sin)
        else:  # rotate Q and K heads in one go
            qk, v = paddle.split(qkv, [nh + nkv, nkv], axis=1)
            q, k = paddle.split(self.rope.apply(qk, cos, sin), [nh, nkv], axis=1)
        if meta is None:
            out = dense_causal_attention(q, k, v, scale=self.scale)
        else:
            out = paged_attention(q, k, v, kv_cache, meta, scale=self.scale)
        return self.o_proj(out.reshape([-1, self.q_size]))


class MLP(nn.Layer):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        gate, up = paddle.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Layer):
    def __init__(self, cfg: DecoderConfig, rope: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Layer):
    """Also serves ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` (see module docstring)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.LayerList([DecoderLayer(cfg, self.rope) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.lm_head_blocks = None  # LM head (or tied embedding) in quantized blocks, see engine.block_linear

    def forward(self, input_ids, positions, meta: AttentionMetadata | None = None, kv_caches=None):
        """Hidden states [num_tokens, hidden] after the final norm.

        With ``meta``/``kv_caches`` the packed batch runs on the paged cache;
        without, ``input_ids`` is one whole sequence and attention is dense.
        """
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope.tables(positions, x.dtype)
        with every_layer_attends(type(self).__name__, kv_caches):
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, meta, None if kv_caches is None else kv_caches[i])
        return self.norm(x)

    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, KV heads, head_dim): what the model runner sizes the paged cache by."""
        return self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim

    def compute_logits(self, hidden):
        if self.lm_head_blocks is not None and self.lm_head_blocks.accepts(hidden):
            return self.lm_head_blocks.matmul(hidden)
        if self.cfg.tie_word_embeddings:
            logits = paddle.matmul(hidden, self.embed_tokens.weight, transpose_y=True)
        else:
            logits = self.lm_head(hidden)
        return logits.astype("float32")
