"""`gpu_kernels.cpu.float_matmul`: a few rows times an ``[out, in]`` weight as Numba dot products, the
rest through NumPy's BLAS; both against a float64 product, and bad operands named before any work."""

import numpy as np
import pytest

from gpu_kernels.cpu import float_matmul as fm


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, fm.FEW_ROWS, fm.FEW_ROWS + 1, 70])
@pytest.mark.parametrize("transpose_w", [True, False])
def test_product_matches_float64(rows, transpose_w):
    rng = np.random.default_rng(rows)
    num_in, num_out = 96, fm.TILE * 2 + 37   # a partial last tile of weight rows
    x = rng.standard_normal((rows, num_in)).astype(np.float32)
    w = rng.standard_normal((num_out, num_in) if transpose_w else (num_in, num_out)).astype(np.float32)
    expected = x.astype(np.float64) @ (w.T if transpose_w else w).astype(np.float64)
    got = fm.float_matmul(x, w, transpose_w=transpose_w)
    assert got.shape == (rows, num_out) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_few_rows_take_the_dot_kernel_and_write_into_out():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    w = rng.standard_normal((300, 40)).astype(np.float32)
    out = np.full((6, 300), np.nan, np.float32)
    assert fm.float_matmul(x, w, out, transpose_w=True) is out
    for t in range(6):   # every row of x, the grouped ones and the remainder, each a plain dot product
        np.testing.assert_allclose(out[t], [np.dot(x[t].astype(np.float64), r) for r in w], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x, w, transpose_w, words", [
    (np.zeros((2, 8), np.float32), np.zeros((9, 4), np.float32), False, "does not match"),
    (np.zeros((2, 8), np.float32), np.zeros((4, 9), np.float32), True, "[out, in]"),
    (np.zeros((2, 8), np.float64), np.zeros((8, 4), np.float32), False, "float32"),
    (np.zeros(8, np.float32), np.zeros((8, 4), np.float32), False, "float32 matrices"),
])
def test_bad_operands_are_named(x, w, transpose_w, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        fm.float_matmul(x, w, transpose_w=transpose_w)
