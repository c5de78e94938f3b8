"""Crafted HF model files (issue 31, items 8 and 9): every bad value is a ValueError naming the file
and the field before anything is built, and sizes taken from the config are capped by what the
engine serves. Each case is a tiny random model (tests/tiny_models.py) with one thing changed;
before these checks each loaded silently with wrong results, or failed later without naming the
field (a numpy TypeError, an AttributeError, a bare Exception, a RecursionError, NaN logits)."""

import json
import os
import struct

import numpy as np
import pytest

from engine import LLM
from engine.loader import load_checkpoint
from engine.models import rope as rope_module
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("pristine")), seed=2)


def _copy(pristine, tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    for name in os.listdir(pristine):
        (directory / name).write_bytes(open(os.path.join(pristine, name), "rb").read())
    return str(directory)


def _with_config(pristine, tmp_path, **changes):
    directory = _copy(pristine, tmp_path)
    path = os.path.join(directory, "config.json")
    config = json.load(open(path))
    config.update(changes)
    with open(path, "w") as fh:
        json.dump(config, fh)
    return directory


@pytest.mark.parametrize("changes,message", [
    ({"rms_norm_eps": 1e300}, "rms_norm_eps must be a number in \\(0, 1\\)"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a number in \\(0, 1\\)"),
    ({"hidden_act": "nope"}, "hidden_act 'nope' is not an activation"),
    ({"eos_token_id": 10**12}, "eos_token_id must be a token id .* vocab_size=256"),
    ({"eos_token_id": [2, "x"]}, "eos_token_id must be a token id"),
    ({"bos_token_id": -1}, "bos_token_id must be a token id"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
    ({"rope_theta": "x"}, "rope_theta must be a finite number > 0"),
    ({"rope_theta": 0}, "rope_theta must be a finite number > 0"),
    ({"rope_theta": -1}, "rope_theta must be a finite number > 0"),
    ({"rope_theta": float("nan")}, "rope_theta must be a finite number > 0"),
    ({"rope_scaling": "x"}, "rope_scaling must be null or an object"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling.factor must be a finite number > 0"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor must be a finite number > 0"),
])
def test_a_crafted_config_value_is_refused_naming_file_and_field(pristine, tmp_path, changes, message):
    directory = _with_config(pristine, tmp_path, **changes)
    with pytest.raises(ValueError, match=message) as err:
        LLM(model=directory, block_size=4)
    if "rope_scaling.factor" not in message:     # the loader's own checks name the file, too
        assert "config.json" in str(err.value)


def test_an_activation_the_native_decoder_does_not_compute_is_refused(pristine, tmp_path):
    """A known activation that is not SiLU (``gelu``) used to be computed as SiLU by the native decoder."""
    directory = _with_config(pristine, tmp_path, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act='gelu' has no native implementation"):
        LLM(model=directory, block_size=4, model_impl="native")


def test_a_config_nested_too_deeply_names_the_file(pristine, tmp_path):
    directory = _copy(pristine, tmp_path)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        fh.write("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="config.json is nested too deeply"):
        load_checkpoint(directory)


def test_a_truncated_tokenizer_names_the_file(pristine, tmp_path):
    directory = _copy(pristine, tmp_path)
    path = os.path.join(directory, "tokenizer.json")
    data = open(path, "rb").read()
    with open(path, "wb") as fh:
        fh.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match="tokenizer.json is not a readable tokenizer file"):
        load_checkpoint(directory)


def test_a_bad_eos_in_generation_config_names_the_file(pristine, tmp_path):
    directory = _copy(pristine, tmp_path)
    with open(os.path.join(directory, "generation_config.json"), "w") as fh:
        json.dump({"eos_token_id": [2, 10**12]}, fh)
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be a token id"):
        load_checkpoint(directory)


def _retype_header(path: str, tensor: str, dtype: str) -> None:
    """Rewrite one tensor's dtype in a safetensors header, keeping its byte length (I32 for F32)."""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header[tensor]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    with open(path, "wb") as fh:
        fh.write(data[:8] + text + data[8 + n:])


@pytest.mark.parametrize("dtype", ["I32", "U32"])
def test_integer_weights_in_a_safetensors_header_are_refused_by_name(pristine, tmp_path, dtype):
    directory = _copy(pristine, tmp_path)
    path = os.path.join(directory, "model.safetensors")
    _retype_header(path, "model.layers.0.mlp.up_proj.weight", dtype)
    with pytest.raises(ValueError, match=f"model.safetensors: tensor model.layers.0.mlp.up_proj.weight has dtype "
                                         f"{dtype}; model weights must be floating point"):
        load_checkpoint(directory)


def test_rope_tables_cover_what_is_served_not_max_position_embeddings(pristine, tmp_path):
    """``max_position_embeddings = 10_000_000`` built tables for 10M positions at load (41.5 s, 4.3
    GB); the tables now cover the positions the engine serves, and the output is unchanged."""
    directory = _with_config(pristine, tmp_path, max_position_embeddings=10_000_000)
    llm = LLM(model=directory, block_size=4, max_model_len=256)
    assert llm.engine.max_model_len == 256
    assert llm.engine.runner.model.rope.positions == 256
    assert tuple(llm.engine.runner.model.rope.cos.shape)[0] == 256
    plain = LLM(model=pristine, block_size=4, max_model_len=256)
    from engine import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(10, 40))}
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == plain.generate(prompt, params)[0].outputs[0].token_ids


def test_a_rotary_embedding_holds_no_more_than_its_first_positions_until_resized():
    rope = rope_module.RotaryEmbedding(64, 10_000_000, 10000.0)
    assert rope.positions == rope_module.TABLE_POSITIONS
    rope.resize(300)
    assert tuple(rope.cos.shape) == (300, 64)
    small = rope_module.RotaryEmbedding(64, 300, 10000.0)
    np.testing.assert_array_equal(rope.cos.numpy(), small.cos.numpy())


# -- the fuzz: crafted config.json, tokenizer.json and safetensors headers ---------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine import SamplingParams  # noqa: E402

ODD = st.sampled_from([None, True, False, "x", "", [], {}, [1, "a"], {"rope_type": 3}, 0, -1, 1, 2, 3, 4, 64,
                       10**12, -(2**70), 0.0, 1e-300, 1e300, float("nan"), float("inf"), 0.5, "silu", "gelu"])
FIELDS = ["rope_theta", "rms_norm_eps", "hidden_act", "eos_token_id", "bos_token_id", "pad_token_id",
          "tie_word_embeddings", "rope_scaling", "max_position_embeddings", "vocab_size", "hidden_size",
          "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "num_hidden_layers",
          "attention_bias", "architectures"]


@settings(max_examples=30, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from(FIELDS), ODD, min_size=1, max_size=2))
def test_fuzzed_configs_load_and_serve_or_name_the_file(pristine, tmp_path_factory, changes):
    """A crafted config.json either is refused with a ValueError naming config.json (or the field),
    or loads into an engine that serves a greedy request normally: no other exception, no hang."""
    directory = _with_config(pristine, tmp_path_factory.mktemp("fuzzed"), **changes)
    try:
        llm = LLM(model=directory, block_size=4, max_model_len=64)
    except ValueError as exc:
        assert "config.json" in str(exc) or any(field in str(exc) for field in changes), (changes, exc)
        return
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=3, temperature=0))[0].outputs[0]
    assert out.finish_reason in ("stop", "length") and out.error is None, (changes, out.error)


@settings(max_examples=25, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0.0, 0.999), dtype=st.sampled_from(["F32", "I32", "U32", "F16", "XX", ""]),
       tensor=st.sampled_from(["model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight",
                               "model.norm.weight"]))
def test_fuzzed_tokenizer_files_and_headers_are_refused_by_name(pristine, tmp_path_factory, cut, dtype, tensor):
    directory = _copy(pristine, tmp_path_factory.mktemp("cut"))
    path = os.path.join(directory, "tokenizer.json")
    data = open(path, "rb").read()
    with open(path, "wb") as fh:
        fh.write(data[:int(len(data) * cut)])
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_checkpoint(directory)
    directory = _copy(pristine, tmp_path_factory.mktemp("retyped"))
    _retype_header(os.path.join(directory, "model.safetensors"), tensor, dtype)
    if dtype == "F32":
        load_checkpoint(directory)
        return
    with pytest.raises(ValueError, match="model.safetensors"):
        load_checkpoint(directory)
