"""ERNIE 4.5 dense (``Ernie4_5ForCausalLM``, the 0.3B architecture) on tiny random weights.

No small ERNIE weights ship on PyPI, so an HF-format directory with random
weights stands in (`make_tiny_ernie`); the reference is PaddleFormers' own
``Ernie4_5ForCausalLM`` -- its eager forward with its own ``sdpa`` attention
and causal mask, no engine cache -- on the same weights:

* the fallback (``model_impl="paddleformers"``, what ``auto`` picked before a
  native model existed) and the native model (``auto``: Llama with the
  interleaved RoPE turned into rotate-half by permuting Q/K rows at load) give
  the library's logits within 1e-4 over a whole prompt;
* greedy decoding through the engine, both implementations, both decode paths
  (the fused CPU step and Paddle), equals a greedy loop over the library model;
* the row permutation is exactly interleaved RoPE (checked on random vectors).

HF transformers' own ``Ernie4_5ForCausalLM`` is compared too
(`test_native_matches_hf_transformers_ernie`): live with the "reference" extra, else its
recorded logits for the same directory (`hf_recorded`).
"""

import json
import os

import numpy as np
import hf_recorded
import paddle
import pytest

from engine import LLM, SamplingParams
from engine.loader import load_checkpoint
from engine.model_impl import build_model, resolve_model_impl
from engine.models import build_native_model, interleaved_to_half
from tiny_models import make_tiny_model, packed_prefill_step, tiny_prompts

LAYERS = 2
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)


def make_tiny_ernie(directory: str, seed: int = 7) -> str:
    """A Llama-layout tiny model re-declared as ERNIE 4.5 (same HF tensor names, tied embeddings)."""
    make_tiny_model(directory, "LlamaForCausalLM", seed=seed, hidden=64, layers=LAYERS, heads=4, kv_heads=2,
                    head_dim=32)
    path = os.path.join(directory, "config.json")
    with open(path) as fh:
        config = json.load(fh)
    config.update(architectures=["Ernie4_5ForCausalLM"], model_type="ernie4_5", use_bias=False,
                  rope_theta=500000.0, rms_norm_eps=1e-5)
    with open(path, "w") as fh:
        json.dump(config, fh)
    return directory


@pytest.fixture(scope="module")
def ernie_dir(tmp_path_factory):
    return make_tiny_ernie(str(tmp_path_factory.mktemp("ernie4_5")))


@pytest.fixture(scope="module")
def library_ernie(ernie_dir):
    """PaddleFormers' Ernie4_5ForCausalLM, its own attention, on the directory's weights."""
    from engine.fallback.hf_config import paddleformers_class, paddleformers_config
    from engine.fallback.weights import load_hf_weights

    checkpoint = load_checkpoint(ernie_dir)
    cls = paddleformers_class("Ernie4_5ForCausalLM")
    config = paddleformers_config(cls, checkpoint.config, "cpu", "sdpa")
    model = cls(config)
    load_hf_weights(model, checkpoint.weights("float32"), num_heads=config.num_attention_heads,
                    num_kv_heads=config.num_key_value_heads)
    model.eval()
    return model


def library_logits(model, ids: list[int]) -> np.ndarray:
    with paddle.no_grad():
        out = model(paddle.to_tensor(np.asarray([ids], np.int64)), return_dict=True)
    return out.logits[0].astype("float32").numpy()


def library_greedy(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(library_logits(model, ids)[-1].argmax()))
    return ids[-n:]


def test_auto_serves_ernie_natively_and_paddleformers_on_request():
    assert resolve_model_impl("auto", "Ernie4_5ForCausalLM") == "native"
    assert resolve_model_impl("paddleformers", "Ernie4_5ForCausalLM") == "paddleformers"


