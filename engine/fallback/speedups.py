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
    under AMP autocast).

`apply_speedups` returns the names of the classes it sped up.
"""

from __future__ import annotations

import types

import paddle


def _rms_norm_forward(self, hidden_states):
    """``paddleformers.nn.norm.RMSNorm.forward`` with fuse_rms_norm off, squaring by multiplication."""
    h32 = hidden_states if hidden_states.dtype == paddle.float32 else hidden_states.astype("float32")
    variance = (h32 * h32).mean(-1, keepdim=True)
    out = paddle.rsqrt(variance + self.variance_epsilon) * hidden_states
    if self.weight.dtype in (paddle.float16, paddle.bfloat16):
        out = out.astype(self.weight.dtype)
    return out * self.weight


def _gemma3_rms_norm_forward(self, x):
    """``Gemma3RMSNorm.forward``: float32 normalisation, scaled by ``1 + weight``, cast back."""
    x32 = x if x.dtype == paddle.float32 else x.astype("float32")
    out = x32 * paddle.rsqrt((x32 * x32).mean(-1, keepdim=True) + self.eps)
    out = out * (1.0 + self.weight.astype("float32"))
    return out if x.dtype == paddle.float32 else out.astype(x.dtype)


def _speedups() -> dict[type, object]:
    from paddleformers.nn.norm import RMSNorm

    table = {RMSNorm: _rms_norm_forward}
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
    return sorted(applied)
