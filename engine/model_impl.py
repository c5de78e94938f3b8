"""``model_impl`` selection (FastDeploy's ``--model-impl auto|native|paddleformers|paddlefleet``).

* ``native``        – our Paddle implementation (``engine.models``);
* ``paddleformers`` – the architecture's PaddleFormers class with its attention
  swapped for ours (``engine.fallback.paddleformers``);
* ``paddlefleet``   – PaddleFleet's GPT model with its core attention swapped
  (``engine.fallback.paddlefleet``), where the ``paddlefleet`` package is installed;
* ``auto``          – native when the architecture has one, else PaddleFormers.
"""

from __future__ import annotations

import importlib.util
import logging

from .models import NATIVE_ARCHITECTURES, EngineModel, build_native_model

logger = logging.getLogger("engine")


def resolve_model_impl(requested: str, architecture: str) -> str:
    if requested == "auto":
        return "native" if architecture in NATIVE_ARCHITECTURES else "paddleformers"
    if requested == "native" and architecture not in NATIVE_ARCHITECTURES:
        raise ValueError(
            f"model_impl='native' has no implementation of {architecture}; native architectures: "
            f"{', '.join(NATIVE_ARCHITECTURES)} (use model_impl='auto' or 'paddleformers' for others)"
        )
    if requested == "paddlefleet" and importlib.util.find_spec("paddlefleet") is None:
        raise ValueError(
            "model_impl='paddlefleet' needs the 'paddlefleet' package, which is not installed; it installs from "
            "Paddle's own package index (paddleformers' 'paddlefleet' extra). Other model_impl values still work: "
            "auto, native, paddleformers."
        )
    return requested


def build_model(impl: str, checkpoint, dtype: str, device: str, quantization: str = "auto") -> EngineModel:
    """Instantiate the model for a resolved ``impl`` with the checkpoint's weights loaded (an `EngineModel`).

    ``quantization="auto"``: on CPU in float32, linears whose weights the checkpoint
    stores in a kept block format also get those blocks and multiply on them
    (``engine.block_linear``).
    """
    logger.info("loading %s (%s) with model_impl=%s, dtype=%s, device=%s",
                checkpoint.path, checkpoint.architecture, impl, dtype, device)
    blocks = {}
    if quantization == "auto" and device == "cpu" and dtype == "float32" and impl in ("native", "paddleformers"):
        blocks = checkpoint.quantized_blocks()
        if blocks:
            kinds = sorted({b.kind for b in blocks.values()})
            logger.info("quantization=auto: %d weights kept in their GGUF blocks too (%s, %.0f MB); CPU matmuls "
                        "run on them", len(blocks), ", ".join(kinds), sum(b.nbytes for b in blocks.values()) / 2**20)
    if impl == "native":
        return build_native_model(checkpoint.architecture, checkpoint.config, checkpoint.weights(), dtype, blocks)
    if impl in ("paddleformers", "paddlefleet"):
        from .fallback.quiet import quiet_paddleformers

        with quiet_paddleformers():     # the notices PaddleFormers prints on import and construction
            if impl == "paddleformers":
                from .fallback.paddleformers import build_paddleformers_model

                return build_paddleformers_model(checkpoint, dtype, device, blocks)
            from .fallback.paddlefleet import build_paddlefleet_model

            return build_paddlefleet_model(checkpoint, dtype, device)
    raise ValueError(f"unknown model_impl {impl!r}")
