"""Register-blocked block-quantized matmul for a few tokens (LLVM vector IR through Numba intrinsics).

With a handful of tokens (decode of several sequences) a block-quantized
matmul is arithmetic-bound, and a general BLAS call on a dequantized tile
spends much of its time packing operands sized for large matrices. This
kernel works on the codes themselves:

``tile_RxC(codes, scales, offsets, row, xt, yt, yrow, col)``
    ``yt[yrow + r, col + c] = sum_k W[row + r, k] * xt[k, col + c]`` for
    ``r < R`` weight rows and ``c < C`` token columns,

``codes`` / ``scales`` / ``offsets``: the rows of a block-quantized weight as
in `cpu.block_dot` (2-d: int8 ``[out, in]`` or nibbles uint8 ``[out, in / 2]``;
scales and offsets float32 or float16 bits ``[out, in / 32]`` or ``[out, in / 16]``
(groups of 16), offsets possibly ``[out, 0]``: none), ``xt``: float32 ``[in, Tp]`` (the tokens'
activations transposed, ``Tp`` a multiple of 8), ``yt``: float32 ``[rows, Tp]``.

Per block of 32 inputs, the kernel dequantizes the ``R`` rows' codes
(``scale * code + offset``, as ``block_dequant`` does) into a small stack
buffer, then for each input ``k`` loads the ``C / 8`` vectors of activations,
broadcasts the ``R`` weights and issues ``R * C / 8`` fused multiply-adds
into accumulators that stay in registers for the whole row: every weight is
unpacked once and applied to all ``C`` tokens while it is in a register. The
next block is unpacked while the current one is multiplied (two buffer
halves), so the integer and conversion work overlaps the multiply-adds.
AVX2 has 16 vector registers: ``R = 4, C = 16`` keeps 8 accumulators, the
activations and the broadcast weight in registers with room left for the
unpacking; six rows (12 accumulators) ran no faster, spilling that work to
the stack.

Each output is accumulated in order of ``k`` with one rounding per step
(``fma``) from the same dequantized weights whatever the tile shape, so a
product does not depend on how its rows and tokens are cut into tiles.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .block_dot import (_F32, _I8, _I32, _I64, _V8F, _check_params, _codes_as_floats, _data, _fma, _load_vec,
                        _Params, _splat)

R = 4  # weight rows of the full tile (16 tokens: two vectors of 8)
BLOCK = 32


def _check(codes, scales, offsets, xt, yt):
    if not (isinstance(codes, types.Array) and codes.ndim == 2 and codes.layout == "C"
            and codes.dtype in (types.uint8, types.int8)):
        raise TypeError(f"tile: codes must be a contiguous 2-d uint8 (nibbles) or int8 array, got {codes}")
    _check_params("tile", scales, offsets, 2)
    for a in (xt, yt):
        if not (isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.float32):
            raise TypeError(f"tile: expected contiguous 2-d float32 arrays, got {a}")
    return codes.dtype == types.uint8


def _opaque(builder, ptr):
    """``ptr`` through an empty inline asm: LLVM can no longer see which stores it reads, so the
    weights are broadcast from memory (one load each) instead of forwarded from the dequantizing
    code's registers and shuffled into place."""
    fnty = ir.FunctionType(ptr.type, [ptr.type])
    return builder.asm(fnty, "", "=r,0", [ptr], side_effect=False)


