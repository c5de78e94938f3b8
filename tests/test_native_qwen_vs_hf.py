"""The native Qwen2 / Qwen3 decoder against HF transformers (the independent implementation).

Tiny random ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` built *in transformers* (its own
initialisation and ``save_pretrained``, kept in tests/fixtures/hf/) are loaded by the engine
from that HF directory: logits over whole prompts within 1e-4 of transformers' on the same
directory, and greedy decoding through the engine (fused CPU decode and Paddle paths) equal to
HF's greedy loop. The variants cover what separates them from
Llama: Q/K/V bias (Qwen2), per-head Q/K RMSNorm (Qwen3), tied and untied
embeddings, a non-default ``head_dim``, and a ``sliding_window`` that is
configured but not in use (Qwen2's default) -- a window actually in use is
refused natively, with the layers it covers, instead of being ignored.

transformers' answers are computed live with the "reference" extra (torch) and read from their
recording without it (`hf_recorded`; ``scripts/record_hf_references.py`` writes both the
directories and the answers).
"""

import json
import os

import hf_recorded
import numpy as np
import paddle
import pytest

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


def build_hf(transformers, variant: str, directory: str):
    """A random tiny model made and saved by transformers (``record`` mode writes the fixtures)."""
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
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE},
                  fh)
    return directory


def model_dir(transformers, variant: str) -> str:
    """The variant's directory as transformers saved it (tests/fixtures/hf/VARIANT)."""
    directory = str(hf_recorded.FIXTURES / variant)
    if hf_recorded.recording():
        build_hf(transformers, variant, directory)
    return directory


def hf_answer(transformers, variant: str, directory: str, prompts: list[list[int]], n: int):
    """transformers' logits over each prompt and its ``n`` greedy tokens, on the directory's model."""
    def compute():
        model = getattr(transformers, f"{VARIANTS[variant][0]}ForCausalLM").from_pretrained(directory).eval()
        return {"logits": [hf_logits(model, ids) for ids in prompts],
                "greedy": [hf_greedy(model, ids, n) for ids in prompts]}

    inputs = {"weights": hf_recorded.file_digest(os.path.join(directory, "model.safetensors"),
                                                 os.path.join(directory, "config.json")),
              "prompts": prompts, "greedy_tokens": n}
    return hf_recorded.answer(f"qwen-{variant}", inputs, compute)


def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[-n:]


@pytest.mark.reference
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_native_qwen_matches_hf_transformers(variant, hf_transformers):
    directory = model_dir(hf_transformers, variant)
    prompts = tiny_prompts(3)
    reference = hf_answer(hf_transformers, variant, directory, [p["prompt_token_ids"] for p in prompts],
                          GREEDY.max_tokens)
    checkpoint = load_checkpoint(directory)
    assert checkpoint.architecture == f"{VARIANTS[variant][0]}ForCausalLM"
    native = build_native_model(checkpoint.architecture, checkpoint.config, checkpoint.weights("float32"), "float32")
    assert native.spec.qkv_bias == variant.startswith("qwen2") and native.spec.qk_norm == variant.startswith("qwen3")
    for prompt, theirs in zip(prompts, reference["logits"]):
        ids = prompt["prompt_token_ids"]
        with paddle.no_grad():
            x = paddle.to_tensor(np.asarray(ids, np.int64))
            ours = native.compute_logits(native(x, paddle.arange(len(ids), dtype="int64"))).numpy()
        assert np.abs(ours - theirs).max() <= 1e-4
        assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    expected = reference["greedy"]
    for decode in ("fused", "paddle"):
        llm = LLM(model=directory, model_impl="native", cpu_decode=decode, block_size=4)
        try:
            assert llm.snapshot().decode_path == decode
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
        finally:
            llm.shutdown()


def test_a_sliding_window_in_use_is_refused_natively(hf_transformers):
    import transformers     # its configurations need no torch; the torch copy where it is imported

    config = (hf_transformers or transformers).Qwen2Config(**COMMON, sliding_window=4, use_sliding_window=True,
                                                           max_window_layers=1)
    hf_config = config.to_dict()
    with pytest.raises(ValueError, match=r"sliding-window layers \(\[1, 2\]"):
        build_native_model("Qwen2ForCausalLM", hf_config, iter(()), "float32")
