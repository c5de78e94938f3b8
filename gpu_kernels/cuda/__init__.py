"""The ``cuda`` backend: ``numba.cuda`` kernels on device arrays.

``backend`` is its face (kernel shapes, scratch buffers, launches);
``decode``, ``prefill`` (float32 on CUDA cores) and ``prefill_mma`` (half
formats on tensor cores, its matrix products in ``mma``: CUDA C++ from
``mma.cu`` linked in, or plain Numba) build the kernels from ``primitives``
(element conversions, warp shuffles), ``shared_memory`` (``cp.async``, vector
loads) and ``launch`` (cached launchers with dynamic shared memory). Importing
``gpu_kernels.cuda.backend`` needs ``numba.cuda`` (or ``NUMBA_ENABLE_CUDASIM=1``).
"""
