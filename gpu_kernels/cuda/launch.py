"""Kernel launches with cached argument marshalling.

``kernel[grid, block, stream](*args)`` in numba-cuda re-derives every
argument's Numba type and re-flattens every array into its launch
parameters (pointer, shape, strides, ...) on each call: tens of microseconds
per array, over 100 µs for the decode kernel's 14 arguments. The KV caches,
scratch buffers and (within a step) the metadata arrays are the same device
array objects call after call (``interop`` caches the views), so
:class:`Launcher` remembers, per array object, its Numba type and flattened
parameters, and per argument-type signature the compiled kernel; a launch is
then one call into ``cuda.core``.

The first launch of a signature goes through Numba's own path (which also
compiles). If this numba-cuda lacks the internals used here, or the
simulator is active, every launch takes Numba's path.

A launcher made with ``shared=n`` gives each block ``n`` bytes of dynamic
shared memory; it first opts the compiled kernel in (needed above 48 KB)
(``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``, through the driver
bindings numba-cuda uses).
"""
from __future__ import annotations

import numpy as np

from .primitives import SIMULATED

try:                                     # numba-cuda >= 0.2x launches through cuda.core
    from cuda.core import LaunchConfig
    from cuda.core import launch as _core_launch
    from numba.cuda.typing.typeof import Purpose, typeof
except ImportError:                      # pragma: no cover - older numba: no fast path
    _core_launch = None

_MAX_ARRAYS = 512
_SCALARS = {}


def _scalar_entry(pytype):
    """(None, Numba type, ctypes converter) for a NumPy scalar type (float32, int32, ...)."""
    entry = _SCALARS.get(pytype)
    if entry is None:
        import ctypes
        ty = typeof(pytype(0), Purpose.argument)
        converter = {np.float32: ctypes.c_float, np.float64: ctypes.c_double,
                     np.int32: ctypes.c_int32, np.int64: ctypes.c_int64}[pytype]
        entry = _SCALARS[pytype] = (None, ty, converter)
    return entry


class Launcher:
    """Wraps one ``cuda.jit`` dispatcher; ``launcher(grid, block, stream, *args)``."""

    fast = _core_launch is not None and not SIMULATED

    def __init__(self, dispatcher, shared=0):
        self.dispatcher = dispatcher
        self.shared = shared     # dynamic shared memory bytes per block
        self._opted_in = set()   # argument-type signatures whose kernel may use `shared`
        self._kernels = {}       # tuple of Numba argument types -> (kernel, cuda.core kernel)
        self._arrays = {}        # id(array) -> (array, numba type, flattened parameters)
        self._configs = {}       # numba launch configuration -> cuda.core LaunchConfig

    def __call__(self, grid, block, stream, *args):
        if not Launcher.fast:
            self._numba_launch(grid, block, stream, args)
            return
        try:
            self._launch(grid, block, stream, args)
        except (AttributeError, TypeError, ImportError, KeyError):
            Launcher.fast = False             # internals differ: use Numba's path from now on
            self._numba_launch(grid, block, stream, args)

    def _numba_launch(self, grid, block, stream, args):
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

    def _array(self, a, stream):
        entry = self._arrays.get(id(a))
        if entry is None or entry[0] is not a:
            ty = typeof(a, Purpose.argument)
            entry = (a, ty, None)
            if len(self._arrays) >= _MAX_ARRAYS:
                self._arrays.clear()
            self._arrays[id(a)] = entry
        return entry

    def _launch(self, grid, block, stream, args):
        entries = []
        for a in args:
            if isinstance(a, (np.floating, np.integer)):
                entries.append(_scalar_entry(type(a)))
            else:
                entries.append(self._array(a, stream))
        key = tuple([id(e[1]) for e in entries])      # Numba types are interned: ids suffice
        compiled = self._kernels.get(key)
        if compiled is None:
            self._numba_launch(grid, block, stream, args)          # compiles and launches
            try:
                kernel = self.dispatcher.overloads[tuple(e[1] for e in entries)]
                self._kernels[key] = (kernel, kernel._codelibrary.get_cufunc().kernel)
            except (AttributeError, KeyError):
                Launcher.fast = False
            return
        kernel, cukernel = compiled
        params = []
        for ty, a, entry in zip(kernel.argument_types, args, entries):
            flat = entry[2]
            if entry[0] is None:                                # scalar: entry[2] converts
                params.append(flat(a))
                continue
            if flat is None:
                flat = []
                kernel._prepare_args(ty, a, stream, [], flat)
                self._arrays[id(a)] = (a, entry[1], flat)
            params.extend(flat)
        launch_config = self.dispatcher.configure(grid, block, stream)   # lru-cached
        config = self._configs.get(launch_config)
        if config is None:
            config = self._configs[launch_config] = LaunchConfig(
                grid=launch_config.griddim, block=launch_config.blockdim, shmem_size=self.shared)
        _core_launch(launch_config.stream, config, cukernel, *params)


def allow_dynamic_shared(cufunc, nbytes):
    """Let a compiled kernel (numba-cuda's function object) use ``nbytes`` of dynamic shared
    memory per block: ``cuKernelSetAttribute`` for a library kernel, else ``cuFuncSetAttribute``."""
    from cuda.bindings import driver as drv
    from numba import cuda
    attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    handle = getattr(cufunc, "handle", None) or cufunc.kernel._handle
    if isinstance(handle, drv.CUfunction):
        err, = drv.cuFuncSetAttribute(handle, attr, nbytes)
    else:                                    # cuda.core loads kernels through cuLibrary
        if not isinstance(handle, drv.CUkernel):
            handle = drv.CUkernel(int(handle))
        device = drv.CUdevice(cuda.get_current_device().id)
        err, = drv.cuKernelSetAttribute(attr, nbytes, handle, device)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot allow {nbytes} bytes of dynamic shared memory: {err}")


_launchers: dict = {}


def launcher(dispatcher, shared=0) -> Launcher:
    """The (cached) :class:`Launcher` of a dispatcher (``shared``: dynamic shared bytes)."""
    found = _launchers.get(dispatcher)
    if found is None:
        found = _launchers[dispatcher] = Launcher(dispatcher, shared)
    return found

