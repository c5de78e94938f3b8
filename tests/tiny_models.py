"""Tiny random HF-format model directories (Llama / Qwen2 / Qwen3 / Gemma3) for fast engine tests.

The weights are random but scaled so logits are peaked (greedy choices are far
from ties), which makes "same greedy output under a different schedule" a
meaningful check rather than a coin toss on float noise.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

VOCAB = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def _tokenizer() -> Tokenizer:
    specials = ["<unk>", "<s>", "</s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    words = specials + [f"w{i}" for i in range(VOCAB - len(specials))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(specials)
    return tok


def make_tiny_model(directory: str, architecture: str = "LlamaForCausalLM", seed: int = 0,
                    hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    head_dim: int | None = None, sliding_window: int = 4) -> str:
    """Write config.json, model.safetensors and tokenizer files; return the directory.

    ``Gemma3ForCausalLM``: Gemma 3's layout (extra norms, q/k norms, tied
    embeddings), even layers local with ``sliding_window``, odd layers global.
    """
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    head_dim = head_dim or hidden // heads
    inter = 2 * hidden
    gemma = architecture == "Gemma3ForCausalLM"
    tied = architecture == "LlamaForCausalLM" or gemma
    config = {
        "architectures": [architecture],
        "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                       "Gemma3ForCausalLM": "gemma3_text"}.get(architecture, "unknown"),
        "vocab_size": VOCAB, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2,
    }
    if gemma:
        config.update({
            "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "sliding_window": sliding_window, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": head_dim,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "attention_dropout": 0.0, "final_logit_softcapping": None, "attn_logit_softcapping": None,
        })

    def w(*shape, std=0.15):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(VOCAB, hidden, std=1.0), "model.norm.weight": 1 + w(hidden, std=0.1)}
    if not tied:
        tensors["lm_head.weight"] = w(VOCAB, hidden, std=0.5)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": 1 + w(hidden, std=0.1),
            p + "post_attention_layernorm.weight": 1 + w(hidden, std=0.1),
        })
        if architecture == "Qwen2ForCausalLM":
            for proj, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                tensors[p + f"self_attn.{proj}_proj.bias"] = w(n * head_dim, std=0.1)
        if architecture == "Qwen3ForCausalLM":
            tensors[p + "self_attn.q_norm.weight"] = 1 + w(head_dim, std=0.1)
            tensors[p + "self_attn.k_norm.weight"] = 1 + w(head_dim, std=0.1)
        if gemma:  # Gemma norms scale by (1 + weight)
            for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"):
                tensors[p + norm + ".weight"] = w(hidden, std=0.1)
            for norm in ("q_norm", "k_norm"):
                tensors[p + f"self_attn.{norm}.weight"] = w(head_dim, std=0.1)
    if gemma:
        tensors["model.norm.weight"] = w(hidden, std=0.1)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(config, fh)
    _tokenizer().save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "chat_template": CHAT_TEMPLATE}, fh)
    return directory


def tiny_prompts(n: int, length: int = 20, shared: int = 9, seed: int = 1) -> list[dict]:
    """Token-id prompts; the first ``shared`` tokens are common, so prefix caching has work to do."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(7, VOCAB, shared).tolist()
    return [{"prompt_token_ids": prefix + rng.integers(7, VOCAB, length - shared + i % 5).tolist()}
            for i in range(n)]


def packed_prefill_step(lengths, num_kv_heads, head_dim, block_size=4, layers=3):
    """Metadata + empty caches for a prefill of sequences of `lengths` tokens packed into one."""
    import paddle

    from engine.attention import AttentionMetadata

    tables, slots, positions, block = [], [], [], 0
    for n in lengths:
        blocks = list(range(block, block + -(-n // block_size)))
        block += len(blocks)
        tables.append(blocks)
        positions += list(range(n))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
    width = max(map(len, tables))
    meta = AttentionMetadata(
        positions=paddle.to_tensor(np.array(positions, np.int64)),
        slot_mapping=paddle.to_tensor(np.array(slots, np.int64)),
        block_tables=paddle.to_tensor(np.array([t + [0] * (width - len(t)) for t in tables], np.int32)),
        context_lens=paddle.to_tensor(np.array(lengths, np.int32)),
        query_start_loc=paddle.to_tensor(np.cumsum([0] + list(lengths)).astype(np.int32)),
        decode_only=False, num_tokens=sum(lengths))
    shape = [block, num_kv_heads, block_size, head_dim]
    caches = [(paddle.zeros(shape), paddle.zeros(shape)) for _ in range(layers)]
    return meta, caches
