"""gpu_kernels: the CUDA kernels under Numba's CUDA simulator, against the NumPy reference.

``NUMBA_ENABLE_CUDASIM=1`` must be set before ``numba.cuda`` is first
imported, so the outer test re-runs this file in a subprocess with the
variable set; there the simulator tests below are collected instead. The
simulator runs every thread as a Python thread: shapes stay tiny.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

IN_SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

if not IN_SIMULATOR:

    def test_cuda_kernels_in_the_simulator():
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            env=env, capture_output=True, text=True, timeout=2700,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        assert "passed" in summary and "skipped" not in summary, summary

else:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import gpu_kernels
    from gpu_kernels.cuda import backend as cuda_backend
    from gpu_kernels.testing import assert_close, make_problem

    SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                        suppress_health_check=[HealthCheck.too_slow])

    @st.composite
    def problems(draw, *, decode_only):
        num_seqs = draw(st.integers(1, 3))
        block_size = draw(st.sampled_from([1, 4, 16]))
        # up to 70 keys: more than one 32-key partition and more than one split
        context_lens = draw(st.lists(st.integers(1, 70), min_size=num_seqs, max_size=num_seqs))
        if decode_only:
            query_lens = [1] * num_seqs
        else:
            query_lens = [draw(st.sampled_from([1, c, min(c, 9)])) for c in context_lens]
        dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
        query_dtype = draw(st.sampled_from([dtype, "float32"]))
        prob = make_problem(
            np.random.default_rng(draw(st.integers(0, 2**31))),
            context_lens=context_lens, query_lens=query_lens, num_kv_heads=draw(st.integers(1, 2)),
            group=draw(st.sampled_from([1, 3, 4, 8])), head_dim=draw(st.sampled_from([8, 16])),
            block_size=block_size, dtype=dtype, query_dtype=query_dtype,
            pad_tokens=draw(st.integers(0, 1)))
        window = draw(st.sampled_from([None, 5, 33]))
        return prob, window, query_dtype

    def run(op, prob, window, backend):
        out = prob.out()
        if op == "decode":
            gpu_kernels.paged_decode(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                                     prob.context_lens, prob.scale, sliding_window=window,
                                     out=out, backend=backend)
        else:
            gpu_kernels.paged_prefill(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                                      prob.query_start_loc, prob.context_lens, prob.scale,
                                      sliding_window=window, out=out, backend=backend)
        return out

    def test_simulator_is_active():
        from numba import config
        assert config.ENABLE_CUDASIM and cuda_backend.SIMULATED

    @SETTINGS
    @given(problems(decode_only=True))
    def test_decode_matches_reference(case):
        prob, window, qdtype = case
        prob.query = prob.query[:len(prob.context_lens)]
        assert_close(run("decode", prob, window, "cuda"), run("decode", prob, window, "reference"),
                     qdtype)

    @SETTINGS
    @given(problems(decode_only=False))
    def test_prefill_mixed_batch_matches_reference(case):
        prob, window, qdtype = case
        prob.query = prob.query[:prob.query_start_loc[-1]]
        assert_close(run("prefill", prob, window, "cuda"),
                     run("prefill", prob, window, "reference"), qdtype)

    @SETTINGS
    @given(problems(decode_only=False))
    def test_write_kv_matches_reference(case):
        prob, _, _ = case
        ref_k, ref_v = prob.k_cache.copy(), prob.v_cache.copy()
        gpu_kernels.write_kv(prob.key, prob.value, ref_k, ref_v, prob.slot_mapping,
                             backend="reference")
        gpu_kernels.write_kv(prob.key, prob.value, prob.k_cache, prob.v_cache, prob.slot_mapping,
                             backend="cuda")
        np.testing.assert_array_equal(prob.k_cache.view(np.uint8), ref_k.view(np.uint8))
        np.testing.assert_array_equal(prob.v_cache.view(np.uint8), ref_v.view(np.uint8))

    @pytest.mark.parametrize("target_blocks", [1, 64])
    def test_split_k_merge_in_kernel(monkeypatch, target_blocks):
        """One split per sequence, and many (merged by the last block), give the same answer."""
        monkeypatch.setattr(cuda_backend, "decode_target_blocks", target_blocks)
        prob = make_problem(np.random.default_rng(11), context_lens=[150, 3], query_lens=[1, 1],
                            num_kv_heads=1, group=2, head_dim=8, block_size=16)
        for _ in range(2):          # the merge counters must be reset for the next call
            assert_close(run("decode", prob, None, "cuda"),
                         run("decode", prob, None, "reference"), "float32")

    @pytest.mark.parametrize("tile", [(32, 16, 32), (64, 64, 32)])
    def test_prefill_tile_shapes(monkeypatch, tile):
        """Other tiles (threads, query rows, keys) than the simulator's (16, 32, 16): a row of
        scores over 8 or 4 threads, 4 x 4 or 4 x 8 scores per thread."""
        monkeypatch.setattr(cuda_backend, "PREFILL_TILES", {16: tile})
        prob = make_problem(np.random.default_rng(5), context_lens=[70, 40, 9],
                            query_lens=[70, 9, 1], num_kv_heads=2, group=4, head_dim=16,
                            block_size=4, dtype="float16", query_dtype="float32")
        prob.query = prob.query[:prob.query_start_loc[-1]]
        for window in (None, 33):
            assert_close(run("prefill", prob, window, "cuda"),
                         run("prefill", prob, window, "reference"), "float32")

    def test_prefill_loads_the_query_element_by_element(monkeypatch):
        """The load a strided query (a view into a fused QKV buffer) takes on a GPU; the
        simulator only passes contiguous arrays, so the backend is told this one is not."""
        monkeypatch.setattr(cuda_backend, "_c_contiguous", lambda arr: False)
        prob = make_problem(np.random.default_rng(8), context_lens=[40, 9], query_lens=[40, 1],
                            num_kv_heads=2, group=4, head_dim=16, block_size=4, dtype="float16",
                            query_dtype="float16")
        prob.query = prob.query[:prob.query_start_loc[-1]]
        assert_close(run("prefill", prob, None, "cuda"), run("prefill", prob, None, "reference"),
                     "float16")

    @pytest.mark.parametrize("tile, message", [((64, 24, 32), "rows must be a power of two"),
                                               ((64, 64, 8), "keys must be .* multiple of 4 x 4")])
    def test_prefill_refuses_tiles_it_cannot_lay_out(monkeypatch, tile, message):
        monkeypatch.setattr(cuda_backend, "PREFILL_TILES", {16: tile})
        prob = make_problem(np.random.default_rng(6), context_lens=[5], query_lens=[5],
                            num_kv_heads=1, group=1, head_dim=16, block_size=4, dtype="float32",
                            query_dtype="float32")
        with pytest.raises(NotImplementedError, match=message):
            run("prefill", prob, None, "cuda")

    def test_prefill_refuses_head_dims_its_output_pass_does_not_cover():
        prob = make_problem(np.random.default_rng(6), context_lens=[5], query_lens=[5], num_kv_heads=1,
                            group=1, head_dim=96, block_size=4, dtype="float32", query_dtype="float32")
        with pytest.raises(NotImplementedError, match="head_dim up to 64 .* got 96"):
            run("prefill", prob, None, "cuda")
