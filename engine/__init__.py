"""In-process LLM inference engine on PaddlePaddle: paged KV cache, prefix caching,
continuous batching, chunked prefill, preemption, sampling with logprobs."""

import warnings

# Importing Paddle warns "No ccache found" (about building C++ extensions, which this project
# never does) on every start; that one message is silenced, before the first Paddle import.
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning,
                        module=r"paddle\.utils\.cpp_extension")

from .config import EngineConfig, add_engine_args, config_from_args
from .llm import LLM
from .llm_process import LLMProcess
from .outputs import CompletionOutput, RequestOutput, StreamDelta
from .request import Logprob, RequestMetrics
from .sampling_params import SamplingParams

from .logs import undo_paddle_root_logging  # noqa: E402  (after the imports above, which import Paddle)

undo_paddle_root_logging()

__all__ = [
    "LLM", "LLMProcess", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "StreamDelta",
    "Logprob", "RequestMetrics", "add_engine_args", "config_from_args",
]
