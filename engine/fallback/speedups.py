"""Faster, mathematically identical forwards for a few PaddleFormers layer classes.

Like vLLM's Transformers backend, which swaps the library's RMSNorm and
linear layers for its own, the fallback may give borrowed layers the
engine's implementation of the same computation. Only classes listed here
are touched, matched by class (not by model), and only their ``forward``
on our model instances; the formulas are the library's own, written so that
Paddle's CPU kernels run them fast:

``paddleformers.nn.norm.RMSNorm`` (Llama, Phi3, ...) and Gemma 3's ``Gemma3RMSNorm`` (and
``Gemma3RMSNormPipe``, its final norm)
    square with ``x * x`` instead of ``x.pow(2)`` (Paddle's CPU ``pow``
    kernel is ~50x slower than a multiply: 1.4 ms vs 13 µs on a 128 x 576
    tensor; the native RMSNorm squares by multiplying too), and skip the
    ``auto_cast(False)`` guard (~40 µs per call; the engine never runs
    under AMP autocast). Float32 on the CPU: one Numba pass per row
    (``gpu_kernels.cpu.norms``) instead of Paddle's five ops, the mean
    of squares summed in float64 (agrees to float32 rounding).

``paddle.nn.Linear`` (weights no GGUF block format holds, e.g. Q6_K)
    float32 products of a prefill's many rows on the CPU through BLAS
    (``engine.block_linear.float_matmul``), as the block-quantized linears
    do; Paddle's CPU matmul is several times slower.

``paddleformers.nn.mlp.MLP`` (Llama, Qwen2/3, ERNIE 4.5, Gemma 3's ``Gemma3MLP``)
    with a SiLU or tanh-GELU activation on float32 CPU rows: the fused gate/up product (the
    library's ``up_gate_proj``, or `fusion`'s fused linear behind ``gate_proj``/``up_proj``)
    goes through one Numba pass, ``act(gate) * up`` (``gpu_kernels.cpu.gated``: the fused decode
    step's own routine, its vector ``exp`` within a few units in the last place of libm's),
    instead of a chunk that copies both halves, the activation and the product: 1.3 -> 0.4 ms
    for a 257 x 2 x 2048 product. Other activations, ``fuse_swiglu`` and other devices run the
    library's forward.

Two module functions are replaced too. In the modeling modules of Gemma 3, Llama, Qwen2 and
Qwen3, ``apply_rotary_pos_emb(q, k, cos, sin)`` is ``x * cos + rotate_half(x) * sin`` with
``cos``/``sin`` ``[batch, seq, head_dim]`` unsqueezed to broadcast over the heads and
``rotate_half(x) = concat(-x[..., half:], x[..., :half])``: on float32 CPU tensors `_rope` runs
it as one Numba pass (``gpu_kernels.cpu.rope``; the same products and sum per element, so
bit-identical): 0.39 ms for a 4 x 257 x 256 query and its 1 x 257 x 256 key, where the library's
ops take 6.4 ms and the same ops on ``cos``/``sin`` expanded first 3.3 ms. Elsewhere it
expands ``cos``/``sin`` to each tensor's shape first (Paddle's kernel for the broadcast over a
size-1 dimension between full ones is the slower part) and applies the same formula with the
module's own ``rotate_half``. And
``masking_utils.prepare_sliding_window_startend_row_indices`` (the row indices of a
sliding-window layer, ``min(start[j], window + j)`` for every query row ``j``) loops over
the rows in Python with Paddle scalar ops, 9.6 ms for a 257-token pack; `_sliding_rows` is
the same ``min`` over the whole column at once in NumPy (0.17 ms, identical integers). Both replace the
attribute of the library's module, for every model of those modules in the process.

`apply_speedups` returns the names of the classes (and modules) it sped up.
"""

from __future__ import annotations

import math
import types

import numpy as np
import paddle

from gpu_kernels.cpu.block_matmul import SMALL_T
from gpu_kernels.cpu.gated import GELU_TANH, SILU, gated_rows
from gpu_kernels.cpu.norms import rms_norm
from gpu_kernels.cpu.rope import rope_rotate_half
from gpu_kernels.interop import host_view

from ..block_linear import float_matmul, on_host_float32


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


def _gemma3_rms_norm_pipe_forward(self, x):
    """``Gemma3RMSNormPipe.forward`` (Gemma 3's final norm): the first of a tuple, then `_gemma3_rms_norm_forward`."""
    return _gemma3_rms_norm_forward(self, x[0] if isinstance(x, tuple) else x)


def _linear_forward(self, x):
    """``paddle.nn.Linear.forward`` (``x @ W + b``, W ``[in, out]``); many float32 CPU rows through BLAS."""
    if on_host_float32(x, self.weight) and math.prod(x.shape) > SMALL_T * self.weight.shape[0]:
        y = float_matmul(x, self.weight)
        return y if self.bias is None else y + self.bias
    return paddle.nn.functional.linear(x, self.weight, self.bias)


def _gated_activation(act_fn) -> int | None:
    """``gpu_kernels.cpu.gated``'s code for the MLP's activation module, or None (not one it runs)."""
    from paddleformers.transformers.activations import PaddleGELUTanh, SiLUActivation

    if type(act_fn) in (paddle.nn.Silu, SiLUActivation):
        return SILU
    if type(act_fn) is PaddleGELUTanh or (type(act_fn) is paddle.nn.GELU and act_fn._approximate):
        return GELU_TANH
    return None


