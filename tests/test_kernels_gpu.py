"""gpu_kernels: the CUDA kernels on a real GPU, on torch tensors, against the NumPy reference.

Skipped where ``numba.cuda`` finds no GPU (CI). Sizes are real: long ragged
contexts (many partitions and splits), GQA 1/4/8, head_dim 64/128/256,
float32/float16/bfloat16 caches, sliding windows, mixed prefill + decode
batches.
"""
import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("real-GPU tests do not run under the CUDA simulator", allow_module_level=True)

from numba import cuda  # noqa: E402

if not cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gpu_kernels  # noqa: E402
from gpu_kernels.cuda import backend as cuda_backend  # noqa: E402
from gpu_kernels.testing import assert_close, make_problem  # noqa: E402

SETTINGS = settings(max_examples=10, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def to_torch(a):
    """NumPy (float16/float32, or uint16 bf16 bits) -> torch CUDA tensor of the real dtype."""
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def to_numpy(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(np.uint16)
    return t.cpu().numpy()


@st.composite
def problems(draw, *, decode_only):
    num_seqs = draw(st.integers(1, 6))
    context_lens = draw(st.lists(st.integers(1, 3000), min_size=num_seqs, max_size=num_seqs))
    if decode_only:
        query_lens = [1] * num_seqs
    else:
        query_lens = [draw(st.sampled_from([1, c, min(c, 37), min(c, 200)])) for c in context_lens]
    dtype = draw(st.sampled_from(["float16", "bfloat16", "float32"]))
    prob = make_problem(
        np.random.default_rng(draw(st.integers(0, 2**31))),
        context_lens=context_lens, query_lens=query_lens,
        num_kv_heads=draw(st.sampled_from([1, 2, 8])), group=draw(st.sampled_from([1, 4, 8])),
        head_dim=draw(st.sampled_from([64, 128, 256])), block_size=draw(st.sampled_from([1, 16])),
        dtype=dtype, query_dtype=draw(st.sampled_from([dtype, "float32"])),
        pad_tokens=draw(st.integers(0, 2)))
    window = draw(st.sampled_from([None, None, 100, 1024]))
    return prob, window


def gpu_run(op, prob, window):
    args = {k: to_torch(getattr(prob, k)) for k in
            ("query", "k_cache", "v_cache", "block_tables", "context_lens", "query_start_loc")}
    out = to_torch(prob.out())
    if op == "decode":
        gpu_kernels.paged_decode(args["query"], args["k_cache"], args["v_cache"],
                                 args["block_tables"], args["context_lens"], prob.scale,
                                 sliding_window=window, out=out)
    else:
        gpu_kernels.paged_prefill(args["query"], args["k_cache"], args["v_cache"],
                                  args["block_tables"], args["query_start_loc"],
                                  args["context_lens"], prob.scale, sliding_window=window, out=out)
    torch.cuda.synchronize()
    return to_numpy(out)


def ref_run(op, prob, window):
    out = prob.out()
    if op == "decode":
        gpu_kernels.paged_decode(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                                 prob.context_lens, prob.scale, sliding_window=window, out=out,
                                 backend="cpu")
    else:
        gpu_kernels.paged_prefill(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                                  prob.query_start_loc, prob.context_lens, prob.scale,
                                  sliding_window=window, out=out, backend="cpu")
    return out


def qdtype(prob):
    return {"u": "bfloat16"}.get(prob.query.dtype.kind, str(prob.query.dtype))


@SETTINGS
@given(problems(decode_only=True))
def test_decode_matches_cpu_backend(case):
    prob, window = case
    prob.query = prob.query[:len(prob.context_lens)]
    assert_close(gpu_run("decode", prob, window), ref_run("decode", prob, window), qdtype(prob))


@SETTINGS
@given(problems(decode_only=False))
def test_prefill_mixed_batch_matches_cpu_backend(case):
    prob, window = case
    prob.query = prob.query[:prob.query_start_loc[-1]]
    assert_close(gpu_run("prefill", prob, window), ref_run("prefill", prob, window),
                 qdtype(prob))


def test_small_decode_matches_reference_exactly_defined():
    """The CPU backend is itself checked against the reference; close the loop once here."""
    prob = make_problem(np.random.default_rng(0), context_lens=[1, 17, 300, 2049],
                        query_lens=[1, 1, 1, 1], num_kv_heads=2, group=4, head_dim=128,
                        dtype="float16")
    ref = prob.out()
    gpu_kernels.paged_decode(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                             prob.context_lens, prob.scale, out=ref, backend="reference")
    assert_close(gpu_run("decode", prob, None), ref, "float16")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_write_kv_on_torch_tensors(dtype):
    prob = make_problem(np.random.default_rng(1), context_lens=[40, 700, 3], query_lens=[40, 1, 3],
                        num_kv_heads=8, head_dim=128, dtype=dtype, pad_tokens=3)
    kc, vc = to_torch(prob.k_cache), to_torch(prob.v_cache)
    gpu_kernels.write_kv(to_torch(prob.key), to_torch(prob.value), kc, vc,
                         to_torch(prob.slot_mapping))
    torch.cuda.synchronize()
    gpu_kernels.write_kv(prob.key, prob.value, prob.k_cache, prob.v_cache, prob.slot_mapping,
                         backend="reference")
    np.testing.assert_array_equal(to_numpy(kc).view(np.uint8), prob.k_cache.view(np.uint8))
    np.testing.assert_array_equal(to_numpy(vc).view(np.uint8), prob.v_cache.view(np.uint8))


@pytest.mark.parametrize("target_blocks", [1, 2048])
def test_split_k_extremes(monkeypatch, target_blocks):
    monkeypatch.setattr(cuda_backend, "decode_target_blocks", target_blocks)
    monkeypatch.setattr(cuda_backend, "DECODE_MIN_CHUNK", 0)      # as many splits as asked for
    prob = make_problem(np.random.default_rng(2), context_lens=[8000, 5, 1300], query_lens=[1] * 3,
                        num_kv_heads=8, group=4, head_dim=128, dtype="float16")
    for _ in range(3):
        assert_close(gpu_run("decode", prob, None), ref_run("decode", prob, None), "float16")


@pytest.mark.parametrize("dtype, head_dim, group, window", [("float16", 128, 4, None),
                                                             ("bfloat16", 64, 8, 100),
                                                             ("float16", 256, 1, None)])
def test_tensor_core_prefill_agrees_with_its_numba_twin(monkeypatch, dtype, head_dim, group,
                                                        window):
    """mma.sync through the linked CUDA C++ vs the plain-Numba products of the same tiling (the
    simulator's path): the same function up to float32 summation order (which can move a
    probability across a rounding boundary of the half format: one unit in its last place).
    Outputs in float32 (``out`` has its own format), so that rounding the output to the half
    format does not hide a difference."""
    from gpu_kernels.cuda import mma
    assert mma.mma_supported(), "this GPU should run mma.sync (compute capability >= 8.0)"
    prob = make_problem(np.random.default_rng(7), context_lens=[700, 33, 1],
                        query_lens=[300, 33, 1], num_kv_heads=2, group=group, head_dim=head_dim,
                        block_size=16, dtype=dtype)
    prob.query = prob.query[:prob.query_start_loc[-1]]
    outs = {}
    for mode in ("auto", "numba"):
        monkeypatch.setattr(cuda_backend, "prefill_mma_mode", mode)
        args = {k: to_torch(getattr(prob, k)) for k in
                ("query", "k_cache", "v_cache", "block_tables", "context_lens", "query_start_loc")}
        out = torch.full(prob.query.shape, float("nan"), dtype=torch.float32, device="cuda")
        gpu_kernels.paged_prefill(args["query"], args["k_cache"], args["v_cache"],
                                  args["block_tables"], args["query_start_loc"],
                                  args["context_lens"], prob.scale, sliding_window=window, out=out)
        torch.cuda.synchronize()
        outs[mode] = out.cpu().numpy()
    assert np.isfinite(outs["auto"]).all()
    np.testing.assert_allclose(outs["auto"], outs["numba"], rtol=0,
                               atol={"float16": 5e-4, "bfloat16": 4e-3}[dtype])
    ref = np.full(prob.query.shape, np.nan, np.float32)
    gpu_kernels.paged_prefill(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                              prob.query_start_loc, prob.context_lens, prob.scale,
                              sliding_window=window, out=ref, backend="reference")
    assert_close(outs["auto"], ref, dtype)


@pytest.mark.parametrize("dtype, head_dim, group, window, target", [
    ("float16", 128, 4, None, None), ("bfloat16", 64, 8, 100, None),
    ("float16", 64, 2, None, 2048), ("bfloat16", 128, 4, 700, 1)])
def test_tensor_core_decode_agrees_with_its_numba_twin(monkeypatch, dtype, head_dim, group,
                                                       window, target):
    """The decode stage on mma.sync vs its plain-Numba twin (the simulator's path) vs the
    CUDA-core stage: the same function up to float32 summation order and P's rounding to the
    half format (the twin rounds P as the tensor cores do). Outputs in float32."""
    from gpu_kernels.cuda import mma
    assert mma.mma_supported(), "this GPU should run mma.sync (compute capability >= 8.0)"
    monkeypatch.setattr(cuda_backend, "decode_target_blocks", target)
    prob = make_problem(np.random.default_rng(5), context_lens=[2900, 1, 17, 1000],
                        query_lens=[1] * 4, num_kv_heads=2, group=group, head_dim=head_dim,
                        block_size=16, dtype=dtype, query_dtype=dtype)
    prob.query = prob.query[:4]
    args = {k: to_torch(getattr(prob, k)) for k in
            ("query", "k_cache", "v_cache", "block_tables", "context_lens")}
    outs = {}
    for mode in ("auto", "numba", "off"):
        monkeypatch.setattr(cuda_backend, "decode_mma_mode", mode)
        outs[mode] = _decode_to_float32(args, prob, window)
    assert np.isfinite(outs["auto"]).all()
    atol = {"float16": 5e-4, "bfloat16": 4e-3}[dtype]
    np.testing.assert_allclose(outs["auto"], outs["numba"], rtol=0, atol=atol)
    np.testing.assert_allclose(outs["auto"], outs["off"], rtol=0, atol=atol)
    assert_close(outs["auto"], _reference_decode(prob, window), dtype)


def _decode_to_float32(args, prob, window):
    """``paged_decode`` on the GPU tensors ``args`` of ``prob`` into a NaN-poisoned float32 output."""
    out = torch.full(prob.query.shape, float("nan"), dtype=torch.float32, device="cuda")
    gpu_kernels.paged_decode(args["query"], args["k_cache"], args["v_cache"],
                             args["block_tables"], args["context_lens"], prob.scale,
                             sliding_window=window, out=out)
    torch.cuda.synchronize()
    return out.cpu().numpy()


def _reference_decode(prob, window):
    ref = np.full(prob.query.shape, np.nan, np.float32)
    gpu_kernels.paged_decode(prob.query, prob.k_cache, prob.v_cache, prob.block_tables,
                             prob.context_lens, prob.scale, sliding_window=window, out=ref,
                             backend="reference")
    return ref


def _few_pairs_problem():
    prob = make_problem(np.random.default_rng(9), context_lens=[2900, 1, 17, 1000],
                        query_lens=[1] * 4, num_kv_heads=2, group=4, head_dim=128,
                        block_size=16, dtype="float16", query_dtype="float16")
    prob.query = prob.query[:4]
    args = {k: to_torch(getattr(prob, k)) for k in
            ("query", "k_cache", "v_cache", "block_tables", "context_lens")}
    return prob, args


@pytest.mark.parametrize("shape", [(256, 3, 1), (256, 4, 1)])
def test_decode_with_few_pairs_takes_larger_blocks(monkeypatch, shape):
    """Few (sequence, head block) pairs (4 x 2 here) take blocks of ``shape[0]`` threads with
    deeper rings: the same function as the default blocks up to float32 summation order (the
    keys meet other warps), and the reference's outputs. One split per sequence (the ring
    turns many times) and the default splits, a window."""
    prob, args = _few_pairs_problem()
    monkeypatch.setattr(cuda_backend, "decode_mma_mode", "auto")
    for target, window in ((1, None), (None, 700)):
        monkeypatch.setattr(cuda_backend, "decode_target_blocks", target)
        outs, threads = {}, {}
        for few in (None, shape):
            monkeypatch.setattr(cuda_backend, "DECODE_FEW_PAIRS_SHAPE", few)
            outs[few] = _decode_to_float32(args, prob, window)
            threads[few] = cuda_backend.last_kernels["decode_threads"]
        assert threads == {None: cuda_backend.DECODE_THREADS, shape: shape[0]}
        assert np.isfinite(outs[shape]).all()
        np.testing.assert_allclose(outs[shape], outs[None], rtol=0, atol=5e-4)
        assert_close(outs[shape], _reference_decode(prob, window), "float16")


def test_decode_l2_hints_change_no_output(monkeypatch):
    """The K/V copies with L2 qualifiers (an evict_first policy, prefetch sizes) give bit for
    bit the outputs of plain copies; an unknown qualifier is refused by name."""
    from gpu_kernels.cuda.shared_memory import cp_async16_hinted
    prob, args = _few_pairs_problem()
    monkeypatch.setattr(cuda_backend, "decode_mma_mode", "auto")
    plain = _decode_to_float32(args, prob, 700)
    plain_kernel = cuda_backend.last_kernels["decode"]
    for hint in (("evict_first",), ("L2::128B", "evict_first")):
        monkeypatch.setattr(cuda_backend, "DECODE_L2_HINT", hint)
        np.testing.assert_array_equal(_decode_to_float32(args, prob, 700), plain)
    monkeypatch.setattr(cuda_backend, "DECODE_L2_HINT", ())
    monkeypatch.setattr(cuda_backend, "DECODE_EVICT_FIRST_L2", 4)   # a few MB: under 4x L2
    np.testing.assert_array_equal(_decode_to_float32(args, prob, 700), plain)
    assert cuda_backend.last_kernels["decode"] is not plain_kernel   # the evict_first build
    with pytest.raises(ValueError, match="L2::512B"):
        cp_async16_hinted(("L2::512B",))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_core_prefill_with_rising_scores(dtype):
    """Scores rising ~0.2 log2 units per key: a row's maximum rises by ~6.4 over a 32-key
    tile (below the rescale slack: kept) and by more over two (moved); see
    test_kernels_mma.grow_scores."""
    from test_kernels_mma import grow_scores
    prob = make_problem(np.random.default_rng(12), context_lens=[600, 90], query_lens=[600, 37],
                        num_kv_heads=2, group=4, head_dim=128, block_size=16, dtype=dtype,
                        query_dtype=dtype)
    prob.query = prob.query[:prob.query_start_loc[-1]]
    grow_scores(prob, 0.2)
    assert_close(gpu_run("prefill", prob, None), ref_run("prefill", prob, None), dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_core_prefill_into_a_strided_output(dtype):
    """A contiguous half output is written as words, a view into a wider tensor element by
    element: the same values either way, and nothing outside the view is touched."""
    prob = make_problem(np.random.default_rng(13), context_lens=[300, 45], query_lens=[300, 1],
                        num_kv_heads=2, group=4, head_dim=128, block_size=16, dtype=dtype,
                        query_dtype=dtype)
    prob.query = prob.query[:prob.query_start_loc[-1]]
    args = [to_torch(getattr(prob, k)) for k in
            ("query", "k_cache", "v_cache", "block_tables", "query_start_loc", "context_lens")]
    whole = torch.full_like(args[0], float("nan"))
    wide = torch.full(args[0].shape[:2] + (256,), 7.0, dtype=args[0].dtype, device="cuda")
    part = wide[:, :, 64:192]
    for out in (whole, part):
        gpu_kernels.paged_prefill(*args, prob.scale, out=out)
    torch.cuda.synchronize()
    assert torch.equal(part, whole)
    assert (wide[:, :, :64] == 7).all() and (wide[:, :, 192:] == 7).all()
    assert_close(to_numpy(whole), ref_run("prefill", prob, None), dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_core_prefill_window_across_a_warps_rows(dtype):
    """One head per block (GQA group 1): a warp's 32 rows are 32 consecutive queries, and a
    key tile can lie inside the window of its first queries but before that of its last one
    (chunk at positions 80..279, window 100). Such a tile must not be skipped."""
    prob = make_problem(np.random.default_rng(9), context_lens=[280], query_lens=[200],
                        num_kv_heads=2, group=1, head_dim=128, block_size=16, dtype=dtype)
    assert_close(gpu_run("prefill", prob, 100), ref_run("prefill", prob, 100), dtype)


def test_repeated_calls_follow_scale_window_and_metadata_written_in_place():
    """Views are cached per tensor pointer and launch parameters packed once per argument
    tuple: a later call on the same tensors with another scale or window, or with context
    lengths written into the same tensor, must compute with those."""
    prob = make_problem(np.random.default_rng(3), context_lens=[700, 33, 1200],
                        query_lens=[1] * 3, num_kv_heads=2, group=4, head_dim=128,
                        dtype="float16")
    prob.query = prob.query[:3]
    args = {k: to_torch(getattr(prob, k)) for k in
            ("query", "k_cache", "v_cache", "block_tables", "context_lens")}
    out = to_torch(prob.out())
    base_scale = prob.scale
    for scale, window, lens in [(base_scale, None, [700, 33, 1200]),
                                (base_scale * 3, 100, [700, 33, 1200]),
                                (base_scale, None, [650, 20, 1190])]:
        prob.scale, prob.context_lens = scale, np.array(lens, np.int32)
        args["context_lens"].copy_(torch.from_numpy(prob.context_lens))
        gpu_kernels.paged_decode(args["query"], args["k_cache"], args["v_cache"],
                                 args["block_tables"], args["context_lens"], scale,
                                 sliding_window=window, out=out)
        torch.cuda.synchronize()
        assert_close(to_numpy(out), ref_run("decode", prob, window), "float16")
    from gpu_kernels.cuda.launch import Launcher
    assert Launcher.fast, f"launches fell back to Numba's path: {Launcher.fallback}"


def test_same_memory_in_another_format_gets_its_own_view():
    """A cache viewed as bfloat16 has the pointer and shape of its float16 self: the cached
    view must still follow the format."""
    prob = make_problem(np.random.default_rng(4), context_lens=[300], query_lens=[1],
                        num_kv_heads=2, group=4, head_dim=128, dtype="float16")
    prob.query = prob.query[:1]
    kc, vc = to_torch(prob.k_cache), to_torch(prob.v_cache)
    rest = {k: to_torch(getattr(prob, k)) for k in ("query", "block_tables", "context_lens")}
    for dtype in ("float16", "bfloat16"):
        k_t, v_t = (kc, vc) if dtype == "float16" else (kc.view(torch.bfloat16),
                                                       vc.view(torch.bfloat16))
        out = torch.full(prob.query.shape, float("nan"), dtype=torch.float32, device="cuda")
        gpu_kernels.paged_decode(rest["query"], k_t, v_t, rest["block_tables"],
                                 rest["context_lens"], prob.scale, out=out)
        torch.cuda.synchronize()
        host = prob.k_cache if dtype == "float16" else prob.k_cache.view(np.uint16)
        host_v = prob.v_cache if dtype == "float16" else prob.v_cache.view(np.uint16)
        ref = np.full(prob.query.shape, np.nan, np.float32)
        gpu_kernels.paged_decode(prob.query, host, host_v, prob.block_tables, prob.context_lens,
                                 prob.scale, out=ref, backend="cpu")
        assert_close(out.cpu().numpy(), ref, dtype)


def test_kernels_run_on_the_callers_torch_stream():
    """The query is written on a side stream behind a long sleep; a launch on any other
    stream would read it before the write lands."""
    prob = make_problem(np.random.default_rng(5), context_lens=[900, 40], query_lens=[1, 1],
                        num_kv_heads=2, group=4, head_dim=128, dtype="float16")
    prob.query = prob.query[:2]
    args = {k: to_torch(getattr(prob, k)) for k in
            ("k_cache", "v_cache", "block_tables", "context_lens")}
    source = to_torch(prob.query)
    query = torch.zeros_like(source)
    out = to_torch(prob.out())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for _ in range(2):                                   # the second call: cached launch
        out.fill_(float("nan"))
        query.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
            query.copy_(source)
            gpu_kernels.paged_decode(query, args["k_cache"], args["v_cache"],
                                     args["block_tables"], args["context_lens"], prob.scale,
                                     out=out)
        torch.cuda.synchronize()
        assert_close(to_numpy(out), ref_run("decode", prob, None), "float16")
