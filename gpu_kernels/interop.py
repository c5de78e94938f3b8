"""Zero-copy views of framework tensors for the kernels.

The kernels take NumPy arrays (CPU) or Numba device arrays (CUDA). This
module turns NumPy arrays, Paddle tensors, torch tensors, CuPy arrays and
Numba device arrays into those, without copying and without host round-trips:

================  ==========================================================
input             view
================  ==========================================================
NumPy array       itself (float16 -> int16 bits, see ``formats.py``)
Paddle, CPU       NumPy array over ``data_ptr()`` (writable: a ``write_kv``
                  into it mutates the tensor). ``np.from_dlpack`` also shares
                  memory but returns a *read-only* array on NumPy < 2 and
                  refuses bfloat16, so the view is built from the pointer.
torch, CPU        ``tensor.numpy()`` (bf16 via an int16 view)
CUDA tensors      ``numba.cuda`` array from ``__cuda_array_interface__``;
                  Paddle and torch report bfloat16 as ``<f2`` or not at all,
                  so bf16 becomes ``<u2``
================  ==========================================================

Views are cached by (data pointer, shape, dtype, strides). Building a view
costs microseconds (tens for a Numba device array); looking one up costs
well under one. A cached view holds no reference to its tensor: it is only
ever returned while a live tensor with the same pointer, shape and dtype is
being passed in, i.e. while its memory is valid. The KV caches and other
persistent buffers therefore hit the cache every call. The flip side: a view
does not keep its tensor alive, so keep a reference to the tensor for as long
as the view is used (``dispatch.py`` holds the arguments during the call).
"""
from __future__ import annotations

import numpy as np

from .formats import canonical

_MAX_CACHED = 1024
_host_views: dict = {}
_device_views: dict = {}


class _Interface:
    """Carrier of an ``__array_interface__`` dict for ``np.asarray``."""
    __slots__ = ("__array_interface__",)

    def __init__(self, ptr, shape, typestr, strides):
        self.__array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr,
                                    "strides": strides, "version": 3}


def _remember(cache, key, view):
    if len(cache) >= _MAX_CACHED:
        cache.clear()
    cache[key] = view
    return view


# --------------------------------------------------------------------------- where


_framework_of_type: dict = {np.ndarray: "numpy"}


def framework(x) -> str:
    """'numpy', 'paddle', 'torch', 'cupy', 'numba' or 'other' (by the type's module)."""
    kind = _framework_of_type.get(type(x))
    if kind is None:
        mod = type(x).__module__
        kind = next((name for name in ("paddle", "torch", "cupy", "numba")
                     if mod.startswith(name)), "other")
        _framework_of_type[type(x)] = kind
    return kind


def is_cuda(x) -> bool:
    """True when ``x`` lives in CUDA device memory."""
    if isinstance(x, np.ndarray):
        return False
    fw = framework(x)
    if fw == "paddle":
        return x.is_cuda
    if fw == "torch":
        return x.is_cuda
    return hasattr(x, "__cuda_array_interface__")


# --------------------------------------------------------------------------- host

# Paddle dtype name -> canonical typestr (formats.py: fp16 travels as int16, bf16 as uint16)
_PADDLE_HOST_TYPESTR = {
    "float32": "<f4", "float64": "<f8", "float16": "<i2", "bfloat16": "<u2",
    "int32": "<i4", "int64": "<i8", "uint8": "|u1", "int8": "|i1", "bool": "|b1", "int16": "<i2",
}


def _paddle_host(t) -> np.ndarray:
    # Paddle dtypes are singletons: id() is a cheap, stable key (hashing them is slow)
    ptr, shape, dtype_id = t.data_ptr(), tuple(t.shape), id(t.dtype)
    strides = None if t.is_contiguous() else tuple(t.strides)
    key = (ptr, shape, dtype_id, strides)
    view = _host_views.get(key)
    if view is not None:
        return view
    typestr = _PADDLE_HOST_TYPESTR[str(t.dtype).rsplit(".", 1)[-1]]
    if strides is not None:
        strides = tuple(s * int(typestr[2:]) for s in strides)
    view = np.asarray(_Interface(ptr, shape, typestr, strides))
    return _remember(_host_views, key, view)


