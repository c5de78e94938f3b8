"""Engine settings: one dataclass, the same names as ``LLM(...)`` kwargs and CLI flags."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

MODEL_IMPLS = ("auto", "native", "paddleformers", "paddlefleet")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "gpu")
ATTENTION_BACKENDS = ("auto", "cpu", "cuda", "reference")
QUANTIZATION_MODES = ("auto", "none")
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class EngineConfig:
    """Everything that shapes the engine, validated on construction.

    ``kv_cache_memory`` is either bytes (> 1) or a fraction (0 < f <= 1) of the
    device's total memory, as vLLM's ``gpu_memory_utilization``: the GPU's total
    memory, or on CPU the machine's total physical RAM (not what is free now, so
    the same setting gives the same cache on every run). It is checked before any
    weights load; a cache too small for one ``max_model_len`` sequence is an
    error that names the minimum.

    ``quantization="auto"`` keeps a GGUF checkpoint's Q4_0/Q4_1/Q8_0 linear
    weights in their blocks too and runs CPU matmuls on them
    (``engine.block_linear``: same weights, a quarter of the bytes to read);
    ``"none"`` runs every matmul on the dequantized float weights.

    ``attention_backend`` picks the ``gpu_kernels`` backend of every attention
    call: ``auto`` follows the tensors (CUDA kernels for GPU tensors, Numba CPU
    kernels else); ``cuda`` on ``device="cpu"`` runs only in Numba's CUDA
    simulator (``NUMBA_ENABLE_CUDASIM=1``); see ``engine.device``.
    """

    model: str = DEFAULT_MODEL
    model_impl: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: float = 256 * 1024**2
    enable_prefix_caching: bool = True
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    device: str = "auto"
    quantization: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        _choice("model_impl", self.model_impl, MODEL_IMPLS)
        _choice("dtype", self.dtype, DTYPES)
        _choice("device", self.device, DEVICES)
        _choice("quantization", self.quantization, QUANTIZATION_MODES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _positive_int("block_size", self.block_size)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if (isinstance(self.kv_cache_memory, bool) or not isinstance(self.kv_cache_memory, (int, float))
                or not math.isfinite(self.kv_cache_memory) or self.kv_cache_memory <= 0):
            raise ValueError(
                f"kv_cache_memory must be bytes (> 1) or a fraction in (0, 1] of the device's total memory; "
                f"got {self.kv_cache_memory!r}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False; got {self.enable_prefix_caching!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0; got {self.seed!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a zoo name, a .gguf path or an HF model directory; got {self.model!r}")

    def kv_cache_bytes(self, device_bytes: int) -> int:
        """Resolve ``kv_cache_memory`` against the memory available for it."""
        if self.kv_cache_memory <= 1:
            return int(self.kv_cache_memory * device_bytes)
        return int(self.kv_cache_memory)


def _choice(name, value, accepted):
    if value not in accepted:
        raise ValueError(f"{name} must be one of {', '.join(accepted)}; got {value!r}")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``EngineConfig`` field as a ``--kebab-case`` flag."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="zoo name, .gguf path or HF model directory")
    g.add_argument("--model-impl", default="auto", choices=MODEL_IMPLS)
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=float, default=EngineConfig.kv_cache_memory,
                   help="bytes, or a fraction (0, 1] of the device's total memory (CPU: total RAM)")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True)
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    g.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--device", default="auto", choices=DEVICES)
    g.add_argument("--quantization", default="auto", choices=QUANTIZATION_MODES,
                   help="auto: CPU matmuls run on a GGUF's Q4_0/Q4_1/Q8_0 blocks; none: float weights only")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="auto: follow the tensors (cuda on GPU, cpu else); reference: the NumPy definition")
    g.add_argument("--seed", type=int, default=0)
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build an ``EngineConfig`` from parsed ``add_engine_args`` flags."""
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})

