"""Numba's disk cache for this package's kernels, stamped with all of its sources.

Numba files a function's compiled code under the stamp (modification time and
size) of the function's own source file, and serves it while that stamp holds.
The kernels here inline functions of other files of the package (the decode
step calls the block dot products of ``block_dot`` and ``microkernel`` and the
gated activation of ``gated``): after an edit to one of those alone, the
callers' old machine code kept running. The locators below give every
function of this package one stamp, that of all its ``.py`` files, so an edit
to any of them recompiles the package's kernels on their next call. Functions
elsewhere keep Numba's own locators.

`install` puts them first in Numba's list of locators; it runs when the package
is imported, before any of its kernels is defined (a kernel picks its locator
when it is decorated).
"""
from __future__ import annotations

import glob
import os

from numba.core import caching

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def package_stamp() -> tuple:
    """(name, modification time, size) of every source file of the package, sorted by name."""
    stamp = []
    for path in sorted(glob.glob(os.path.join(PACKAGE_DIR, "*.py"))):
        st = os.stat(path)
        stamp.append((os.path.basename(path), st.st_mtime, st.st_size))
    return tuple(stamp)


class _PackageStamped:
    """A locator mixin: only this package's functions, stamped with `package_stamp`."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.dirname(os.path.abspath(py_file)) != PACKAGE_DIR:
            return None
        return super().from_function(py_func, py_file)

    def get_source_stamp(self):
        return package_stamp()


class PackageUserProvidedLocator(_PackageStamped, caching.UserProvidedCacheLocator):
    """``NUMBA_CACHE_DIR`` set: the cache there, package-stamped."""


class PackageInTreeLocator(_PackageStamped, caching.InTreeCacheLocator):
    """The cache in the package's ``__pycache__``, package-stamped."""


def install() -> None:
    """Put the package's locators ahead of Numba's own (once), in Numba's order of preference."""
    classes = caching.CacheImpl._locator_classes
    if PackageInTreeLocator not in classes:
        classes[:0] = [PackageUserProvidedLocator, PackageInTreeLocator]
