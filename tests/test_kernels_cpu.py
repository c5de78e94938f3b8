"""gpu_kernels: the Numba CPU backend against the NumPy reference, and zero-copy interop."""
import numpy as np
import paddle
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpu_kernels
from gpu_kernels import interop
from gpu_kernels.cpu import attention as cpu
from gpu_kernels.testing import assert_close, make_problem, np_dtype

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw, *, decode_only):
    """Ragged batches crossing block boundaries, GQA 1/3/4/8, windows, fp32/fp16/bf16."""
    num_seqs = draw(st.integers(1, 4))
    block_size = draw(st.sampled_from([1, 3, 16]))
    context_lens = draw(st.lists(st.integers(1, 80), min_size=num_seqs, max_size=num_seqs))
    if decode_only:
        query_lens = [1] * num_seqs
    else:   # prefill chunks (whole prompts or later chunks) mixed with decodes
        query_lens = [draw(st.sampled_from([1, c, max(1, c // 2), min(c, 5)]))
                      for c in context_lens]
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    query_dtype = draw(st.sampled_from([dtype, "float32"]))
    prob = make_problem(
        np.random.default_rng(draw(st.integers(0, 2**31))),
        context_lens=context_lens, query_lens=query_lens,
        num_kv_heads=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 3, 4, 8])),
        head_dim=draw(st.sampled_from([8, 64, 128, 256])), block_size=block_size,
        dtype=dtype, query_dtype=query_dtype, pad_tokens=draw(st.integers(0, 2)))
    window = draw(st.sampled_from([None, None, 1, 7, 40]))
    return prob, window, query_dtype


def run_both(op, prob, window, **kw):
    outs = []
    for backend in ("reference", "cpu"):
        out = prob.out()
        if op == "decode":
            gpu_kernels.paged_decode(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                                     prob.context_lens, prob.scale, sliding_window=window,
                                     out=out, backend=backend)
        else:
            gpu_kernels.paged_prefill(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                                      prob.query_start_loc, prob.context_lens, prob.scale,
                                      sliding_window=window, out=out, backend=backend)
        outs.append(out)
    return outs


@SETTINGS
@given(problems(decode_only=True))
def test_decode_matches_reference(case):
    prob, window, qdtype = case
    prob.query = prob.query[:len(prob.context_lens)]          # decode: one row per sequence
    ref, got = run_both("decode", prob, window)
    assert_close(got, ref, qdtype)


@SETTINGS
@given(problems(decode_only=False))
def test_prefill_mixed_batch_matches_reference(case):
    prob, window, qdtype = case
    n = prob.query_start_loc[-1]
    prob.query = prob.query[:n]
    ref, got = run_both("prefill", prob, window)
    assert_close(got, ref, qdtype)


@SETTINGS
@given(problems(decode_only=False))
def test_write_kv_matches_reference(case):
    prob, _, _ = case
    caches = []
    for backend in ("reference", "cpu"):
        kc, vc = prob.k_cache.copy(), prob.v_cache.copy()
        gpu_kernels.write_kv(prob.key, prob.value, kc, vc, prob.slot_mapping, backend=backend)
        caches.append((kc, vc))
    (rk, rv), (ck, cv) = caches
    np.testing.assert_array_equal(ck.view(np.uint8), rk.view(np.uint8))
    np.testing.assert_array_equal(cv.view(np.uint8), rv.view(np.uint8))
    assert not np.array_equal(rk.view(np.uint8), prob.k_cache.view(np.uint8))


def test_write_kv_converts_float32_into_half_caches():
    rng = np.random.default_rng(1)
    for dtype in ("float16", "bfloat16"):
        prob = make_problem(rng, context_lens=[20, 33], query_lens=[20, 1], dtype=dtype)
        key = rng.standard_normal(prob.key.shape).astype(np.float32)
        value = rng.standard_normal(prob.key.shape).astype(np.float32)
        ref_k, ref_v = prob.k_cache.copy(), prob.v_cache.copy()
        gpu_kernels.write_kv(key, value, ref_k, ref_v, prob.slot_mapping, backend="reference")
        gpu_kernels.write_kv(key, value, prob.k_cache, prob.v_cache, prob.slot_mapping)
        np.testing.assert_array_equal(prob.k_cache.view(np.uint16), ref_k.view(np.uint16))
        np.testing.assert_array_equal(prob.v_cache.view(np.uint16), ref_v.view(np.uint16))


def test_decode_equals_prefill_with_chunks_of_one():
    prob = make_problem(np.random.default_rng(2), context_lens=[5, 70, 33], query_lens=[1, 1, 1],
                        num_kv_heads=3, group=3, head_dim=64)
    a, b = prob.out(), prob.out()
    gpu_kernels.paged_decode(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                             prob.context_lens, prob.scale, out=a)
    gpu_kernels.paged_prefill(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                              prob.query_start_loc, prob.context_lens, prob.scale, out=b)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_zero_length_context_gives_zeros_and_window_wider_than_context_is_no_window():
    prob = make_problem(np.random.default_rng(3), context_lens=[1, 40], query_lens=[1, 1])
    lens = np.array([0, 40], np.int32)
    a, b = prob.out(), prob.out()
    gpu_kernels.paged_decode(prob.query, prob.k_cache, prob.v_cache, prob.block_tables, lens,
                             prob.scale, sliding_window=1000, out=a)
    gpu_kernels.paged_decode(prob.query, prob.k_cache, prob.v_cache, prob.block_tables, lens,
                             prob.scale, out=b)
    assert (a[0] == 0).all()
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_parallel_split_k_decode_and_parallel_prefill(monkeypatch, dtype):
    """Long contexts with the parallel paths forced: decode splits keys and merges the pieces."""
    monkeypatch.setattr(cpu, "min_parallel_work", 0)
    assert cpu.choose_splits(1, 1, 1000, num_threads=2) == 3
    assert cpu.choose_splits(8, 2, 1000, num_threads=2) == 1
    prob = make_problem(np.random.default_rng(4), context_lens=[1000, 700], query_lens=[1, 1],
                        num_kv_heads=1, group=4, head_dim=64, dtype=dtype)
    ref, got = run_both("decode", prob, None)
    assert_close(got, ref, dtype)
    ref, got = run_both("decode", prob, 300)
    assert_close(got, ref, dtype)
    prob = make_problem(np.random.default_rng(5), context_lens=[300, 9], query_lens=[200, 1],
                        num_kv_heads=2, group=2, head_dim=64, dtype=dtype)
    ref, got = run_both("prefill", prob, 50)
    assert_close(got, ref, dtype)


def test_parallel_prefill_hands_out_the_costliest_tiles_first():
    """The order items are handed to threads: tiles by tokens times visible keys, largest first
    (a 257-token chunk in tiles of 48 -- its short last tile sees the most keys -- and a decode)."""
    from gpu_kernels.cpu.prefill import costliest_first

    qsl, lens = np.array([0, 257, 258], np.int32), np.array([257, 40], np.int32)
    tile_start, tile = np.array([0, 6, 7], np.int64), np.array([48, 64], np.int64)
    # costs: 48 x 48, 48 x 96, ..., 48 x 240, then 17 x 257 = 4369 (between 48 x 96 and 48 x 48), 1 x 40
    assert costliest_first(qsl, lens, tile_start, tile, 0).tolist() == [4, 3, 2, 1, 5, 0, 6]
    # a window of 64: the tiles from the third on see 48 + 63 keys (equal: kept in order), the first
    # two 48 and 96, the short last one 17 + 63
    assert costliest_first(qsl, lens, tile_start, tile, 64).tolist() == [2, 3, 4, 1, 0, 5, 6]


def test_shape_errors_are_reported():
    prob = make_problem(np.random.default_rng(6), context_lens=[4], query_lens=[1],
                        num_kv_heads=2, group=2)
    with pytest.raises(ValueError, match="multiple"):
        gpu_kernels.paged_decode(prob.query[:, :3], prob.k_cache, prob.v_cache, prob.block_tables,
                                 prob.context_lens, 1.0, out=np.zeros_like(prob.query[:, :3]))
    with pytest.raises(ValueError, match="backend"):
        gpu_kernels.write_kv(prob.key, prob.value, prob.k_cache, prob.v_cache, prob.slot_mapping,
                             backend="tpu")


# --------------------------------------------------------------------------- Paddle interop


def test_paddle_cpu_views_are_writable_zero_copy_and_cached():
    t = paddle.zeros([4, 2, 16, 8], dtype="float32")
    view = interop.host_view(t)
    assert view.flags.writeable and view.ctypes.data == t.data_ptr()
    view[1, 0, 3, 2] = 7.0
    assert float(t[1, 0, 3, 2]) == 7.0
    assert interop.host_view(t) is view                      # cached by pointer/shape/dtype
    half = paddle.zeros([3, 5], dtype="float16")
    assert interop.host_view(half).dtype == np.int16          # float16 bits
    bf16 = paddle.ones([3, 5], dtype="bfloat16")
    bits = interop.host_view(bf16)
    assert bits.dtype == np.uint16 and (bits == 0x3F80).all()  # 1.0 in bfloat16
    strided = paddle.arange(24, dtype="float32").reshape([4, 6])[:, 1:4]
    np.testing.assert_array_equal(interop.host_view(strided), strided.numpy())


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_paddle_tensors_end_to_end(dtype):
    """write_kv mutates Paddle caches in place; decode/prefill on Paddle tensors match NumPy."""
    prob = make_problem(np.random.default_rng(7), context_lens=[9, 40], query_lens=[9, 1],
                        num_kv_heads=2, group=3, head_dim=64, dtype=dtype, query_dtype="float32")

    def to_paddle(a):
        if a.dtype == np.uint16:                   # bf16 bits
            return paddle.to_tensor(a).view(paddle.bfloat16)
        return paddle.to_tensor(a)

    kc, vc = to_paddle(prob.k_cache), to_paddle(prob.v_cache)
    key, value = to_paddle(prob.key), to_paddle(prob.value)
    gpu_kernels.write_kv(key, value, kc, vc, paddle.to_tensor(prob.slot_mapping))
    gpu_kernels.write_kv(prob.key, prob.value, prob.k_cache, prob.v_cache, prob.slot_mapping)
    np.testing.assert_array_equal(interop.host_view(kc).view(np.uint8),
                                  interop.host_view(prob.k_cache).view(np.uint8))
    out = paddle.zeros(prob.query.shape, dtype="float32")
    gpu_kernels.paged_prefill(paddle.to_tensor(prob.query), kc, vc,
                              paddle.to_tensor(prob.block_tables),
                              paddle.to_tensor(prob.query_start_loc),
                              paddle.to_tensor(prob.context_lens), prob.scale, out=out)
    ref = prob.out()
    gpu_kernels.paged_prefill(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                              prob.query_start_loc, prob.context_lens, prob.scale, out=ref,
                              backend="reference")
    assert_close(out.numpy(), ref, "float32")


def test_vectorized_silu_matches_the_exact_activation():
    """silu(g) * u with its own vector exp, against float64 over g in [-80, 80]; elements past the
    last multiple of 8 are the caller's and stay untouched."""
    from numba import njit

    from gpu_kernels.cpu.activations import silu_mul

    @njit
    def run(gate_up, out):
        silu_mul(gate_up, out)

    rng = np.random.default_rng(0)
    n = 1003
    gate = np.concatenate([np.linspace(-80, 80, 200), rng.standard_normal(n - 200) * 4]).astype(np.float32)
    up = rng.standard_normal(n).astype(np.float32)
    out = np.full(n, 7.0, np.float32)
    run(np.concatenate([gate, up]), out)
    g = gate.astype(np.float64)
    exact = g / (1 + np.exp(-g)) * up
    done = n // 8 * 8
    np.testing.assert_allclose(out[:done], exact[:done], rtol=1e-6, atol=1e-30)
    assert (out[done:] == 7.0).all()


def test_vectorized_gelu_tanh_matches_the_exact_activation():
    """GELU's tanh approximation (Gemma's gelu_pytorch_tanh) times u with the vector exp, against
    0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) in float64 over g in [-40, 40]; the tail is the
    caller's."""
    from numba import njit

    from gpu_kernels.cpu.activations import gelu_tanh_mul

    @njit
    def run(gate_up, out):
        gelu_tanh_mul(gate_up, out)

    rng = np.random.default_rng(1)
    n = 1003
    gate = np.concatenate([np.linspace(-40, 40, 200), rng.standard_normal(n - 200) * 4]).astype(np.float32)
    up = rng.standard_normal(n).astype(np.float32)
    out = np.full(n, 7.0, np.float32)
    run(np.concatenate([gate, up]), out)
    g = gate.astype(np.float64)
    z = np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)
    with np.errstate(over="ignore"):  # = 0.5 g (1 + tanh z), without float64's cancellation for g << 0
        exact = g / (1 + np.exp(-2 * z)) * up
    np.testing.assert_allclose(exact, 0.5 * g * (1 + np.tanh(z)) * up, rtol=1e-9, atol=1e-12)
    done = n // 8 * 8
    # float32's rounding of 2z (|2z| up to ~50 where the result is above float32's range) bounds the error
    np.testing.assert_allclose(out[:done], exact[:done], rtol=1e-5, atol=1e-30)
    assert (out[done:] == 7.0).all()


