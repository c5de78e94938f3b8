"""Loader and tokenizer checked against independent references.

* weights, config and logits vs HF `transformers` loading the same GGUF files;
* SmolLM2 tokenizer and chat template vs transformers' tokenizer;
* Gemma 3 tokenizer vs `sentencepiece` (Gemma's native tokenizer library) with
  a model built from the GGUF vocabulary (transformers approximates Gemma's
  BPE vocabulary with a Unigram model and splits some words differently);
* permutation/quantization round trips through tiny GGUF files written with
  `gguf.GGUFWriter` exactly as llama.cpp's converter writes them;
* HF model directories written by transformers' ``save_pretrained``;
* clear errors for missing paths, truncated files and unknown architectures.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from conftest import import_transformers

from engine.loader import load_checkpoint, resolve_model, zoo
from engine.loader.gguf_tokenizer import GEMMA_CHAT_TEMPLATE

TEXTS = [
    "Hello world! 12345 héllo",
    "The  quick\n\nbrown\tfox jumps over 3.14159 lazy dogs",
    "中文字符 and Ωmega café, naïve façade — “quotes” …",
    "emoji 🤗👩‍👩‍👧‍👦🏳️‍🌈 end",
    "it's we'll   spaces   ",
    "def f(x):\n    return x**2\n",
    "   leading spaces and trailing\n",
]


@pytest.fixture(scope="module")
def transformers():
    return import_transformers()


@pytest.fixture(scope="module")
def hf_smollm2(transformers, smollm2_checkpoint):
    """transformers' own reading of the SmolLM2 GGUF: (model, tokenizer)."""
    directory, name = os.path.split(smollm2_checkpoint.path)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model.eval(), tokenizer


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _model_from_checkpoint(transformers, ckpt, state_dict):
    """A transformers model built from *our* config dict and *our* weights."""
    import torch

    config_class = transformers.AutoConfig.for_model(ckpt.config["model_type"]).__class__
    config = config_class(**{k: v for k, v in ckpt.config.items() if k != "model_type"})
    model = getattr(transformers, ckpt.architecture)(config).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()},
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


# -- SmolLM2 (llama architecture, Q4_1) ----------------------------------------------------

def test_smollm2_checkpoint_metadata(smollm2_checkpoint):
    ckpt = smollm2_checkpoint
    assert (ckpt.format, ckpt.architecture) == ("gguf", "LlamaForCausalLM")
    c = ckpt.config
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"], c["intermediate_size"], c["vocab_size"]) == (576, 30, 9, 3, 64, 1536, 49152)
    assert c["rope_theta"] == 100000.0 and c["tie_word_embeddings"] is True
    tok = ckpt.tokenizer
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1
    assert tok.id_to_token(2) == "<|im_end|>" and tok.eos_token_ids == {2}
    assert tok.chat_template is not None


