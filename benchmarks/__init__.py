"""Benchmarks: each prints our numbers beside a peer's, measured in the same run.

``python -m benchmarks.engine`` (engine throughput and latency; ``fallback``
is its model-implementation section), ``python -m benchmarks.kernels`` (the
Numba kernels; ``kernel_sweep`` times GPU tile variants) and
``python -m benchmarks.playground`` (decode speed with the live UI running).
Each writes its run through ``results`` (``benchmarks/results/NAME.json``, rendered
into ``docs/benchmarks/``). Not runtime code: nothing under ``engine``,
``gpu_kernels`` or ``playground`` imports it.
"""
