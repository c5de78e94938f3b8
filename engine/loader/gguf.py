"""Open a GGUF file as a `Checkpoint`.

A GGUF file holds everything in one place: the architecture's hyper-parameters
(`gguf_config`), the tokenizer (`gguf_tokenizer`) and quantized tensors
(`gguf_weights`, and kept in their blocks by `gguf_blocks`).  This module ties the three together.
"""

from __future__ import annotations

import functools

from .checkpoint import Checkpoint
from .gguf_blocks import iter_gguf_blocks
from .gguf_config import GGUF_ARCHITECTURES, config_from_gguf
from .gguf_file import GGUFFile
from .gguf_tokenizer import tokenizer_from_gguf
from .gguf_weights import iter_gguf_weights

__all__ = ["GGUF_ARCHITECTURES", "load_gguf"]


def load_gguf(path: str) -> Checkpoint:
    """Open the GGUF file at `path`: config and tokenizer now, weights on demand.

    Raises ValueError for a truncated/corrupt file or an architecture the
    engine does not know (the message names the file and lists what is supported).
    """
    f = GGUFFile(path)
    try:
        config = config_from_gguf(f)
        tokenizer = tokenizer_from_gguf(f)
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, OverflowError) as exc:
        if isinstance(exc, ValueError) and path in str(exc):
            raise
        raise ValueError(f"{path}: corrupt GGUF metadata ({type(exc).__name__}: {exc})") from exc
    return Checkpoint(
        path=path,
        format="gguf",
        architecture=config["architectures"][0],
        config=config,
        tokenizer=tokenizer,
        _read_weights=functools.partial(iter_gguf_weights, f, config),
        _read_blocks=functools.partial(iter_gguf_blocks, f, config),
    )
