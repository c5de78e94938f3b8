"""GGUF weights kept in their quantized blocks, for the engine's block-quantized matmul.

In the Q4_0, Q4_1 and Q8_0 formats every weight of a block of 32 consecutive
inputs is ``scale * code + offset`` with a small integer ``code`` and one
``scale`` (and, for Q4_1, one ``offset``) per block:

| format | bytes per block | code | offset |
|---|---|---|---|
| Q8_0 | 2 + 32 | int8 | 0 |
| Q4_0 | 2 + 16 | nibble - 8 | 0 |
| Q4_1 | 2 + 2 + 16 | nibble | f16 ``m`` |
| Q5_0 | 2 + 4 + 16 | nibble + 16 x high bit - 16 | 0 |
| Q4_K | (2 + 2 + 12 + 128) / 8 | nibble | ``-dmin * m_j`` |
| Q6_K | (128 + 64 + 16 + 2) / 8 | 6 bits - 32 | 0 (a scale per 16 inputs) |

Q4_K is a "K-quant": a super-block of 256 inputs holds f16 ``d`` and ``dmin`` and,
per block ``j`` of 32, 6-bit ``sc_j`` and ``m_j``; its weights are
``(d * sc_j) * q - dmin * m_j``, i.e. the blocks of 32 above with scale
``d * sc_j`` and offset ``-dmin * m_j`` (computed in float32, as gguf computes them).

`BlockQuantized` holds those codes as int8 (one byte per weight instead of
four) with float32 scales and offsets; `dequantize` gives back exactly the
float32 values ``gguf.quants.dequantize`` produces, so a matmul on the
blocks computes with the same weights as one on the dequantized tensor.
Q6_K is a K-quant with a scale per 16 inputs: a super-block of 256 holds f16 ``d``,
16 int8 ``sc_j`` and 6-bit ``q``; its weights are ``(d * sc_j) * (q - 32)``. It is
kept as int8 codes ``q - 32`` with a scale per 16 (``scales`` then has two per
block of 32 codes, and the kernels scale each half on its own: `gpu_kernels.cpu.block_dot`).
Other formats (Q5_1, Q5_K, ...) are not kept (`unpack` returns None) and run on
their float weights.

Every transformation the loaders apply to linear weights permutes or
concatenates *rows* (outputs): `map_rows` and `concat_rows` apply them to
the blocks (`combine_rows` when they take several weights).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT

from .gguf_names import hf_name, undo_rope_permutation

BLOCK = 32
KEPT_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")
SUPER = 256  # inputs per K-quant super-block


@dataclass(frozen=True)
class BlockQuantized:
    """A ``[out, in]`` weight as ``scales[o, g] * code + offsets[o, g]``: codes in blocks of 32 inputs,
    a scale and an offset per ``group`` inputs (32, or 16 for Q6_K)."""

    codes: np.ndarray    # int8    [out, in // 32, 32]
    scales: np.ndarray   # float32 [out, in // group]
    offsets: np.ndarray  # float32 [out, in // group] (zeros for Q4_0 / Q8_0 / Q6_K)
    kind: str            # GGUF format name, "+"-joined after concatenating different ones

    @property
    def group(self) -> int:
        """Inputs per scale: 32, or 16."""
        return self.codes.shape[1] * BLOCK // self.scales.shape[1]

    def in_groups_of_16(self) -> "BlockQuantized":
        """The same weight with a scale (and offset) per 16 inputs: each block's repeated, exactly."""
        if self.group == 16:
            return self
        return BlockQuantized(self.codes, np.repeat(self.scales, 2, axis=1), np.repeat(self.offsets, 2, axis=1),
                              self.kind)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.offsets.nbytes

    def dequantize(self) -> np.ndarray:
        """float32 ``[out, in]``, computed as GGUF's own dequantization does."""
        out, groups = self.scales.shape
        codes = self.codes.reshape(out, groups, -1).astype(np.float32)
        return (self.scales[..., None] * codes + self.offsets[..., None]).reshape(self.shape)

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> "BlockQuantized":
        """Apply a row operation (reorder, reshape along outputs) to codes, scales and offsets alike."""
        return combine_rows([self], fn)


def combine_rows(parts: list[BlockQuantized], fn: Callable[..., np.ndarray]) -> BlockQuantized:
    """Apply a row operation that takes several weights (``fn(*arrays)``) to codes, scales and offsets."""
    kinds = dict.fromkeys(p.kind for p in parts)
    return BlockQuantized(*(np.ascontiguousarray(fn(*(getattr(p, f) for p in parts)))
                            for f in ("codes", "scales", "offsets")), "+".join(kinds))


