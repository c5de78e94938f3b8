"""One thread for SciPy's bundled OpenBLAS, the BLAS that Numba's ``np.dot`` calls.

The CPU kernels that multiply through BLAS (tiled prefill, block matmul)
already spread their work items over every core, so BLAS threads of its own
would only compete with those items (and with Paddle) for the same cores.
NumPy's BLAS is not touched.
"""
from __future__ import annotations

import ctypes
import glob
import os

_blas_configured = False


def single_threaded_blas():
    """Set SciPy's bundled OpenBLAS (the one Numba's ``np.dot`` calls) to one thread, once."""
    global _blas_configured
    if _blas_configured:
        return
    _blas_configured = True
    try:
        import scipy
    except ImportError:
        return
    libs = os.path.join(os.path.dirname(os.path.dirname(scipy.__file__)), "scipy.libs")
    for path in glob.glob(os.path.join(libs, "*openblas*")):
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(1)
                break
