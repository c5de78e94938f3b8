"""gpu_kernels: the CUDA kernels under Numba's CUDA simulator, against the NumPy reference.

``NUMBA_ENABLE_CUDASIM=1`` must be set before ``numba.cuda`` is first
imported, so the outer test re-runs this file in a subprocess with the
variable set; there the simulator tests below are collected instead. The
outer process starts that subprocess as soon as collection is over (see
``conftest.py``), so it runs beside the rest of the suite, and relays its
progress when its turn comes.

The simulator runs every thread as a Python thread, and its cost grows with
threads x blocks: each case below is the smallest problem that reaches one
kernel path (its id says which), and together they reach every path once:
decode with one split and with split-K merging (also past a sequence's end),
page-aligned and straddling stages, GQA groups of 1 / 3 / 4 / 8 (heads padded
to a power of two, two head chunks), sliding windows shorter and longer than
the context, float32 / float16 / bfloat16 caches with float32 or matching
queries; prefill tiles (the simulator's and two others), full prefills,
chunks and decodes in one batch, interior and masked key tiles, row padding,
strided queries; write_kv with padding slots.
"""
import os

import numpy as np
import pytest

IN_SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

if not IN_SIMULATOR:

    @pytest.mark.slow
    def test_cuda_kernels_in_the_simulator(request, capsys):
        from conftest import relay_cudasim_run

        returncode, out = relay_cudasim_run(request.config, __file__, capsys)
        summary = out.strip().splitlines()[-1] if out.strip() else ""
        assert returncode == 0, out[-6000:]
        assert "passed" in summary and "skipped" not in summary, summary

else:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from numba import cuda  # a module global: the simulator rebinds it in a kernel's globals

    import gpu_kernels
    from gpu_kernels.cuda import backend as cuda_backend
    from gpu_kernels.testing import assert_close, make_problem

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

    def check(op, prob, window, qdtype):
        n = len(prob.context_lens) if op == "decode" else prob.query_start_loc[-1]
        prob.query = prob.query[:n]
        assert_close(run(op, prob, window, "cuda"), run(op, prob, window, "reference"), qdtype)

    def test_simulator_is_active():
        from numba import config
        assert config.ENABLE_CUDASIM and cuda_backend.SIMULATED

    # (context_lens, num_kv_heads, group, head_dim, block_size, cache dtype, query dtype,
    #  window, decode_target_blocks)
    DECODE = {
        # 3 splits of 16 keys merged by the last block; the third lies past the context; 2 KV heads
        "split-k-merge-f32-pages-aligned": ([20], 2, 1, 8, 16, "float32", "float32", None, 8),
        # one split; stages straddle 4-token pages; 3 heads padded to 4; window inside the context
        "one-split-f16-gqa3-window": ([9, 3], 1, 3, 16, 4, "float16", "float32", 5, 1),
        # 8 heads in two chunks of 4 (vector head reads); one-token pages cap a split at the block table's 8 entries;
        # a window longer than the context
        "table-capped-splits-bf16-gqa8": ([9], 1, 8, 16, 1, "bfloat16", "bfloat16", 33, 8),
        # a whole key row per lane (no reduce-scatter), 32-key stages over 16-token pages
        "row-per-lane-f16": ([24], 1, 1, 8, 16, "float16", "float16", None, 8),
        # tensor-core stage layout (plain-Numba twin): 4 heads of 16 rows, one split per
        # sequence, 8-key stages in 16-token pages, a sequence shorter than a stage
        "tensor-core-f16-gqa4": ([20, 7], 1, 4, 64, 16, "float16", "float16", None, 1),
        # stages straddling 4-token pages, a window, split-K over 2 splits
        "tensor-core-bf16-window-split": ([40], 1, 2, 64, 4, "bfloat16", "bfloat16", 21, 8),
    }

    @pytest.mark.parametrize("case", list(DECODE.values()), ids=list(DECODE))
    def test_decode_matches_reference(monkeypatch, case):
        ctx, kvh, group, head_dim, block_size, dtype, qdtype, window, target = case
        monkeypatch.setattr(cuda_backend, "decode_target_blocks", target)
        prob = make_problem(np.random.default_rng(len(ctx) + group), context_lens=ctx,
                            query_lens=[1] * len(ctx), num_kv_heads=kvh, group=group,
                            head_dim=head_dim, block_size=block_size, dtype=dtype,
                            query_dtype=qdtype)
        check("decode", prob, window, qdtype)

    def test_decode_stage_routing(monkeypatch):
        """Half queries in the cache's format with head_dim 64 or 128 take the tensor-core
        stage (its plain-Numba twin here); float32 queries, the other half format, head_dim 16
        or 256 and mode "off" keep the CUDA-core stage; a bad mode is named."""
        from gpu_kernels.cuda.primitives import BF16, F16, F32
        choose = cuda_backend._decode_tensor_cores
        assert choose(F16, F16, 128, 4) == 1 and choose(BF16, BF16, 64, 8) == 1
        assert choose(F32, F16, 128, 4) == 0 and choose(BF16, F16, 128, 4) == 0
        assert choose(F16, F16, 16, 4) == 0 and choose(F16, F16, 256, 4) == 0
        assert choose(F32, F32, 128, 4) == 0
        monkeypatch.setattr(cuda_backend, "decode_mma_mode", "off")
        assert choose(F16, F16, 128, 4) == 0
        monkeypatch.setattr(cuda_backend, "decode_mma_mode", "on")
        with pytest.raises(ValueError, match="decode_mma_mode"):
            choose(F16, F16, 128, 4)

    def test_split_k_counters_are_reset_for_the_next_call():
        """The last split's block resets its merge counter: a second call merges again."""
        prob = make_problem(np.random.default_rng(11), context_lens=[20], query_lens=[1],
                            num_kv_heads=1, group=2, head_dim=8, block_size=16)
        prob.query = prob.query[:1]
        first = run("decode", prob, None, "cuda")
        assert_close(first, run("decode", prob, None, "reference"), "float32")
        np.testing.assert_array_equal(run("decode", prob, None, "cuda"), first)

    def test_split_rule_caps_many_short_splits(monkeypatch):
        """Beyond DECODE_MERGE_SPLITS splits, a split keeps DECODE_MIN_CHUNK keys: a table of
        5 pages (80 keys), 8 blocks aimed at, 16-key grain -> 5 splits without the rule, 3
        with it (32-key chunks); the merged output stays right."""
        monkeypatch.setattr(cuda_backend, "decode_target_blocks", 8)
        prob = make_problem(np.random.default_rng(12), context_lens=[64], query_lens=[1],
                            num_kv_heads=1, group=1, head_dim=8, block_size=16)
        prob.query = prob.query[:1]
        plan = lambda: cuda_backend._decode_plan(prob.query, prob.k_cache, prob.block_tables,  # noqa
                                                 0, prob.out())
        assert plan()[2][0] == 5
        monkeypatch.setattr(cuda_backend, "DECODE_MIN_CHUNK", 32)
        monkeypatch.setattr(cuda_backend, "DECODE_MERGE_SPLITS", 1)
        assert plan()[2][0] == 3
        check("decode", prob, None, "float32")

    # (context_lens, query_lens, num_kv_heads, group, head_dim, block_size, cache dtype,
    #  query dtype, windows)
    PREFILL = {
        # a full prefill, a chunk (its first key tile interior) and a decode in one batch
        "mixed-batch-f16-gqa4": ([24, 20, 9], [24, 6, 1], 1, 4, 16, 4, "float16", "float32",
                                 (None, 5)),
        # 3 heads: 30 of 32 tile rows used; one-token pages; window longer than the context
        "row-padding-bf16-gqa3": ([12], [12], 1, 3, 8, 1, "bfloat16", "bfloat16", (33,)),
        # one head per row, 2 KV heads, whole-page key tiles, a window cutting key tiles away
        "kv-heads-f32-window": ([20], [20], 2, 1, 16, 16, "float32", "float32", (5,)),
        # 8 heads: 4 tokens per tile
        "gqa8-f16": ([6, 1], [6, 1], 1, 8, 16, 16, "float16", "float16", (None,)),
    }

    @pytest.mark.parametrize("case", list(PREFILL.values()), ids=list(PREFILL))
    def test_prefill_matches_reference(case):
        ctx, qlens, kvh, group, head_dim, block_size, dtype, qdtype, windows = case
        prob = make_problem(np.random.default_rng(len(ctx) + group), context_lens=ctx,
                            query_lens=qlens, num_kv_heads=kvh, group=group, head_dim=head_dim,
                            block_size=block_size, dtype=dtype, query_dtype=qdtype)
        for window in windows:
            check("prefill", prob, window, qdtype)

    @pytest.mark.parametrize("tile", [(32, 16, 32), (64, 64, 32)])
    def test_prefill_tile_shapes(monkeypatch, tile):
        """Other tiles (threads, query rows, keys) than the simulator's (16, 32, 16): a row of
        scores over 8 or 4 threads, 4 x 4 or 4 x 8 scores per thread."""
        monkeypatch.setattr(cuda_backend, "PREFILL_TILES", {16: tile})
        prob = make_problem(np.random.default_rng(5), context_lens=[40, 9], query_lens=[40, 1],
                            num_kv_heads=1, group=4, head_dim=16, block_size=4, dtype="float16",
                            query_dtype="float32")
        check("prefill", prob, 33, "float32")

    def test_prefill_loads_the_query_element_by_element(monkeypatch):
        """The load a strided query (a view into a fused QKV buffer) takes on a GPU; the
        simulator only passes contiguous arrays, so the backend is told this one is not."""
        monkeypatch.setattr(cuda_backend, "_c_contiguous", lambda arr: False)
        prob = make_problem(np.random.default_rng(8), context_lens=[20, 9], query_lens=[20, 1],
                            num_kv_heads=1, group=4, head_dim=16, block_size=4, dtype="float16",
                            query_dtype="float16")
        check("prefill", prob, None, "float16")

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

    @settings(max_examples=4, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def test_random_small_prefill_batches_match_reference(data):
        """A few random mixes of the above (prefill's blocks are the cheap ones to simulate)."""
        draw = data.draw
        context_lens = draw(st.lists(st.integers(1, 24), min_size=1, max_size=2))
        dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
        qdtype = draw(st.sampled_from([dtype, "float32"]))
        prob = make_problem(
            np.random.default_rng(draw(st.integers(0, 2**31))), context_lens=context_lens,
            query_lens=[draw(st.sampled_from([1, c, min(c, 9)])) for c in context_lens],
            num_kv_heads=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 3, 4, 8])),
            head_dim=draw(st.sampled_from([8, 16])), block_size=draw(st.sampled_from([1, 4, 16])),
            dtype=dtype, query_dtype=qdtype)
        check("prefill", prob, draw(st.sampled_from([None, 5, 33])), qdtype)

    @settings(max_examples=6, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
           context_lens=st.lists(st.integers(1, 20), min_size=1, max_size=2),
           block_size=st.sampled_from([1, 4, 16]), pad_tokens=st.integers(0, 1),
           seed=st.integers(0, 2**31))
    def test_write_kv_matches_reference(dtype, context_lens, block_size, pad_tokens, seed):
        prob = make_problem(np.random.default_rng(seed), context_lens=context_lens,
                            query_lens=[min(c, 3) for c in context_lens], num_kv_heads=2, group=1,
                            head_dim=8, block_size=block_size, dtype=dtype, pad_tokens=pad_tokens)
        ref_k, ref_v = prob.k_cache.copy(), prob.v_cache.copy()
        gpu_kernels.write_kv(prob.key, prob.value, ref_k, ref_v, prob.slot_mapping,
                             backend="reference")
        gpu_kernels.write_kv(prob.key, prob.value, prob.k_cache, prob.v_cache, prob.slot_mapping,
                             backend="cuda")
        np.testing.assert_array_equal(prob.k_cache.view(np.uint8), ref_k.view(np.uint8))
        np.testing.assert_array_equal(prob.v_cache.view(np.uint8), ref_v.view(np.uint8))

    def test_device_functions_keep_the_fake_module_when_calls_interleave():
        """The simulator swaps a device function's global ``cuda`` per call
        (``numba/cuda/simulator/kernelapi.py``, ``swapped_cuda_module``): thread A enters
        while the real module is bound (and will restore it), thread B enters after it,
        A leaves -- B must still reach the launch's ``syncthreads``. Replays that order
        with the library's own context manager, as our launches run it."""
        from numba import cuda
        from numba.cuda.simulator.kernel import _push_kernel_context
        from numba.cuda.simulator.kernelapi import FakeCUDAModule, swapped_cuda_module

        from gpu_kernels.cuda import primitives

        fake = FakeCUDAModule((1, 1, 1), (2, 1, 1), 0)
        fn = primitives.shfl_xor.fn
        with _push_kernel_context(fake), primitives.simulated_launch():
            a, b = swapped_cuda_module(fn, fake), swapped_cuda_module(fn, fake)
            a.__enter__()
            b.__enter__()
            a.__exit__(None, None, None)
            assert primitives.cuda.syncthreads == fake.syncthreads     # B, still inside
            b.__exit__(None, None, None)
        assert primitives.cuda is cuda

    def test_the_waiting_block_scheduler_keeps_the_simulators_rules():
        """conftest.py installs ``cudasim_blocks`` (a block scheduler that waits for its threads
        instead of polling them) in this process: a barrier opens when every thread still running
        reaches it (two threads of each block return before it), what a block writes to shared
        memory before a barrier it reads after it, and a thread's exception is raised at the launch
        with its thread index while the threads waiting at the barrier are aborted."""
        from numba.cuda.simulator import kernel as sim

        import cudasim_blocks

        assert sim.BlockManager.run is cudasim_blocks._run_block

        @cuda.jit
        def reverse_six(x, out):
            buf = cuda.shared.array(8, dtype=np.float32)
            i = cuda.threadIdx.x
            if i >= 6:
                return
            buf[i] = x[cuda.blockIdx.x * 8 + i]
            cuda.syncthreads()
            out[cuda.blockIdx.x * 8 + i] = buf[5 - i]
            cuda.syncthreads()
            buf[i] = 0
            cuda.syncthreads()
            out[cuda.blockIdx.x * 8 + i] += buf[5 - i] + 1

        x, out = np.arange(16, dtype=np.float32), np.zeros(16, np.float32)
        reverse_six[2, 8](x, out)
        assert out.tolist() == [6, 5, 4, 3, 2, 1, 0, 0, 14, 13, 12, 11, 10, 9, 0, 0]

        @cuda.jit
        def third_fails(out):
            i = cuda.threadIdx.x
            if i == 3:
                raise ValueError("thread three")
            cuda.syncthreads()
            out[i] = 1

        marks = np.zeros(4, np.float32)
        with pytest.raises(ValueError, match=r"tid=\[3, 0, 0\] ctaid=\[0, 0, 0\]: thread three"):
            third_fails[1, 4](marks)
        assert not marks.any()      # the others never passed the barrier
