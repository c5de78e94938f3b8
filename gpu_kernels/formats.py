"""Number formats of KV caches and activations, as NumPy sees them.

NumPy has no bfloat16 and Numba's CPU target has no float16, so the kernels
agree on a *canonical* host representation where the element type alone says
how to read the bits:

=============  ======================  ==========================================
format         canonical host dtype    notes
=============  ======================  ==========================================
float32        ``float32``             also ``float64`` (read as is)
float16        ``int16``               IEEE half bits; ``np.float16`` arrays are
                                       viewed as ``int16`` by :func:`canonical`
bfloat16       ``uint16``              upper 16 bits of a float32; a plain
                                       ``uint16`` array *is* read as bf16, and so
                                       is an ``ml_dtypes.bfloat16`` array
=============  ======================  ==========================================

On a CUDA device the kernels take ``float16`` natively, so the device
representation is float32 / float16 / uint16 (= bf16); see ``interop.py``.

:func:`to_float32` and :func:`from_float32` convert between a canonical array
and float32 values with NumPy (round-to-nearest-even, like the kernels). The
reference backend and the tests use them.
"""
from __future__ import annotations

import numpy as np

#: canonical host dtype for each format name
HOST_DTYPE = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.int16),
    "bfloat16": np.dtype(np.uint16),
}


def format_of(dtype) -> str:
    """Name of the number format an array of ``dtype`` holds ("float16", "bfloat16", ...)."""
    dtype = np.dtype(dtype)
    if dtype == np.float16 or dtype == np.int16:
        return "float16"
    if dtype == np.uint16 or dtype.name == "bfloat16":
        return "bfloat16"
    if dtype == np.float32:
        return "float32"
    if dtype == np.float64:
        return "float64"
    raise TypeError(f"unsupported attention dtype {dtype}")


def canonical(a: np.ndarray) -> np.ndarray:
    """View ``a`` in the canonical host representation (no copy).

    float16 -> int16 bits, bfloat16 (ml_dtypes) -> uint16 bits; anything else is
    returned unchanged. (Compares dtype characters: this runs on every call.)
    """
    char = a.dtype.char
    if char == "e":
        return a.view(np.int16)
    if char in _PLAIN_CHARS or a.dtype.name != "bfloat16":
        return a
    return a.view(np.uint16)


_PLAIN_CHARS = frozenset("fdghHiIlLqQbB?")


def to_float32(a: np.ndarray) -> np.ndarray:
    """Decode a canonical (or float16 / ml_dtypes bf16) array into float32 values."""
    fmt = format_of(a.dtype)
    if fmt == "float16":
        return a.view(np.float16).astype(np.float32)
    if fmt == "bfloat16":
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 bits (uint16), round to nearest even; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def from_float32(x: np.ndarray, dtype) -> np.ndarray:
    """Encode float32 (or float64) values into arrays of ``dtype``'s format.

    The result has ``dtype`` itself (``np.float16`` gives float16, ``int16``
    gives half bits, ``uint16`` gives bf16 bits).
    """
    dtype = np.dtype(dtype)
    fmt = format_of(dtype)
    if fmt == "float16":
        return np.asarray(x, np.float32).astype(np.float16).view(dtype)
    if fmt == "bfloat16":
        return bf16_bits(np.asarray(x, np.float32)).view(dtype)
    return np.asarray(x).astype(dtype)
