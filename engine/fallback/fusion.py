"""Q/K/V and gate/up of a borrowed model fused into one linear each, at load.

FastDeploy lists "QKV and gate+up fusion" among what makes its PaddleFormers
backend fast; here it is done to the library's modules without rewriting
their forwards. Where a layer owns ``q_proj``/``k_proj``/``v_proj`` (or an
MLP ``gate_proj``/``up_proj``) as plain ``paddle.nn.Linear`` reading the same
input, their weights are concatenated once, in that order, into one
`FusedLinear` (``[in, q + k + v]``, biases and quantized blocks
(``engine.block_linear``) concatenated the same way) kept on the parent as
``fused_qkv`` / ``fused_gate_up``, and the original attributes become
`ProjectionSlice` s: calling ``q_proj(x)`` runs the one fused matmul and
returns its ``q`` columns; ``k_proj(x)`` and ``v_proj(x)`` on the *same*
tensor ``x`` (how every decoder layer calls them) reuse that product. A call
on another tensor computes again, so the result never depends on the call
pattern, only the speed does. The separate weights are dropped: memory is
unchanged.

The library's forwards stay the definition of the architecture; the fused
weights are also exactly what the engine's fused CPU decode step reads
(``q | k | v`` and ``gate | up`` along outputs, as the native model stores
them; `captured`).

Models that the library already builds fused (Gemma 3 and ERNIE 4.5 own a
``qkv_proj`` and an ``up_gate_proj``) have nothing to fuse.
"""

from __future__ import annotations

import numpy as np
import paddle

from ..block_linear import BlockWeight
from ..loader.gguf_blocks import concat_rows

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


class FusedLinear(paddle.nn.Layer):
    """Several ``paddle.nn.Linear`` of one input as one ``[in, sum(out)]`` linear (remembers its last product)."""

    def __init__(self, parts: list[paddle.nn.Linear]):
        super().__init__()
        self.widths = [int(p.weight.shape[1]) for p in parts]
        self.bounds = np.cumsum([0] + self.widths).tolist()
        self.weight = self.create_parameter(
            [int(parts[0].weight.shape[0]), self.bounds[-1]], dtype=parts[0].weight.dtype,
            default_initializer=paddle.nn.initializer.Assign(paddle.concat([p.weight for p in parts], axis=1)))
        self.bias = None
        if parts[0].bias is not None:
            self.bias = self.create_parameter(
                [self.bounds[-1]], dtype=parts[0].bias.dtype, is_bias=True,
                default_initializer=paddle.nn.initializer.Assign(paddle.concat([p.bias for p in parts])))
        blocks = [getattr(p, "block_weight", None) for p in parts]
        self.block_weight = None
        if blocks[0] is not None:
            self.block_weight = BlockWeight(concat_rows([b.blocks for b in blocks]))
        self._memo: tuple[paddle.Tensor, paddle.Tensor] | None = None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.block_weight is not None and self.block_weight.accepts(x):
            y = self.block_weight.matmul(x, self.weight)
        else:
            y = paddle.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias

    def product(self, x: paddle.Tensor) -> paddle.Tensor:
        """``forward(x)``, computed once for consecutive calls on the same tensor ``x``."""
        memo = self._memo
        if memo is not None and memo[0] is x:
            return memo[1]
        y = self.forward(x)
        self._memo = (x, y)
        return y

    def forget(self) -> None:
        """Drop the remembered product (and the input it holds)."""
        self._memo = None


class ProjectionSlice(paddle.nn.Layer):
    """Part ``index`` of a `FusedLinear`: the columns the replaced linear produced."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        self.__dict__["_fused"] = fused  # not a sublayer: the parent owns it once
        self.lo, self.hi = fused.bounds[index], fused.bounds[index + 1]
        self.in_features, self.out_features = int(fused.weight.shape[0]), self.hi - self.lo

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self._fused.product(x)[..., self.lo:self.hi]


def _fusable(parent: paddle.nn.Layer, names: tuple[str, ...]) -> list[paddle.nn.Linear] | None:
    parts = [getattr(parent, n, None) for n in names]
    if not all(type(p) is paddle.nn.Linear for p in parts):
        return None
    if len({int(p.weight.shape[0]) for p in parts}) != 1 or len({p.weight.dtype for p in parts}) != 1:
        return None
    if len({p.bias is None for p in parts}) != 1:
        return None
    blocks = [getattr(p, "block_weight", None) for p in parts]
    if len({b is None for b in blocks}) != 1:  # some quantized, some not: leave them be
        return None
    return parts


def fuse_projections(model: paddle.nn.Layer) -> dict[str, int]:
    """Fuse every fusable Q/K/V and gate/up group of ``model``; how many of each were fused."""
    counts = {"fused_qkv": 0, "fused_gate_up": 0}
    for _, layer in list(model.named_sublayers(include_self=True)):
        for names, attr in ((QKV, "fused_qkv"), (GATE_UP, "fused_gate_up")):
            parts = _fusable(layer, names)
            if parts is None:
                continue
            fused = FusedLinear(parts)
            setattr(layer, attr, fused)
            for i, name in enumerate(names):
                setattr(layer, name, ProjectionSlice(fused, i))
            counts[attr] += 1
    return counts


def forget_products(model: paddle.nn.Layer) -> None:
    """Release every fused linear's remembered product (end of a step)."""
    for layer in model.sublayers():
        if isinstance(layer, FusedLinear):
            layer.forget()
