"""The native Llama matches PaddleFormers' own ``LlamaForCausalLM`` on SmolLM2's weights.

PaddleFormers runs here entirely its own way — its ``sdpa`` attention with its
causal mask, no engine cache — so this checks the native model (and the
checkpoint loading both share) against an independent Paddle implementation:
max |Δ logit| ≤ 1e-3 in float32 and the same top-1 token at every position.
"""

import numpy as np
import paddle
import pytest

from engine.models import build_native_model

PROMPTS = [
    "The capital of France is",
    "Question: What is 2+3?\nAnswer:",
    # a chat turn: holds <|im_end|>, which SmolLM2 also uses as its pad id
    "<|im_start|>user\nName three fruits.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]


@pytest.fixture(scope="module")
def paddleformers_llama(smollm2_checkpoint, smollm2_state_dict):
    from engine.fallback.hf_config import paddleformers_class, paddleformers_config
    from engine.fallback.weights import load_hf_weights

    cls = paddleformers_class("LlamaForCausalLM")
    config = paddleformers_config(cls, smollm2_checkpoint.config, "cpu", "sdpa")  # the library's own attention
    model = cls(config)
    load_hf_weights(model, smollm2_state_dict.items(), num_heads=config.num_attention_heads,
                    num_kv_heads=config.num_key_value_heads)
    model.eval()
    return model


@pytest.fixture(scope="module")
def native_llama(smollm2_checkpoint, smollm2_state_dict):
    return build_native_model(smollm2_checkpoint.architecture, smollm2_checkpoint.config,
                              smollm2_state_dict.items(), "float32")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_native_logits_match_paddleformers_llama(prompt, smollm2_checkpoint, native_llama, paddleformers_llama):
    ids = smollm2_checkpoint.tokenizer.encode(prompt, add_special_tokens=True)
    x = paddle.to_tensor(np.asarray(ids, dtype=np.int64))
    with paddle.no_grad():
        ours = native_llama.compute_logits(native_llama(x, paddle.arange(len(ids), dtype="int64"))).numpy()
        theirs = paddleformers_llama(x.unsqueeze(0), return_dict=True).logits[0].astype("float32").numpy()
    assert ours.shape == theirs.shape == (len(ids), smollm2_checkpoint.config["vocab_size"])
    assert np.abs(ours - theirs).max() <= 1e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
