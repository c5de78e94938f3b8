"""Framework-neutral paged-attention kernels.

Three operations over a paged KV cache laid out as
``[num_blocks, num_kv_heads, block_size, head_dim]`` (docs/ARCHITECTURE.md):

* :func:`write_kv` -- scatter new tokens' keys/values into their slots;
* :func:`paged_decode` -- one query per sequence;
* :func:`paged_prefill` -- packed query chunks (chunked prefill, mixed with decodes).

Backends: ``reference`` (NumPy, ``reference.py``), ``cpu`` (Numba ``njit``,
``cpu/``) and ``cuda`` (``numba.cuda``, ``cuda/``); ``dispatch.py`` picks
one from where the arrays live, ``interop.py`` makes zero-copy views of
NumPy / Paddle / torch / CuPy / Numba arrays.
"""
from .dispatch import BACKENDS, paged_decode, paged_prefill, write_kv

__all__ = ["BACKENDS", "write_kv", "paged_decode", "paged_prefill"]