def test_vectorized_softmax_weights_match_exp():
    """exp(s - shift) in place, 8 lanes at a time, against float64; the tail is the caller's."""
    from numba import njit

    from gpu_kernels.cpu.activations import exp_shifted

    @njit
    def run(s, shift):
        exp_shifted(s, shift)

    s = np.linspace(-90, 5, 21).astype(np.float32)
    out = s.copy()
    run(out, np.float32(3.5))
    expected = np.exp(s.astype(np.float64) - 3.5)
    np.testing.assert_allclose(out[:16], expected[:16], rtol=1e-6, atol=1e-37)
    np.testing.assert_array_equal(out[16:], s[16:])


def test_no_two_cached_kernels_share_a_cache_file():
    """Numba files a cached function by module, qualified name and first line, not by its compile
    flags: two ``njit``s of one Python function (threaded and one-thread) would overwrite each
    other's machine code on disk, and a later process would load the same code for both."""
    import importlib
    import pkgutil

    import gpu_kernels.cpu
    from numba.core.caching import NullCache
    from numba.core.registry import CPUDispatcher

    seen: dict[tuple, str] = {}
    for info in pkgutil.iter_modules(gpu_kernels.cpu.__path__, "gpu_kernels.cpu."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if isinstance(obj, CPUDispatcher) and obj.__module__ == module.__name__ \
                    and not isinstance(obj._cache, NullCache):
                fn = obj.py_func
                key = (fn.__module__, fn.__qualname__, fn.__code__.co_firstlineno)
                assert key not in seen, f"{info.name}.{name} and {seen[key]} share the cache file of {key}"
                seen[key] = f"{info.name}.{name}"
    assert len(seen) > 10


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("rows", [3, 4500])  # on the calling thread, and spread over the threads
def test_rms_norm_rows_match_the_float64_formula(offset, rows):
    from gpu_kernels.cpu.norms import rms_norm

    rng = np.random.default_rng(int(offset) * 10 + rows)
    full = (rng.standard_normal((rows, 2, 256)) * 4).astype(np.float32)
    x = full[:, 1]  # strided rows, as a split of a fused projection gives them
    w = rng.standard_normal(256).astype(np.float32)
    out = np.full(x.shape, np.nan, np.float32)
    rms_norm(x, w, 1e-6, offset, out)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * (w.astype(np.float64) + offset)
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:128], 1e-6, offset, out)
