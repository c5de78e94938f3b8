"""``model_impl="paddlefleet"``: PaddleFleet's GPT model with its core attention on our paged KV cache.

In paddleformers 1.2, ``Qwen2ForCausalLM``/``Qwen3ForCausalLM`` are PaddleFleet
``GPTModel``s (a ``PipelineLayer`` whose ``run_function`` is embedding,
``TransformerLayer``s, final norm, LM head). Each layer's
``self_attn.core_attention`` is a ``DotProductAttention`` called, after
RoPE, as

    core_attention(query, key, value, attention_mask, attn_mask_startend_row_indices,
                   attn_mask_type=..., attention_bias=..., packed_seq_params=..., ...)

with ``query`` ``[b, s, heads_per_partition, head_dim]`` and ``key``/``value``
``[b, s, kv_heads_per_partition, head_dim]``, returning
``[b, s, heads_per_partition * head_dim]``. `FleetPagedAttention` has that
signature and layout and runs ``engine.attention.paged_attention``.
`patch_core_attention` swaps it into every layer, reading from the layer it
replaces:

* the layer index: ``DotProductAttention.layer_number`` is **1-based**
  (``max(1, layer_number)``) and counts ``num_empty_layers_add_in_head``;
  KV cache ``i`` belongs to ``layer_number - 1 - num_empty_layers_add_in_head``;
* the head counts **per tensor-parallel partition** (what q/k/v carry and
  what the KV cache holds on this rank);
* the softmax scale (``softmax_scale``; times ``layer_number`` under
  ``apply_query_key_layer_scaling``, where Fleet divides it out and multiplies
  it back in the softmax);
* the sliding window as the layer decided it (``scale_mask_softmax.sliding_window``).

``paddlefleet`` is not on PyPI (it installs from Paddle's own package index,
paddleformers' ``paddlefleet`` extra); everything that needs it is imported
inside `build_paddlefleet_model`, so this module imports without it and the
adapter can be tested against the reference kernels anywhere.
"""

from __future__ import annotations

import importlib.util
import logging

import paddle

from .attention_adapter import attend
from .step_context import bind_step

logger = logging.getLogger("engine")

INSTALL_HINT = ("model_impl='paddlefleet' needs the 'paddlefleet' package, which is not installed; it installs "
                "from Paddle's own package index (paddleformers' 'paddlefleet' extra). Other model_impl values "
                "still work: auto, native, paddleformers.")


def paddlefleet_available() -> bool:
    return importlib.util.find_spec("paddlefleet") is not None


def _window(sliding_window) -> int | None:
    """HF-style window (a query at p sees keys > p - w) from Fleet's int or ``(left, right)`` form."""
    if not sliding_window:
        return None
    if isinstance(sliding_window, (tuple, list)):
        left, right = sliding_window
        if right not in (0, None) or left is None or left < 0:
            raise NotImplementedError(f"sliding window {tuple(sliding_window)} is not a causal left window")
        return int(left) + 1  # (left, 0): the current token and `left` before it
    return int(sliding_window)


