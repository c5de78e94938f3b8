"""llama.cpp (through ``llama-cpp-python``) as the peer of the engine's CPU numbers.

Both sides get the same GGUF file, the same token ids and the same thread
count, and are measured the same way:

* **prefill tok/s** -- one prompt of real text evaluated from an empty cache
  (``Llama.eval`` / the engine's TTFT with prefix caching off);
* **single-stream decode tok/s** -- ``1 / median`` of the intervals between
  consecutive generated tokens (greedy, one request).

Install the peer with ``pip install -e ".[bench]"`` (it builds llama.cpp from source).
"""

from __future__ import annotations

import os
import statistics
import time

INSTALL = 'pip install -e ".[bench]"  (llama-cpp-python, builds llama.cpp from source)'


def available() -> str | None:
    """llama-cpp-python's version, or None when it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.__version__


class LlamaCppPeer:
    """One ``llama_cpp.Llama`` on a GGUF file, greedy, ``threads`` threads."""

    def __init__(self, path: str, threads: int, n_ctx: int = 2048):
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=512, verbose=False)

    def prefill_tok_s(self, tokens: list[int], repeats: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            self.llm.reset()
            t0 = time.perf_counter()
            self.llm.eval(tokens)
            best = min(best, time.perf_counter() - t0)
        return len(tokens) / best

    def decode(self, prompt: list[int], n: int) -> tuple[list[float], list[int]]:
        """Intervals between consecutive generated tokens (s) and the tokens, greedy."""
        times, out = [], []
        self.llm.reset()
        for tok in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            out.append(tok)
            if len(out) == n:
                break
        return [b - a for a, b in zip(times, times[1:])], out

    def decode_tok_s(self, prompt: list[int], n: int, repeats: int) -> tuple[float, list[int]]:
        gaps, tokens = [], []
        for _ in range(repeats):
            g, tokens = self.decode(prompt, n)
            gaps += g
        return 1.0 / statistics.median(gaps), tokens

    def close(self) -> None:
        self.llm.close()


def threads() -> int:
    """The thread count both sides use: the cores this process may run on."""
    return len(os.sched_getaffinity(0))
