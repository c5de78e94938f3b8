"""Where the engine runs: the device, the attention backend, and a warm-up step that proves both.

``device="auto"`` takes the GPU only when the whole GPU stack is there
(`gpu_stack_problem`): Paddle built with CUDA and seeing a GPU, and
``numba-cuda`` importable and seeing the driver (the attention kernels are
``numba.cuda`` kernels). Otherwise it runs on the CPU and logs why.
``device="gpu"`` with an incomplete stack is an error naming the missing piece.

``attention_backend`` (`resolve_attention_backend`): ``auto`` follows the
tensors; ``cpu`` and ``reference`` read host memory, so they need the CPU;
``cuda`` needs the GPU, or Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``),
where CPU tensors stand in for device memory and the CUDA kernels run as
Python threads (how CI runs the engine on the CUDA kernels).

`warm_up` runs one short prefill and one decode through the model on a
throwaway cache right after loading, so that a broken stack fails in
``LLM(...)`` with its cause instead of turning every request into
``finish_reason="error"``, and so that the kernels are compiled before the
first request.
"""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import paddle

from .attention import AttentionMetadata

logger = logging.getLogger("engine")

INSTALL = "docs/GPU.md: paddlepaddle-gpu from Paddle's own package index, then pip install -e '.[cuda]'"


def gpu_stack_problem() -> str | None:
    """Why the GPU path cannot run here, or None when Paddle, the GPU and numba-cuda are all present."""
    if not paddle.is_compiled_with_cuda():
        return f"Paddle is built without CUDA (PyPI's paddlepaddle is the CPU build; {INSTALL})"
    if paddle.device.cuda.device_count() < 1:
        return "Paddle is built with CUDA but sees no GPU"
    if importlib.util.find_spec("numba_cuda") is None:
        return f"numba-cuda is not installed: the CUDA attention kernels need it ({INSTALL})"
    try:
        from numba import cuda

        available = cuda.is_available()
    except Exception as exc:  # a broken driver or toolkit raises here, not later
        return f"numba.cuda cannot start: {type(exc).__name__}: {exc}"
    if not available:
        return "numba-cuda sees no CUDA driver or GPU"
    return None


def _simulator() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def resolve_device(device: str) -> str:
    """``auto`` / ``cpu`` / ``gpu`` -> ``cpu`` or ``gpu`` (see the module docstring)."""
    if device == "cpu":
        return "cpu"
    problem = gpu_stack_problem()
    if device == "gpu":
        if problem:
            raise ValueError(f"device='gpu' cannot run here: {problem}. Use device='cpu' or 'auto'.")
        return "gpu"
    if problem is None:
        return "gpu"
    log = logger.warning if paddle.is_compiled_with_cuda() else logger.info
    log("device='auto' runs on the CPU: %s", problem)
    return "cpu"


def resolve_attention_backend(requested: str, device: str) -> tuple[str, str | None]:
    """``(name shown in snapshots, gpu_kernels backend passed to every call)``; None follows the tensors."""
    if requested == "auto":
        return ("cuda" if device == "gpu" else "cpu"), None
    if requested == "cuda" and device == "cpu" and not _simulator():
        raise ValueError("attention_backend='cuda' needs device='gpu' (on the CPU it runs only in Numba's CUDA "
                         "simulator, NUMBA_ENABLE_CUDASIM=1); accepted on the CPU: auto, cpu, reference")
    if requested in ("cpu", "reference") and device == "gpu":
        raise ValueError(f"attention_backend={requested!r} reads host memory and the KV cache is on the GPU; "
                         "accepted with device='gpu': auto, cuda")
    return requested, requested


def _check_finite(logits) -> None:
    if not np.isfinite(logits.numpy()).all():
        raise FloatingPointError("the step's logits are not finite")


def warm_up(runner, device: str, num_tokens: int = 4, stage=lambda name: None) -> None:
    """A ``num_tokens`` prefill and a one-token decode through ``runner``'s model on a throwaway cache,
    then one decode through the fused CPU decode step where it serves (``cpu_decode="fused"``).

    Same block size, KV dtype and attention backend as the engine's steps, so
    the kernels it compiles are the ones serving uses. Raises RuntimeError
    with the cause when the step fails or its logits are not finite. ``stage(name)`` is called as
    each part starts (`compile_progress.STAGES`: what a first run compiles there).
    """
    layers, kv_heads, head_dim = runner.model.kv_layout()
    kv_dtype = runner.kv_caches[0][0].dtype
    bs = runner.block_size
    num_blocks = -(-(num_tokens + 1) // bs)
    shape = [num_blocks, kv_heads, bs, head_dim]
    caches = [(paddle.zeros(shape, dtype=kv_dtype), paddle.zeros(shape, dtype=kv_dtype)) for _ in range(layers)]
    table = paddle.to_tensor(np.arange(num_blocks, dtype=np.int32)[None])  # block i holds positions i*bs...
    try:
        with paddle.no_grad():
            for lo, hi, part in ((0, num_tokens, "prefill"), (num_tokens, num_tokens + 1, "decode")):
                stage(part)
                positions = paddle.to_tensor(np.arange(lo, hi, dtype=np.int64))
                meta = AttentionMetadata(
                    positions=positions, slot_mapping=positions, block_tables=table,
                    context_lens=paddle.to_tensor(np.array([hi], dtype=np.int32)),
                    query_start_loc=paddle.to_tensor(np.array([0, hi - lo], dtype=np.int32)),
                    decode_only=hi - lo == 1, num_tokens=hi - lo, backend=runner.attention_backend)
                hidden = runner.model.forward(paddle.zeros([hi - lo], dtype="int64"), positions, meta, caches)
                _check_finite(runner.model.compute_logits(hidden[-1:]))
            if runner.fused_decode is not None:
                stage("fused decode")
                # The fused CPU decode kernel reads the engine's own cache: one token at slot 0,
                # which nothing has used yet (the pool is empty at load; later steps overwrite it).
                zero = paddle.to_tensor(np.zeros(1, dtype=np.int64))
                meta = AttentionMetadata(
                    positions=zero, slot_mapping=zero, block_tables=paddle.to_tensor(np.zeros((1, 1), np.int32)),
                    context_lens=paddle.to_tensor(np.ones(1, np.int32)),
                    query_start_loc=paddle.to_tensor(np.array([0, 1], np.int32)),
                    decode_only=True, num_tokens=1, backend=runner.attention_backend)
                _check_finite(runner.model.compute_logits(runner.fused_decode.forward(zero, meta)))
    except Exception as exc:
        raise RuntimeError(f"the warm-up step on device={device!r}, attention_backend="
                           f"{runner.attention_backend or 'auto'!r} failed: "
                           f"{type(exc).__name__}: {exc}") from exc
