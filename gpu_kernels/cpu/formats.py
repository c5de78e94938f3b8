"""Half-precision loads and stores for Numba CPU kernels.

Numba's CPU target has no float16 type and NumPy has no bfloat16, so CPU
kernels see half-precision data as 16-bit integers (``formats.py``):
``int16`` holds IEEE float16 bits and ``uint16`` holds bfloat16 bits.

Two generic functions hide this from the kernels; Numba picks the right code
at compile time from the element type, so there is no run-time branch:

``to_f32(x)``
    one element (float32/float64/int16-as-f16/uint16-as-bf16) -> float32.
``from_f32(v, arr)``
    a float32 value -> an element of ``arr``'s format, round to nearest even.

float16 goes through LLVM's ``half`` type (``fpext`` / ``fptrunc``), which
compiles to the F16C conversion instructions and vectorizes. bfloat16 is bit
arithmetic on the float32 pattern. The CUDA kernels have their own definitions
(``cuda/primitives.py`` says why: one PTX instruction each there).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload


@intrinsic
def _f16_bits_to_f32(typingctx, bits):
    """int16 holding IEEE half bits -> float32 (exact)."""
    def codegen(context, builder, signature, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def _f32_to_f16_bits(typingctx, value):
    """float32 -> int16 holding IEEE half bits (round to nearest even)."""
    def codegen(context, builder, signature, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))
    return types.int16(value), codegen


@intrinsic
def _u32_as_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as float32."""
    def codegen(context, builder, signature, args):
        value = args[0]
        if value.type.width != 32:
            value = builder.trunc(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def _f32_as_u32(typingctx, value):
    """Reinterpret float32 bits as uint32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(value), codegen


@njit
def _bf16_bits_to_f32(bits):
    return _u32_as_f32(np.uint32(bits) << np.uint32(16))


@njit
def _f32_to_bf16_bits(value):
    bits = _f32_as_u32(np.float32(value))
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):   # NaN: keep it quiet NaN
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16((bits + rounding) >> np.uint32(16))


def to_f32(x):
    """Element -> float32 (see module docstring); pure-Python twin for reading."""
    raise NotImplementedError("only callable from Numba-compiled code")


def from_f32(value, arr):
    """float32 -> element of ``arr``'s format (see module docstring)."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(to_f32)
def _to_f32_impl(x):
    if x == types.int16:
        return lambda x: _f16_bits_to_f32(x)
    if x == types.uint16:
        return lambda x: _bf16_bits_to_f32(x)
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    raise TypeError(f"unsupported attention element type {x}")


@overload(from_f32)
def _from_f32_impl(value, arr):
    dtype = arr.dtype
    if dtype == types.int16:
        return lambda value, arr: _f32_to_f16_bits(np.float32(value))
    if dtype == types.uint16:
        return lambda value, arr: _f32_to_bf16_bits(value)
    if dtype == types.float32:
        return lambda value, arr: np.float32(value)
    if dtype == types.float64:
        return lambda value, arr: np.float64(value)
    raise TypeError(f"unsupported attention element type {dtype}")
