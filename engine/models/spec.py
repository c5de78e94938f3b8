"""`DecoderSpec`: every fact about a decoder that the code computing it reads -- one description.

The native Paddle modules (`engine.models.llama`) are built from it, the fused CPU decode step
(`engine.fused_decode`) packs weights and picks the kernel's flags from it, and both loaders
produce it: the native one from the checkpoint's HF config (`DecoderSpec.from_hf`), the
PaddleFormers backend from the borrowed model's modules (`engine.fallback.captured`). A fact
that only one path read is the divergence this file exists to prevent; tests/test_decoder_spec.py
flips each field and requires both paths to change, identically.

Adding a native architecture is an entry in `ARCHITECTURES` (its facts from the HF config);
a fact no decoder has had yet is a field here, read by `llama.py` and `fused_decode.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
         "max_position_embeddings")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_pytorch_tanh"}  # config name -> ours


@dataclass(frozen=True)
class DecoderSpec:
    # sizes
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    # norms: RMSNorm ``x * rsqrt(mean(x^2) + eps) * (norm_offset + w)``
    rms_norm_eps: float = 1e-6
    norm_offset: float = 0.0                    # Gemma's 1 (the weight stored as w, multiplied as 1 + w)
    sandwich_norms: bool = False                # attention and MLP outputs normed before their residual adds
    # attention
    qkv_bias: bool = False
    qk_norm: bool = False                       # RMSNorm on each head of Q and K before RoPE
    grouped_qkv: bool = False                   # the fused QKV product per KV head (its queries, key, value)
    attn_scale: float | None = None             # softmax scale; None: head_dim ** -0.5
    sliding_windows: tuple[int, ...] = ()       # per layer (0: the whole context); (): none anywhere
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    local_rope_theta: float | None = None       # the windowed layers' base, unscaled (Gemma 3); None: rope_theta
    rope_interleaved: bool = False              # checkpoint rotates pairs (2i, 2i+1) (ERNIE): Q/K rows permuted at load
    # MLP, embedding, head
    activation: str = "silu"                    # of the gated MLP: "silu" or "gelu_pytorch_tanh"
    embed_scale: float = 1.0                    # embedding rows times this (Gemma: sqrt(hidden))
    tie_word_embeddings: bool = False
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        for name in SIZES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"decoder {name} must be a positive integer; got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"decoder num_heads={self.num_heads} is not a multiple of num_kv_heads="
                             f"{self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"decoder head_dim must be even (RoPE rotates pairs); got {self.head_dim}")
        if self.activation not in ACTIVATIONS.values():
            raise ValueError(f"decoder activation {self.activation!r} is not computed here; accepted: "
                             f"{', '.join(sorted(set(ACTIVATIONS.values())))}")
        if self.sliding_windows and (len(self.sliding_windows) != self.num_layers
                                     or any(not isinstance(w, int) or w < 0 for w in self.sliding_windows)):
            raise ValueError(f"decoder sliding_windows must be () or {self.num_layers} integers >= 0 (one per "
                             f"layer); got {self.sliding_windows!r:.80}")
        for name in ("rms_norm_eps", "rope_theta", "embed_scale", "attn_scale", "final_logit_softcapping",
                     "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and value > 0):
                raise ValueError(f"decoder {name} must be a finite number > 0{'' if name in _REQUIRED else ' or None'}"
                                 f"; got {value!r}")
            if value is None and name in _REQUIRED:
                raise ValueError(f"decoder {name} must be a finite number > 0; got None")

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: the whole context)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def layer_rope(self, layer: int) -> tuple[float, dict | None]:
        """``(theta, scaling)`` layer ``layer`` rotates Q and K with."""
        if self.local_rope_theta is not None and self.window(layer):
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale

    @classmethod
    def from_hf(cls, architecture: str, c: dict) -> "DecoderSpec":
        """The native decoder of ``architecture`` as an HF config describes it; a ValueError naming the
        field (or the architecture) that has no native implementation, before anything is allocated."""
        if architecture not in ARCHITECTURES:
            raise ValueError(f"no native implementation for {architecture}; native architectures: "
                             f"{', '.join(ARCHITECTURES)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if c.get(key) is None:
                raise ValueError(f"{architecture} config is missing {key}")
        act = c.get("hidden_act") or c.get("hidden_activation") or "silu"
        heads = c["num_attention_heads"]
        common = dict(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"], num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=c.get("rope_theta", 10000.0),
            rope_scaling=c.get("rope_scaling"), activation=ACTIVATIONS.get(act, act),
            tie_word_embeddings=c.get("tie_word_embeddings", False))
        return cls(**{**common, **ARCHITECTURES[architecture](architecture, c)})


_REQUIRED = ("rms_norm_eps", "rope_theta", "embed_scale")
BEHAVIOUR = tuple(f.name for f in fields(DecoderSpec) if f.name not in SIZES)


def _silu_only(architecture: str, c: dict) -> None:
    act = c.get("hidden_act") or c.get("hidden_activation") or "silu"
    if ACTIVATIONS.get(act) != "silu":
        raise ValueError(f"{architecture} with hidden_act={act!r} has no native implementation: its native "
                         "decoder's MLP is SiLU-gated; use model_impl='paddleformers'")


def _no_window(architecture: str, c: dict) -> None:
    windowed = sliding_layers(c)
    if windowed:
        raise ValueError(f"{architecture} with sliding-window layers ({windowed[:4]}..., sliding_window="
                         f"{c.get('sliding_window')}) has no native implementation: its native decoder attends "
                         f"to the whole context")


def _llama(architecture: str, c: dict) -> dict:
    _silu_only(architecture, c)
    _no_window(architecture, c)
    return dict(qkv_bias=bool(c.get("attention_bias", False)))


def _qwen2(architecture: str, c: dict) -> dict:
    return {**_llama(architecture, c), "qkv_bias": True}


def _qwen3(architecture: str, c: dict) -> dict:
    return {**_llama(architecture, c), "qk_norm": True}


def _ernie4_5(architecture: str, c: dict) -> dict:
    if c.get("use_bias"):
        raise ValueError("Ernie4_5ForCausalLM with use_bias=true (biased linears and norms) has no native "
                         "implementation; use model_impl='paddleformers'")
    # ERNIE 4.5's config defaults to tied embeddings; interleaved RoPE
    return {**_llama(architecture, c), "rope_interleaved": True,
            "tie_word_embeddings": c.get("tie_word_embeddings", True)}


ARCHITECTURES = {  # HF class -> its facts beyond the common ones (`DecoderSpec.from_hf`)
    "LlamaForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Ernie4_5ForCausalLM": _ernie4_5,
}


def sliding_layers(c: dict) -> list[int]:
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
