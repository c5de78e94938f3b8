"""The ``cpu`` backend: Numba ``njit`` kernels on host arrays.

``attention`` (write_kv, decode, the row-by-row prefill pieces), ``prefill``
(chunked prefill tiled through BLAS), ``formats`` (half/bfloat16 element
conversions inside ``njit`` code), ``block_matmul`` (float32 rows times
GGUF-quantized weight blocks, on the row kernels of ``block_dot`` and the
several-token ``microkernel``), ``activations`` (a vector ``exp``),
``decode_step`` (a whole decode step, its work shared through ``sync``),
``norms`` (RMS normalisation of many rows), ``rope`` (rotary embedding of many rows),
``gated`` (a gated MLP's activation of many rows), ``float_matmul`` (float32 products: a
float LM head's few rows as dot products) and ``blas`` (one BLAS thread per work item).
``kernel_cache`` stamps the kernels' disk cache with all of the package's sources, installed
here, before any kernel is defined.
"""
from .kernel_cache import install as _install_cache_locators

_install_cache_locators()
