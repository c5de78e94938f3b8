"""In-process LLM inference engine on PaddlePaddle: paged KV cache, prefix caching,
continuous batching, chunked prefill, preemption, sampling with logprobs.

The public names are imported on first use (PEP 562), so ``engine.config`` and a command's
``--help`` do not wait for Paddle's import.
"""

import importlib
import os
import sys
import warnings

# NumPy's OpenBLAS reads this when NumPy loads, so it is set before NumPy is imported (an explicit
# setting is kept). After each product its worker threads then wait asleep instead of spinning
# on the cores for about 2^28 cycles, which took those cores from the Numba kernels that run next:
# a Gemma 3 prefill's attention ran 2.5 ms a layer right after the BLAS products, 1.6 without
# the spinning (engine.fused_prefill). The minimum, 4, is 2^4 cycles.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

# Importing Paddle warns "No ccache found" (about building C++ extensions, which this project
# never does) on every start; that one message is silenced, before the first Paddle import.
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning,
                        module=r"paddle\.utils\.cpp_extension")

if "paddle" in sys.modules:     # imported before the engine: take back its root-logger setup now
    from .logs import undo_paddle_root_logging

    undo_paddle_root_logging()      # (engine.llm_engine does it where the engine itself imports Paddle)

_PUBLIC = {
    "LLM": ".llm", "LLMProcess": ".llm_process", "SamplingParams": ".sampling_params", "EngineConfig": ".config",
    "RequestOutput": ".outputs", "CompletionOutput": ".outputs", "StreamDelta": ".outputs", "Logprob": ".request",
    "RequestMetrics": ".request", "add_engine_args": ".config", "config_from_args": ".config",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value
    return value
