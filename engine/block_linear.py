"""Linear layers that multiply on the checkpoint's own quantized blocks (CPU).

A GGUF checkpoint stores most linear weights quantized (SmolLM2: Q4_1, its
embedding / tied LM head Q8_0); the loader dequantizes them to float32 for
Paddle. On a CPU a decode step is bound by reading the weights from memory,
4 bytes each in float32. With ``quantization="auto"`` the engine also keeps
the formats it can compute on (`engine.loader.gguf_blocks`: Q4_0, Q4_1,
Q8_0) as int8 codes plus per-block scales, 1.25 bytes per weight, and
float32 inputs multiply on those (`gpu_kernels.cpu.block_matmul`: a fused
dot kernel for one row, a micro-kernel for a few). A prefill's many rows
(more than ``SMALL_T``) are a compute-bound product: where the layer still
holds its float32 weight, they multiply on it in one call to NumPy's BLAS
(`float_matmul`, threaded), which beats both dequantizing tiles and Paddle's
own CPU matmul. The weights are the same numbers either way (the blocks
dequantize exactly to the float32 tensors); only the order of the
floating-point sums differs.

`attach_blocks` gives a layer its blocks; the native ``Linear`` and the
borrowed models' ``paddle.nn.Linear`` / LM heads then route float32 inputs
through `BlockWeight.matmul`.
"""

from __future__ import annotations

import types

import numpy as np
import paddle

from gpu_kernels.cpu.block_matmul import SMALL_T, block_matmul
from gpu_kernels.cpu.float_matmul import float_matmul as host_matmul
from gpu_kernels.interop import host_view

from .loader.gguf_blocks import BlockQuantized, concat_rows


class BlockWeight:
    """A ``[out, in]`` weight in blocks; ``matmul`` computes ``x @ W.T`` for float32 CPU inputs."""

    def __init__(self, blocks: BlockQuantized):
        self.blocks = blocks
        self.codes, self.scales, self.offsets = blocks.codes, blocks.scales, blocks.offsets
        self.kind = blocks.kind
        self.out_features, self.in_features = blocks.shape

    def accepts(self, x: paddle.Tensor) -> bool:
        """Float32 input (blocks are only kept for CPU models, so ``x`` is on the CPU)."""
        return x.dtype == paddle.float32

    def matmul(self, x: paddle.Tensor, weight: paddle.Tensor | None = None) -> paddle.Tensor:
        """``x @ W.T`` (`host_matmul`); ``weight``: the same ``W`` as float32 ``[in, out]``, or None."""
        out = paddle.empty(list(x.shape[:-1]) + [self.out_features], dtype="float32")
        self.host_matmul(host_view(x).reshape(-1, self.in_features), None if weight is None else host_view(weight),
                         host_view(out).reshape(-1, self.out_features))
        return out

    def host_matmul(self, x: np.ndarray, weight: np.ndarray | None = None,
                    out: np.ndarray | None = None) -> np.ndarray:
        """``x @ W.T`` on host arrays (``x`` float32 ``[T, in]``): through NumPy's BLAS on ``weight`` (the same
        ``W`` as float32 ``[in, out]``), when given, for more than ``SMALL_T`` rows; else on the blocks."""
        if weight is not None and x.shape[0] > SMALL_T:
            return host_matmul(x, weight, out)
        return block_matmul(x, self.codes, self.scales, self.offsets, out)


def float_matmul(x: paddle.Tensor, weight: paddle.Tensor, transpose_y: bool = False) -> paddle.Tensor:
    """``x @ weight`` for float32 CPU tensors (``weight`` ``[in, out]``, or ``[out, in]`` with
    ``transpose_y``): NumPy's BLAS, or for a few rows times an ``[out, in]`` weight (a float LM head in
    a decode step) Numba dot products that read the weight once (`gpu_kernels.cpu.float_matmul`).

    Paddle's CPU matmul (MKL) runs a prefill's products 3-10x slower than the OpenBLAS that NumPy
    ships (e.g. a 257 x 640 by 640 x 4096 product; ``benchmarks.fallback_gemma``), and SmolLM2's
    float LM head for one row, ``[1, 576] x [576, 49152]``, in 12 ms against 3.8."""
    num_out = weight.shape[0] if transpose_y else weight.shape[1]
    out = paddle.empty(list(x.shape[:-1]) + [num_out], dtype="float32")
    host_matmul(host_view(x).reshape(-1, x.shape[-1]), host_view(weight), host_view(out).reshape(-1, num_out),
                transpose_w=transpose_y)
    return out


def on_host_float32(x: paddle.Tensor, weight: paddle.Tensor) -> bool:
    """Both tensors float32 on the CPU: the products `float_matmul` computes."""
    return x.dtype == paddle.float32 and weight.dtype == paddle.float32 and x.place.is_cpu_place()


def head_matmul(hidden: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
    """``hidden @ weight.T`` for an LM head's ``[vocab, hidden]`` weight: `float_matmul` on float32 CPU
    tensors, else Paddle's matmul."""
    if on_host_float32(hidden, weight):
        return float_matmul(hidden, weight, transpose_y=True)
    return paddle.matmul(hidden, weight, transpose_y=True)


def fused_blocks(blocks: dict[str, BlockQuantized], names: list[str]) -> BlockQuantized | None:
    """The blocks of several HF weights stacked along outputs, or None unless every one of them is kept."""
    if not names or any(n not in blocks for n in names):
        return None
    return concat_rows([blocks[n] for n in names]) if len(names) > 1 else blocks[names[0]]


def _linear_forward(self, x):
    """``paddle.nn.Linear.forward`` (``x @ W + b``, W ``[in, out]``) with float32 inputs on the blocks."""
    if self.block_weight.accepts(x):
        y = self.block_weight.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias
    return paddle.nn.functional.linear(x, self.weight, self.bias)


def attach_blocks(layer: paddle.nn.Layer, blocks: BlockQuantized | None) -> bool:
    """Give ``layer`` its weight's blocks; a ``paddle.nn.Linear`` also gets the routing forward.

    Checks the blocks dequantize to the layer's weight shape (``[in, out]`` for
    linears, ``[out, in]`` for LM heads/embeddings is the caller's business).
    """
    if blocks is None:
        return False
    layer.block_weight = BlockWeight(blocks)
    if type(layer) is paddle.nn.Linear:
        if tuple(layer.weight.shape) != (blocks.shape[1], blocks.shape[0]):
            raise ValueError(f"blocks {blocks.shape} do not fit linear weight {list(layer.weight.shape)}")
        layer.forward = types.MethodType(_linear_forward, layer)
    return True
