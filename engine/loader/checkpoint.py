"""`Checkpoint`: what a loader hands the engine -- config, tokenizer, weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import math
import numbers

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    from .gguf_blocks import BlockQuantized
    from ..tokenizer import Tokenizer


MAX_POSITIONS = 1 << 24  # context lengths beyond 16M tokens are a corrupt header, not a model
# Activations a config may name (HF's ACT2FN names the engine's implementations understand).
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python", "quick_gelu",
               "relu", "tanh", "sigmoid")


def validate_config(path: str, config: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse sizes that are impossible or disagree with the tensors the file holds, before anything is
    allocated from them. ``shapes``: HF name -> shape of the tensors in the file."""
    def positive(key: str, limit: int | None = None, optional: bool = False) -> int | None:
        value = config.get(key)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1 or (
                limit is not None and value > limit):
            bound = f" <= {limit:,}" if limit is not None else ""
            raise ValueError(f"{path}: {key} must be a positive integer{bound}; got {value!r}")
        return int(value)

    hidden, heads, kv_heads = positive("hidden_size"), positive("num_attention_heads"), positive("num_key_value_heads")
    head_dim, layers, vocab = positive("head_dim"), positive("num_hidden_layers"), positive("vocab_size")
    inter = positive("intermediate_size")
    positive("max_position_embeddings", MAX_POSITIONS, optional=True)
    validate_values(path, config, vocab)
    if heads % kv_heads:
        raise ValueError(f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    expected = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.layers.0.self_attn.q_proj.weight": (heads * head_dim, hidden),
        "model.layers.0.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "model.layers.0.mlp.up_proj.weight": (inter, hidden),
    }
    for name, shape in expected.items():
        if name in shapes and tuple(int(d) for d in shapes[name]) != shape:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(shapes[name])} but the config implies {shape} "
                             f"(vocab_size={vocab}, hidden_size={hidden}, heads={heads}, kv_heads={kv_heads}, "
                             f"head_dim={head_dim}, intermediate_size={inter})")
    present = {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if present and max(present) + 1 != layers:
        raise ValueError(f"{path}: num_hidden_layers={layers} but the file holds layers 0..{max(present)}")


def validate_values(path: str, config: dict, vocab: int) -> None:
    """The config's values the model is computed with, by type and range, before anything is built:
    a wrong one used to load silently (``rms_norm_eps = 1e300``, ``hidden_act = "nope"``,
    ``tie_word_embeddings = "no"``, ``eos_token_id = 10**12``) or fail later without naming the field
    (``rope_theta = "x"`` / 0 / NaN, ``rope_scaling = "x"``)."""
    def number(key: str, low: float, high: float, accepted: str) -> None:
        value = config.get(key)
        if value is None:
            return
        try:
            ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
                  and low < value < high)
        except OverflowError:
            ok = False
        if not ok:
            raise ValueError(f"{path}: {key} must be {accepted}; got {_short(value)}")

    number("rope_theta", 0.0, math.inf, "a finite number > 0")
    number("rope_local_base_freq", 0.0, math.inf, "a finite number > 0")
    for key in ("rms_norm_eps", "layer_norm_eps", "norm_eps"):
        number(key, 0.0, 1.0, "a number in (0, 1)")
    scaling = config.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ValueError(f"{path}: rope_scaling must be null or an object with rope_type and factor; got "
                             f"{_short(scaling)}")
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind is not None and not isinstance(kind, str):
            raise ValueError(f"{path}: rope_scaling.rope_type must be a string; got {_short(kind)}")
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = scaling.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{path}: rope_scaling.{key} must be a finite number > 0; got {_short(value)}")
    for key in ("tie_word_embeddings", "attention_bias"):
        if key in config and not isinstance(config[key], bool):
            raise ValueError(f"{path}: {key} must be true or false; got {_short(config[key])}")
    for key in ("hidden_act", "hidden_activation"):
        value = config.get(key)
        if value is not None and value not in ACTIVATIONS:
            raise ValueError(f"{path}: {key} {_short(value)} is not an activation the engine knows; accepted: "
                             f"{', '.join(ACTIVATIONS)}")
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = config.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                         and 0 <= i < vocab for i in ids):
            raise ValueError(f"{path}: {key} must be a token id (or a list of them) in [0, vocab_size={vocab}); "
                             f"got {_short(value)}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({type(value).__name__})"


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_dtype(path: str, name: str, dtype: str) -> None:
    """A model weight stored as integers or booleans (a header saying ``I32`` for ``F32`` data, which
    loads as garbage numbers) is refused by name; the engine's weights are floating point."""
    if name.startswith(("model.", "lm_head.")) and str(dtype).upper() not in FLOAT_DTYPES:
        raise ValueError(f"{path}: tensor {name} has dtype {dtype}; model weights must be floating point "
                         f"({', '.join(FLOAT_DTYPES)})")


def check_finite(path: str, name: str, array: np.ndarray) -> None:
    """A tensor holding NaN or inf is a corrupt file (caught at load, not as NaN logits later)."""
    if array.dtype.kind == "f" or array.dtype == np.dtype(ml_dtypes.bfloat16):
        if not np.isfinite(array).all():
            raise ValueError(f"{path}: tensor {name} holds NaN or infinite values; the file is corrupt")


def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype for a weights dtype name."""
    if dtype in ("float32", "float16"):
        return np.dtype(dtype)
    if dtype == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got {dtype!r}")


@dataclass(frozen=True)
class Checkpoint:
    """A model checkpoint, opened but not yet materialized.

    Attributes:
        path: the resolved GGUF file or HF model directory.
        format: ``"gguf"`` or ``"hf"``.
        architecture: HF class name, e.g. ``"LlamaForCausalLM"``, ``"Gemma3ForCausalLM"``.
        config: HF ``config.json``-style dict (``hidden_size``, ``num_hidden_layers``,
            ``rope_theta``, ``tie_word_embeddings``, Gemma 3's ``layer_types``...).
        tokenizer: the model's `engine.tokenizer.Tokenizer`.

    Weights are read on demand by `weights`, so opening a checkpoint is cheap.
    """

    path: str
    format: str
    architecture: str
    config: dict
    tokenizer: "Tokenizer"
    _read_weights: Callable[..., Iterator[tuple[str, np.ndarray]]] = field(repr=False, compare=False)
    _read_blocks: Callable[[], Iterator[tuple[str, "BlockQuantized"]]] | None = field(
        default=None, repr=False, compare=False)

    def weights(self, dtype: str = "float32", progress: bool = True) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(name, array)`` for every parameter, one tensor at a time.

        Names and layouts are HF's (``model.layers.0.self_attn.q_proj.weight``,
        ``[out, in]`` for linear weights); quantized tensors come dequantized and
        format-specific transformations are undone.  A tied ``lm_head`` is not
        yielded (see ``config["tie_word_embeddings"]``).  `dtype`: ``"float32"``,
        ``"float16"`` or ``"bfloat16"`` (NumPy via ml_dtypes).  `progress`: tqdm bar.
        """
        numpy_dtype(dtype)  # reject a bad dtype now, not at the first tensor
        return self._read_weights(dtype=dtype, progress=progress)

    def quantized_blocks(self) -> dict[str, "BlockQuantized"]:
        """HF-named linear weights that the file stores in a block format the engine computes on
        directly (`engine.loader.gguf_blocks`: Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0), rows ordered as in `weights`.
        Empty for other checkpoints and formats."""
        return dict(self._read_blocks()) if self._read_blocks else {}

    def state_dict(self, dtype: str = "float32") -> dict[str, np.ndarray]:
        """All weights in one dict (convenient for small models and tests)."""
        return dict(self.weights(dtype))
