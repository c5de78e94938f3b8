"""The public entry points: pick a backend, make zero-copy views, check shapes, call.

``backend=None`` chooses from where ``query`` (``key`` for ``write_kv``)
lives: CUDA memory -> ``"cuda"``, anything else -> ``"cpu"``. ``backend=``
forces ``"reference"`` (NumPy, host arrays only), ``"cpu"`` or ``"cuda"``.

Every argument may come from any supported framework (``interop.py``);
``out`` and the caches are written in place. Per-call cost on the CPU path
is a few microseconds for views (cached for persistent buffers such as the
KV caches) plus Numba's argument unboxing; ``python -m benchmarks.kernels``
measures it.

CUDA kernels are launched on the current stream of the framework that owns
``query``/``key`` (torch, Paddle, CuPy), so they are ordered with the
framework's own kernels without synchronizing.
"""
from __future__ import annotations

import threading

from numba import get_num_threads

from . import interop, reference
from .cpu import attention as cpu, prefill as cpu_prefill
from .cpu.blas import single_threaded_blas

BACKENDS = ("reference", "cpu", "cuda")
_cpu_lock = threading.Lock()     # Numba's workqueue threading layer is not re-entrant


def _backend(x, backend):
    if backend is None:
        return "cuda" if interop.is_cuda(x) else "cpu"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def _window(sliding_window) -> int:
    return int(sliding_window) if sliding_window else 0


def _check_cache(k_cache, v_cache):
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache/v_cache must both be [num_blocks, num_kv_heads, block_size, "
                         f"head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")


def _check_attention(query, k_cache, v_cache, block_tables, out):
    _check_cache(k_cache, v_cache)
    if query.ndim != 3 or tuple(out.shape) != tuple(query.shape):
        raise ValueError(f"query/out must be [tokens, heads, head_dim] of one shape, got "
                         f"{tuple(query.shape)} and {tuple(out.shape)}")
    if query.shape[2] != k_cache.shape[3]:
        raise ValueError(f"head_dim mismatch: query {query.shape[2]} vs cache {k_cache.shape[3]}")
    if query.shape[1] % k_cache.shape[1]:
        raise ValueError(f"num_heads {query.shape[1]} is not a multiple of num_kv_heads "
                         f"{k_cache.shape[1]}")
    if block_tables.ndim != 2:
        raise ValueError("block_tables must be [num_seqs, max_blocks_per_seq]")


def _cuda_backend():
    from .cuda import backend   # imported on first use: needs numba.cuda
    return backend


def write_kv(key, value, k_cache, v_cache, slot_mapping, *, backend=None):
    """Scatter ``key``/``value`` [num_tokens, num_kv_heads, head_dim] into the paged caches.

    ``slot_mapping[t] = block_id * block_size + offset``; -1 skips token t.
    """
    backend = _backend(key, backend)
    if backend == "cuda":
        views = [interop.device_view(a) for a in (key, value, k_cache, v_cache, slot_mapping)]
        _check_cache(views[2], views[3])
        _cuda_backend().write_kv(*views, stream=interop.cuda_stream(key))
        return
    # new names: the views do not keep the tensors alive, the arguments do
    k, v, kc, vc, slots = (interop.host_view(a) for a in (key, value, k_cache, v_cache, slot_mapping))
    _check_cache(kc, vc)
    if k.shape != v.shape or k.shape[1:] != (kc.shape[1], kc.shape[3]):
        raise ValueError(f"key/value {k.shape} do not match the cache {kc.shape}")
    if backend == "reference":
        reference.write_kv(k, v, kc, vc, slots)
        return
    with _cpu_lock:
        cpu.write_kv(k, v, kc, vc, slots, cpu.min_parallel_work)


def paged_decode(query, k_cache, v_cache, block_tables, context_lens, scale, *,
                 sliding_window=None, out, backend=None):
    """Attention of one query per sequence (at position ``context_lens[i] - 1``) over its cache.

    query/out: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, max_blocks];
    context_lens: [num_seqs] tokens in the cache including the current one.
    """
    backend = _backend(query, backend)
    window = _window(sliding_window)
    if backend == "cuda":
        q, kc, vc, bt, cl, o = (interop.device_view(a) for a in
                                (query, k_cache, v_cache, block_tables, context_lens, out))
        _check_attention(q, kc, vc, bt, o)
        _cuda_backend().paged_decode(q, kc, vc, bt, cl, float(scale), window, o,
                                     stream=interop.cuda_stream(query))
        return out
    q, kc, vc, bt, cl, o = (interop.host_view(a) for a in
                            (query, k_cache, v_cache, block_tables, context_lens, out))
    _check_attention(q, kc, vc, bt, o)
    if backend == "reference":
        reference.paged_decode(q, kc, vc, bt, cl, scale, sliding_window=window, out=o)
        return out
    with _cpu_lock:
        cpu.paged_decode(q, kc, vc, bt, cl, float(scale), window, o, get_num_threads(),
                         cpu.min_parallel_work)
    return out


def paged_prefill(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                  *, sliding_window=None, out, backend=None):
    """Chunked prefill / mixed batches: packed query chunks, each the last tokens of its sequence.

    query/out: [num_tokens, num_heads, head_dim]; query_start_loc: [num_seqs + 1]
    cumulative chunk starts; context_lens: [num_seqs]. Decodes are chunks of length 1.
    """
    backend = _backend(query, backend)
    window = _window(sliding_window)
    args = (query, k_cache, v_cache, block_tables, query_start_loc, context_lens, out)
    if backend == "cuda":
        q, kc, vc, bt, qsl, cl, o = (interop.device_view(a) for a in args)
        _check_attention(q, kc, vc, bt, o)
        _cuda_backend().paged_prefill(q, kc, vc, bt, qsl, cl, float(scale), window, o,
                                      stream=interop.cuda_stream(query))
        return out
    q, kc, vc, bt, qsl, cl, o = (interop.host_view(a) for a in args)
    _check_attention(q, kc, vc, bt, o)
    if backend == "reference":
        reference.paged_prefill(q, kc, vc, bt, qsl, cl, scale, sliding_window=window, out=o)
        return out
    single_threaded_blas()
    with _cpu_lock:
        cpu_prefill.paged_prefill(q, kc, vc, bt, qsl, cl, float(scale), window, o, get_num_threads(),
                                  cpu.min_parallel_work)
    return out
