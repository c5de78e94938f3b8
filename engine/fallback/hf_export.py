"""Write a checkpoint (e.g. a dequantized GGUF) as a minimal HF model directory.

Libraries whose loaders only read HF directories (PaddleFormers'
``from_pretrained`` for PaddleFleet models) get ``config.json`` plus one
``model.safetensors`` with HF names and ``[out, in]`` layouts — exactly what
``Checkpoint.weights`` yields. The tokenizer is not written: the engine keeps
its own.
"""

from __future__ import annotations

import json
import os

from safetensors.numpy import save_file


def export_hf_directory(checkpoint, directory: str, dtype: str = "float32") -> str:
    """Write ``config.json`` and ``model.safetensors`` for ``checkpoint`` into ``directory``; return it."""
    os.makedirs(directory, exist_ok=True)
    config = dict(checkpoint.config)
    config.setdefault("architectures", [checkpoint.architecture])
    config["torch_dtype"] = dtype
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    tensors = dict(checkpoint.weights(dtype, progress=False))
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory
