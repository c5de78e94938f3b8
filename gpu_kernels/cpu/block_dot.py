"""Row kernels for block-quantized weights, written as LLVM vector IR (Numba intrinsics).

A matrix-vector product on GGUF blocks spends its time turning codes into
floats, not reading memory. Left to itself, LLVM vectorizes the obvious Numba
loop but keeps its 32 partial sums in memory and widens nibbles through int64;
these intrinsics spell out the vector code instead (8 floats a register, which
AVX2 and AVX-512 machines both run natively):

``dot_row(codes, scales, offsets, x, block_sums, out, row)``
    ``out[row] = W[row] . x`` for row ``row`` of 2-d codes / scales / offsets,
    ``W[row, 32 b + j] = scales[row, b] * code_j + offsets[row, b]``;
``block_dequant(codes, scales, offsets, out)``
    the row as float32 (for products with many tokens through BLAS).

Scales and offsets are float32 or float16 bits in uint16 arrays (both the same);
offsets with a last dimension of 0 read as zeros (Q8_0 has none). A scale covers 32
codes, or 16 where the scales have two per block of codes (GGUF's Q6_K scales
blocks of 16): ``W[row, 16 g + j] = scales[row, g] * code + offsets[row, g]``, and
``block_sums`` are then sums over 16 inputs. The kernels tell which from the shapes
(scales per row = code blocks, or twice that).

The codes' dtype picks the format at compile time: int8 ``[blocks * 32]`` (one
code a byte), or uint8 ``[blocks * 16]``, nibbles (byte ``j`` of a block holds
code ``j`` in its low and code ``j + 16`` in its high four bits, GGUF's Q4
order: half the bytes).

The dot products compute ``sum_b scales[b] * (codes_b . x_b) + offsets[b] * block_sums[b]``
with ``block_sums[b] = sum(x_b)``, so a row costs per block one load, a few
integer ops, four conversions, four multiply-adds and one scaled add; the
offsets' term is a short loop of its own after the blocks.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_F16, _F32, _I8, _I16, _I32, _I64 = (ir.HalfType(), ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32),
                                     ir.IntType(64))
_V8F = ir.VectorType(_F32, 8)
_FAST = ("fast",)


def _fma(builder):
    """llvm.fma.v8f32 (a * b + c, one rounding): declared by name, llvmlite names only scalar types."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F] * 3), "llvm.fma.v8f32")


def _data(context, builder, ty, value):
    return context.make_array(ty)(context, builder, value).data


def _load_vec(builder, base, index, vec_type, align):
    """Load a vector of ``vec_type`` starting at element ``index`` of ``base``."""
    ptr = builder.gep(base, [index])
    return builder.load(builder.bitcast(ptr, vec_type.as_pointer()), align=align)


