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
                  Paddle reports bfloat16 as ``<f2`` (like float16) and torch
                  not at all, so bf16 becomes ``<u2``; strides travel as given
CPU tensors,      under ``NUMBA_ENABLE_CUDASIM=1`` the host view in the device
simulator         representation (device memory is host memory there)
================  ==========================================================

Kernels launch on the current stream of the framework that owns the query
(`framework_stream_handle`: the CUDA stream protocol ``__cuda_stream__`` where
the framework's stream object offers it).

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
from numba import config as _config

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


def _paddle_device_interface(t):
    """(cache key, ``__cuda_array_interface__``) of a Paddle CUDA tensor, bf16 as ``<u2``.

    Paddle reports bfloat16 *and* float16 as ``<f2``, byte strides for a
    non-contiguous tensor (``None`` when contiguous), and raises
    ``RuntimeError`` for a tensor that requires grad; such a tensor is read
    through ``detach()`` (same memory). See ``Tensor.__cuda_array_interface__``
    in ``paddle/base/dygraph/tensor_patch_methods.py``.
    """
    import paddle
    if not t.stop_gradient:
        t = t.detach()
    key = (t.data_ptr(), tuple(t.shape), str(t.dtype), tuple(t.strides))
    cai = dict(t.__cuda_array_interface__)
    if t.dtype == paddle.bfloat16:
        cai["typestr"] = "<u2"
    return key, cai


def _device_key(x, fw):
    """The cache key of a CUDA tensor's view (pointer, shape, dtype, strides), read without
    building its ``__cuda_array_interface__`` (torch and Paddle build that dict in Python)."""
    if fw == "torch":
        return (x.data_ptr(), x.shape, x.dtype, x.stride())
    if fw == "paddle":      # dtypes are singletons: id() is a cheap, stable key
        return (x.data_ptr(), tuple(x.shape), id(x.dtype), tuple(x.strides))
    cai = x.__cuda_array_interface__
    return (cai["data"][0], tuple(cai["shape"]), cai["typestr"], cai.get("strides"))


def _device_interface(x, fw):
    """``__cuda_array_interface__`` of any CUDA tensor, bf16 as ``<u2``."""
    if fw == "paddle":
        return _paddle_device_interface(x)[1]
    if fw == "torch":
        import torch
        t = x.detach()
        bf16 = t.dtype == torch.bfloat16
        cai = dict((t.view(torch.int16) if bf16 else t).__cuda_array_interface__)
        if bf16:                 # the int16 view reports '<i2'; bf16 travels as uint16
            cai["typestr"] = "<u2"
        return cai
    return dict(x.__cuda_array_interface__)


def _simulated_view(x) -> np.ndarray:
    """Under ``NUMBA_ENABLE_CUDASIM=1`` device memory is host memory: the device representation
    (float16 as ``float16``, bf16 as ``uint16``) of a host array or CPU tensor, shared.

    The simulator only launches on contiguous arrays, so a strided input (a
    query viewed out of a fused QKV buffer) is copied; a strided *output* would
    lose its writes, and the engine allocates none. (On a GPU the strides
    travel in the ``__cuda_array_interface__``.)
    """
    if isinstance(x, np.ndarray):
        a = x.view(np.uint16) if x.dtype.name == "bfloat16" else x
    else:
        a = host_view(x)
        a = a.view(np.float16) if a.dtype == np.int16 and _is_half(x) else a
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _is_half(x) -> bool:
    return str(x.dtype).rsplit(".", 1)[-1] == "float16"


def device_view(x):
    """Numba device array over a CUDA tensor's memory (float16 native, bf16 as uint16).

    A cached view costs its key (four attribute reads on a torch tensor) and a dict lookup."""
    fw = _framework_of_type.get(type(x)) or framework(x)
    if _config.ENABLE_CUDASIM and not is_cuda(x):
        return _simulated_view(x)
    if fw == "numba":
        from numba import cuda
        if cuda.is_cuda_array(x):
            return x
    key = _device_key(x, fw)
    view = _device_views.get(key)
    if view is not None:
        return view
    from numba import cuda
    cai = _device_interface(x, fw)
    cai.pop("stream", None)      # ordering: the kernels run on the caller's stream (dispatch.py)
    view = cuda.from_cuda_array_interface(cai, owner=None, sync=False)
    return _remember(_device_views, key, view)


# --------------------------------------------------------------------------- streams


def stream_protocol_handle(stream) -> int | None:
    """The ``cudaStream_t`` an object offers through the CUDA stream protocol, else None.

    The protocol (``__cuda_stream__() -> (version, handle)``, version 0) is
    offered by ``paddle.device.Stream``, ``torch.cuda.Stream`` and others.
    """
    method = getattr(stream, "__cuda_stream__", None)
    if method is None:
        return None
    version, handle = method()
    if version != 0:
        raise ValueError(f"CUDA stream protocol version {version} of {type(stream).__name__} is not "
                         "version 0, the one this module reads")
    return int(handle)


def _paddle_stream_handle(t) -> int:
    """Paddle: the current stream of the tensor's GPU (``paddle.device.current_stream``).

    ``current_stream`` wants a device string or ``CUDAPlace``; a tensor's
    ``place`` is a generic ``Place``, so the device is named by its id.
    """
    import paddle
    stream = paddle.device.current_stream(f"gpu:{t.place.gpu_device_id()}")
    handle = stream_protocol_handle(stream)
    return int(stream.stream_base.cuda_stream) if handle is None else handle


def _torch_stream_handle(t) -> int:
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # fast path of torch's own kernels
    if raw is not None:
        return int(raw(t.get_device()))
    stream = torch.cuda.current_stream(t.device)
    handle = stream_protocol_handle(stream)
    return int(stream.cuda_stream) if handle is None else handle


def _cupy_stream_handle(a) -> int:
    import cupy
    stream = cupy.cuda.get_current_stream()
    handle = stream_protocol_handle(stream)
    return int(stream.ptr) if handle is None else handle


_STREAM_HANDLES = {"paddle": _paddle_stream_handle, "torch": _torch_stream_handle,
                   "cupy": _cupy_stream_handle}


def framework_stream_handle(x) -> int:
    """The raw ``cudaStream_t`` (an int) of the current stream of the framework that owns ``x``.

    torch and CuPy queue work on their current stream, Paddle on its device's
    current (compute) stream; launching there orders our kernels after the
    kernels that produced ``x``. 0 (the legacy default stream) for anything
    else: NumPy, Numba device arrays, host memory under the simulator.
    """
    handle_of = _STREAM_HANDLES.get(framework(x))
    if handle_of is None or not is_cuda(x):
        return 0
    return handle_of(x)


_streams: dict = {}


def cuda_stream(x):
    """The Numba stream for `framework_stream_handle` (0: the default stream)."""
    ptr = framework_stream_handle(x)
    stream = _streams.get(ptr)
    if stream is None:
        from numba import cuda
        stream = 0 if ptr == 0 else cuda.external_stream(ptr)
        _streams[ptr] = stream
    return stream
