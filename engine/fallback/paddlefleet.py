"""``model_impl="paddlefleet"``: PaddleFleet's GPT model with its core attention on our paged KV cache.

In paddleformers 1.2 (``paddleformers[paddlefleet]`` pins ``paddlefleet==0.3.0``)
Qwen2/Qwen3 are PaddleFleet ``GPTModel``s: a ``PipelineLayer`` whose
``run_function`` is ``GPTEmbedding``, the ``TransformerLayer``s, the final
norm and ``GPTLMHead``. Each ``TransformerLayer`` owns ``self_attn`` (a
``SelfAttention``) whose ``core_attention`` (a ``DotProductAttention``) is called,
after RoPE, with ``query`` ``[b, s, heads_per_partition, head_dim]`` and
``key``/``value`` ``[b, s, kv_heads_per_partition, head_dim]`` and returns
``[b, s, heads_per_partition * head_dim]`` (with ``past_key_values``,
``layer_idx``, ``use_cache`` keywords in newer versions). Like FastDeploy's
``patch_paddlefleet_core_attention`` (``base_fleet.py``), `patch_core_attention`
replaces every core attention with a `FleetPagedAttention` reading what it
needs from the layers themselves:

* **the KV cache index** from the ``TransformerLayer``'s ``layer_number``: the
  GPT layer specs number layers from 0 (plus ``num_empty_layers_add_in_head``),
  while ``DotProductAttention.layer_number`` is ``max(1, layer_number)``, so
  layers 0 and 1 would share a number there;
* the head counts **per tensor-parallel partition** (what q/k/v carry);
* **the softmax scale** ``softmax_scale`` times ``scale_mask_softmax.scale``:
  under ``apply_query_key_layer_scaling`` the layer divides its scale by the
  layer number and its fp32 softmax multiplies it back (FastDeploy passes the
  divided scale on);
* **the sliding window** the layer decided (``scale_mask_softmax.sliding_window``,
  from ``is_layer_window_attention``), as the fp32 path of ``FusedScaleMaskSoftmax``
  masks with it: ``get_sliding_window_causal_mask`` (``src/paddlefleet/transformer/utils.py``
  @ d2a7743e5c125c706fcc4b988fde056ab05d367e) reads an int ``W`` as ``(left=W, right=0)``
  and lets the query at position ``p`` see keys ``p - left .. p + right``, so ``W`` and
  ``(W, 0)`` are one window of ``W + 1`` keys (the ``W`` keys before the query and the
  query); ``left < 0`` is no window. (The flashmask path's
  ``startend_row_indices_add_sliding_window``, same file, caps each key column's
  masked-from row at ``column + W`` for both forms alike, which by Paddle's
  ``flashmask_attention`` row-index rule keeps ``W`` keys: one fewer than the fp32
  mask. The adapter replaces ``DotProductAttention``, whose mask is the fp32 one.)

The model is fed the way FastDeploy feeds it: token embeddings from
``get_input_embeddings()`` as ``decoder_input`` of the ``GPTEmbedding``, with
``{"input_ids": None, "position_ids": positions}`` (1-D), then every layer of
``run_function`` but the LM head; the LM head takes ``[s, b, h]``.
On one device, PaddleFleet's layers need Fleet's hybrid parallel state with
every degree 1 (`init_single_device`, after FastDeploy's
``_init_paddlefleet_parallel_state``).

``paddlefleet`` installs from Paddle's own package index, not PyPI; this module
imports without it, so the adapter is tested on stand-ins of PaddleFleet's
classes anywhere.
"""

from __future__ import annotations

import importlib.util
import logging

import paddle

from ..attention import every_layer_attends
from .attention_adapter import attend
from .step_context import bind_step

logger = logging.getLogger("engine")

INSTALL_HINT = ("model_impl='paddlefleet' needs the 'paddlefleet' package, which is not installed; it installs "
                "from Paddle's own package index (paddleformers' 'paddlefleet' extra). Other model_impl values "
                "still work: auto, native, paddleformers.")
UNPATCHED = "a layer's core attention is not the engine's adapter (patch_core_attention missed it)"