class FleetPagedAttention(paddle.nn.Layer):
    """Drop-in for PaddleFleet's ``DotProductAttention`` running the engine's paged attention."""

    def __init__(self, layer_index: int, num_heads: int, num_kv_heads: int, head_dim: int, softmax_scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.softmax_scale = softmax_scale
        self.sliding_window = sliding_window

    @classmethod
    def replacing(cls, core_attention) -> "FleetPagedAttention":
        """The adapter for one ``DotProductAttention``, its settings read from it (see module docstring)."""
        config = core_attention.config
        layer_number = int(core_attention.layer_number)
        scale = float(core_attention.softmax_scale)
        if getattr(config, "apply_query_key_layer_scaling", False):
            scale *= layer_number
        softmax = getattr(core_attention, "scale_mask_softmax", None)
        return cls(
            layer_index=layer_number - 1 - int(getattr(config, "num_empty_layers_add_in_head", None) or 0),
            num_heads=int(core_attention.num_attention_heads_per_partition),
            num_kv_heads=int(core_attention.num_query_groups_per_partition),
            head_dim=int(core_attention.hidden_size_per_attention_head),
            softmax_scale=scale,
            sliding_window=_window(getattr(softmax, "sliding_window", None)),
        )

    def forward(self, query, key, value, attention_mask=None, attn_mask_startend_row_indices=None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None, use_rr_flash_attention=False,
                **kwargs):
        """``[1, s, heads, D]`` q and ``[1, s, kv_heads, D]`` k/v -> ``[1, s, heads * D]``; masks are unused."""
        if attention_bias is not None:
            raise NotImplementedError("attention bias is not supported by the engine's paged attention")
        if query.ndim != 4 or query.shape[0] != 1:
            raise ValueError(f"expected query [1, seq, heads, head_dim] (one packed sequence); got {query.shape}")
        if query.shape[2] != self.num_heads or key.shape[2] != self.num_kv_heads:
            raise ValueError(f"layer {self.layer_index}: got {query.shape[2]} query / {key.shape[2]} KV heads, "
                             f"expected {self.num_heads} / {self.num_kv_heads} per partition")
        out = attend(query[0], key[0], value[0], self.layer_index, scale=self.softmax_scale,
                     sliding_window=self.sliding_window)
        return out.reshape([1, out.shape[0], self.num_heads * self.head_dim])


def transformer_layers(model) -> list:
    """The layers of a Fleet model that own a ``self_attn.core_attention``, in execution order."""
    layers = getattr(model, "run_function", None)
    if layers is None:
        layers = [m for _, m in model.named_sublayers()]
    return [m for m in layers if getattr(getattr(m, "self_attn", None), "core_attention", None) is not None]


def patch_core_attention(model) -> list[FleetPagedAttention]:
    """Replace every layer's core attention with a `FleetPagedAttention`; the adapters, by layer index."""
    adapters = []
    for layer in transformer_layers(model):
        adapter = FleetPagedAttention.replacing(layer.self_attn.core_attention)
        layer.self_attn.core_attention = adapter
        adapters.append(adapter)
    indices = sorted(a.layer_index for a in adapters)
    if indices != list(range(len(adapters))) or not adapters:
        raise ValueError(f"core attention layer indices {indices} are not 0..{len(adapters) - 1}; "
                         "cannot map layers to KV caches")
    return sorted(adapters, key=lambda a: a.layer_index)


class PaddleFleetModel:
    """The engine's model interface around a PaddleFleet ``GPTModel`` (see `engine.model_runner`)."""

    def __init__(self, model, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        self.adapters = patch_core_attention(model)
        first = self.adapters[0]
        self._layout = (len(self.adapters), first.num_kv_heads, first.head_dim)

    def kv_layout(self) -> tuple[int, int, int]:
        return self._layout

    def forward(self, input_ids, positions, meta, kv_caches):
        """Run embedding and transformer layers (not the LM head) on the packed batch as one sequence."""
        from paddlefleet.models.gpt.lm_head import GPTLMHead

        state = {"input_ids": input_ids.unsqueeze(0), "position_ids": positions.unsqueeze(0)}
        with bind_step(meta, kv_caches):
            for layer in self.model.run_function:
                if not isinstance(layer, GPTLMHead):
                    state = layer(state)
        return state["hidden_states"].reshape([-1, state["hidden_states"].shape[-1]])

    def compute_logits(self, hidden):
        head = self.model.get_lm_head()
        logits = head({"hidden_states": hidden.unsqueeze(1)})  # Fleet's head takes [s, b, h]
        logits = logits.reshape([hidden.shape[0], -1]).astype("float32")
        return logits[:, : self.vocab_size]  # Fleet pads the vocabulary for tensor parallelism


def build_paddlefleet_model(checkpoint, dtype: str, device: str) -> PaddleFleetModel:
    """PaddleFormers' Fleet model for the checkpoint (weights via its HF loader) with our core attention."""
    if not paddlefleet_available():
        raise ValueError(INSTALL_HINT)
    import tempfile

    from paddleformers.transformers import AutoConfig, AutoModelForCausalLM

    from .hf_export import export_hf_directory

    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        directory = checkpoint.path if checkpoint.format == "hf" else export_hf_directory(checkpoint, tmp)
        config = AutoConfig.from_pretrained(directory)
        config.tensor_model_parallel_size = 1
        config.sequence_parallel = False
        model = AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=dtype, convert_from_hf=True,
                                                     load_via_cpu=True, load_checkpoint_format="flex_checkpoint")
    model.eval()
    wrapped = PaddleFleetModel(model, checkpoint.config["vocab_size"])
    logger.info("PaddleFleet %s with %d core attentions on the engine's paged KV cache",
                checkpoint.architecture, len(wrapped.adapters))
    return wrapped
