"""`Checkpoint`: what a loader hands the engine -- config, tokenizer, weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    from .gguf_blocks import BlockQuantized
    from ..tokenizer import Tokenizer


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
