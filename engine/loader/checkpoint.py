"""`Checkpoint`: what a loader hands the engine -- config, tokenizer, weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    from .gguf_blocks import BlockQuantized
    from ..tokenizer import Tokenizer


MAX_POSITIONS = 1 << 24  # context lengths beyond 16M tokens are a corrupt header, not a model


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
        directly (`engine.loader.gguf_blocks`: Q4_0, Q4_1, Q8_0), rows ordered as in `weights`.
        Empty for other checkpoints and formats."""
        return dict(self._read_blocks()) if self._read_blocks else {}

    def state_dict(self, dtype: str = "float32") -> dict[str, np.ndarray]:
        """All weights in one dict (convenient for small models and tests)."""
        return dict(self.weights(dtype))
