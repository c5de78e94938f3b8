"""``model_impl="paddleformers"``: a PaddleFormers model running on the engine's paged KV cache.

`build_paddleformers_model` constructs the PaddleFormers class named by the
checkpoint's architecture (``LlamaForCausalLM``, ``Gemma3ForCausalLM``, any
class that routes attention through ``ALL_ATTENTION_FUNCTIONS``) from the
checkpoint's HF config (`hf_config`), loads the weights (`weights`), applies
known corrections (`fixups`) and faster equivalent norms (`speedups`), and
points its attention at ours (`attention_adapter`). `PaddleFormersModel` then gives the model runner the
engine's model interface:

``forward(input_ids, positions, meta, kv_caches) -> hidden [T, hidden]``
    Runs the library's decoder body (``model.model``) on the whole packed
    batch as *one* sequence — batch dimension 1, explicit ``position_ids`` —
    with the step bound (`step_context.bind_step`) so that every attention
    layer finds the metadata and its KV cache.
``compute_logits(hidden) -> float32 [rows, vocab]``
    The LM head applied only to the rows the sampler needs (the runner
    selects them), plus final logit soft-capping where the config has it.
``kv_layout() -> (layers, kv_heads, head_dim)``
    What the runner sizes the paged cache by.
"""

from __future__ import annotations

import logging

import numpy as np
import paddle

from . import attention_adapter
from .fixups import apply_fixups
from .hf_config import paddleformers_class, paddleformers_config
from .speedups import apply_speedups
from .step_context import bind_step
from .weights import load_hf_weights

logger = logging.getLogger("engine")


class PaddleFormersModel:
    """The engine's model interface around a PaddleFormers ``*ForCausalLM``."""

    def __init__(self, model, *, fixups: tuple[str, ...] = ()):
        config = model.config
        if getattr(config, "attn_logit_softcapping", None):
            raise NotImplementedError(f"{type(model).__name__} soft-caps attention logits "
                                      "(attn_logit_softcapping), which the paged kernels do not support")
        self.model = model
        self.body = getattr(model, model.base_model_prefix)
        self.config = config
        self.fixups = fixups
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.softcap = getattr(config, "final_logit_softcapping", None)

    @property
    def architecture(self) -> str:
        return type(self.model).__name__

    def kv_layout(self) -> tuple[int, int, int]:
        return self.num_layers, self.num_kv_heads, self.head_dim

    def forward(self, input_ids: paddle.Tensor, positions: paddle.Tensor, meta, kv_caches) -> paddle.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm for the packed batch."""
        with bind_step(meta, kv_caches):
            out = self.body(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                attn_mask_startend_row_indices=packed_row_indices(meta),
                use_cache=False,
                return_dict=False,
            )
        hidden = out[0] if isinstance(out, (tuple, list)) else out
        return hidden.squeeze(0)

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        head = self.model.lm_head
        logits = paddle.matmul(hidden, head.weight, transpose_y=True)  # LM head weight is [vocab, hidden]
        if getattr(head, "bias", None) is not None:
            logits = logits + head.bias
        logits = logits.astype("float32")
        if self.softcap:
            logits = paddle.tanh(logits / self.softcap) * self.softcap
        return logits


def packed_row_indices(meta) -> paddle.Tensor:
    """This step's packed causal structure in PaddleFormers' FlashMask form, ``int32 [1, 1, T, 1]``.

    Key column ``j`` (a token of request ``r``) is masked from row
    ``query_start_loc[r + 1]`` on: rows of later requests in the pack never see it.
    Our attention ignores it (the metadata carries the full picture, cached
    tokens included), but models such as Gemma 3 take "neither a mask nor row
    indices" as a cue to bypass the configured attention for ``sdpa``, and
    given row indices the library skips building dense ``[T, T]`` masks.
    """
    starts = meta.query_start_loc.numpy()
    ends = np.repeat(starts[1:], np.diff(starts)).astype(np.int32)
    return paddle.to_tensor(ends.reshape(1, 1, -1, 1))


def build_paddleformers_model(checkpoint, dtype: str, device: str) -> PaddleFormersModel:
    """The checkpoint's architecture as a PaddleFormers model on our paged attention, weights loaded."""
    model_cls = paddleformers_class(checkpoint.architecture)
    name = attention_adapter.register()
    config = paddleformers_config(model_cls, checkpoint.config, device, name)
    model = model_cls(config)
    load_hf_weights(model, checkpoint.weights("float32"), num_heads=config.num_attention_heads,
                    num_kv_heads=config.num_key_value_heads)
    fixups = tuple(apply_fixups(model))
    faster = apply_speedups(model)
    if dtype != "float32":
        model.to(dtype=dtype)
    model.eval()
    _check_attention_routed(model, name)
    logger.info("PaddleFormers %s on the engine's paged attention (fixups: %s; faster forwards: %s)",
                model_cls.__name__, ", ".join(fixups) or "none", ", ".join(faster) or "none")
    return PaddleFormersModel(model, fixups=fixups)


def _check_attention_routed(model, name: str) -> None:
    """Fail at load time, not mid-generation, when the class does not use the attention interface."""
    layers = [m for _, m in model.named_sublayers() if hasattr(m, "layer_idx") and hasattr(m, "config")
              and getattr(m.config, "_attn_implementation", None) is not None]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layers that route through PaddleFormers' "
                         f"ALL_ATTENTION_FUNCTIONS, so the engine cannot give it the paged KV cache")
    for layer in layers:
        if getattr(layer, "attn_implementation", name) != name:  # a copy taken at construction (Gemma 3)
            layer.attn_implementation = name
