"""What start-up says while Numba compiles the kernels: a bar, the kernel, an estimate.

The CPU kernels are Numba functions with ``cache=True``: the first run after an install compiles
about thirty of them during the engine's warm-up (80 s on an idle 2-core machine, several minutes
under load) and keeps them in Numba's disk cache, from which every later start loads them in a
second. `compile_progress` shows that compilation as a tqdm bar over the warm-up's stages, each
weighted by its share of a cold compile (`STAGES`), with the kernel being compiled in the
description and the time left at the pace of the stages done so far. It listens to Numba's own ``numba:compile``
event (numba/core/dispatcher.py, ``Dispatcher.compile``: fired on a cache miss only), so a start
that finds every kernel in the cache shows nothing.

The bar is the loaders' (`load_progress`): in a terminal it stays as one line saying how long
compiling took; in a Jupyter kernel it is a widget whose output becomes that line as text when it
closes (no stderr in the cell, no widget left for a saved notebook).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from numba.core import event
from numba.core.caching import NullCache
from tqdm.auto import tqdm as auto_tqdm
from tqdm.notebook import tqdm_notebook

from .loader.progress import load_progress

# The warm-up's stages with their share (%) of a cold compile: SmolLM2 on the default fused CPU
# decode, 293 s in all on the 2-core machine at load 8 (16 + 109 + 21 + 118 + 29 s).
# (The runner: the fused decode step's lists of weights; prefill and decode: one step each through
# the model; fused decode: one step through the fused CPU decode step.)
STAGES = {"runner": 5, "prefill": 37, "decode": 7, "fused decode": 41, "sampler": 10}
DESCRIPTION = "first run, compiling kernels"


class CompileProgress(event.Listener):
    """The bar of one warm-up: `stage` marks where the warm-up is; Numba's compile events draw it."""

    def __init__(self, stages: dict[str, int] = STAGES):
        self._stages = dict(stages)
        self._lock = threading.Lock()
        self._done, self._stage = 0, None      # weight of the stages finished; the stage running now
        self._bar, self._depth, self._kernel = None, 0, ""
        self._quiet = False         # the kernel compiling now is one Numba compiles on every start
        self._shown_at = self._stage_ended = 0.0      # when the bar appeared; when the last stage ended
        self.kernels = 0                      # top-level kernels compiled (their callees not counted)

    def stage(self, name: str) -> None:
        """The warm-up starts stage ``name`` (a key of the stages), the one before it is done."""
        if name not in self._stages:
            raise ValueError(f"unknown warm-up stage {name!r}; known: {', '.join(self._stages)}")
        with self._lock:
            if self._stage is not None:
                self._done += self._stages[self._stage]
                self._stage_ended = time.monotonic()
            self._stage, self._kernel = name, ""
            if self._bar is not None:
                self._bar.update(self._done - self._bar.n)
                self._describe()

    def on_start(self, ev) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                dispatcher = ev.data["dispatcher"]
                # a kernel Numba cannot cache (sync.close_step calls a ctypes pointer) compiles on every
                # start, in a blink: not a first run's
                self._quiet = isinstance(dispatcher._cache, NullCache)
                if self._quiet:
                    return
                function = dispatcher.py_func
                self._kernel = f"{function.__module__.rsplit('.', 1)[-1]}.{function.__qualname__}"
                self.kernels += 1
            elif self._quiet:
                return
            if self._bar is None:
                in_notebook = issubclass(auto_tqdm, tqdm_notebook)
                self._shown_at = self._stage_ended = time.monotonic()
                self._bar = load_progress(total=sum(self._stages.values()), initial=self._done,
                                          desc=self._description(), leave=not in_notebook, dynamic_ncols=True,
                                          bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed}{postfix}")
            self._describe()      # also a callee's start: the elapsed time moves on during a long kernel

    def on_end(self, ev) -> None:
        with self._lock:
            self._depth -= 1

    def _description(self) -> str:
        return (DESCRIPTION + (f" ({self._stage})" if self._stage else "") +
                (f": {self._kernel}" if self._kernel else ""))

    def _left(self) -> str:
        """The time left, at the pace of the stages finished since the bar appeared (tqdm's own estimate
        would count the running stage's time without its share)."""
        done = self._done - self._bar.initial
        if done <= 0:
            return "estimating the time left after this stage"
        now = time.monotonic()
        left = (self._stage_ended - self._shown_at) / done * (self._bar.total - self._done) - (now - self._stage_ended)
        return f"about {self._bar.format_interval(left)} left" if left >= 1 else "a little longer than estimated"

    def _describe(self) -> None:
        self._bar.set_postfix_str(self._left(), refresh=False)
        self._bar.set_description(self._description(), refresh=True)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.update(self._bar.total - self._bar.n)
                self._bar.set_postfix_str("", refresh=False)
                self._bar.set_description(f"first run, compiled {self.kernels} kernels (Numba keeps them cached)",
                                          refresh=False)
                self._bar.close()
                self._bar = None


@contextlib.contextmanager
def compile_progress(stages: dict[str, int] = STAGES) -> Iterator[CompileProgress]:
    """``with compile_progress() as progress:`` the warm-up, calling ``progress.stage(name)`` as it
    goes: a bar while Numba compiles, nothing when every kernel comes from its cache."""
    progress = CompileProgress(stages)
    try:
        with event.install_listener("numba:compile", progress):
            yield progress
    finally:
        progress.close()
