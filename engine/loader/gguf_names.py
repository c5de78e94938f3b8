"""GGUF tensor names and row orders -> HF's, shared by the float loader and the block loader.

* **Names**: ``blk.3.attn_q.weight`` <- ``model.layers.3.self_attn.q_proj.weight``
  (tables below; Gemma 3 has two extra norms per layer).
* **Q/K RoPE permutation** (``llama`` only): llama.cpp's ``LlamaModel.permute``
  reorders the rows of q_proj/k_proj within each head from HF's "rotate half"
  RoPE layout to interleaved pairs; `unpermute` reverses it. Qwen2/Qwen3/Gemma 3
  use NeoX-style RoPE in llama.cpp and are stored unpermuted.
"""

from __future__ import annotations

import re

import numpy as np

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Gemma 3 normalizes before and after both attention and MLP.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Tensors llama.cpp adds that are not model parameters in HF (precomputed RoPE factors).
SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")


def hf_name(gguf_name: str, architecture: str) -> str:
    """The HF parameter name of GGUF tensor `gguf_name` (ValueError if unknown)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    table = _GEMMA3_LAYER_NAMES if architecture == "gemma3" else _LAYER_NAMES
    if match and match.group(2) in table:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{table[part]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name for architecture {architecture!r}")


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute`` on q_proj/k_proj rows (weight or bias).

    llama.cpp: ``w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)``.
    """
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def undo_rope_permutation(gguf_name: str, arch: str, config: dict, w: np.ndarray) -> np.ndarray:
    """`unpermute` the rows of a ``llama`` q_proj/k_proj tensor; any other tensor as it is."""
    if arch == "llama" and ".attn_q." in gguf_name:
        return unpermute(w, config["num_attention_heads"])
    if arch == "llama" and ".attn_k." in gguf_name:
        return unpermute(w, config["num_key_value_heads"])
    return w
