"""The native Qwen2 / Qwen3 decoder against HF transformers (the independent implementation).

Tiny random ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` are built *in
transformers* (its own initialisation and ``save_pretrained``), saved, and
loaded by the engine from that HF directory: logits over whole prompts within
1e-4, and greedy decoding through the engine (fused CPU decode and Paddle
paths) equal to HF's greedy loop. The variants cover what separates them from
Llama: Q/K/V bias (Qwen2), per-head Q/K RMSNorm (Qwen3), tied and untied
embeddings, a non-default ``head_dim``, and a ``sliding_window`` that is
configured but not in use (Qwen2's default) -- a window actually in use is
refused natively, with the layers it covers, instead of being ignored.

Needs the "reference" extra (torch, transformers); skipped without it.
"""

import os

import numpy as np
import paddle
import pytest
from conftest import torch_transformers

from engine import LLM, SamplingParams
from engine.loader import load_checkpoint
from engine.models import build_native_model
from tiny_models import CHAT_TEMPLATE, VOCAB, _tokenizer, tiny_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              rope_theta=10000.0, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
VARIANTS = {
    "qwen2-tied": ("Qwen2", dict(tie_word_embeddings=True, sliding_window=4, use_sliding_window=False)),
    "qwen2-untied": ("Qwen2", dict(tie_word_embeddings=False)),
    "qwen3-tied": ("Qwen3", dict(tie_word_embeddings=True, head_dim=24)),
    "qwen3-untied": ("Qwen3", dict(tie_word_embeddings=False, head_dim=16)),
}


@pytest.fixture(scope="module")
def transformers():
    with torch_transformers() as module:
        yield module


def build_hf(transformers, variant: str, directory: str):
    """A random tiny model made and saved by transformers; (model, directory)."""
    import torch

    family, extra = VARIANTS[variant]
    torch.manual_seed(sum(map(ord, variant)))
    config = getattr(transformers, f"{family}Config")(**COMMON, **extra)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0: every weight matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    _tokenizer().save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
        import json

        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE},
                  fh)
    return model, directory


def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[-n:]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_native_qwen_matches_hf_transformers(variant, transformers, tmp_path):
    hf, directory = build_hf(transformers, variant, str(tmp_path / variant))
    checkpoint = load_checkpoint(directory)
    assert checkpoint.architecture == f"{VARIANTS[variant][0]}ForCausalLM"
    native = build_native_model(checkpoint.architecture, checkpoint.config, checkpoint.weights("float32"), "float32")
    assert native.cfg.qkv_bias == variant.startswith("qwen2") and native.cfg.qk_norm == variant.startswith("qwen3")
    prompts = tiny_prompts(3)
    for prompt in prompts:
        ids = prompt["prompt_token_ids"]
        with paddle.no_grad():
            x = paddle.to_tensor(np.asarray(ids, np.int64))
            ours = native.compute_logits(native(x, paddle.arange(len(ids), dtype="int64"))).numpy()
        theirs = hf_logits(hf, ids)
        assert np.abs(ours - theirs).max() <= 1e-4
        assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    expected = [hf_greedy(hf, p["prompt_token_ids"], GREEDY.max_tokens) for p in prompts]
    for decode in ("fused", "paddle"):
        llm = LLM(model=directory, model_impl="native", cpu_decode=decode, block_size=4)
        try:
            assert llm.snapshot().decode_path == decode
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
        finally:
            llm.shutdown()


def test_a_sliding_window_in_use_is_refused_natively(transformers, tmp_path):
    config = transformers.Qwen2Config(**COMMON, sliding_window=4, use_sliding_window=True, max_window_layers=1)
    hf_config = config.to_dict()
    with pytest.raises(ValueError, match=r"sliding-window layers \(\[1, 2\]"):
        build_native_model("Qwen2ForCausalLM", hf_config, iter(()), "float32")