def test_smollm2_weights_equal_transformers(hf_smollm2, smollm2_state_dict):
    model, _ = hf_smollm2
    reference = {k: v.float().numpy() for k, v in model.state_dict().items()}
    assert set(smollm2_state_dict) == set(reference) - {"lm_head.weight"}  # lm_head is tied
    for name, ours in smollm2_state_dict.items():
        assert ours.dtype == np.float32 and ours.shape == reference[name].shape, name
        np.testing.assert_array_equal(ours, reference[name], err_msg=name)
    # Q/K rows come back in HF order: not the permuted layout llama.cpp stores
    q = smollm2_state_dict["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (576, 576)


def test_smollm2_config_drives_same_logits(transformers, hf_smollm2, smollm2_checkpoint, smollm2_state_dict):
    model, _ = hf_smollm2
    ours = _model_from_checkpoint(transformers, smollm2_checkpoint, smollm2_state_dict)
    ids = smollm2_checkpoint.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    a, b = _logits(ours, ids), _logits(model, ids)
    assert np.abs(a - b).max() < 1e-4
    assert smollm2_checkpoint.tokenizer.decode([int(a[-1].argmax())]) == " Rome"


def test_smollm2_tokenizer_matches_transformers(hf_smollm2, smollm2_checkpoint):
    _, reference = hf_smollm2
    tok = smollm2_checkpoint.tokenizer
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>\n"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == reference.decode(ids) == text
    # the GGUF says add_bos_token = false (transformers ignores that flag and adds one)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids) == "user"


def test_smollm2_chat_template_matches_transformers(hf_smollm2, smollm2_checkpoint):
    _, reference = hf_smollm2
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🤗"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
    ]
    for messages in conversations:
        for add in (True, False):
            ours = smollm2_checkpoint.tokenizer.apply_chat_template(messages, add_generation_prompt=add)
            theirs = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert ours == theirs
    assert ours.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_stream_decoder_matches_decode(smollm2_checkpoint):
    tok = smollm2_checkpoint.tokenizer
    text = "Emoji 🤗 and 中文, then <|im_end|> and more."
    ids = tok.encode(text)
    for skip in (True, False):
        stream = tok.stream_decoder(skip_special_tokens=skip)
        pieces = [stream.step(i) for i in ids]
        assert "".join(p for p in pieces if p) == tok.decode(ids, skip_special_tokens=skip)
    assert None in pieces  # the emoji spans several byte-level tokens


@pytest.fixture(scope="module")
def smollm2_hf_dir(tmp_path_factory, hf_smollm2, smollm2_checkpoint):
    """SmolLM2 as an HF model directory: config + safetensors written by transformers'
    ``save_pretrained``, tokenizer.json + tokenizer_config.json as the Hub ships them."""
    directory = tmp_path_factory.mktemp("smollm2-hf")
    hf_smollm2[0].save_pretrained(directory)
    tok = smollm2_checkpoint.tokenizer
    tok.backend.save(str(directory / "tokenizer.json"))
    with open(directory / "tokenizer_config.json", "w") as fh:
        json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                   "unk_token": "<|endoftext|>", "chat_template": tok.chat_template,
                   "tokenizer_class": "GPT2Tokenizer"}, fh)
    return directory


def test_hf_directory(transformers, smollm2_hf_dir, smollm2_state_dict):
    ckpt = load_checkpoint(str(smollm2_hf_dir))
    assert (ckpt.format, ckpt.architecture) == ("hf", "LlamaForCausalLM")
    assert ckpt.config["num_key_value_heads"] == 3 and ckpt.config["head_dim"] == 64
    weights = dict(ckpt.weights())
    assert set(weights) == set(smollm2_state_dict)
    for name, value in weights.items():
        np.testing.assert_array_equal(value, smollm2_state_dict[name], err_msg=name)
    reference = transformers.AutoTokenizer.from_pretrained(smollm2_hf_dir)
    tok = ckpt.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text), text
        assert tok.decode(tok.encode(text)) == reference.decode(reference.encode(text), skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token) == (1, 2, "<|im_end|>")
    assert reference.eos_token_id in tok.eos_token_ids


def test_hf_directory_bf16_qwen3(tmp_path, transformers, smollm2_hf_dir):
    import torch

    config = transformers.Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, tie_word_embeddings=False, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_hf_dir / name, tmp_path / name)
    with open(tmp_path / "generation_config.json", "w") as fh:
        json.dump({"eos_token_id": [2, 0]}, fh)
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.architecture == "Qwen3ForCausalLM" and ckpt.tokenizer.eos_token_ids >= {0, 2}
    weights = dict(ckpt.weights("float32"))
    assert "model.layers.1.self_attn.q_norm.weight" in weights and "lm_head.weight" in weights
    for name, tensor in model.state_dict().items():
        np.testing.assert_array_equal(weights[name], tensor.float().numpy(), err_msg=name)
    bf16 = dict(ckpt.weights("bfloat16"))
    assert str(bf16["lm_head.weight"].dtype) == "bfloat16"
