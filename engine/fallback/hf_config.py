"""HF ``config.json``-style dict -> the PaddleFormers model class and its config.

The checkpoint loaders (``engine.loader``) describe every model with an HF
config dict, whether it came from ``config.json`` or from GGUF metadata.
PaddleFormers' config classes take the same field names, so translation is
mostly passing them through, plus what the engine needs:

* ``_attn_implementation`` -> our paged attention (`attention_adapter`);
* ``fuse_rms_norm=False`` on CPU (the fused kernel is GPU-only);
* ``use_cache=False`` (the library's own KV cache is never used);
* no tensor/sequence parallelism (one device, one process);
* ``pad_token_id=None``: PaddleFormers passes it to ``paddle.nn.Embedding`` as
  ``padding_idx``, and Paddle (unlike torch, which only freezes that row's
  gradient) *outputs zeros* for it. Where the pad id is a real token —
  SmolLM2 pads with ``<|im_end|>`` — every turn end would embed as zeros.

The class is looked up by the checkpoint's architecture name in
``paddleformers.transformers`` (``LlamaForCausalLM``, ``Gemma3ForCausalLM``,
``Phi3ForCausalLM``...).
"""

from __future__ import annotations

import copy

# Keys of an HF config dict that describe the file, not the model.
_DROPPED = ("architectures", "torch_dtype", "dtype", "transformers_version", "model_type", "auto_map",
            "quantization_config")


def paddleformers_class(architecture: str):
    """The ``paddleformers.transformers`` class named ``architecture`` (ValueError if it has none)."""
    import paddleformers.transformers as pf

    try:
        cls = getattr(pf, architecture)
    except ImportError as exc:  # e.g. Qwen2/Qwen3 in paddleformers 1.2 need paddlefleet
        raise ValueError(f"PaddleFormers cannot build {architecture} here: {exc}. "
                         f"Use model_impl='native' or 'paddlefleet' for it") from exc
    except AttributeError:
        raise ValueError(f"PaddleFormers has no {architecture} class, so model_impl='paddleformers' "
                         f"cannot serve it") from None
    if getattr(cls, "is_fleet", False):
        raise ValueError(f"PaddleFormers' {architecture} is a PaddleFleet model; use model_impl='paddlefleet'")
    return cls


def paddleformers_config(model_cls, hf_config: dict, device: str, attn_implementation: str):
    """An instance of ``model_cls.config_class`` built from the HF config dict."""
    kwargs = {k: copy.deepcopy(v) for k, v in hf_config.items() if k not in _DROPPED and v is not None}
    kwargs.update(
        use_cache=False,
        fuse_rms_norm=device != "cpu",
        tensor_model_parallel_size=1,
        sequence_parallel=False,
        pad_token_id=None,
        _attn_implementation=attn_implementation,
    )
    config = model_cls.config_class(**kwargs)
    # Some config classes overwrite _attn_implementation in their __init__; make sure ours wins.
    config._attn_implementation = attn_implementation
    return config
