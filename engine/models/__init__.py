"""Native model registry and HF-weight → native-parameter loading."""

from __future__ import annotations

import re

import numpy as np
import paddle

from .llama import DecoderConfig, LlamaForCausalLM

NATIVE_ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

_FUSED = {  # HF projection -> (our fused parameter, position among its parts)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


def build_native_model(architecture: str, hf_config: dict, weights, dtype: str) -> LlamaForCausalLM:
    """Construct the native model for ``architecture`` and load HF-named weights into it."""
    if architecture not in NATIVE_ARCHITECTURES:
        raise ValueError(
            f"no native implementation for {architecture}; native architectures: {', '.join(NATIVE_ARCHITECTURES)}"
        )
    cfg = DecoderConfig.from_hf(architecture, hf_config)
    model = NATIVE_ARCHITECTURES[architecture](cfg)
    load_hf_weights(model, weights)
    if dtype != "float32":
        model.to(dtype=dtype)
    model.eval()
    return model


def load_hf_weights(model: LlamaForCausalLM, weights) -> None:
    """Copy HF-layout tensors (``[out, in]`` linears) into the fused, ``[in, out]`` native parameters."""
    params = dict(model.named_parameters())
    pending: dict[str, dict[int, np.ndarray]] = {}
    loaded = set()
    for name, array in weights:
        if name.startswith("lm_head.") and model.cfg.tie_word_embeddings:
            continue
        target, part = _native_name(name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name} has no place in the native model ({target})")
        if target.endswith(".weight") and array.ndim == 2 and "embed_tokens" not in target:
            array = array.T  # HF [out, in] -> Paddle [in, out]
        if part is None:
            _assign(params[target], array)
            loaded.add(target)
            continue
        parts = pending.setdefault(target, {})
        parts[part] = array
        if len(parts) == (3 if "qkv" in target else 2):
            fused = np.concatenate([parts[i] for i in sorted(parts)], axis=-1)
            _assign(params[target], fused)
            loaded.add(target)
            del pending[target]
    missing = set(params) - loaded
    if missing or pending:
        raise ValueError(f"checkpoint is missing tensors for: {sorted(missing | set(pending))[:8]}")


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
