"""Loader and tokenizer of Gemma 3 270M (gemma3 architecture, Q4_K_M mix, SentencePiece
vocabulary) checked against independent references:

* weights, config and logits vs HF `transformers` loading the same GGUF file (live with the
  "reference" extra, else its recorded answers: `hf_recorded`);
* the tokenizer vs `sentencepiece` (Gemma's native tokenizer library) with a model built
  from the GGUF vocabulary (transformers approximates Gemma's BPE vocabulary with a Unigram
  model and splits some words differently).

Its own module, so that test_loader.py's SmolLM2 references are freed before Gemma's load.
"""

from __future__ import annotations

import hashlib
import json

import hf_recorded
import numpy as np
import pytest
from conftest import queued_reference
from hf_reference import tensor_digest
from test_loader import TEXTS

CONTINUATIONS = [("Question: What is 2+3?\nAnswer:", " 2+3=5"), ("def fibonacci(n):", "\n    if n == 0:")]


@pytest.fixture(scope="module")
def gemma3_state_dict(gemma3_checkpoint):
    return gemma3_checkpoint.state_dict()


@pytest.fixture(scope="module")
def gemma3_digests(gemma3_state_dict):
    """`tensor_digest` of each of our tensors: what transformers' answers computed on our weights
    were computed on."""
    return {name: tensor_digest(value) for name, value in gemma3_state_dict.items()}


def weights_inputs(digests) -> str:
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


@pytest.fixture(scope="module")
def gemma3_reference_model(hf_transformers, gemma3_checkpoint, gemma3_state_dict):
    """transformers' Gemma3ForCausalLM built from our config, its parameters our weights
    themselves (shared with `gemma3_state_dict`, not copied: a gigabyte less; the norms, which
    test_gemma3_norm_convention changes in place, are copies). None without torch."""
    if hf_transformers is None:
        return None
    import torch

    transformers = hf_transformers
    from accelerate import init_empty_weights

    config_class = transformers.AutoConfig.for_model(gemma3_checkpoint.config["model_type"]).__class__
    config = config_class(**{k: v for k, v in gemma3_checkpoint.config.items() if k != "model_type"})
    with init_empty_weights(include_buffers=False):     # parameters on "meta", computed buffers real
        model = getattr(transformers, gemma3_checkpoint.architecture)(config)
    weights = {k: torch.from_numpy(v.copy() if k.endswith("norm.weight") else v)
               for k, v in gemma3_state_dict.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    return model.eval()


@pytest.fixture(scope="module")
def sentencepiece_gemma3(tmp_path_factory, gemma3_checkpoint):
    """A `sentencepiece` BPE model with the GGUF's pieces, scores and types.

    llama.cpp stores user-defined pieces with real spaces ("  ") where
    SentencePiece has "▁▁"; everything else is copied as is.
    """
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2 as pb

    from engine.loader.gguf_file import GGUFFile

    f = GGUFFile(gemma3_checkpoint.path)
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 3, 2, 1
    proto.trainer_spec.pad_id = 0
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    for token, score, kind in zip(f.get("tokenizer.ggml.tokens"), f.get("tokenizer.ggml.scores"),
                                  f.get("tokenizer.ggml.token_type")):
        piece = proto.pieces.add()
        piece.piece = token.replace(" ", "\u2581") if kind == 4 else token
        piece.score, piece.type = float(score), int(kind)
    path = tmp_path_factory.mktemp("spm") / "gemma3.model"
    path.write_bytes(proto.SerializeToString())
    return sentencepiece.SentencePieceProcessor(model_file=str(path))


def test_gemma3_checkpoint_metadata(gemma3_checkpoint):
    ckpt = gemma3_checkpoint
    assert (ckpt.format, ckpt.architecture) == ("gguf", "Gemma3ForCausalLM")
    c = ckpt.config
    assert c["model_type"] == "gemma3_text"
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"], c["vocab_size"]) == (640, 18, 4, 1, 256, 262144)
    assert c["sliding_window"] == 512 and c["query_pre_attn_scalar"] == 256
    assert (c["rope_theta"], c["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert [i for i, kind in enumerate(c["layer_types"]) if kind == "full_attention"] == [5, 11, 17]
    assert c["tie_word_embeddings"] is True and c["hidden_activation"] == "gelu_pytorch_tanh"
    tok = ckpt.tokenizer
    assert tok.vocab_size == 262144 and tok.bos_token_id == 2 and tok.chat_template is None
    assert tok.eos_token_ids == {1, 106} and tok.id_to_token(106) == "<end_of_turn>"


@pytest.mark.reference
@pytest.mark.slow
def test_gemma3_weights_equal_transformers(request, gemma3_checkpoint, gemma3_state_dict, gemma3_digests):
    """Every tensor equals transformers' own reading of the file (dequantized, renamed, Q/K
    layout), compared through per-tensor digests from `hf_reference.py`'s process (queued
    beside the suite at its start, see conftest.py)."""
    def compute():
        run = queued_reference(request.config, "gemma3-weights", "weights", gemma3_checkpoint.path)
        try:
            return run.result()
        finally:
            run.close()

    reference = hf_recorded.answer("gemma3-weights", hf_recorded.gguf_inputs(gemma3_checkpoint.path), compute)
    assert set(reference) == set(gemma3_state_dict)
    differ = {}
    for name, ours in gemma3_state_dict.items():
        assert ours.dtype == np.float32, name
        digest = gemma3_digests[name]
        if digest != reference[name]:
            differ[name] = {"ours": digest, "transformers": reference[name]}
    assert not differ, f"{len(differ)} tensors differ from transformers': {differ}"


@pytest.mark.reference
@pytest.mark.slow
def test_gemma3_norm_convention(gemma3_checkpoint, gemma3_state_dict, gemma3_digests, gemma3_reference_model):
    """HF Gemma RMSNorm multiplies by (1 + w); llama.cpp stores w + 1.  With the shift undone
    the model (transformers' Gemma 3 on our weights) predicts plain English well; leaving it in
    (w + 1) ruins it."""
    text = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin "
            "is the capital of Germany. Water boils at 100 degrees Celsius.")
    ids = gemma3_checkpoint.tokenizer.encode(text)

    def compute():
        import torch

        tensor = torch.tensor([ids])
        norms = {n: p for n, p in gemma3_reference_model.named_parameters() if n.endswith("norm.weight")}
        assert norms.keys() == {k for k in gemma3_state_dict if k.endswith("norm.weight")}
        with torch.no_grad():
            good = gemma3_reference_model(tensor, labels=tensor).loss.item()
            for name, param in norms.items():      # the same model with the shift left in
                param.copy_(torch.from_numpy(gemma3_state_dict[name] + 1))
            try:
                bad = gemma3_reference_model(tensor, labels=tensor).loss.item()
            finally:
                for name, param in norms.items():
                    param.copy_(torch.from_numpy(gemma3_state_dict[name]))
        return {"good": good, "bad": bad}

    loss = hf_recorded.answer("gemma3-norm-convention", {"weights": weights_inputs(gemma3_digests), "ids": ids},
                              compute, atol=1e-3)
    assert loss["good"] < 3.0 and loss["bad"] > loss["good"] + 5.0


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CONTINUATIONS)))
def test_gemma3_greedy_continuation(gemma3_checkpoint, gemma3_digests, gemma3_reference_model, index):
    """transformers' Gemma 3 on our weights continues plain prompts as expected."""
    prompt, expected = CONTINUATIONS[index]
    tok = gemma3_checkpoint.tokenizer
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_token_id  # the GGUF asks for BOS

    def compute():
        import torch

        with torch.no_grad():
            out = gemma3_reference_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        return out[0, len(ids):].tolist()

    tokens = hf_recorded.answer(f"gemma3-continuation-{index}",
                                {"weights": weights_inputs(gemma3_digests), "ids": ids}, compute)
    assert tok.decode(tokens).startswith(expected)