def concat_rows(parts: list[BlockQuantized]) -> BlockQuantized:
    """Stack weights along outputs (fused projections such as Q/K/V or gate/up); parts with a scale per
    16 inputs and parts with one per 32 stack with a scale per 16 throughout."""
    if len({p.group for p in parts}) > 1:
        parts = [p.in_groups_of_16() for p in parts]
    return combine_rows(parts, lambda *arrays: np.concatenate(arrays))


def unpack(raw: np.ndarray, tensor_type: QT, shape: tuple[int, ...]) -> BlockQuantized | None:
    """The blocks of a 2-D GGUF tensor (``raw``: its bytes), or None when its format is not kept."""
    if tensor_type.name not in KEPT_FORMATS or len(shape) != 2 or shape[1] % BLOCK:
        return None
    rows, nblk = shape[0], shape[1] // BLOCK
    if tensor_type == QT.Q4_K:
        codes, scales, offsets = _q4_k(np.ascontiguousarray(raw).view(np.uint8).reshape(rows * nblk // 8, -1))
        return BlockQuantized(codes.reshape(rows, nblk, BLOCK), scales.reshape(rows, nblk),
                              offsets.reshape(rows, nblk), tensor_type.name)
    if tensor_type == QT.Q6_K:
        if shape[1] % SUPER:
            return None
        codes, scales = _q6_k(np.ascontiguousarray(raw).view(np.uint8).reshape(rows * nblk // 8, -1))
        return BlockQuantized(codes.reshape(rows, nblk, BLOCK), scales.reshape(rows, 2 * nblk),
                              np.zeros((rows, 2 * nblk), np.float32), tensor_type.name)
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows * nblk, -1)
    scales = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    offsets = np.zeros_like(scales)
    if tensor_type == QT.Q8_0:
        codes = blocks[:, 2:].copy().view(np.int8)
    elif tensor_type == QT.Q5_0:  # f16 d, 32 high bits (bit j: input j), 16 bytes of low nibbles
        high = (blocks[:, 2:6].copy().view(np.uint32) >> np.arange(BLOCK, dtype=np.uint32)) & 1
        packed = blocks[:, 6:]
        low = np.concatenate([packed & 0x0F, packed >> 4], axis=1)
        codes = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
    else:
        if tensor_type == QT.Q4_1:
            offsets = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        packed = blocks[:, -BLOCK // 2:]
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.int8)  # low nibbles first
        if tensor_type == QT.Q4_0:
            codes -= 8
    return BlockQuantized(codes.reshape(rows, nblk, BLOCK), scales.reshape(rows, nblk),
                          offsets.reshape(rows, nblk), tensor_type.name)


def _q4_k(supers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks (uint8 ``[n, 144]``) -> codes int8 ``[n * 8, 32]``, scales and offsets ``[n * 8]``
    (``gguf.quants.Q4_K``'s layout: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, then 4 runs
    of 32 bytes, each the low nibbles of block 2i and the high nibbles of block 2i + 1)."""
    from gguf.quants import Q4_K

    n = supers.shape[0]
    d = supers[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = supers[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(supers[:, 4:16].copy())
    qs = supers[:, 16:].reshape(n, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n * 8, BLOCK).astype(np.int8)
    scales = (d * sc.astype(np.float32)).reshape(-1)
    offsets = -(dmin * m.astype(np.float32)).reshape(-1)
    return codes, scales, offsets


def _q6_k(supers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks (uint8 ``[n, 210]``) -> codes int8 ``[n * 256]`` (``q - 32``) and scales ``[n * 16]``
    (``d * sc_j``, a scale per 16 inputs), unpacked as ``gguf.quants.Q6_K.dequantize_blocks`` does: 128
    bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, f16 ``d``."""
    n = supers.shape[0]
    ql, qh, sc, d = supers[:, :128], supers[:, 128:192], supers[:, 192:208], supers[:, 208:210]
    scales = (d.copy().view(np.float16).astype(np.float32) * sc.copy().view(np.int8).astype(np.float32))
    low = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(0x03)
    codes = (low.reshape(n, -1, 32) | (high.reshape(n, -1, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
    return codes.reshape(-1), scales.reshape(-1)


def iter_gguf_blocks(f, config: dict) -> Iterator[tuple[str, BlockQuantized]]:
    """``(hf_name, blocks)`` for every 2-D tensor of GGUF file ``f`` in a kept format, rows
    ordered as the float loader orders them (llama.cpp's Q/K RoPE permutation undone)."""
    for tensor in f.tensors.values():
        blocks = unpack(tensor.raw(f.buf), tensor.tensor_type, tensor.shape)
        if blocks is not None:
            yield hf_name(tensor.name, f.architecture), blocks.map_rows(
                lambda a: undo_rope_permutation(tensor.name, f.architecture, config, a))