def _prefetch_rows(builder, codes, first, count, row_bytes):
    """Ask for the ``count`` rows of codes from row ``first`` on, a 64-byte line at a time."""
    i8p = _I8.as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                        "llvm.prefetch.p0i8")
    start = builder.gep(builder.bitcast(codes, i8p), [builder.mul(first, row_bytes)])
    end = builder.mul(row_bytes, ir.Constant(_I64, count))
    with cgutils.for_range_slice(builder, ir.Constant(_I64, 0), end, ir.Constant(_I64, 64)) as (i, _):
        # read access, keep in all cache levels, data cache
        builder.call(fn, [builder.gep(start, [i]), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


def _tile_codegen(rows, vecs, nibble):
    def codegen(context, builder, sig, args):
        arrays = {i: context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 4)}
        codes = _data(context, builder, sig.args[0], args[0])
        params = _Params(context, builder, sig.args[1], args[1], sig.args[2], args[2])
        xt, yt = _data(context, builder, sig.args[4], args[4]), _data(context, builder, sig.args[5], args[5])
        row, yrow, col = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (3, 6, 7))
        row_bytes = builder.extract_value(arrays[0].shape, 1)
        code_blocks = params.code_blocks(row_bytes, nibble)
        xstride = builder.extract_value(arrays[4].shape, 1)
        fma = _fma(builder)
        half = rows * BLOCK
        buf = cgutils.alloca_once(builder, _F32, size=2 * half)
        row_codes = [builder.gep(codes, [builder.mul(builder.add(row, ir.Constant(_I64, r)), row_bytes)])
                     for r in range(rows)]
        row_blocks = [builder.mul(builder.add(row, ir.Constant(_I64, r)), params.num_blocks) for r in range(rows)]
        _prefetch_rows(builder, codes, builder.add(row, ir.Constant(_I64, rows)), rows, row_bytes)

        def dequant(b):
            """Block ``b`` of the rows, scaled, into buffer half ``b & 1``."""
            at = builder.mul(builder.and_(b, ir.Constant(_I64, 1)), ir.Constant(_I64, half))
            for r in range(rows):
                w = _codes_as_floats(builder, row_codes[r], b, nibble)
                sm = params.halves(row_blocks[r], b)
                for i in range(4):
                    s, m = sm[i // 2]
                    ptr = builder.gep(buf, [builder.add(at, ir.Constant(_I64, r * BLOCK + 8 * i))])
                    builder.store(builder.call(fma, [w[i], s, m]), builder.bitcast(ptr, _V8F.as_pointer()), align=4)

        zero = ir.Constant(_V8F, [0.0] * 8)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(vecs)] for _ in range(rows)]
        dequant(ir.Constant(_I64, 0))
        last = builder.sub(code_blocks, ir.Constant(_I64, 1))
        with cgutils.for_range(builder, code_blocks) as loop:
            b = loop.index
            nxt = builder.add(b, ir.Constant(_I64, 1))
            dequant(builder.select(builder.icmp_unsigned("<", nxt, code_blocks), nxt, last))
            at = builder.mul(builder.and_(b, ir.Constant(_I64, 1)), ir.Constant(_I64, half))
            cur = _opaque(builder, builder.gep(buf, [at]))
            acc = [[builder.load(a) for a in row_accs] for row_accs in accs]
            for k in range(BLOCK):
                xbase = builder.add(builder.mul(builder.add(builder.mul(b, ir.Constant(_I64, BLOCK)),
                                                            ir.Constant(_I64, k)), xstride), col)
                xs = [_load_vec(builder, xt, builder.add(xbase, ir.Constant(_I64, 8 * j)), _V8F, 4)
                      for j in range(vecs)]
                for r in range(rows):
                    wk = builder.load(builder.gep(cur, [ir.Constant(_I64, r * BLOCK + k)]))
                    wk = _splat(builder, wk)
                    for j in range(vecs):
                        acc[r][j] = builder.call(fma, [wk, xs[j], acc[r][j]])
            for r in range(rows):
                for j in range(vecs):
                    builder.store(acc[r][j], accs[r][j])
        for r in range(rows):
            ybase = builder.add(builder.mul(builder.add(yrow, ir.Constant(_I64, r)), xstride), col)
            for j in range(vecs):
                ptr = builder.gep(yt, [builder.add(ybase, ir.Constant(_I64, 8 * j))])
                builder.store(builder.load(accs[r][j]), builder.bitcast(ptr, _V8F.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def _make(rows, vecs):
    def tile(typingctx, codes, scales, offsets, row, xt, yt, yrow, col):
        nibble = _check(codes, scales, offsets, xt, yt)
        return (types.void(codes, scales, offsets, row, xt, yt, yrow, col),
                _tile_codegen(rows, vecs, nibble))
    tile.__name__ = f"tile_{rows}x{8 * vecs}"
    tile.__doc__ = f"``{rows}`` weight rows times ``{8 * vecs}`` token columns (module docstring)."
    return intrinsic(tile)


tile_4x16 = _make(R, 2)  # the full tile
tile_4x8 = _make(R, 1)  # a last group of 8 tokens
tile_1x16 = _make(1, 2)  # the last rows of a range
tile_1x8 = _make(1, 1)