def test_gemma3_tokenizer_matches_sentencepiece(gemma3_checkpoint, sentencepiece_gemma3):
    import random

    tok = gemma3_checkpoint.tokenizer
    rng = random.Random(0)
    alphabet = ([chr(c) for c in range(32, 127)] + [chr(c) for c in range(0xA0, 0x250)]
                + [chr(c) for c in range(0x4E00, 0x4E40)] + ["🤗", "👩‍👧", " ", "  ", "\n", "\t", "<b>"])
    texts = TEXTS + ["<b>bold</b> &amp; <start_of_turn>", "Question: What is 2+3?\nAnswer:",
                     "\t\tindented\r\nwindows"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 50))) for _ in range(100)]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sentencepiece_gemma3.encode(text) or "<start_of_turn>" in text, text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<start_of_turn>user", add_special_tokens=False)[0] == 105  # control token


def test_gemma3_chat_falls_back_to_turn_format(gemma3_checkpoint, caplog):
    tok = gemma3_checkpoint.tokenizer
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "How are you?"}]
    with caplog.at_level("WARNING"):
        text = tok.apply_chat_template(messages)
        tok.apply_chat_template(messages[1:2])
    assert text == ("<bos><start_of_turn>user\nYou are helpful.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n")
    assert sum("no chat template" in r.getMessage() for r in caplog.records) <= 1
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(2) == 1 and ids.count(106) == 3
    with pytest.raises(Exception, match="alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