def test_permuted_rows_turn_interleaved_rope_into_rotate_half():
    rng = np.random.default_rng(0)
    head_dim, pos, theta = 8, 5, 500000.0
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    w = rng.standard_normal((2 * head_dim, 3))  # two heads' rows of a q_proj [out, in]
    x = rng.standard_normal(3)
    (_, permuted), = interleaved_to_half([("model.layers.0.self_attn.q_proj.weight", w)], head_dim)

    def interleaved(q):  # HF Ernie4_5: pairs (2i, 2i+1) by frequency i
        c, s = np.repeat(np.cos(pos * inv), 2), np.repeat(np.sin(pos * inv), 2)
        rot = np.stack([-q[..., 1::2], q[..., 0::2]], -1).reshape(q.shape)
        return q * c + rot * s

    def half(q):  # Llama: pairs (i, i + D/2) by frequency i
        c, s = np.tile(np.cos(pos * inv), 2), np.tile(np.sin(pos * inv), 2)
        rot = np.concatenate([-q[..., head_dim // 2:], q[..., :head_dim // 2]], -1)
        return q * c + rot * s

    ref = interleaved((w @ x).reshape(2, head_dim))
    ours = half((permuted @ x).reshape(2, head_dim))
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    np.testing.assert_allclose(ours, ref[:, order], atol=1e-12)
    # the same permutation on keys leaves every score q . k unchanged
    np.testing.assert_allclose(ours @ ours.T, ref @ ref.T, atol=1e-12)


@pytest.mark.parametrize("impl", ["paddleformers", "native"])
def test_logits_match_the_library_forward(impl, ernie_dir, library_ernie):
    checkpoint = load_checkpoint(ernie_dir)
    ids = tiny_prompts(1, length=17)[0]["prompt_token_ids"]
    model = build_model(impl, checkpoint, "float32", "cpu")
    meta, caches = packed_prefill_step([len(ids)], *model.kv_layout()[1:], layers=LAYERS)
    with paddle.no_grad():
        hidden = model.forward(paddle.to_tensor(np.asarray(ids, np.int64)), meta.positions, meta, caches)
        ours = model.compute_logits(hidden).numpy()
    theirs = library_logits(library_ernie, ids)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("impl,decode", [("native", "fused"), ("native", "paddle"),
                                         ("paddleformers", "fused"), ("paddleformers", "paddle")])
def test_greedy_matches_the_library(impl, decode, ernie_dir, library_ernie):
    prompts = tiny_prompts(3)
    llm = LLM(model=ernie_dir, model_impl=impl, cpu_decode=decode, block_size=4)
    try:
        outs = llm.generate(prompts, GREEDY)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == library_greedy(library_ernie, prompt["prompt_token_ids"], 12)


def test_ernie_with_biases_is_left_to_paddleformers(ernie_dir):
    checkpoint = load_checkpoint(ernie_dir)
    config = dict(checkpoint.config, use_bias=True)
    with pytest.raises(ValueError, match="use_bias"):
        build_native_model("Ernie4_5ForCausalLM", config, checkpoint.weights("float32"), "float32")


@pytest.mark.reference
def test_native_matches_hf_transformers_ernie(ernie_dir, hf_transformers):
    """HF transformers' Ernie4_5ForCausalLM (the independent implementation) on the same directory."""
    prompts = [p["prompt_token_ids"] for p in tiny_prompts(3)]

    def compute():
        import torch

        hf = hf_transformers.Ernie4_5ForCausalLM.from_pretrained(ernie_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            return [hf(torch.tensor([ids])).logits[0].float().numpy() for ids in prompts]

    inputs = {"weights": hf_recorded.file_digest(*(os.path.join(ernie_dir, name)
                                                   for name in ("model.safetensors", "config.json"))),
              "prompts": prompts}
    reference = hf_recorded.answer("ernie4_5-logits", inputs, compute)
    checkpoint = load_checkpoint(ernie_dir)
    native = build_model("native", checkpoint, "float32", "cpu")
    for ids, theirs in zip(prompts, reference):
        with paddle.no_grad():
            x = paddle.to_tensor(np.asarray(ids, np.int64))
            ours = native.compute_logits(native(x, paddle.arange(len(ids), dtype="int64"))).numpy()
        assert np.abs(ours - theirs).max() <= 1e-4
        assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_a_checkpoint_without_a_template_chats_in_ernies_turn_format(tmp_path, caplog):
    """ERNIE 4.5's tokenizer_config template (huggingface/transformers
    ``src/transformers/models/ernie4_5/convert_ernie4_5_tokenizer.py`` @ 0bbbf64fb93addfd4d24af8d4c8fd20aa5881091,
    ``DEFAULT_CHAT_TEMPLATE``): the ``<|begin_of_sentence|>`` prefix, a system message then ``\\n``,
    ``User: ...\\n``, ``Assistant: ...<|end_of_sentence|>``, and ``Assistant: `` to prompt -- PaddleFormers'
    ``ernie_nothink`` SFT template (``paddleformers/datasets/template/template.py``) lays turns out the same."""
    from engine.loader.hf import tokenizer_from_hf_dir

    directory = make_tiny_ernie(str(tmp_path))
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as fh:
        tok_config = json.load(fh)
    tok_config.pop("chat_template")
    with open(path, "w") as fh:
        json.dump(tok_config, fh)
    with open(os.path.join(directory, "config.json")) as fh:
        tok = tokenizer_from_hf_dir(directory, json.load(fh))
    assert tok.chat_template is None
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "How are you?"}]
    with caplog.at_level("WARNING", logger="engine"):
        text = tok.apply_chat_template(messages)
        assert tok.apply_chat_template(messages[1:2], add_generation_prompt=False) == "<|begin_of_sentence|>User: Hi\n"
    assert text == ("<|begin_of_sentence|>You are helpful.\nUser: Hi\nAssistant: Hello<|end_of_sentence|>"
                    "User: How are you?\nAssistant: ")
    warnings = [r.getMessage() for r in caplog.records if "no chat template" in r.getMessage()]
    assert len(warnings) == 1 and "User: ...\\nAssistant: " in warnings[0]