def paddlefleet_available() -> bool:
    return importlib.util.find_spec("paddlefleet") is not None


def _window(sliding_window) -> int | None:
    """The engine's window ``w`` (a query at ``p`` sees keys ``> p - w``) for a Fleet window, int ``W`` or
    ``(left, right)``, as ``get_sliding_window_causal_mask`` masks: int ``W`` is ``(W, 0)``, and
    ``(left, 0)`` lets the query see ``left`` keys before it and itself, ``w = left + 1``."""
    if sliding_window is None:
        return None
    left, right = tuple(sliding_window) if isinstance(sliding_window, (tuple, list)) else (sliding_window, 0)
    if right not in (0, None):
        raise NotImplementedError(f"sliding window {sliding_window!r} lets queries see {right} later keys; "
                                  "the engine's attention is causal")
    if left is None or left < 0:  # Fleet's infinite window: a plain causal mask
        return None
    return int(left) + 1


def cache_index(transformer_layer) -> int:
    """The KV cache of a ``TransformerLayer``: its 0-based ``layer_number`` less the empty head layers."""
    empty = getattr(transformer_layer.config, "num_empty_layers_add_in_head", None) or 0
    return int(transformer_layer.layer_number) - int(empty)


def softmax_scale(core_attention) -> float:
    """The scale the layer's own softmax applies to ``q . k``."""
    coeff = getattr(core_attention.scale_mask_softmax, "scale", None)  # the layer number under qk layer scaling
    return float(core_attention.softmax_scale) * (float(coeff) if coeff else 1.0)


