"""Open an HF-format model directory as a `Checkpoint`.

Expected files (as written by ``save_pretrained``):

* ``config.json`` -- the model config, used as is;
* ``*.safetensors`` -- weights (one file or shards with ``model.safetensors.index.json``),
  read with the `safetensors` package in NumPy mode (bf16 arrives as ml_dtypes.bfloat16);
* ``tokenizer.json`` -- the `tokenizers` pipeline;
* ``tokenizer_config.json`` -- special tokens and the chat template (newer
  exports keep the template in ``chat_template.jinja``);
* optionally ``generation_config.json`` -- extra EOS ids (e.g. Qwen's ``<|im_end|>``).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Iterator

import ml_dtypes  # noqa: F401  (registers NumPy's "bfloat16" dtype, which safetensors needs)
import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from ..tokenizer import Tokenizer
from .checkpoint import Checkpoint, check_dtype, check_finite, numpy_dtype, validate_config
from .gguf_tokenizer import fallback_chat_template
from .progress import load_progress


def _read_json(path: str) -> dict:
    """The JSON object in ``path`` ({} when the file is absent); anything else is a ValueError naming it."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    except RecursionError:
        raise ValueError(f"{path} is nested too deeply to be a config file") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object; it holds a {type(value).__name__}")
    return value


def _token_content(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _chat_template(directory: str, tok_config: dict) -> str | None:
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as fh:
            return fh.read()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def tokenizer_from_hf_dir(directory: str, config: dict) -> Tokenizer:
    """The `Tokenizer` of an HF model directory (tokenizer.json + tokenizer_config.json)."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"{directory} has no tokenizer.json (the engine needs the fast-tokenizer file)")
    try:
        backend = HFTokenizer.from_file(path)
    except Exception as exc:  # the tokenizers library raises a bare Exception naming no file
        raise ValueError(f"{path} is not a readable tokenizer file: {exc}") from None
    tok_config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    gen_config = _read_json(os.path.join(directory, "generation_config.json"))

    def token_id(key: str) -> int | None:
        content = _token_content(tok_config.get(key))
        return None if content is None else backend.token_to_id(content)

    bos_id = token_id("bos_token")
    if bos_id is None and tok_config.get("bos_token") is None:
        bos_id = config.get("bos_token_id")
    eos_ids: list[int] = []
    vocab = config.get("vocab_size")
    for where, values in (("config.json", config.get("eos_token_id")),
                          ("generation_config.json", gen_config.get("eos_token_id"))):
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in _as_list(values)):
            raise ValueError(f"{os.path.join(directory, where)}: eos_token_id must be a token id (or a list of "
                             f"them) in [0, vocab_size={vocab}); got {values!r:.80}")
    for candidate in ([token_id("eos_token")] + _as_list(config.get("eos_token_id"))
                      + _as_list(gen_config.get("eos_token_id"))):
        if candidate is not None and candidate not in eos_ids:
            eos_ids.append(int(candidate))
    pad_id = token_id("pad_token")
    template = _chat_template(directory, tok_config)
    fallback = fallback_chat_template(config.get("model_type") or "") if template is None else None
    return Tokenizer(backend, bos_token_id=bos_id, eos_token_ids=eos_ids,
                     pad_token_id=pad_id if pad_id is not None else config.get("pad_token_id"),
                     unk_token_id=token_id("unk_token"), chat_template=template,
                     fallback_chat_template=fallback, name=os.path.basename(os.path.normpath(directory)))


def safetensors_files(directory: str) -> list[str]:
    """The weight files of `directory`, in shard order."""
    index = _read_json(os.path.join(directory, "model.safetensors.index.json"))
    if index:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{directory}/model.safetensors.index.json has no weight_map of tensor -> file")
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"{directory} has no *.safetensors weight files")
    return [os.path.join(directory, n) for n in names]


def iter_safetensors(files: list[str], config: dict, dtype: str = "float32",
                     progress: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, array)`` from safetensors `files`, converted to `dtype`."""
    out_dtype = numpy_dtype(dtype)
    skip_lm_head = bool(config.get("tie_word_embeddings", False))
    names = []
    for path in files:
        with _open_safetensors(path) as fh:
            names.extend((path, key) for key in fh.keys())
    bar = load_progress(total=len(names), desc=f"loading {config['architectures'][0]}", unit="tensor",
                        disable=not progress, leave=False)
    for path in files:
        with _open_safetensors(path) as fh:
            for key in fh.keys():
                bar.update(1)
                if skip_lm_head and key == "lm_head.weight":
                    continue
                try:
                    array = fh.get_tensor(key)
                except Exception as exc:
                    raise ValueError(f"{path}: cannot read tensor {key}: {exc}") from exc
                check_finite(path, key, array)
                yield key, np.require(array, out_dtype, ["C", "W"])
    bar.close()


def _open_safetensors(path: str):
    try:
        return safe_open(path, framework="np")
    except Exception as exc:  # safetensors raises its own SafetensorError for a corrupt header
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc


def tensor_shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers (no tensor data is read); a model weight
    whose header names a non-float dtype is a ValueError naming the file and tensor."""
    shapes = {}
    for path in files:
        with _open_safetensors(path) as fh:
            for key in fh.keys():
                piece = fh.get_slice(key)
                check_dtype(path, key, piece.get_dtype())
                shapes[key] = tuple(piece.get_shape())
    return shapes


def _complete_config(config: dict) -> dict:
    """Fill the keys the engine reads but some config.json files leave to class defaults."""
    config = dict(config)
    if "text_config" in config and "hidden_size" not in config:  # multimodal wrapper: use the text model
        config = {**config["text_config"], "architectures": config.get("architectures")}
    heads = config.get("num_attention_heads")
    config.setdefault("num_key_value_heads", heads)
    hidden = config.get("hidden_size")
    if config.get("head_dim") is None and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        config["head_dim"] = hidden // heads
    config.setdefault("rope_theta", 10000.0)
    config.setdefault("rope_scaling", None)
    config.setdefault("tie_word_embeddings", config.get("model_type", "").startswith("gemma"))
    return config


def load_hf_dir(directory: str) -> Checkpoint:
    """Open the HF model directory `directory` (ValueError if it lacks what is needed)."""
    path = os.path.join(directory, "config.json")
    config = _complete_config(_read_json(path))
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise ValueError(f"{directory}/config.json names no architecture (\"architectures\": [...])")
    files = safetensors_files(directory)
    validate_config(path, config, tensor_shapes(files))
    return Checkpoint(
        path=directory,
        format="hf",
        architecture=architectures[0],
        config=config,
        tokenizer=tokenizer_from_hf_dir(directory, config),
        _read_weights=functools.partial(iter_safetensors, files, config),
    )
