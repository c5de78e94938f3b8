"""`gpu_kernels.cpu.kernel_cache`: a cached kernel that calls a function of another file of the
package is compiled anew after an edit to that file alone (Numba's own stamp, the kernel's file,
kept serving the old machine code). Each run is a new process, which loads the disk cache."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = textwrap.dedent("""
    import sys
    import gpu_kernels.cpu.kernel_cache as kc
    if sys.argv[2] == "package":   # the package's locators for the files there (else Numba's own serve them)
        kc.PACKAGE_DIR = sys.argv[1]
    sys.path.insert(0, sys.argv[1])
    import caller
    print(caller.kernel(0))
""")


def _run(directory, locators):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", RUN, str(directory), locators], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("locators, after_edit", [("package", 2), ("numba", 1)])
def test_an_edit_to_a_called_file_recompiles_the_caller(tmp_path, locators, after_edit):
    (tmp_path / "helper.py").write_text("from numba import njit\n\n@njit\ndef value(x):\n    return x + 1\n")
    (tmp_path / "caller.py").write_text("from numba import njit\nfrom helper import value\n\n"
                                        "@njit(cache=True)\ndef kernel(x):\n    return value(x)\n")
    assert _run(tmp_path, locators) == 1
    assert list((tmp_path / "__pycache__").glob("caller.kernel-*.nbi"))   # cached on disk
    (tmp_path / "helper.py").write_text("from numba import njit\n\n@njit\ndef value(x):\n    return x + 2\n")
    # Numba's own stamp (caller.py's) still matches: the stale code; the package's stamp does not
    assert _run(tmp_path, locators) == after_edit
