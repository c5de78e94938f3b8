"""HF-named NumPy weights -> the parameters of a PaddleFormers model.

Differences between an HF checkpoint and a PaddleFormers model, and how each
is bridged (the same rules PaddleFormers' own ``_gen_aoa_config`` states for
its safetensors loader):

* **Linear layout**: ``paddle.nn.Linear`` stores ``[in, out]``, HF ``[out, in]``:
  every weight owned by a ``paddle.nn.Linear`` is transposed. The LM head
  (``[vocab, hidden]``) and embeddings keep HF's layout.
* **Fused Q/K/V** (``self_attn.qkv_proj``, e.g. Gemma 3): grouped per KV head —
  for KV head ``g``: its query heads, then ``k_g``, then ``v_g`` (the
  ``fused_qkv`` rule), which is the order the model splits them back in.
* **Fused gate/up** (``mlp.up_gate_proj``): ``[gate, up]`` (the ``fused_ffn`` rule).
* **Tied embeddings**: PaddleFormers ties ``lm_head`` to the embedding itself;
  a checkpoint's ``lm_head.weight`` is only loaded when the model has its own.

Every parameter must be filled exactly once; anything missing or left over
raises ``ValueError``.
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np
import paddle

from ..block_linear import BlockWeight, attach_blocks, fused_blocks
from ..loader.gguf_blocks import combine_rows

_QKV = re.compile(r"^(.*)\.self_attn\.(q|k|v)_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^(.*)\.mlp\.(gate|up)_proj\.(weight|bias)$")


def load_hf_weights(model: paddle.nn.Layer, weights: Iterable[tuple[str, np.ndarray]], *,
                    num_heads: int, num_kv_heads: int) -> None:
    """Copy HF ``(name, array)`` pairs into ``model`` (a PaddleFormers ``*ForCausalLM``)."""
    params = dict(model.named_parameters())
    linear_weights = {f"{prefix}.weight" if prefix else "weight"
                      for prefix, layer in model.named_sublayers(include_self=True)
                      if isinstance(layer, paddle.nn.Linear)}
    pending: dict[str, dict[str, np.ndarray]] = {}
    loaded: set[str] = set()

    def assign(target: str, array: np.ndarray) -> None:
        if target in linear_weights:
            array = array.T  # HF [out, in] -> Paddle [in, out]
        param = params[target]
        if tuple(param.shape) != array.shape:
            raise ValueError(f"shape mismatch for {target}: model {list(param.shape)} vs checkpoint "
                             f"{list(array.shape)}")
        param.set_value(np.ascontiguousarray(array, dtype=np.float32))
        loaded.add(target)

    for name, array in weights:
        if name in params:
            assign(name, array)
            continue
        if name == "lm_head.weight":
            continue  # tied: the model's LM head is its embedding
        fused = _fused_target(name, params)
        if fused is None:
            raise ValueError(f"checkpoint tensor {name} has no place in {type(model).__name__}")
        target, part = fused
        parts = pending.setdefault(target, {})
        parts[part] = array
        if ".qkv_proj." in target and len(parts) == 3:
            assign(target, fuse_qkv(parts["q"], parts["k"], parts["v"], num_heads, num_kv_heads))
            del pending[target]
        elif "up_gate_proj" in target and len(parts) == 2:
            assign(target, np.concatenate([parts["gate"], parts["up"]], axis=0))
            del pending[target]

    missing = sorted((set(params) - loaded) | set(pending))
    if missing:
        raise ValueError(f"checkpoint is missing tensors for {type(model).__name__}: {missing[:8]}")


def _fused_target(name: str, params: dict) -> tuple[str, str] | None:
    """(fused parameter, part) for an HF projection that the model stores fused, else None."""
    m = _QKV.match(name)
    if m and f"{m.group(1)}.self_attn.qkv_proj.{m.group(3)}" in params:
        return f"{m.group(1)}.self_attn.qkv_proj.{m.group(3)}", m.group(2)
    m = _GATE_UP.match(name)
    if m and f"{m.group(1)}.mlp.up_gate_proj.{m.group(3)}" in params:
        return f"{m.group(1)}.mlp.up_gate_proj.{m.group(3)}", m.group(2)
    return None


def fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """HF q/k/v (``[out, in]`` weights or ``[out]`` biases) -> one grouped ``[out_q + 2 out_kv, ...]``.

    Rows are ordered per KV head ``g``: ``q`` heads ``g*G .. g*G+G-1``, ``k_g``, ``v_g``
    with ``G = num_heads // num_kv_heads``.
    """
    head_dim = k.shape[0] // num_kv_heads
    rest = q.shape[1:]
    group = num_heads // num_kv_heads
    qg = q.reshape(num_kv_heads, group * head_dim, *rest)
    kg = k.reshape(num_kv_heads, head_dim, *rest)
    vg = v.reshape(num_kv_heads, head_dim, *rest)
    return np.concatenate([qg, kg, vg], axis=1).reshape(-1, *rest)


def attach_hf_blocks(model: paddle.nn.Layer, blocks: dict, *, num_heads: int, num_kv_heads: int) -> int:
    """Give the model's ``paddle.nn.Linear`` layers their HF weights' quantized blocks, fused the way
    `load_hf_weights` fuses the float weights (see ``engine.block_linear``); returns how many."""
    attached = 0
    for prefix, layer in model.named_sublayers():
        if type(layer) is not paddle.nn.Linear:
            continue
        found = blocks.get(f"{prefix}.weight")
        if found is None and prefix.endswith(".self_attn.qkv_proj"):
            names = [prefix.replace("qkv_proj", f"{p}_proj.weight") for p in "qkv"]
            if all(n in blocks for n in names):
                found = combine_rows([blocks[n] for n in names],
                                     lambda q, k, v: fuse_qkv(q, k, v, num_heads, num_kv_heads))
        elif found is None and prefix.endswith(".mlp.up_gate_proj"):
            found = fused_blocks(blocks, [prefix.replace("up_gate_proj", f"{p}_proj.weight") for p in ("gate", "up")])
        attached += attach_blocks(layer, found)
    return attached


def lm_head_blocks(blocks: dict, tied: bool) -> BlockWeight | None:
    """The LM head's blocks (``[vocab, hidden]``): its own, or the embedding's when tied."""
    found = blocks.get("lm_head.weight") or (blocks.get("model.embed_tokens.weight") if tied else None)
    return BlockWeight(found) if found is not None else None
