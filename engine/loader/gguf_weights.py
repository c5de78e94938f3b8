"""GGUF tensors -> HF parameter names and layouts, dequantized.

What llama.cpp's converter (``convert_hf_to_gguf.py``) did to each tensor, and
what this module does to undo it:

* **Names**: ``blk.3.attn_q.weight`` <- ``model.layers.3.self_attn.q_proj.weight``
  (table below; Gemma 3 has two extra norms per layer).
* **Layout**: GGUF lists dimensions fastest-first (``[in, out]``); read as a
  row-major NumPy array the shape is ``[out, in]``, HF/torch's linear layout.
* **Quantization**: Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, F16... -> float32 with
  `gguf.quants.dequantize`.
* **Q/K RoPE permutation** (``llama`` only): ``LlamaModel.permute`` reorders the
  rows of q_proj/k_proj within each head from HF's "rotate half" RoPE layout to
  llama.cpp's interleaved pairs; `unpermute` reverses it.  Qwen2/Qwen3/Gemma 3
  use NeoX-style RoPE in llama.cpp and are stored unpermuted.
* **Gemma norms**: HF Gemma RMSNorm computes ``x * (1 + w)``; llama.cpp's
  converter stores ``w + 1`` so that ggml can multiply by it directly.  Every
  ``*norm.weight`` of a Gemma checkpoint therefore gets 1 subtracted.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
from gguf.quants import dequantize

from .checkpoint import check_finite, numpy_dtype
from .gguf_file import GGUFFile, GGUFTensor
from .gguf_names import SKIPPED, hf_name, undo_rope_permutation
from .progress import load_progress

def dequantized(f: GGUFFile, tensor: GGUFTensor) -> np.ndarray:
    """A GGUF tensor as float32 in NumPy (row-major, HF ``[out, in]`` for linear weights)."""
    data = dequantize(tensor.raw(f.buf), tensor.tensor_type)
    return data.astype(np.float32, copy=False).reshape(tensor.shape)


def iter_gguf_weights(f: GGUFFile, config: dict, dtype: str = "float32",
                      progress: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, array)`` for every parameter in `f`, HF conventions, `dtype`."""
    out_dtype = numpy_dtype(dtype)
    arch = f.architecture
    tensors = [t for t in f.tensors.values() if t.name not in SKIPPED]
    bar = load_progress(tensors, desc=f"loading {config['architectures'][0]}", unit="tensor",
                        disable=not progress, leave=False)
    for tensor in bar:
        name = hf_name(tensor.name, arch)
        try:
            w = dequantized(f, tensor)
        except Exception as exc:
            raise ValueError(f"{f.path}: cannot dequantize tensor {tensor.name} "
                             f"({tensor.tensor_type.name}): {exc}") from exc
        check_finite(f.path, tensor.name, w)
        w = undo_rope_permutation(tensor.name, arch, config, w)
        if arch.startswith("gemma") and tensor.name.endswith("norm.weight"):
            w = w - 1.0
        yield name, np.require(w, out_dtype, ["C", "W"])  # own, writable memory
