"""`exit_without_teardown`: end a process whose work is done without the interpreter's teardown.

Once the server is closed and the engine shut down, a normal exit still frees every object of
Paddle, Gradio and the model one by one (module teardown, then Paddle's C++ destructors): 1-4 s
of a stop, more on a busy machine, for memory the OS takes back anyway. The ``atexit`` handlers
(logging's flush, Gradio's and ``tempfile``'s clean-ups, multiprocessing's finalizers) still run
first; only the teardown after them is skipped. Used where a command or the engine's process ends.
"""

from __future__ import annotations

import atexit
import os
import sys


def exit_without_teardown(code: int = 0) -> None:
    """Run the ``atexit`` handlers, flush stdout and stderr, and end the process with ``code``."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):   # closed or replaced by something without a flush
            pass
    os._exit(code)
