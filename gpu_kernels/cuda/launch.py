"""Kernel launches with the kernel parameters packed once per argument tuple.

``kernel[grid, block, stream](*args)`` in numba-cuda re-derives every
argument's Numba type, re-flattens every array into its launch parameters
(meminfo, parent, size, itemsize, pointer, shape, strides) and converts each
to a ctypes object on every call: about 100 parameters for the decode
kernel's 14 arguments. The KV caches, scratch buffers and the metadata of a
step are the same device array objects call after call (``interop`` caches
the views), so :class:`Launcher` packs, per tuple of argument objects, the
``void *kernelParams[]`` array that ``cuLaunchKernel`` takes, keeps it, and
on later calls only rewrites the scalar arguments in place; a launch is then
one ``cuLaunchKernel`` through ``cuda.bindings`` (the driver bindings
numba-cuda itself uses). The packed entry holds its arguments, so the ids in
its key cannot be reused while it exists.

The first launch of an argument-type signature goes through Numba's own
path (which also compiles). If this numba-cuda lacks the internals used
here, or the simulator is active, every launch takes Numba's path.

A launcher made with ``shared=n`` gives each block ``n`` bytes of dynamic
shared memory; it first opts the compiled kernel in (needed above 48 KB)
(``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``).
"""
from __future__ import annotations

import ctypes

import numpy as np

from .primitives import SIMULATED, simulated_launch

try:
    from cuda.bindings import driver as _drv
    from numba.cuda.typing.typeof import Purpose, typeof
    _SUCCESS = _drv.CUresult.CUDA_SUCCESS
except ImportError:                      # older numba-cuda, or numba's built-in simulator
    _drv = None

_MAX_BOUND = 256
_INTERNALS = (AttributeError, TypeError, ImportError, KeyError, NotImplementedError)
_SCALARS = {np.float32: ctypes.c_float, np.float64: ctypes.c_double, np.int32: ctypes.c_int32,
            np.int64: ctypes.c_int64}
_scalar_types: dict = {}


def _scalar_type(pytype):
    ty = _scalar_types.get(pytype)
    if ty is None:
        ty = _scalar_types[pytype] = typeof(pytype(0), Purpose.argument)
    return ty


class _Bound:
    """The packed ``kernelParams`` of one tuple of arguments (kept alive here)."""
    __slots__ = ("args", "params", "array", "address", "scalars", "function")

    def __init__(self, args, params, scalars, function):
        self.args = args                  # keeps the arguments (and so their ids) alive
        self.params = params              # the ctypes objects the pointers point at
        self.array = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
        self.address = ctypes.addressof(self.array)
        self.scalars = scalars            # (argument index, ctypes object) rewritten per launch
        self.function = function


def _as_ctypes(param):
    """One flattened array field as a ctypes object. Every field of Numba's array struct
    (meminfo, parent, nitems, itemsize, data, shape, strides) is pointer-sized."""
    if isinstance(param, ctypes._SimpleCData):
        return param
    if isinstance(param, np.generic):
        return np.ctypeslib.as_ctypes_type(param.dtype)(param.item())
    value = getattr(param, "value", param)              # ctypes-like pointer wrappers
    return ctypes.c_int64(int(value or 0))


