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

from ..attention import every_layer_attends
from ..block_linear import head_matmul
from . import attention_adapter
from .captured import capture
from .fixups import apply_fixups
from .fusion import FusedLinear, fuse_projections
from .hf_config import paddleformers_class, paddleformers_config
from .speedups import apply_speedups
from .step_context import bind_step
from .weights import attach_hf_blocks, lm_head_blocks, load_hf_weights

logger = logging.getLogger("engine")

BYPASS = ("the model bypasses PaddleFormers' attention interface, so its attention would not see the "
          "cached context")


class PaddleFormersModel:
    """The engine's model interface around a PaddleFormers ``*ForCausalLM``."""

    def __init__(self, model, *, fixups: tuple[str, ...] = (), faster: tuple[str, ...] = ()):
        config = model.config
        if getattr(config, "attn_logit_softcapping", None):
            raise NotImplementedError(f"{type(model).__name__} soft-caps attention logits "
                                      "(attn_logit_softcapping), which the paged kernels do not support")
        self.model = model
        self.body = getattr(model, model.base_model_prefix)
        self.config = config
        self.fixups = fixups    # corrections applied (see fixups.py)
        self.faster = faster    # layer classes given faster forwards (see speedups.py)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.lm_head_blocks = None  # LM head in quantized blocks (engine.block_linear), set by the builder
        self.fused_linears = [layer for layer in model.sublayers() if isinstance(layer, FusedLinear)]
        self._captured = None  # DecoderView or the reason there is none, on first use (`fused_decoder`)

    @property
    def fused_decoder(self):
        """The model's decoder as the engine's fused CPU decode step reads it (``engine.fallback.captured``:
        the captured decode step), or the reason it cannot be; worked out (and checked on a probe) once."""
        if self._captured is None:
            self._captured = capture(self)
            if isinstance(self._captured, str):
                logger.info("PaddleFormers %s: decode steps stay eager (%s)", type(self.model).__name__,
                            self._captured)
        return self._captured

    def kv_layout(self) -> tuple[int, int, int]:
        return self.num_layers, self.num_kv_heads, self.head_dim

    def forward(self, input_ids: paddle.Tensor, positions: paddle.Tensor, meta, kv_caches) -> paddle.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm for the packed batch."""
        with bind_step(meta, kv_caches), every_layer_attends(type(self.model).__name__, kv_caches, BYPASS):
            out = self.body(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                attn_mask_startend_row_indices=packed_row_indices(meta),
                use_cache=False,
                return_dict=False,
            )
        for fused in self.fused_linears:
            fused.forget()
        hidden = out[0] if isinstance(out, (tuple, list)) else out
        return hidden.squeeze(0)

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        head = self.model.lm_head
        if self.lm_head_blocks is not None and self.lm_head_blocks.accepts(hidden):
            logits = self.lm_head_blocks.matmul(hidden)  # on the GGUF's quantized blocks
        else:
            logits = head_matmul(hidden, head.weight)  # LM head weight is [vocab, hidden]
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


def build_paddleformers_model(checkpoint, dtype: str, device: str, blocks: dict | None = None, *,
                              hf_config: dict | None = None, weights=None) -> PaddleFormersModel:
    """The checkpoint's architecture as a PaddleFormers model on our paged attention, weights loaded.

    ``hf_config`` / ``weights``: another config and HF-named weights than the checkpoint's (a
    tensor-parallel rank's share of the heads and its slices, ``engine.parallel.fallback``)."""
    model_cls = paddleformers_class(checkpoint.architecture)
    name = attention_adapter.register()
    config = paddleformers_config(model_cls, hf_config or checkpoint.config, device, name)
    with paddle.LazyGuard():   # parameters get memory when the checkpoint fills them
        model = model_cls(config)
    weights = checkpoint.weights("float32") if weights is None else weights
    load_hf_weights(model, weights, num_heads=config.num_attention_heads,
                    num_kv_heads=config.num_key_value_heads)
    fixups = tuple(apply_fixups(model))
    faster = apply_speedups(model)
    if dtype != "float32":
        model.to(dtype=dtype)
    model.eval()
    head_blocks = None
    if blocks and dtype == "float32":
        attach_hf_blocks(model, blocks, num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads)
        head_blocks = lm_head_blocks(blocks, bool(checkpoint.config.get("tie_word_embeddings")))
    fused = fuse_projections(model)  # after the blocks: fused with the float weights
    faster += [f"{name} x{n}" for name, n in fused.items() if n]
    wrapped = PaddleFormersModel(model, fixups=fixups, faster=tuple(faster))
    wrapped.lm_head_blocks = head_blocks
    with paddle.no_grad():
        wrapped.forward(*_probe_step(wrapped))  # fails now, not mid-generation, if attention bypasses the engine
    logger.info("PaddleFormers %s on the engine's paged attention (fixups: %s; faster forwards: %s)",
                model_cls.__name__, ", ".join(fixups) or "none", ", ".join(faster) or "none")
    return wrapped


def _probe_step(wrapped: PaddleFormersModel):
    """A one-token step on a throwaway one-block cache: ``(input_ids, positions, meta, kv_caches)``."""
    from ..attention import AttentionMetadata

    layers, kv_heads, head_dim = wrapped.kv_layout()
    dtype = wrapped.model.lm_head.weight.dtype
    caches = [(paddle.zeros([1, kv_heads, 1, head_dim], dtype=dtype), paddle.zeros([1, kv_heads, 1, head_dim],
                                                                                    dtype=dtype))
              for _ in range(layers)]
    meta = AttentionMetadata(
        positions=paddle.zeros([1], dtype="int64"), slot_mapping=paddle.zeros([1], dtype="int64"),
        block_tables=paddle.zeros([1, 1], dtype="int32"), context_lens=paddle.ones([1], dtype="int32"),
        query_start_loc=paddle.to_tensor(np.array([0, 1], dtype=np.int32)), decode_only=True, num_tokens=1)
    return paddle.zeros([1], dtype="int64"), meta.positions, meta, caches
