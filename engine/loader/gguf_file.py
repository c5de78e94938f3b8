"""Opening a GGUF file and reading its metadata.

`GGUFFile` is a thin layer over `gguf.GGUFReader` (which memory-maps the file):
it turns the reader's low-level failures on a truncated or corrupt file into a
`ValueError` that names the file, and gives typed access to metadata keys
(``file.get("llama.block_count")``, arch-relative ``file.arch_get("block_count")``).
"""

from __future__ import annotations

import os

import numpy as np
from gguf import GGUFReader

GGUF_MAGIC = b"GGUF"


class GGUFFile:
    """One GGUF file: its metadata and tensor descriptors (data stays memory-mapped)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
        try:
            self.reader = GGUFReader(path, "r")
        except Exception as exc:  # the reader raises ValueError, IndexError, struct/numpy errors...
            size = os.path.getsize(path)
            raise ValueError(
                f"cannot read GGUF file {path} ({size:,} bytes): it is truncated or corrupt "
                f"({type(exc).__name__}: {exc})") from exc
        self.architecture: str = self.get("general.architecture")
        if not self.architecture:
            raise ValueError(f"GGUF file {path} has no general.architecture key")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default=None):
        """The value of metadata `key` as a Python scalar, str or list, else `default`."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def arch_get(self, key: str, default=None):
        """`get("<architecture>.<key>")`, e.g. ``arch_get("attention.head_count")``."""
        return self.get(f"{self.architecture}.{key}", default)

    def get_array(self, key: str, dtype) -> np.ndarray | None:
        """A numeric array key (token scores, token types) as one NumPy array, fast."""
        field = self.reader.fields.get(key)
        if field is None:
            return None
        if not field.data:
            return np.zeros(0, dtype=dtype)
        first, last = field.data[0], field.data[-1]
        if last - first + 1 == len(field.data):  # scalar elements stored back to back
            parts = field.parts[first:last + 1]
            return np.concatenate(parts).astype(dtype)
        return np.array([field.parts[i][0] for i in field.data], dtype=dtype)

    def get_strings(self, key: str) -> list[str] | None:
        """A string-array key (tokens, merges) as a list of str."""
        field = self.reader.fields.get(key)
        if field is None:
            return None
        parts = field.parts
        return [bytes(parts[i]).decode("utf-8", errors="replace") for i in field.data]