class Launcher:
    """Wraps one ``cuda.jit`` dispatcher; ``launcher(grid, block, stream, *args)``."""

    fast = _drv is not None and not SIMULATED
    fallback = None          # why launches took Numba's path, once they do

    def __init__(self, dispatcher, shared=0):
        self.dispatcher = dispatcher
        self.shared = shared     # dynamic shared memory bytes per block
        self._opted_in = set()   # argument-type signatures whose kernel may use `shared`
        self._kernels = {}       # tuple of Numba argument types -> (kernel, CUfunction)
        self._bound = {}         # ids of arrays / types of scalars -> _Bound
        self._configs = {}       # (grid, block, stream) -> cuLaunchKernel's launch arguments

    def __call__(self, grid, block, stream, *args):
        if not Launcher.fast:
            self._numba_launch(grid, block, stream, args)
            return
        key = tuple([type(a) if type(a) in _SCALARS else id(a) for a in args])
        bound = self._bound.get(key)
        if bound is None:
            try:
                bound = self._bind(stream, args, key)      # None: signature not compiled yet
            except _INTERNALS as exc:
                _give_up(exc)                               # internals differ: Numba's path
            if bound is None:
                self._numba_launch(grid, block, stream, args)   # compiles on first use
                if Launcher.fast:
                    try:
                        self._remember_kernel(args)
                    except _INTERNALS as exc:
                        _give_up(exc)
                return
        for i, slot in bound.scalars:
            slot.value = args[i]
        config = self._configs.get((grid, block, stream))
        if config is None:
            config = self._config(grid, block, stream)
        err, = _drv.cuLaunchKernel(bound.function, *config, bound.address, 0)
        if err != _SUCCESS:
            raise RuntimeError(f"cuLaunchKernel of {self.dispatcher.__name__}: {err}")

    def _numba_launch(self, grid, block, stream, args):
        if SIMULATED:
            with simulated_launch():
                self.dispatcher[grid, block, stream, self.shared](*args)
            return
        if not self.shared:
            self.dispatcher[grid, block, stream](*args)
            return
        self._opt_in(args)
        self.dispatcher[grid, block, stream, self.shared](*args)

    def _opt_in(self, args):
        """Compile for ``args`` and allow ``self.shared`` bytes of dynamic shared memory."""
        sig = tuple(typeof(a, Purpose.argument) for a in args)
        if sig in self._opted_in:
            return
        kernel = self.dispatcher.compile(sig)
        allow_dynamic_shared(kernel._codelibrary.get_cufunc(), self.shared)
        self._opted_in.add(sig)

    @staticmethod
    def _types(args):
        return tuple(_scalar_type(type(a)) if type(a) in _SCALARS else typeof(a, Purpose.argument)
                     for a in args)

    def _remember_kernel(self, args):
        types = self._types(args)
        kernel = self.dispatcher.overloads[types]
        self._kernels[types] = (kernel, _function(kernel._codelibrary.get_cufunc()))

    def _bind(self, stream, args, key):
        """Pack the launch parameters of ``args`` (None if their signature is not compiled)."""
        compiled = self._kernels.get(self._types(args))
        if compiled is None:
            return None
        kernel, function = compiled
        params, scalars = [], []
        for i, (ty, a) in enumerate(zip(kernel.argument_types, args)):
            if type(a) in _SCALARS:
                slot = _SCALARS[type(a)](a)
                scalars.append((i, slot))
                params.append(slot)
                continue
            flat = []
            kernel._prepare_args(ty, a, stream, [], flat)
            if len(flat) != 5 + 2 * a.ndim:
                raise TypeError(f"numba-cuda flattened a {a.ndim}-d array into {len(flat)} "
                                "parameters, not the 5 + 2 ndim of Numba's array struct")
            params.extend(_as_ctypes(p) for p in flat)
        if len(self._bound) >= _MAX_BOUND:
            self._bound.clear()
        bound = self._bound[key] = _Bound(args, params, scalars, function)
        return bound

    def _config(self, grid, block, stream):
        """(grid x, y, z, block x, y, z, shared bytes, CUstream) for cuLaunchKernel."""
        dims = [(d, 1, 1) if isinstance(d, int) else tuple(d) + (1,) * (3 - len(d))
                for d in (grid, block)]
        handle = 0
        if stream:
            handle = stream.handle
            handle = getattr(handle, "value", handle) or 0
        config = (*dims[0], *dims[1], self.shared, _drv.CUstream(int(handle)))
        if len(self._configs) >= _MAX_BOUND:
            self._configs.clear()
        self._configs[(grid, block, stream)] = config
        return config


def _give_up(exc):
    Launcher.fast = False
    Launcher.fallback = f"{type(exc).__name__}: {exc}"


def _handle(cufunc):
    """The driver handle of numba-cuda's compiled function: CUfunction, or CUkernel (cuLibrary)."""
    handle = getattr(cufunc, "handle", None) or cufunc.kernel._handle
    if isinstance(handle, (_drv.CUfunction, _drv.CUkernel)):
        return handle
    return _drv.CUkernel(int(handle))


def _function(cufunc):
    """The CUfunction to launch in the current context."""
    handle = _handle(cufunc)
    if isinstance(handle, _drv.CUfunction):
        return handle
    err, function = _drv.cuKernelGetFunction(handle)
    if err != _SUCCESS:
        raise RuntimeError(f"cuKernelGetFunction: {err}")
    return function


def allow_dynamic_shared(cufunc, nbytes):
    """Let a compiled kernel (numba-cuda's function object) use ``nbytes`` of dynamic shared
    memory per block: ``cuFuncSetAttribute`` for a function, ``cuKernelSetAttribute`` for a
    library kernel."""
    from numba import cuda
    attr = _drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    handle = _handle(cufunc)
    if isinstance(handle, _drv.CUfunction):
        err, = _drv.cuFuncSetAttribute(handle, attr, nbytes)
    else:
        device = _drv.CUdevice(cuda.get_current_device().id)
        err, = _drv.cuKernelSetAttribute(attr, nbytes, handle, device)
    if err != _SUCCESS:
        raise RuntimeError(f"cannot allow {nbytes} bytes of dynamic shared memory: {err}")


_launchers: dict = {}


def launcher(dispatcher, shared=0) -> Launcher:
    """The (cached) :class:`Launcher` of a dispatcher (``shared``: dynamic shared bytes)."""
    found = _launchers.get(dispatcher)
    if found is None:
        found = _launchers[dispatcher] = Launcher(dispatcher, shared)
    return found
