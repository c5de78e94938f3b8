"""Backend consistency from the page: the serving backend vs the other one.

The Engine panel's backend-consistency button compares the model that
serves the chat (e.g. ``model_impl="native"``) with the same checkpoint run by
the other implementation (``paddleformers``, or ``native`` when the fallback
is serving) on the current conversation, through ``engine.align.compare_backends``. The
second engine is loaded on first use (it takes a while and its own memory)
and kept for later runs.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Aligner", "other_impl"]


def other_impl(model_impl: str) -> str:
    """The implementation to compare against the one serving."""
    return "paddleformers" if model_impl == "native" else "native"


class Aligner:
    """Lazily loads the reference engine and aligns prompts against it."""

    def __init__(self, llm: Any, *, kv_cache_memory: float = 64 * 1024**2, max_tokens: int = 16):
        self.llm = llm
        self.impl = other_impl(llm.model_impl)
        self.kv_cache_memory = kv_cache_memory
        self.max_tokens = max_tokens
        self._reference = None
        self._lock = threading.Lock()

    def reference(self) -> Any:
        """The second ``LLM`` (loaded once, on first use)."""
        from engine import LLM

        with self._lock:
            if self._reference is None:
                config = self.llm.config
                self._reference = LLM(model=config.model, model_impl=self.impl, dtype=config.dtype,
                                      device=config.device, kv_cache_memory=self.kv_cache_memory,
                                      max_num_seqs=4)
            return self._reference

    def run(self, prompt: str) -> dict:
        """Align ``prompt`` (a rendered chat prompt) and return the report as a dict."""
        from engine.align import compare_backends

        report = compare_backends(self.llm, self.reference(), [prompt], max_tokens=self.max_tokens)
        out = report.to_dict()
        out["top1_agreement"] = report.top1_agreement
        out["max_abs_logprob_diff"] = report.max_abs_logprob_diff
        out["all_greedy_identical"] = report.all_greedy_identical
        return out
