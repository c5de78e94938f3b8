"""gpu_kernels: the tensor-core prefill's tiling (``cuda/prefill_mma.py``) in Numba's CUDA simulator.

The simulator cannot run the linked CUDA C++ (``cuda/mma.cu``); it runs the kernel with the
plain-Numba twin of the two matrix products (``cuda/mma.py``), same tiling, layouts, masking
and online softmax. ``tests/test_kernels_gpu.py`` checks on a GPU that the two agree. Like
``test_kernels_cudasim.py``, the outer test re-runs this file in a subprocess with
``NUMBA_ENABLE_CUDASIM=1``; shapes are the smallest that reach each case.
"""
import os

import numpy as np
import pytest

IN_SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def grow_scores(prob, log2_step):
    """Make every query score key ``j`` of its sequence about ``log2_step * j`` (log2 units,
    after the softmax scale) plus noise: each row's maximum keeps rising, by less than the
    tensor-core kernel's rescale slack over some tiles and by more over others. In place."""
    from gpu_kernels.formats import from_float32, to_float32
    head_dim = prob.query.shape[2]
    u = np.full(head_dim, head_dim ** -0.5, np.float32)           # unit direction
    q = np.broadcast_to(u, prob.query.shape) * 2.0
    prob.query[...] = from_float32(q.astype(np.float32), prob.query.dtype)
    k = to_float32(prob.k_cache)
    block_size = k.shape[2]
    per_key = log2_step / np.log2(np.e) / prob.scale / 2.0        # along u, per key
    for i, length in enumerate(prob.context_lens):
        for j in range(length):
            blk, off = prob.block_tables[i, j // block_size], j % block_size
            k[blk, :, off] = 0.1 * k[blk, :, off] + per_key * j * u
    prob.k_cache[...] = from_float32(k, prob.k_cache.dtype)

if not IN_SIMULATOR:

    @pytest.mark.slow
    def test_tensor_core_prefill_in_the_simulator(request, capsys):
        from conftest import relay_cudasim_run   # started beside the other tests, see conftest.py

        returncode, out = relay_cudasim_run(request.config, __file__, capsys)
        summary = out.strip().splitlines()[-1] if out.strip() else ""
        assert returncode == 0, out[-6000:]
        assert "passed" in summary and "skipped" not in summary, summary

else:
    import gpu_kernels
    from gpu_kernels.cuda import backend as cuda_backend
    from gpu_kernels.cuda import prefill_mma
    from gpu_kernels.testing import assert_close, make_problem

    def run(prob, window, backend):
        out = prob.out()
        gpu_kernels.paged_prefill(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                                  prob.query_start_loc, prob.context_lens, prob.scale,
                                  sliding_window=window, out=out, backend=backend)
        return out

    def built_tensor_core_kernels():
        return prefill_mma.build_prefill_mma_kernel.cache_info().currsize

    @pytest.mark.parametrize("dtype, group, block_size, window, tile", [
        # 3 heads in a 16-row tile: row 15 is padding; ragged chunks with a decode
        ("float16", 3, 4, None, (1, 1, 16)),
        # a window that starts inside a key tile and masks whole tiles for later rows;
        # three K/V buffers
        ("bfloat16", 4, 1, 5, (1, 1, 16, 3)),
        # two warps, two 16-row tiles each, 32-key tiles
        ("float16", 1, 16, 20, (2, 2, 32)),
    ])
    def test_matches_reference(monkeypatch, dtype, group, block_size, window, tile):
        monkeypatch.setattr(cuda_backend, "PREFILL_MMA_TILES", {16: tile})
        prob = make_problem(np.random.default_rng(3), context_lens=[37, 6, 20],
                            query_lens=[37, 1, 9], num_kv_heads=1, group=group, head_dim=16,
                            block_size=block_size, dtype=dtype, query_dtype=dtype)
        prob.query = prob.query[:prob.query_start_loc[-1]]
        before = built_tensor_core_kernels()
        got = run(prob, window, "cuda")
        assert built_tensor_core_kernels() == before + 1       # this kernel, not the fp32 one
        assert_close(got, run(prob, window, "reference"), dtype)

    @pytest.mark.parametrize("slack", [8.0, 0.0])
    def test_rising_scores_rescale_right(monkeypatch, slack):
        """Scores rising ~0.4 log2 units per key: over a 16-key tile a row's maximum moves by
        ~6.4 (kept, below the slack: probabilities up to 2**6.4), over two by more (moved).
        One 16-row tile (8 tokens x 2 heads) over three key tiles sees both. With the slack
        and without it (the maximum moving on every rise) the output matches the reference;
        a missed rescale would weight early keys 2**6 too much or too little."""
        monkeypatch.setattr(cuda_backend, "PREFILL_MMA_TILES",
                            {16: (1, 1, 16, 2, None, slack)})
        prob = make_problem(np.random.default_rng(10), context_lens=[48], query_lens=[8],
                            num_kv_heads=1, group=2, head_dim=16, block_size=4, dtype="float16",
                            query_dtype="float16")
        grow_scores(prob, 0.4)
        assert_close(run(prob, None, "cuda"), run(prob, None, "reference"), "float16")

    def test_output_not_known_contiguous_is_written_element_by_element(monkeypatch):
        """Only an output known to be C-contiguous is written as words; any other is written
        element by element through its strides (tests/test_kernels_gpu.py checks a real
        strided view on a GPU: the simulator copies non-contiguous NumPy arrays)."""
        monkeypatch.setattr(cuda_backend, "_c_contiguous", lambda arr: False)
        prob = make_problem(np.random.default_rng(11), context_lens=[20, 7], query_lens=[20, 1],
                            num_kv_heads=1, group=2, head_dim=16, block_size=4, dtype="bfloat16",
                            query_dtype="bfloat16")
        prob.query = prob.query[:prob.query_start_loc[-1]]
        before = built_tensor_core_kernels()
        assert_close(run(prob, None, "cuda"), run(prob, None, "reference"), "bfloat16")
        assert built_tensor_core_kernels() == before + 1

    def test_query_in_another_half_format_is_converted():
        """A float16 query on a bfloat16 cache: Q is converted element by element to bf16."""
        prob = make_problem(np.random.default_rng(4), context_lens=[18], query_lens=[18],
                            num_kv_heads=1, group=2, head_dim=16, block_size=4, dtype="bfloat16",
                            query_dtype="float16")
        assert_close(run(prob, None, "cuda"), run(prob, None, "reference"), "bfloat16")

    def test_float32_queries_keep_the_cuda_core_kernel(monkeypatch):
        """Half caches with float32 queries (and strided ones: element-by-element load) stay
        on the float32 kernel, which keeps the query's precision."""
        monkeypatch.setattr(cuda_backend, "_c_contiguous", lambda arr: False)
        prob = make_problem(np.random.default_rng(8), context_lens=[20, 9], query_lens=[20, 1],
                            num_kv_heads=2, group=4, head_dim=16, block_size=4, dtype="float16",
                            query_dtype="float32")
        prob.query = prob.query[:prob.query_start_loc[-1]]
        before = built_tensor_core_kernels()
        assert_close(run(prob, None, "cuda"), run(prob, None, "reference"), "float32")
        assert built_tensor_core_kernels() == before

    def test_warps_skip_only_key_tiles_none_of_their_rows_sees():
        """The predicate by which a warp skips a key tile, against brute force: queries at
        consecutive positions (a warp's rows), causal, with and without a window. (A window
        test on the last query alone skipped tiles that the warp's first queries still see.)"""
        for first in range(0, 12):
            for last in range(first, first + 6):
                for window in (0, 1, 3, 7):
                    for kt0 in range(0, 20, 4):
                        for nk in (1, 4):
                            keys = range(kt0, kt0 + nk)
                            seen = any(j <= p and (window <= 0 or j > p - window)
                                       for p in range(first, last + 1) for j in keys)
                            assert prefill_mma.tile_seen_by_rows(kt0, nk, first, last,
                                                                 window) == seen, \
                                (kt0, nk, first, last, window)

    def test_bad_mode_is_refused(monkeypatch):
        monkeypatch.setattr(cuda_backend, "prefill_mma_mode", "fast")
        prob = make_problem(np.random.default_rng(6), context_lens=[5], query_lens=[5],
                            num_kv_heads=1, group=1, head_dim=16, block_size=4, dtype="float16")
        with pytest.raises(ValueError, match="prefill_mma_mode must be 'auto', 'numba' or 'off'"):
            run(prob, None, "cuda")

    def test_tile_it_cannot_lay_out_is_refused(monkeypatch):
        monkeypatch.setattr(cuda_backend, "PREFILL_MMA_TILES", {16: (1, 1, 24)})
        prob = make_problem(np.random.default_rng(6), context_lens=[5], query_lens=[5],
                            num_kv_heads=1, group=1, head_dim=16, block_size=4, dtype="float16")
        with pytest.raises(NotImplementedError, match="keys per tile .24. must be multiples of 16"):
            run(prob, None, "cuda")
