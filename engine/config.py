"""Engine settings: one dataclass, the one source of ``LLM(...)`` keyword arguments and CLI flags.

Every field carries its flag's help (and choices, and other spellings) in its metadata;
``add_engine_args`` derives the ``--kebab-case`` flags from the fields, so a default or a
description lives in one place. FastDeploy's and vLLM's names for the same settings are
accepted (``--gpu-memory-utilization``, ``--kv-cache-ratio``, ``--tensor-parallel-size``,
``--model-impl fastdeploy``, ``--no-enable-prefix-caching``), and so are their flags that have no
meaning in this engine (``--enable-chunked-prefill``, ``--engine-worker-queue-port``,
``--enable-logprob``): ``accepted_only_notes`` says once what each of those does here.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
from dataclasses import MISSING, dataclass, field, fields

MODEL_IMPLS = ("auto", "native", "fastdeploy", "paddleformers", "paddlefleet")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "gpu")
ATTENTION_BACKENDS = ("auto", "cpu", "cuda", "reference")
QUANTIZATION_MODES = ("auto", "none")
CPU_DECODE_PATHS = ("fused", "paddle")
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_KV_CACHE_BYTES = 256 * 1024**2


def _setting(default, help: str, **flag):
    """A field with its flag's description: ``help``, and argparse's ``choices``, ``flags`` (other
    spellings), ``metavar``."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass
class EngineConfig:
    """Everything that shapes the engine, validated on construction (before any weights load).

    The KV cache is sized by ``kv_cache_memory`` (bytes, or a fraction of the device's total
    memory: the GPU's, on CPU the machine's total RAM, so the same setting gives the same cache
    on every run), or on a GPU by ``gpu_memory_utilization`` when given (FastDeploy's and vLLM's
    meaning: the share of the device's memory for weights and cache together; the cache gets
    what the weights leave). A cache too small for one ``max_model_len`` sequence is an error
    that names the minimum. See each field's help (``python -m engine.entrypoints.openai.api_server
    --help``) for the rest.
    """

    model: str = _setting(DEFAULT_MODEL, "zoo name (smollm2-135m-instruct, gemma3-270m), a .gguf path or an HF "
                                         "model directory")
    model_impl: str = _setting(
        "auto", "native: this engine's own model code; paddleformers / paddlefleet: the library's model with "
        "its attention swapped for the paged kernels (FastDeploy's --model-impl); fastdeploy is FastDeploy's "
        "name for native; auto: native where the architecture has one", choices=MODEL_IMPLS)
    dtype: str = _setting("auto", "auto: bfloat16 on GPU, float32 on CPU", choices=DTYPES)
    block_size: int = _setting(16, "tokens per KV cache block (FastDeploy's default is 64, vLLM's 16)")
    kv_cache_memory: float | None = _setting(
        None, "KV cache size: bytes (> 1), or a fraction in (0, 1] of the device's total memory (on CPU: of total "
        "RAM, allocated at start); default: 256 MiB, or what one --max-model-len sequence needs when more")
    gpu_memory_utilization: float | None = _setting(
        None, "GPU: the share (0, 1] of the device's memory for weights + KV cache, the cache taking what the "
        "weights leave (FastDeploy/vLLM; overrides --kv-cache-memory). On CPU it sizes nothing: a CPU cache is "
        "allocated up front in RAM shared with everything else, so --kv-cache-memory sizes it there")
    kv_cache_ratio: float = _setting(
        1.0, "FastDeploy's admission share: new requests start only while the KV cache is less than this full, "
        "the rest stays for running requests to grow (FastDeploy's default 0.75); 1.0 admits while blocks are "
        "free, preemption making room later")
    enable_prefix_caching: bool = _setting(True, "reuse the KV blocks of earlier prompts with the same prefix",
                                           flags=("--enable-prefix-caching",))
    max_num_seqs: int = _setting(16, "most requests running at once (the rest wait)")
    max_num_batched_tokens: int = _setting(512, "token budget of one step; longer prompts are split across "
                                                "steps (chunked prefill, always on)")
    max_model_len: int | None = _setting(None, "longest sequence (prompt + output); default and upper bound: the "
                                               "model's positions and what the KV cache holds", metavar="TOKENS")
    tensor_parallel_size: int = _setting(
        1, "ranks to shard the model over (tensor parallelism: this process is rank 0 and starts the others on "
        "127.0.0.1, collectives over gloo; docs/DISTRIBUTED.md). N must divide the attention heads and the MLP, "
        "and the KV heads split into N parts or divide N; on CPU at most 2 ranks a core",
        flags=("--tensor-parallel-size", "-tp"))
    device: str = _setting("auto", "auto: the GPU when Paddle has CUDA and numba-cuda works, else the CPU",
                           choices=DEVICES)
    quantization: str = _setting("auto", "auto: CPU matmuls run on a GGUF's blocks (Q4_0/Q4_1/Q4_K/Q5_0/Q6_K/"
                                         "Q8_0); none: float weights only", choices=QUANTIZATION_MODES)
    attention_backend: str = _setting("auto", "auto: follow the tensors (cuda on GPU, cpu else); reference: the "
                                              "NumPy definition", choices=ATTENTION_BACKENDS)
    cpu_decode: str = _setting("fused", "fused: CPU decode steps of native models as one Numba kernel; paddle: "
                                        "through the Paddle layers", choices=CPU_DECODE_PATHS)
    seed: int = _setting(0, "seed of the requests that bring none")

    def __post_init__(self) -> None:
        _choice("model_impl", self.model_impl, MODEL_IMPLS)
        if self.model_impl == "fastdeploy":     # FastDeploy's name for its own (native) model code
            self.model_impl = "native"
        _choice("dtype", self.dtype, DTYPES)
        _choice("device", self.device, DEVICES)
        _choice("quantization", self.quantization, QUANTIZATION_MODES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("cpu_decode", self.cpu_decode, CPU_DECODE_PATHS)
        _positive_int("block_size", self.block_size)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1:   # the model's heads are checked against it before loading
            check_ranks_fit(self.tensor_parallel_size, self.device)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.kv_cache_memory is not None and (not _finite(self.kv_cache_memory) or self.kv_cache_memory <= 0):
            raise ValueError(
                f"kv_cache_memory must be bytes (> 1) or a fraction in (0, 1] of the device's total memory; "
                f"got {self.kv_cache_memory!r}"
            )
        if self.gpu_memory_utilization is not None and not (
                _finite(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be None or a fraction in (0, 1]; "
                             f"got {self.gpu_memory_utilization!r}")
        if not (_finite(self.kv_cache_ratio) and 0 < self.kv_cache_ratio <= 1):
            raise ValueError(f"kv_cache_ratio must be a fraction in (0, 1]; got {self.kv_cache_ratio!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False; got {self.enable_prefix_caching!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0; got {self.seed!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a zoo name, a .gguf path or an HF model directory; got {self.model!r}")

    def kv_cache_bytes(self, device: str, device_bytes: int, weight_bytes: int = 0, min_bytes: int = 0) -> int:
        """The KV cache's bytes: ``gpu_memory_utilization`` of a GPU less its weights when given, else
        ``kv_cache_memory`` (bytes, or a fraction of ``device_bytes``); when neither is set, 256 MiB or
        ``min_bytes`` (one ``max_model_len`` sequence), whichever is more."""
        if device == "gpu" and self.gpu_memory_utilization is not None:
            return max(int(self.gpu_memory_utilization * device_bytes) - weight_bytes, 0)
        if self.kv_cache_memory is None:
            return max(DEFAULT_KV_CACHE_BYTES, min_bytes)
        if self.kv_cache_memory <= 1:
            return int(self.kv_cache_memory * device_bytes)
        return int(self.kv_cache_memory)


RANKS_PER_CORE = 2  # CPU ranks may share a core (a rank waiting in gloo sleeps on its socket); not more


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_ranks_fit(world: int, device: str = "auto") -> None:
    """A ValueError for more tensor-parallel ranks than this machine runs: on the CPU at most
    ``RANKS_PER_CORE`` ranks a core. (Tensor parallelism runs on CPU ranks; a GPU is refused
    where the engine resolves the device.)"""
    cores = usable_cores()
    if device != "gpu" and world > RANKS_PER_CORE * cores:
        raise ValueError(f"tensor_parallel_size={world} is more ranks than this machine's {cores} usable core(s) "
                         f"run: at most {RANKS_PER_CORE} ranks a core, so at most {RANKS_PER_CORE * cores}")


def _finite(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _choice(name, value, accepted):
    if value not in accepted:
        raise ValueError(f"{name} must be one of {', '.join(accepted)}; got {value!r}")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


# FastDeploy's flags that have no meaning in this engine: accepted so its command lines run
# unchanged; ``accepted_only_notes`` says what each does here.
ACCEPTED_ONLY = {
    "enable_chunked_prefill": ("--enable-chunked-prefill", {"action": "store_true"},
                               "chunked prefill is always on here (see --max-num-batched-tokens)"),
    "engine_worker_queue_port": ("--engine-worker-queue-port", {"type": int, "metavar": "PORT"},
                                 "has no meaning here: the engine runs inside this process, with no worker queue"),
    "enable_logprob": ("--enable-logprob", {"action": "store_true"},
                       "logprobs are always available here (up to --max-logprobs a token)"),
}


class FlagParser(argparse.ArgumentParser):
    """The project's command lines: an unknown flag is refused with the nearest known one
    (``unknown flag --max-model-lenght; did you mean --max-model-len?``), and an error is one line,
    not argparse's usage of every flag."""

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_arguments(self, extras))
        return parsed

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


def unknown_arguments(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """What is wrong with ``extras`` (what ``parser`` did not take), naming the nearest known flag."""
    known = [flag for action in parser._actions if action.help is not argparse.SUPPRESS
             for flag in action.option_strings if flag.startswith("--")]
    flags = [arg.split("=", 1)[0] for arg in extras if arg.startswith("-") and len(arg) > 1]
    if not flags:
        return f"unexpected argument{'s' if len(extras) > 1 else ''}: {' '.join(extras)}"
    said = []
    for flag in flags:
        near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        said.append(f"unknown flag {flag}" + (f"; did you mean {near[0]}?" if near else ""))
    return "; ".join(said)


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``EngineConfig`` field as a ``--kebab-case`` flag (its default, help and choices from
    the field), and FastDeploy's accepted-only flags."""
    g = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        meta, flag = f.metadata, "--" + f.name.replace("_", "-")
        names = list(dict.fromkeys((flag, *meta.get("flags", ()))))
        kwargs = {"dest": f.name, "default": f.default if f.default is not MISSING else None,
                  "help": meta.get("help")}
        if f.type in (bool, "bool"):
            g.add_argument(*names, action=argparse.BooleanOptionalAction, **kwargs)
            if f.name == "enable_prefix_caching":       # the playground's older spelling
                g.add_argument("--no-prefix-caching", dest=f.name, action="store_false", help=argparse.SUPPRESS)
            continue
        kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(str(f.type), None)
        if kind is not None:
            kwargs["type"] = kind
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        if "metavar" in meta:
            kwargs["metavar"] = meta["metavar"]
        g.add_argument(*names, **kwargs)
    fd = parser.add_argument_group("accepted for FastDeploy's command line (no effect here)")
    for dest, (flag, kwargs, note) in ACCEPTED_ONLY.items():
        fd.add_argument(flag, dest=dest, help=note, **kwargs)
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build an ``EngineConfig`` from parsed ``add_engine_args`` flags."""
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def accepted_only_notes(args: argparse.Namespace) -> list[str]:
    """One line for each accepted-only flag given on the command line, saying what it does here."""
    notes = []
    for dest, (flag, kwargs, note) in ACCEPTED_ONLY.items():
        value = getattr(args, dest, None)
        if value not in (None, False):
            notes.append(f"{flag}: {note}")
    return notes
