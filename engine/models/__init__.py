"""The model contract (`EngineModel`), the native model registry, and HF-weight → native-parameter loading.

A native model is built from its `DecoderSpec` (``engine.models.spec``); the spec also decides how
weights are packed at load (Q/K rows permuted for interleaved RoPE, the fused Q/K/V product's layout)."""

from __future__ import annotations

import re
from typing import Protocol, runtime_checkable

import numpy as np
import paddle

from ..block_linear import BlockWeight, attach_blocks, fused_blocks
from ..loader.gguf_blocks import combine_rows
from .llama import LlamaForCausalLM
from .spec import ARCHITECTURES, DecoderSpec

@runtime_checkable
class EngineModel(Protocol):
    """What the model runner drives: native models and the PaddleFormers / PaddleFleet wrappers alike.

    Each runs its layers inside ``engine.attention.every_layer_attends``, so a
    step in which some layer did not attend through the paged KV cache raises.
    """

    def kv_layout(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)``: what the runner sizes the paged cache by."""
        ...

    def forward(self, input_ids: paddle.Tensor, positions: paddle.Tensor, meta, kv_caches) -> paddle.Tensor:
        """Hidden states ``[num_tokens, hidden]`` (after the final norm) for the packed batch ``input_ids``
        ``[num_tokens]`` at ``positions``, attending through ``kv_caches[i]`` in layer ``i``
        (``meta``: the step's ``AttentionMetadata``)."""
        ...

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """float32 logits ``[rows, vocab]`` of the rows the sampler needs."""
        ...


NATIVE_ARCHITECTURES = {name: LlamaForCausalLM for name in ARCHITECTURES}  # one decoder, a spec per architecture

_FUSED = {  # HF projection -> (our fused parameter, position among its parts)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


def build_native_model(architecture: str, hf_config: dict, weights, dtype: str,
                       blocks: dict | None = None, spec: DecoderSpec | None = None) -> LlamaForCausalLM:
    """Construct the native model for ``architecture`` and load HF-named weights into it.

    ``blocks``: HF-named weights also kept quantized (``Checkpoint.quantized_blocks``),
    which float32 CPU inputs then multiply on (``engine.block_linear``). ``spec``: the decoder
    to build instead of the one ``hf_config`` describes (`DecoderSpec.from_hf`).
    """
    spec = spec or DecoderSpec.from_hf(architecture, hf_config)
    model = NATIVE_ARCHITECTURES.get(architecture, LlamaForCausalLM)(spec)
    if spec.rope_interleaved:
        weights = interleaved_to_half(weights, spec.head_dim)
        blocks = {name: map_rows(b, _rope_rows(name, spec.head_dim)) if _rope_rows(name, spec.head_dim) is not None
                  else b for name, b in (blocks or {}).items()}
    load_hf_weights(model, weights)
    if dtype != "float32":
        model.to(dtype=dtype)
    elif blocks:
        attach_native_blocks(model, blocks)
    model.eval()
    return model


def qkv_rows(spec: DecoderSpec, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Q, K and V (outputs along axis 0) stacked as the spec lays out the fused product: all queries,
    all keys, all values; or (``grouped_qkv``) per KV head its query heads, its key, its value."""
    if not spec.grouped_qkv:
        return np.concatenate([q, k, v])
    nkv, rest = spec.num_kv_heads, q.shape[1:]
    parts = [a.reshape(nkv, -1, *rest) for a in (q, k, v)]
    return np.concatenate(parts, axis=1).reshape(-1, *rest)


_QK = re.compile(r"^model\.layers\.\d+\.self_attn\.(q|k)_proj\.(weight|bias)$")


def _rope_rows(name: str, head_dim: int) -> np.ndarray | None:
    """For a Q/K projection, the row order that turns interleaved RoPE into rotate-half, else None.

    Interleaved RoPE rotates the pairs ``(2i, 2i + 1)`` of each head by frequency ``i``; rotate-half
    rotates ``(i, i + head_dim/2)``. Taking each head's even rows first, then its odd ones, makes the
    second the first: Q and K get the same permutation, so every score ``q . k`` is unchanged.
    """
    if not _QK.match(name):
        return None
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def interleaved_to_half(weights, head_dim: int):
    """HF ``(name, array)`` pairs with the Q/K rows of every head permuted (`_rope_rows`)."""
    for name, array in weights:
        order = _rope_rows(name, head_dim)
        if order is not None:
            heads = array.shape[0] // head_dim
            array = array.reshape(heads, head_dim, *array.shape[1:])[:, order].reshape(array.shape)
        yield name, array


def map_rows(blocks, order: np.ndarray):
    """The same per-head row permutation on block-quantized weights (rows are outputs)."""
    head_dim = len(order)
    return combine_rows([blocks], lambda a: a.reshape(a.shape[0] // head_dim, head_dim, *a.shape[1:])[:, order]
                        .reshape(a.shape))


def load_hf_weights(model: LlamaForCausalLM, weights) -> None:
    """Copy HF-layout tensors (``[out, in]`` linears) into the fused, ``[in, out]`` native parameters."""
    params = dict(model.named_parameters())
    pending: dict[str, dict[int, np.ndarray]] = {}
    loaded = set()
    for name, array in weights:
        if name.startswith("lm_head.") and model.spec.tie_word_embeddings:
            continue
        target, part = _native_name(name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name} has no place in the native model ({target})")
        if part is None:
            _assign(params[target], _paddle_layout(target, array))
            loaded.add(target)
            continue
        parts = pending.setdefault(target, {})
        parts[part] = array
        if len(parts) == (3 if "qkv" in target else 2):
            ordered = [parts[i] for i in sorted(parts)]
            fused = qkv_rows(model.spec, *ordered) if "qkv" in target else np.concatenate(ordered)
            _assign(params[target], _paddle_layout(target, fused))
            loaded.add(target)
            del pending[target]
    missing = set(params) - loaded
    if missing or pending:
        raise ValueError(f"checkpoint is missing tensors for: {sorted(missing | set(pending))[:8]}")


def _paddle_layout(target: str, array: np.ndarray) -> np.ndarray:
    """HF [out, in] linears -> Paddle [in, out]; embeddings, norms and biases as they are."""
    return array.T if target.endswith(".weight") and array.ndim == 2 and "embed_tokens" not in target else array


def attach_native_blocks(model: LlamaForCausalLM, blocks: dict) -> int:
    """Give the native linears (fused like their weights) and the LM head their blocks; returns how many."""
    attached = 0
    qkv = lambda *parts: qkv_rows(model.spec, *parts)  # noqa: E731 -- the fused product's row layout
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        for linear, names in (
            (layer.self_attn.qkv_proj, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            (layer.self_attn.o_proj, ["self_attn.o_proj"]),
            (layer.mlp.gate_up_proj, ["mlp.gate_proj", "mlp.up_proj"]),
            (layer.mlp.down_proj, ["mlp.down_proj"]),
        ):
            parts = fused_blocks(blocks, [f"{prefix}{n}.weight" for n in names])
            if parts is not None and linear is layer.self_attn.qkv_proj and model.spec.grouped_qkv:
                parts = combine_rows([blocks[f"{prefix}{n}.weight"] for n in names], qkv)
            attached += attach_blocks(linear, parts)
    head = "model.embed_tokens.weight" if model.spec.tie_word_embeddings else "lm_head.weight"
    if head in blocks:
        model.lm_head_blocks = BlockWeight(blocks[head])
        attached += 1
    return attached


def _native_name(hf_name: str) -> tuple[str, int | None]:
    m = _LAYER.match(hf_name)
    if m and m.group(3) in _FUSED:
        fused, part = _FUSED[m.group(3)]
        return f"layers.{m.group(1)}.{m.group(2)}.{fused}.{m.group(4)}", part
    return hf_name.removeprefix("model."), None


def _assign(param: paddle.Tensor, array: np.ndarray) -> None:
    if tuple(param.shape) != array.shape:
        raise ValueError(f"shape mismatch for {param.name}: model {list(param.shape)} vs checkpoint {list(array.shape)}")
    param.set_value(np.ascontiguousarray(array, dtype=np.float32))
