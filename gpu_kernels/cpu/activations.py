"""Vectorized ``exp`` for the CPU kernels (LLVM vector IR through Numba intrinsics).

``silu_mul(gate_up, out)``
    ``out[i] = silu(g_i) * u_i`` for a row ``gate_up = [g_0 .. g_n-1, u_0 .. u_n-1]``,
    ``silu(g) = g / (1 + exp(-g))`` (the MLP's activation);
``gelu_tanh_mul(gate_up, out)``
    the same with GELU's tanh approximation (Gemma's ``gelu_pytorch_tanh``):
    ``0.5 g (1 + tanh(z)) = g / (1 + exp(-2 z))``, ``z = sqrt(2 / pi) (g + 0.044715 g^3)``;
``exp_shifted(s, shift)``
    ``s[i] = exp(s[i] - shift)`` in place (softmax weights of attention scores).

Numba's ``np.exp`` is a scalar libm call per element, which LLVM cannot
vectorize without a vector math library; with several decode tokens the
activation then costs as much as a small projection, and attention spends
more on one ``exp`` per position than on its two 64-wide dot products. Here ``exp`` is the
Cephes single-precision routine (range reduction by ``ln 2`` in two parts,
a degree-5 polynomial, the power of two built from the exponent bits), eight
lanes at a time: within two units in the last place of libm's ``expf``.
Both process the first ``n // 8 * 8`` elements; the rest are left to the caller.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .block_dot import _I32, _I64, _V8F, _data, _load_vec

_V8I = ir.VectorType(_I32, 8)
_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _const(value):
    return ir.Constant(_V8F, [value] * 8)


def _exp(builder, x):
    """exp(x) for <8 x float> (Cephes expf; plain IEEE operations, so LLVM keeps its rounding steps)."""
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F]), "llvm.floor.v8f32")
    x = builder.select(builder.fcmp_ordered(">", x, _const(88.3762626647949)), _const(88.3762626647949), x)
    x = builder.select(builder.fcmp_ordered("<", x, _const(-88.3762626647949)), _const(-88.3762626647949), x)
    fx = builder.call(floor, [builder.fadd(builder.fmul(x, _const(1.44269504088896341)), _const(0.5))])
    x = builder.fsub(builder.fsub(x, builder.fmul(fx, _const(0.693359375))), builder.fmul(fx, _const(-2.12194440e-4)))
    y = _const(_POLY[0])
    for p in _POLY[1:]:
        y = builder.fadd(builder.fmul(y, x), _const(p))
    y = builder.fadd(builder.fadd(builder.fmul(y, builder.fmul(x, x)), x), _const(1.0))
    n = builder.add(builder.fptosi(fx, _V8I), ir.Constant(_V8I, [127] * 8))
    return builder.fmul(y, builder.bitcast(builder.shl(n, ir.Constant(_V8I, [23] * 8)), _V8F))


_GELU_C = 2.0 * 0.7978845608028654  # 2 sqrt(2 / pi)


def _silu_gate(builder, g):
    """silu(g) = g / (1 + exp(-g))."""
    return builder.fdiv(g, builder.fadd(_const(1.0), _exp(builder, builder.fsub(_const(0.0), g))))


def _gelu_tanh_gate(builder, g):
    """GELU (tanh approximation) as g / (1 + exp(-2 z)), z = sqrt(2 / pi) (g + 0.044715 g^3)."""
    cube = builder.fmul(builder.fmul(g, g), g)
    two_z = builder.fmul(_const(_GELU_C), builder.fadd(g, builder.fmul(_const(0.044715), cube)))
    return builder.fdiv(g, builder.fadd(_const(1.0), _exp(builder, builder.fsub(_const(0.0), two_z))))


def _gated(name, gate):
    """An intrinsic ``out[i] = gate(gate_up[i]) * gate_up[n + i]`` for ``i < n // 8 * 8``, ``n = len(out)``."""

    def typer(typingctx, gate_up, out):
        for a in (gate_up, out):
            if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == types.float32):
                raise TypeError(f"{name}: expected contiguous 1-d float32 arrays, got {a}")

        def codegen(context, builder, sig, args):
            gu, res = _data(context, builder, sig.args[0], args[0]), _data(context, builder, sig.args[1], args[1])
            n = builder.extract_value(context.make_array(sig.args[1])(context, builder, args[1]).shape, 0)
            with cgutils.for_range(builder, builder.udiv(n, ir.Constant(_I64, 8))) as loop:
                i = builder.mul(loop.index, ir.Constant(_I64, 8))
                g = _load_vec(builder, gu, i, _V8F, 4)
                u = _load_vec(builder, gu, builder.add(i, n), _V8F, 4)
                value = builder.fmul(gate(builder, g), u)
                builder.store(value, builder.bitcast(builder.gep(res, [i]), _V8F.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(gate_up, out), codegen

    typer.__name__ = name
    return intrinsic(typer)


silu_mul = _gated("silu_mul", _silu_gate)
gelu_tanh_mul = _gated("gelu_tanh_mul", _gelu_tanh_gate)


@intrinsic
def exp_shifted(typingctx, s, shift):
    """``s[i] = exp(s[i] - shift)`` for ``i < len(s) // 8 * 8`` (module docstring)."""
    if not (isinstance(s, types.Array) and s.ndim == 1 and s.layout == "C" and s.dtype == types.float32):
        raise TypeError(f"exp_shifted: expected a contiguous 1-d float32 array, got {s}")
    if shift != types.float32:
        raise TypeError(f"exp_shifted: shift must be float32, got {shift}")

    def codegen(context, builder, sig, args):
        data = _data(context, builder, sig.args[0], args[0])
        n = builder.extract_value(context.make_array(sig.args[0])(context, builder, args[0]).shape, 0)
        shift_vec = builder.insert_element(ir.Constant(_V8F, ir.Undefined), args[1], ir.Constant(_I32, 0))
        shift_vec = builder.shuffle_vector(shift_vec, ir.Constant(_V8F, ir.Undefined), ir.Constant(_V8I, [0] * 8))
        with cgutils.for_range(builder, builder.udiv(n, ir.Constant(_I64, 8))) as loop:
            i = builder.mul(loop.index, ir.Constant(_I64, 8))
            v = builder.fsub(_load_vec(builder, data, i, _V8F, 4), shift_vec)
            builder.store(_exp(builder, v), builder.bitcast(builder.gep(data, [i]), _V8F.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(s, shift), codegen
