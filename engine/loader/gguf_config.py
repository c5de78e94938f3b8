"""Translate GGUF metadata into an HF ``config.json``-style dict.

GGUF keys are named ``<arch>.<key>`` (``llama.block_count``...).  The table
below maps each supported GGUF architecture to its HF class and ``model_type``;
`config_from_gguf` fills in what HF configs carry, using the defaults llama.cpp
itself applies where GGUF stores nothing (Gemma 3's local RoPE base, sliding
window pattern and query scaling are hard-wired in llama.cpp, not in the file).
"""

from __future__ import annotations

import numpy as np

from .checkpoint import validate_config
from .gguf_file import GGUFFile
from .gguf_names import SKIPPED, hf_name

# GGUF general.architecture -> (HF class, HF model_type)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}

# Gemma 3 defaults that llama.cpp hard-codes (src/llama-model.cpp, LLM_ARCH_GEMMA3) for files
# that do not carry attention.sliding_window_pattern / rope.freq_base_swa / attention.scale.
GEMMA3_SLIDING_WINDOW_PATTERN = 6       # every 6th layer is global, the rest use the sliding window
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10000.0   # RoPE base of the sliding-window layers


def _rope_scaling(f: GGUFFile) -> dict | None:
    kind = f.arch_get("rope.scaling.type")
    factor = f.arch_get("rope.scaling.factor")
    if kind in (None, "none") or factor in (None, 0, 1.0):
        return None
    scaling = {"rope_type": kind, "factor": float(factor)}
    original = f.arch_get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _int(f: GGUFFile, key: str, default=None) -> int:
    """A positive integer ``<arch>.<key>`` (``default`` when absent; absent without one is an error)."""
    value = f.arch_get(key, default)
    if value is None:
        raise ValueError(f"{f.path}: metadata key {f.architecture}.{key} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{f.path}: metadata key {f.architecture}.{key} must be a positive integer; got {value!r}")
    return int(value)


def config_from_gguf(f: GGUFFile) -> dict:
    """HF-style config dict for the model in `f` (raises ValueError for unknown architectures)."""
    arch = f.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{f.path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})")
    hf_class, model_type = GGUF_ARCHITECTURES[arch]

    hidden = _int(f, "embedding_length")
    heads = _int(f, "attention.head_count")
    kv_heads = _int(f, "attention.head_count_kv", heads)
    head_dim = _int(f, "attention.key_length", hidden // heads)
    vocab_size = f.arch_get("vocab_size") or len(f.get("tokenizer.ggml.tokens", ()))
    if not vocab_size and "token_embd.weight" in f.tensors:
        vocab_size = f.tensors["token_embd.weight"].shape[0]

    config = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _int(f, "feed_forward_length"),
        "num_hidden_layers": _int(f, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(f.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(f.arch_get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(f),
        "vocab_size": int(vocab_size),
        "max_position_embeddings": _int(f, "context_length", 2048),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": f.get("tokenizer.ggml.padding_token_id"),
        "unk_token_id": f.get("tokenizer.ggml.unknown_token_id"),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "gemma3":
        config.update(_gemma3_extras(f, config))
    shapes = {}
    for t in f.tensors.values():
        if t.name not in SKIPPED:
            try:
                shapes[hf_name(t.name, arch)] = t.shape
            except ValueError:  # named when the weights are read
                pass
    validate_config(f.path, config, shapes)
    return config


def _gemma3_extras(f: GGUFFile, config: dict) -> dict:
    layers = config["num_hidden_layers"]
    pattern = f.arch_get("attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, (int, np.integer)):  # every pattern-th layer is global
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    else:  # newer converters write one flag per layer (true = sliding window)
        sliding = [bool(flag) for flag in pattern]
        pattern = next((i + 1 for i, flag in enumerate(sliding) if not flag), layers)
    # llama.cpp scales queries by 1/sqrt(head_dim), except Gemma 3 27B (62 layers):
    # 1/sqrt(hidden_size / num_heads).  HF expresses this as query_pre_attn_scalar.
    scale = f.arch_get("attention.scale")
    if scale:
        scalar = round(1.0 / float(scale) ** 2)
    elif layers == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = config["head_dim"]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(f.arch_get("attention.sliding_window", 4096)),
        "sliding_window_pattern": int(pattern),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": float(f.arch_get("rope.freq_base_swa", GEMMA3_ROPE_LOCAL_BASE_FREQ)),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": f.arch_get("final_logit_softcapping"),
        "attn_logit_softcapping": f.arch_get("attn_logit_softcapping"),
        "attention_dropout": 0.0,
    }
