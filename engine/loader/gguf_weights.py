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

import re
from typing import Iterator

import numpy as np
from gguf.quants import dequantize
from tqdm.auto import tqdm

from .checkpoint import numpy_dtype
from .gguf_file import GGUFFile, GGUFTensor

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Gemma 3 normalizes before and after both attention and MLP.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Tensors llama.cpp adds that are not model parameters in HF (precomputed RoPE factors).
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")


def hf_name(gguf_name: str, architecture: str) -> str:
    """The HF parameter name of GGUF tensor `gguf_name` (ValueError if unknown)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    table = _GEMMA3_LAYER_NAMES if architecture == "gemma3" else _LAYER_NAMES
    if match and match.group(2) in table:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{table[part]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name for architecture {architecture!r}")


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute`` on q_proj/k_proj rows (weight or bias).

    llama.cpp: ``w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)``.
    """
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def undo_rope_permutation(gguf_name: str, arch: str, config: dict, w: np.ndarray) -> np.ndarray:
    """`unpermute` the rows of a ``llama`` q_proj/k_proj tensor; any other tensor as it is."""
    if arch == "llama" and ".attn_q." in gguf_name:
        return unpermute(w, config["num_attention_heads"])
    if arch == "llama" and ".attn_k." in gguf_name:
        return unpermute(w, config["num_key_value_heads"])
    return w


def dequantized(f: GGUFFile, tensor: GGUFTensor) -> np.ndarray:
    """A GGUF tensor as float32 in NumPy (row-major, HF ``[out, in]`` for linear weights)."""
    data = dequantize(tensor.raw(f.buf), tensor.tensor_type)
    return data.astype(np.float32, copy=False).reshape(tensor.shape)


def iter_gguf_weights(f: GGUFFile, config: dict, dtype: str = "float32",
                      progress: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, array)`` for every parameter in `f`, HF conventions, `dtype`."""
    out_dtype = numpy_dtype(dtype)
    arch = f.architecture
    tensors = [t for t in f.tensors.values() if t.name not in _SKIPPED]
    bar = tqdm(tensors, desc=f"loading {config['architectures'][0]}", unit="tensor",
               disable=not progress, leave=False)
    for tensor in bar:
        name = hf_name(tensor.name, arch)
        try:
            w = dequantized(f, tensor)
        except Exception as exc:
            raise ValueError(f"{f.path}: cannot dequantize tensor {tensor.name} "
                             f"({tensor.tensor_type.name}): {exc}") from exc
        w = undo_rope_permutation(tensor.name, arch, config, w)
        if arch.startswith("gemma") and tensor.name.endswith("norm.weight"):
            w = w - 1.0
        yield name, np.require(w, out_dtype, ["C", "W"])  # own, writable memory