class FleetPagedAttention(paddle.nn.Layer):
    """Drop-in for PaddleFleet's ``DotProductAttention`` running the engine's paged attention."""

    def __init__(self, layer_index: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    @classmethod
    def replacing(cls, transformer_layer) -> "FleetPagedAttention":
        """The adapter for one ``TransformerLayer``'s core attention, its settings read from the layers."""
        core = transformer_layer.self_attn.core_attention
        return cls(
            layer_index=cache_index(transformer_layer),
            num_heads=int(core.num_attention_heads_per_partition),
            num_kv_heads=int(core.num_query_groups_per_partition),
            head_dim=int(core.hidden_size_per_attention_head),
            scale=softmax_scale(core),
            sliding_window=_window(getattr(core.scale_mask_softmax, "sliding_window", None)),
        )

    def forward(self, query, key, value, attention_mask=None, attn_mask_startend_row_indices=None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None, use_rr_flash_attention=False,
                **kwargs):
        """``[1, s, heads, D]`` q and ``[1, s, kv_heads, D]`` k/v -> ``[1, s, heads * D]``; masks are unused
        (the step's metadata says what each query sees)."""
        if attention_bias is not None:
            raise NotImplementedError("attention bias is not supported by the engine's paged attention")
        if query.ndim != 4 or query.shape[0] != 1:
            raise ValueError(f"expected query [1, seq, heads, head_dim] (one packed sequence); got {query.shape}")
        if query.shape[2] != self.num_heads or key.shape[2] != self.num_kv_heads:
            raise ValueError(f"layer {self.layer_index}: got {query.shape[2]} query / {key.shape[2]} KV heads, "
                             f"expected {self.num_heads} / {self.num_kv_heads} per partition")
        out = attend(query[0], key[0], value[0], self.layer_index, scale=self.scale,
                     sliding_window=self.sliding_window)
        return out.reshape([1, out.shape[0], self.num_heads * self.head_dim])


def _is(layer, class_name: str) -> bool:
    return type(layer).__name__ == class_name


def transformer_layers(model) -> list:
    """The layers of ``run_function`` that own a ``self_attn.core_attention``, in execution order."""
    return [m for m in model.run_function
            if getattr(getattr(m, "self_attn", None), "core_attention", None) is not None]


def patch_core_attention(model) -> list[FleetPagedAttention]:
    """Replace every ``TransformerLayer``'s core attention with a `FleetPagedAttention`; the adapters, by cache."""
    adapters = []
    for layer in transformer_layers(model):
        adapter = FleetPagedAttention.replacing(layer)
        layer.self_attn.core_attention = adapter
        adapters.append(adapter)
    indices = [a.layer_index for a in adapters]
    if not adapters or indices != list(range(len(adapters))):
        raise ValueError(f"transformer layers give KV cache indices {indices} in execution order, not "
                         f"0..{len(adapters) - 1}; cannot map layers to KV caches")
    return adapters


class PaddleFleetModel:
    """The engine's model interface (`engine.models.EngineModel`) around a PaddleFleet ``GPTModel``."""

    def __init__(self, model, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        self.adapters = patch_core_attention(model)
        layouts = sorted({(a.num_kv_heads, a.head_dim) for a in self.adapters})
        if len(layouts) > 1:  # e.g. sliding-window layers with their own swa_head_dim / swa_num_key_value_heads
            raise NotImplementedError(f"{type(model).__name__}'s layers have different KV layouts (kv heads, "
                                      f"head_dim) {layouts}; the engine's paged KV cache has one layout")
        self._layout = (len(self.adapters), *layouts[0])

    def kv_layout(self) -> tuple[int, int, int]:
        return self._layout

    def forward(self, input_ids, positions, meta, kv_caches):
        """Embedding, transformer layers and final norm (not the LM head) on the packed batch as one sequence."""
        embeds = self.model.get_input_embeddings()(input_ids.unsqueeze(0))  # [1, T, hidden]
        state = {"input_ids": None, "position_ids": positions}
        with bind_step(meta, kv_caches), every_layer_attends(type(self.model).__name__, kv_caches, UNPATCHED):
            for layer in self.model.run_function:
                if _is(layer, "GPTLMHead"):
                    continue
                state = layer(state, decoder_input=embeds) if _is(layer, "GPTEmbedding") else layer(state)
        hidden = state["hidden_states"]
        return hidden.reshape([-1, hidden.shape[-1]])

    def compute_logits(self, hidden):
        head = self.model.get_lm_head()
        logits = head({"hidden_states": hidden.unsqueeze(1)})  # Fleet's head takes [s, b, h]
        logits = logits.reshape([hidden.shape[0], -1]).astype("float32")
        return logits[:, : self.vocab_size]  # Fleet pads the vocabulary for tensor parallelism


def init_single_device() -> None:
    """Fleet's hybrid parallel state for one process on one device (every degree 1), and PaddleFleet's
    tensor-parallel group of that one rank, which its parallel linears and attention read."""
    import paddle.distributed as dist
    from paddle.distributed import fleet
    from paddlefleet import parallel_state

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sep_degree": 1,
                               "sharding_degree": 1, "ep_degree": 1, "cp_degree": 1, "moe_sharding_degree": 1,
                               "order": ["pp", "moe_sharding", "ep", "dp", "sharding", "sep", "cp", "mp"]}
    fleet.init(is_collective=True, strategy=strategy)
    if parallel_state._TENSOR_MODEL_PARALLEL_GROUP is None:
        ranks = [dist.get_rank()]
        parallel_state._TENSOR_MODEL_PARALLEL_GROUP = dist.new_group(ranks=ranks)
        parallel_state._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = ranks


def build_paddlefleet_model(checkpoint, dtype: str, device: str) -> PaddleFleetModel:
    """PaddleFormers' Fleet model for the checkpoint (weights via its HF loader) with our core attention."""
    if not paddlefleet_available():
        raise ValueError(INSTALL_HINT)
    import tempfile

    from paddleformers.transformers import AutoConfig, AutoModelForCausalLM

    from .hf_export import export_hf_directory

    init_single_device()
    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        directory = checkpoint.path if checkpoint.format == "hf" else export_hf_directory(checkpoint, tmp)
        config = AutoConfig.from_pretrained(directory)
        config.tensor_model_parallel_size = 1
        config.sequence_parallel = False
        config.parallel_output = True
        model = AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=dtype, convert_from_hf=True,
                                                     load_via_cpu=True, load_checkpoint_format="flex_checkpoint")
    model.eval()
    wrapped = PaddleFleetModel(model, checkpoint.config["vocab_size"])
    logger.info("PaddleFleet %s with %d core attentions on the engine's paged KV cache",
                checkpoint.architecture, len(wrapped.adapters))
    return wrapped