def _torch_host(t) -> np.ndarray:
    import torch
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return canonical(t.numpy())


def host_view(x) -> np.ndarray:
    """Canonical NumPy view of a CPU tensor (shares memory; writable when the tensor is)."""
    if isinstance(x, np.ndarray):
        return canonical(x)
    fw = framework(x)
    if fw == "paddle":
        return _paddle_host(x)
    if fw == "torch":
        return _torch_host(x)
    if hasattr(x, "__dlpack__"):
        a = np.from_dlpack(x)
        if not a.flags.writeable:   # NumPy < 2 marks DLPack imports read-only
            ai = a.__array_interface__
            a = np.asarray(_Interface(ai["data"][0], a.shape, ai["typestr"], a.strides))
        return canonical(a)
    return canonical(np.asarray(x))


# --------------------------------------------------------------------------- device


def _cuda_interface(x):
    """(cache key, __cuda_array_interface__ dict with bf16 as '<u2'), for any CUDA tensor."""
    fw = framework(x)
    if fw == "torch":
        import torch
        bf16 = x.dtype == torch.bfloat16
        key = (x.data_ptr(), x.shape, x.dtype, None if x.is_contiguous() else x.stride())
        make = lambda: dict((x.view(torch.int16) if bf16 else x.detach()).__cuda_array_interface__)
    elif fw == "paddle":
        import paddle
        bf16 = x.dtype == paddle.bfloat16
        key = (x.data_ptr(), tuple(x.shape), x.dtype, tuple(x.strides))
        make = lambda: dict(x.__cuda_array_interface__)
    else:
        cai = x.__cuda_array_interface__
        bf16 = False
        key = (cai["data"][0], tuple(cai["shape"]), cai["typestr"], cai.get("strides"))
        make = lambda: dict(cai)
    return key, bf16, make


def device_view(x):
    """Numba device array over a CUDA tensor's memory (float16 native, bf16 as uint16)."""
    from numba import config, cuda
    fw = framework(x)
    if fw == "numpy" and config.ENABLE_CUDASIM:
        return x.view(np.uint16) if x.dtype.name == "bfloat16" else x   # simulator: host memory
    if fw == "numba" and cuda.is_cuda_array(x):
        return x
    key, bf16, make = _cuda_interface(x)
    view = _device_views.get(key)
    if view is not None:
        return view
    cai = make()
    if bf16:
        cai["typestr"] = "<u2"
    cai.pop("stream", None)      # ordering: the kernels run on the caller's stream (dispatch.py)
    view = cuda.from_cuda_array_interface(cai, owner=None, sync=False)
    return _remember(_device_views, key, view)


def clear_caches():
    """Forget all cached views (e.g. after freeing and reallocating a KV cache)."""
    _host_views.clear()
    _device_views.clear()


_streams: dict = {}


def cuda_stream(x):
    """The Numba stream for the current stream of the framework that owns ``x``.

    torch and CuPy queue work on their current stream, Paddle on its own
    compute stream; launching there keeps our kernels ordered after the
    kernels that produced ``x``.
    """
    from numba import cuda
    fw = framework(x)
    if fw == "torch":
        import torch
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # fast; public API below
        ptr = raw(x.get_device()) if raw else torch.cuda.current_stream(x.device).cuda_stream
    elif fw == "paddle":
        import paddle
        ptr = paddle.device.current_stream().cuda_stream
    elif fw == "cupy":
        import cupy
        ptr = cupy.cuda.get_current_stream().ptr
    else:
        ptr = 0
    stream = _streams.get(ptr)
    if stream is None:
        stream = 0 if ptr == 0 else cuda.external_stream(ptr)   # 0: the default stream
        _streams[ptr] = stream
    return stream