def _splat(builder, value):
    vec = builder.insert_element(ir.Constant(_V8F, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, ir.Constant(_V8F, ir.Undefined), ir.Constant(ir.VectorType(_I32, 8), [0] * 8))


def _codes_as_floats(builder, codes_ptr, b, nibble):
    """The 32 codes of block ``b`` as four <8 x float> (codes 0-7, 8-15, 16-23, 24-31)."""
    v8i8, v8i32 = ir.VectorType(_I8, 8), ir.VectorType(_I32, 8)
    if nibble:  # bytes 0-7 hold codes 0-7 and 16-23, bytes 8-15 codes 8-15 and 24-31
        base = builder.mul(b, ir.Constant(_I64, 16))
        parts = []
        for half in range(2):
            bytes8 = _load_vec(builder, codes_ptr, builder.add(base, ir.Constant(_I64, 8 * half)), v8i8, 1)
            parts.append(builder.zext(bytes8, v8i32))
        low = [builder.and_(p, ir.Constant(v8i32, [15] * 8)) for p in parts]
        high = [builder.lshr(p, ir.Constant(v8i32, [4] * 8)) for p in parts]
        ints = low + high
    else:
        base = builder.mul(b, ir.Constant(_I64, 32))
        ints = [builder.sext(_load_vec(builder, codes_ptr, builder.add(base, ir.Constant(_I64, 8 * i)), v8i8, 1), v8i32)
                for i in range(4)]
    return [builder.sitofp(i, _V8F) for i in ints]


def _hsum(builder, vec):
    total = builder.extract_element(vec, ir.Constant(_I32, 0))
    for i in range(1, 8):
        total = builder.fadd(total, builder.extract_element(vec, ir.Constant(_I32, i)), flags=_FAST)
    return total


class _Params:
    """Scales and offsets of a block weight inside generated code: float32, or float16 bits held as
    uint16 (Numba's CPU target has no float16 arrays; GGUF stores scales and offsets as float16, so
    the halves are exact and read half the bytes), and offsets possibly absent (a last dimension of
    0: Q8_0 has none), which then read as 0."""

    def __init__(self, context, builder, sc_t, sc, off_t, off):
        self.builder = builder
        self.half = sc_t.dtype == types.uint16
        self.scales, self.offsets = _data(context, builder, sc_t, sc), _data(context, builder, off_t, off)
        shapes = [context.make_array(t)(context, builder, a).shape for t, a in ((sc_t, sc), (off_t, off))]
        self.num_blocks = builder.extract_value(shapes[0], sc_t.ndim - 1)
        off_blocks = builder.extract_value(shapes[1], off_t.ndim - 1)
        self.has_offsets = builder.icmp_unsigned("!=", off_blocks, ir.Constant(_I64, 0))
        self.zero = cgutils.alloca_once_value(builder, ir.Constant(_I16, 0) if self.half else ir.Constant(_F32, 0.0))
        self.per_block = ir.Constant(_I64, 1)

    def code_blocks(self, code_bytes, nibble):
        """The blocks of 32 codes in a row of ``code_bytes`` bytes (nibbles: 16 bytes a block); notes how many
        scales each has, ``per_block``: 1, or 2 for groups of 16 (`by_16` says which)."""
        blocks = self.builder.udiv(code_bytes, ir.Constant(_I64, 16 if nibble else 32))
        self.per_block = self.builder.udiv(self.num_blocks, blocks)
        self.by_16 = self.builder.icmp_unsigned("==", self.per_block, ir.Constant(_I64, 2))
        return blocks

    def group(self, row_base, b, second):
        """Index of the scale (and offset) of half ``second`` (0 or 1) of code block ``b`` in a row whose
        scales start at ``row_base``: ``b`` for groups of 32, ``2 b + second`` for groups of 16."""
        builder = self.builder
        at = builder.mul(b, self.per_block)
        if second:
            at = builder.add(at, builder.sub(self.per_block, ir.Constant(_I64, 1)))
        return builder.add(row_base, at)

    def halves(self, row_base, b):
        """(scale, offset) splatted for each half of code block ``b`` (the same pair twice for groups of 32)."""
        return [(_splat(self.builder, self.scale(g)), _splat(self.builder, self.offset(g)))
                for g in (self.group(row_base, b, 0), self.group(row_base, b, 1))]

    def _value(self, ptr):
        value = self.builder.load(ptr)
        return self.builder.fpext(self.builder.bitcast(value, _F16), _F32) if self.half else value

    def scale(self, index):
        return self._value(self.builder.gep(self.scales, [index]))

    def offset(self, index):
        """offsets[index], or 0 where there are none (a select of the pointer: no branch)."""
        return self._value(self.builder.select(self.has_offsets, self.builder.gep(self.offsets, [index]), self.zero))


def _dequant_codegen(nibble):
    def codegen(context, builder, sig, args):
        codes_t, sc_t, off_t, out_t = sig.args
        codes = _data(context, builder, codes_t, args[0])
        params = _Params(context, builder, sc_t, args[1], off_t, args[2])
        out = _data(context, builder, out_t, args[3])
        fma = _fma(builder)
        num_codes = builder.extract_value(context.make_array(codes_t)(context, builder, args[0]).shape, 0)
        with cgutils.for_range(builder, params.code_blocks(num_codes, nibble)) as loop:
            b = loop.index
            w = _codes_as_floats(builder, codes, b, nibble)
            sm = params.halves(ir.Constant(_I64, 0), b)
            ob = builder.mul(b, ir.Constant(_I64, 32))
            for i in range(4):
                s, m = sm[i // 2]
                ptr = builder.gep(out, [builder.add(ob, ir.Constant(_I64, 8 * i))])
                builder.store(builder.call(fma, [w[i], s, m]), builder.bitcast(ptr, _V8F.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def _check_params(name, scales, offsets, ndim):
    """Scales and offsets: contiguous ``ndim``-d, both float32 or both float16 bits (uint16)."""
    for a in (scales, offsets):
        if not (isinstance(a, types.Array) and a.ndim == ndim and a.layout == "C"
                and a.dtype in (types.float32, types.uint16)):
            raise TypeError(f"{name}: scales and offsets must be contiguous {ndim}-d float32 or float16 bits "
                            f"(uint16) arrays, got {a}")
    if scales.dtype != offsets.dtype:
        raise TypeError(f"{name}: scales {scales.dtype} and offsets {offsets.dtype} differ")


def _check(name, codes, scales, offsets, out):
    """The block format from the codes' dtype: uint8 = packed nibbles, int8 = int8 codes."""
    if not (isinstance(codes, types.Array) and codes.ndim == 1 and codes.layout == "C"
            and codes.dtype in (types.uint8, types.int8)):
        raise TypeError(f"{name}: codes must be a contiguous 1-d uint8 (nibbles) or int8 array, got {codes}")
    _check_params(name, scales, offsets, 1)
    if not (isinstance(out, types.Array) and out.ndim == 1 and out.layout == "C" and out.dtype == types.float32):
        raise TypeError(f"{name}: expected a contiguous 1-d float32 out, got {out}")
    return codes.dtype == types.uint8


@intrinsic
def block_dequant(typingctx, codes, scales, offsets, out):
    """A row of blocks as float32 into ``out``."""
    nibble = _check("block_dequant", codes, scales, offsets, out)
    return types.void(codes, scales, offsets, out), _dequant_codegen(nibble)


def _dot_rows_codegen(rows, nibble):
    """``out[row + r] = W[row + r] . x`` for ``r < rows``: the rows share each block's activation loads,
    each has its own accumulator (independent dependency chains); the offsets' term
    ``sum_b offsets[b] * block_sums[b]`` is a short loop of its own after the blocks."""
    def codegen(context, builder, sig, args):
        codes_t, sc_t, off_t, x_t, bs_t, out_t, row_t = sig.args
        codes, x, block_sums, out = (_data(context, builder, sig.args[i], args[i]) for i in (0, 3, 4, 5))
        params = _Params(context, builder, sc_t, args[1], off_t, args[2])
        row = context.cast(builder, args[6], row_t, types.int64)
        row_bytes = builder.extract_value(context.make_array(codes_t)(context, builder, args[0]).shape, 1)
        code_blocks = params.code_blocks(row_bytes, nibble)
        num_blocks = params.num_blocks  # scales (and offsets, block sums) per row
        fma = _fma(builder)
        rows_at = [builder.add(row, ir.Constant(_I64, r)) for r in range(rows)]
        row_codes = [builder.gep(codes, [builder.mul(r, row_bytes)]) for r in rows_at]
        row_blocks = [builder.mul(r, num_blocks) for r in rows_at]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(rows)]

        def blocks(halves):
            """The loop over code blocks, each scaled as one group (``halves`` 1) or as two of 16 (2)."""
            with cgutils.for_range(builder, code_blocks) as loop:
                b = loop.index
                xb = builder.mul(b, ir.Constant(_I64, 32))
                xs = [_load_vec(builder, x, builder.add(xb, ir.Constant(_I64, 8 * i)), _V8F, 4) for i in range(4)]
                for r in range(rows):
                    w = _codes_as_floats(builder, row_codes[r], b, nibble)
                    per = 4 // halves
                    for h in range(halves):
                        part = builder.fmul(w[h * per], xs[h * per], flags=_FAST)
                        for i in range(h * per + 1, (h + 1) * per):
                            part = builder.call(fma, [w[i], xs[i], part])
                        at = builder.add(builder.mul(b, ir.Constant(_I64, halves)), ir.Constant(_I64, h))
                        s = params.scale(builder.add(row_blocks[r], at))
                        builder.store(builder.call(fma, [_splat(builder, s), part, builder.load(accs[r])]), accs[r])

        with builder.if_else(params.by_16) as (sixteen, thirty_two):
            with sixteen:
                blocks(2)
            with thirty_two:
                blocks(1)
        shifts = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(rows)]
        with builder.if_then(params.has_offsets):  # Q8_0 has none: nothing to read
            with cgutils.for_range(builder, num_blocks) as loop:
                b = loop.index
                bsum = builder.load(builder.gep(block_sums, [b]))
                for r in range(rows):
                    m = params.offset(builder.add(row_blocks[r], b))
                    builder.store(builder.fadd(builder.load(shifts[r]), builder.fmul(m, bsum, flags=_FAST),
                                               flags=_FAST), shifts[r])
        for r in range(rows):
            total = builder.fadd(_hsum(builder, builder.load(accs[r])), builder.load(shifts[r]), flags=_FAST)
            builder.store(total, builder.gep(out, [rows_at[r]]))
        return context.get_dummy_value()
    return codegen


def _check_rows(name, codes, scales, offsets, x, block_sums, out):
    if not (isinstance(codes, types.Array) and codes.ndim == 2 and codes.layout == "C"
            and codes.dtype in (types.uint8, types.int8)):
        raise TypeError(f"{name}: codes must be a contiguous 2-d uint8 (nibbles) or int8 array, got {codes}")
    _check_params(name, scales, offsets, 2)
    for a in (x, block_sums, out):
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == types.float32):
            raise TypeError(f"{name}: expected a contiguous 1-d float32 array, got {a}")
    return codes.dtype == types.uint8


def _make_dot_rows(rows):
    def dot_rows(typingctx, codes, scales, offsets, x, block_sums, out, row):
        nibble = _check_rows(f"dot_rows_{rows}", codes, scales, offsets, x, block_sums, out)
        return types.void(codes, scales, offsets, x, block_sums, out, row), _dot_rows_codegen(rows, nibble)
    dot_rows.__name__ = f"dot_rows_{rows}"
    dot_rows.__doc__ = (f"``out[row + r] = W[row + r] . x`` for ``r < {rows}`` (2-d codes, scales, offsets; "
                        "``block_sums`` of ``x``).")
    return intrinsic(dot_rows)


dot_row = _make_dot_rows(1)  # two or four rows a pass ran no faster (and int8 rows slower)
