"""Per-model corrections where a PaddleFormers model departs from its HF reference.

The fallback serves the library's model as it is, except where it computes
something different from the HF model the checkpoint was trained as. Each
fixup below names the deviation, how it is detected and how it is undone;
`apply_fixups` installs every one that applies to a model and returns their names.

Gemma 3 local RoPE (paddleformers 1.2)
    HF Gemma 3 rotates queries/keys of its sliding-window ("local") layers
    with ``rope_local_base_freq`` (10,000) and of its global layers with
    ``rope_theta`` (1,000,000). ``Gemma3TextModel`` in paddleformers 1.2 builds
    one rotary embedding from ``rope_theta`` and passes it to every layer (a
    TODO in its source). The fixup registers a forward pre-hook on each
    sliding layer that swaps the ``position_embeddings`` argument for cos/sin
    computed with the local base (by the library's own rotary class), and
    leaves that rotary embedding where a fixed library keeps its own, as the
    body's ``rotary_emb_local`` (not a sublayer: nothing the library saves or
    converts changes), which the captured decode step reads its tables from.
"""

from __future__ import annotations

import copy

import paddle


class Gemma3LocalRope:
    """Give Gemma 3's sliding-window layers the RoPE base HF gives them."""

    name = "gemma3-local-rope"

    @staticmethod
    def applies(model) -> bool:
        body = getattr(model, "model", None)
        config = getattr(model, "config", None)
        return (type(model).__name__ == "Gemma3ForCausalLM" and body is not None
                and not hasattr(body, "rotary_emb_local")  # a fixed library keeps its own
                and getattr(config, "rope_local_base_freq", None) is not None
                and "sliding_attention" in (getattr(config, "layer_types", None) or []))

    def __init__(self, model):
        body = model.model
        local_config = copy.deepcopy(model.config)
        local_config.rope_parameters = {"rope_type": "default", "rope_theta": float(model.config.rope_local_base_freq)}
        self.rotary = type(body.rotary_emb)(config=local_config)  # the library's Gemma3RotaryEmbedding
        object.__setattr__(body, "rotary_emb_local", self.rotary)
        self._memo: tuple[paddle.Tensor, tuple] | None = None
        for layer in body.layers:
            if layer.attention_type == "sliding_attention":
                layer.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, layer, args, kwargs):
        position_ids = kwargs.get("position_ids")
        cos_sin = kwargs.get("position_embeddings")
        if position_ids is None or cos_sin is None:
            raise RuntimeError("Gemma3 local-RoPE fixup: the decoder layer was called without "
                               "position_ids/position_embeddings keywords")
        if self._memo is None or self._memo[0] is not position_ids:
            # once per forward: every layer of one call gets the same position_ids tensor
            self._memo = (position_ids, self.rotary(cos_sin[0], position_ids))
        kwargs["position_embeddings"] = self._memo[1]
        return args, kwargs


FIXUPS = (Gemma3LocalRope,)


def apply_fixups(model) -> list[str]:
    """Install every applicable fixup on ``model``; the names of those installed."""
    installed = []
    for fixup in FIXUPS:
        if fixup.applies(model):
            fixup(model)  # the hooks keep the fixup object alive
            installed.append(fixup.name)
    return installed