def _gate_up_product(mlp, x):
    """The MLP's ``[..., gate | up]`` product of ``x``: its own fused linear, or `fusion`'s behind
    ``gate_proj``/``up_proj``; None when the halves come from separate linears."""
    from .fusion import ProjectionSlice

    if mlp.fuse_up_gate:
        return getattr(mlp, mlp.gate_up_proj_name)(x)
    gate, up = mlp.gate_proj, mlp.up_proj
    if (type(gate) is ProjectionSlice and type(up) is ProjectionSlice and gate._fused is up._fused
            and gate.lo == 0 and gate.hi == up.lo and up.hi == 2 * gate.hi == gate._fused.bounds[-1]):
        return gate._fused.product(x)
    return None


def _mlp_forward(self, x):
    """``paddleformers.nn.mlp.MLP.forward``: ``down(act(gate) * up)``, the activation of float32 CPU rows
    in one pass over the fused gate/up product (module docstring)."""
    kind = _gated_activation(self.act_fn)
    if kind is None or self.fuse_swiglu or x.dtype != paddle.float32 or not x.place.is_cpu_place():
        return type(self).forward(self, x)
    gate_up = _gate_up_product(self, x)
    if gate_up is None:
        return type(self).forward(self, x)
    if gate_up.dtype != paddle.float32 or not gate_up.is_contiguous():
        gate, up = gate_up.chunk(2, axis=-1)
        return self.down_proj(self.act_fn(gate) * up)
    width = gate_up.shape[-1] // 2
    act = paddle.empty(gate_up.shape[:-1] + [width], dtype="float32")
    gated_rows(host_view(gate_up).reshape(-1, 2 * width), kind, host_view(act).reshape(-1, width))
    return self.down_proj(act)


ROPE_MODULES = ("gemma3_text", "llama", "qwen2", "qwen3")


def _cpu_rope(x, cos, sin):
    out = paddle.empty(x.shape, dtype="float32")
    rope_rotate_half(host_view(x), host_view(cos), host_view(sin), host_view(out))
    return out


def _rope(original, rotate_half):
    """``apply_rotary_pos_emb`` of a module: float32 CPU tensors in one Numba pass, others with the
    broadcasts over the heads expanded first (module docstring)."""

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        if unsqueeze_dim != 1 or q.ndim != 4 or cos.ndim != 3 or any(
                t.dtype != paddle.float32 for t in (q, k, cos, sin)):
            return original(q, k, cos, sin, position_ids, unsqueeze_dim)
        if (all(t.place.is_cpu_place() for t in (q, k, cos, sin)) and q.shape[-1] % 2 == 0
                and cos.shape == sin.shape and cos.shape[0] in (1, q.shape[0])
                and cos.shape[1:] == q.shape[2:] and k.shape[2:] == q.shape[2:]):
            return _cpu_rope(q, cos, sin), _cpu_rope(k, cos, sin)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return tuple(x * cos.expand(x.shape) + rotate_half(x) * sin.expand(x.shape) for x in (q, k))

    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


def _sliding_rows(original):
    """``masking_utils.prepare_sliding_window_startend_row_indices``: start row ``j`` becomes
    ``min(start, window + j)``, the whole column at once (module docstring)."""

    def prepare_sliding_window_startend_row_indices(startend_row_indices, window_size=5):
        if startend_row_indices is None or window_size is None or startend_row_indices.ndim != 4:
            return original(startend_row_indices, window_size)
        rows = startend_row_indices.numpy()
        if rows.shape[3] > 2:
            return original(startend_row_indices, window_size)  # the library's own refusal
        out = rows.copy()
        out[..., 0] = np.minimum(rows[..., 0], window_size + np.arange(rows.shape[2]))
        return paddle.to_tensor(out, place=startend_row_indices.place)

    prepare_sliding_window_startend_row_indices.original = original
    return prepare_sliding_window_startend_row_indices


def _patch_sliding_rows(model: paddle.nn.Layer) -> str | None:
    """Replace ``prepare_sliding_window_startend_row_indices`` if ``model``'s config has sliding layers."""
    from paddleformers.transformers import masking_utils

    config = getattr(model, "config", None)
    if getattr(config, "sliding_window", None) is None or "sliding_attention" not in (
            getattr(config, "layer_types", None) or ()):
        return None
    current = masking_utils.prepare_sliding_window_startend_row_indices
    if not hasattr(current, "original"):
        masking_utils.prepare_sliding_window_startend_row_indices = _sliding_rows(current)
    return "masking_utils.prepare_sliding_window_startend_row_indices"


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
    from paddleformers.nn.mlp import MLP
    from paddleformers.nn.norm import RMSNorm

    table = {RMSNorm: _rms_norm_forward, paddle.nn.Linear: _linear_forward, MLP: _mlp_forward}
    try:
        from paddleformers.transformers.gemma3_text.modeling import Gemma3MLP, Gemma3RMSNorm, Gemma3RMSNormPipe

        table[Gemma3RMSNorm] = _gemma3_rms_norm_forward
        table[Gemma3RMSNormPipe] = _gemma3_rms_norm_pipe_forward
        table[Gemma3MLP] = _mlp_forward
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
    functions = [_patch_rope(model), _patch_sliding_rows(model)]
    return sorted(applied) + [f for f in functions if f]
