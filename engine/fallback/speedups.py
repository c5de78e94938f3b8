"""Faster, mathematically identical forwards for a few PaddleFormers layer classes.

Like vLLM's Transformers backend, which swaps the library's RMSNorm and
linear layers for its own, the fallback may give borrowed layers the
engine's implementation of the same computation. Only classes listed here
are touched, matched by class (not by model), and only their ``forward``
on our model instances; the formulas are the library's own, written so that
Paddle's CPU kernels run them fast:

``paddleformers.nn.norm.RMSNorm`` (Llama, Phi3, ...) and Gemma 3's ``Gemma3RMSNorm``
    square with ``x * x`` instead of ``x.pow(2)`` (Paddle's CPU ``pow``
    kernel is ~50x slower than a multiply: 1.4 ms vs 13 µs on a 128 x 576
    tensor; the native RMSNorm squares by multiplying too), and skip the
    ``auto_cast(False)`` guard (~40 µs per call; the engine never runs
    under AMP autocast). Float32 on the CPU: one Numba pass per row
    (``gpu_kernels.cpu.norms``) instead of Paddle's five ops, the mean
    of squares summed in float64 (agrees to float32 rounding).

``paddle.nn.Linear`` (weights no GGUF block format holds, e.g. Q6_K)
    float32 products of a prefill's many rows on the CPU through NumPy's
    BLAS (``engine.block_linear.float_matmul``), as the block-quantized
    linears do; Paddle's CPU matmul is several times slower.

One module function is replaced too, in the modeling modules of Gemma 3, Llama, Qwen2 and
Qwen3, whose ``apply_rotary_pos_emb(q, k, cos, sin)`` is ``x * cos + rotate_half(x) * sin``
with ``cos``/``sin`` ``[batch, seq, head_dim]`` unsqueezed to broadcast over the heads:
Paddle's CPU kernel for that broadcast (a size-1 dimension between full ones) is ~25x slower
than expanding first (2.2 ms vs 0.09 ms for a 4 x 257 x 256 query), so `_rope` expands
``cos``/``sin`` to each tensor's shape and applies the same formula with the module's own
``rotate_half``: bit-identical results, every model of those modules in the process.

`apply_speedups` returns the names of the classes (and modules) it sped up.
"""

from __future__ import annotations

import types

import paddle

from gpu_kernels.cpu.block_matmul import SMALL_T
from gpu_kernels.cpu.norms import rms_norm
from gpu_kernels.interop import host_view

from ..block_linear import float_matmul


def _on_cpu_kernel(x, weight) -> bool:
    return x.dtype == paddle.float32 and weight.dtype == paddle.float32 and x.place.is_cpu_place()


def _cpu_rms_norm(x, weight, eps: float, offset: float):
    """The norm of float32 CPU rows in one pass (``gpu_kernels.cpu.norms``); ``offset`` 1 for ``1 + weight``."""
    dim = x.shape[-1]
    out = paddle.empty(x.shape, dtype="float32")
    rms_norm(host_view(x).reshape(-1, dim), host_view(weight), eps, offset, host_view(out).reshape(-1, dim))
    return out


def _rms_norm_forward(self, hidden_states):
    """``paddleformers.nn.norm.RMSNorm.forward`` with fuse_rms_norm off, squaring by multiplication."""
    if _on_cpu_kernel(hidden_states, self.weight):
        return _cpu_rms_norm(hidden_states, self.weight, self.variance_epsilon, 0.0)
    h32 = hidden_states if hidden_states.dtype == paddle.float32 else hidden_states.astype("float32")
    variance = (h32 * h32).mean(-1, keepdim=True)
    out = paddle.rsqrt(variance + self.variance_epsilon) * hidden_states
    if self.weight.dtype in (paddle.float16, paddle.bfloat16):
        out = out.astype(self.weight.dtype)
    return out * self.weight


def _gemma3_rms_norm_forward(self, x):
    """``Gemma3RMSNorm.forward``: float32 normalisation, scaled by ``1 + weight``, cast back."""
    if _on_cpu_kernel(x, self.weight):
        return _cpu_rms_norm(x, self.weight, self.eps, 1.0)
    x32 = x if x.dtype == paddle.float32 else x.astype("float32")
    out = x32 * paddle.rsqrt((x32 * x32).mean(-1, keepdim=True) + self.eps)
    out = out * (1.0 + self.weight.astype("float32"))
    return out if x.dtype == paddle.float32 else out.astype(x.dtype)


def _linear_forward(self, x):
    """``paddle.nn.Linear.forward`` (``x @ W + b``, W ``[in, out]``); many float32 CPU rows through BLAS."""
    if (x.dtype == paddle.float32 and self.weight.dtype == paddle.float32 and x.place.is_cpu_place()
            and x.size > SMALL_T * self.weight.shape[0]):
        y = float_matmul(x, self.weight)
        return y if self.bias is None else y + self.bias
    return paddle.nn.functional.linear(x, self.weight, self.bias)


ROPE_MODULES = ("gemma3_text", "llama", "qwen2", "qwen3")


def _rope(original, rotate_half):
    """``apply_rotary_pos_emb`` of a module, its broadcasts over the heads expanded first (float32)."""

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        if unsqueeze_dim != 1 or q.ndim != 4 or cos.ndim != 3 or any(
                t.dtype != paddle.float32 for t in (q, k, cos, sin)):
            return original(q, k, cos, sin, position_ids, unsqueeze_dim)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return tuple(x * cos.expand(x.shape) + rotate_half(x) * sin.expand(x.shape) for x in (q, k))

    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


def _patch_rope(model: paddle.nn.Layer) -> str | None:
    """Replace ``apply_rotary_pos_emb`` in ``model``'s modeling module if it is one of `ROPE_MODULES`
    (a whole model only: the module's other layers, such as its norms, leave it be)."""
    import sys

    from paddleformers.transformers.model_utils import PretrainedModel

    if not isinstance(model, PretrainedModel):
        return None
    module = sys.modules.get(type(model).__module__)
    name = getattr(module, "__name__", "")
    if not any(name == f"paddleformers.transformers.{m}.modeling" for m in ROPE_MODULES):
        return None
    current = getattr(module, "apply_rotary_pos_emb", None)
    if current is None or getattr(module, "rotate_half", None) is None:
        return None
    if not hasattr(current, "original"):
        module.apply_rotary_pos_emb = _rope(current, module.rotate_half)
    return f"{name.split('.')[-2]}.apply_rotary_pos_emb"


def _speedups() -> dict[type, object]:
    from paddleformers.nn.norm import RMSNorm

    table = {RMSNorm: _rms_norm_forward, paddle.nn.Linear: _linear_forward}
    try:
        from paddleformers.transformers.gemma3_text.modeling import Gemma3RMSNorm

        table[Gemma3RMSNorm] = _gemma3_rms_norm_forward
    except ImportError:
        pass
    return table


def apply_speedups(model: paddle.nn.Layer) -> list[str]:
    """Give every layer of a listed class (exact type, not subclasses) its faster forward."""
    table = _speedups()
    applied = set()
    for _, layer in model.named_sublayers(include_self=True):
        fast = table.get(type(layer))
        if fast is None or getattr(getattr(layer, "config", None), "fuse_rms_norm", False):
            continue  # not listed, or the library already runs a fused kernel (GPU)
        layer.forward = types.MethodType(fast, layer)
        applied.add(type(layer).__name__)
    rope = _patch_rope(model)
    return sorted(applied) + ([rope] if rope else [])
