"""The fused CPU decode step against the Paddle layers it replaces, token for token."""

import contextlib
import threading

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine import LLM, SamplingParams
from engine.block_linear import BlockWeight
from engine.config import EngineConfig
from engine.fused_decode import FusedDecode, fused_decode_support, typed_list
from engine.loader.gguf_blocks import unpack
from gpu_kernels.cpu import decode_step as kernel
from gpu_kernels.cpu.sync import STRIDE
from tiny_models import make_tiny_model, tiny_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)


def assert_same_decoding(reference, fused):
    for ref, out in zip(reference, fused):
        ref_ids, ids = ref.outputs[0].token_ids, out.outputs[0].token_ids
        assert ids == ref_ids
        for tok, lp_ref, lp in zip(ids, ref.outputs[0].logprobs, out.outputs[0].logprobs):
            assert abs(lp[tok].logprob - lp_ref[tok].logprob) <= 1e-4


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_fused_decode_matches_paddle_layers_on_tiny_models(tmp_path, architecture):
    model = make_tiny_model(str(tmp_path), architecture, seed=5)
    prompts = tiny_prompts(4)  # one batch of four decoding sequences, then single ones as they finish
    outputs = {}
    for path in ("paddle", "fused"):
        llm = LLM(model=model, cpu_decode=path, block_size=4)
        assert llm.snapshot().decode_path == path
        outputs[path] = llm.generate(prompts, GREEDY) + llm.generate(prompts[:1], GREEDY)
        llm.shutdown()
    assert_same_decoding(outputs["paddle"], outputs["fused"])


def test_float_linears_with_more_items_than_block_rows_decode_like_paddle(tmp_path):
    """A float checkpoint whose MLP has more items of input rows (`K_ROWS` each) than a block linear's
    bound on a phase's items (a 1024-input down projection: 16 items): the team's marks cover them,
    and two threads decode as the Paddle layers do, the same again on a second run."""
    model = make_tiny_model(str(tmp_path), hidden=512, heads=4, kv_heads=2, seed=8)
    prompts = tiny_prompts(2)
    outputs = {}
    for path in ("paddle", "fused"):
        llm = LLM(model=model, cpu_decode=path, block_size=4, enable_prefix_caching=False)
        if path == "fused":
            llm.engine.runner.fused_decode.threads = 2
        outputs[path] = llm.generate(prompts, GREEDY)
        if path == "fused":
            again = llm.generate(prompts, GREEDY)
            assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs[path]]
            fused = llm.engine.runner.fused_decode  # a phase's marks hold one per item: none written past them
            assert fused.marks.shape[1] >= max(kernel.float_items(w.shape[0]) for w in fused.float_w) == 16
        llm.shutdown()
    assert_same_decoding(outputs["paddle"], outputs["fused"])


@contextlib.contextmanager
def paddle_decode(llm):
    """Run the same engine's decode steps through the Paddle layers for a while."""
    runner = llm.engine.runner
    fused, runner.fused_decode = runner.fused_decode, None
    try:
        yield
    finally:
        runner.fused_decode = fused


def test_fused_decode_matches_paddle_layers_on_smollm2(smollm2_llm):
    """Five sequences (the micro-kernel, the LM head's int8 rows included), then one (dot products)."""
    assert smollm2_llm.snapshot().decode_path == "fused"
    prompts = ["Tell me a story about a dragon.", "What is the capital of France?", "List three fruits.",
               "Why is the sky blue?", "Write a haiku about rain."]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    fused = smollm2_llm.generate(prompts, params) + smollm2_llm.generate(prompts[:1], params)
    with paddle_decode(smollm2_llm):
        reference = smollm2_llm.generate(prompts, params) + smollm2_llm.generate(prompts[:1], params)
    assert_same_decoding(reference, fused)


NO_PARTIALS = (np.zeros(0, np.float32), np.full(1, -1, np.int64))  # no float32 linear: no partial products


def random_blocks(rng, qtype, out_features, in_features):
    """A random weight in ``qtype``'s blocks: gguf's quantizer, or (Q4_K, which gguf-py cannot
    quantize) random super-blocks with small f16 d / dmin -- any other bytes are valid (Q6_K alike:
    its f16 d last)."""
    if qtype not in (QT.Q4_K, QT.Q6_K):
        raw = gguf.quants.quantize(rng.standard_normal((out_features, in_features)).astype(np.float32), qtype)
        return unpack(raw, qtype, (out_features, in_features))
    size, halves = (144, (0, 2)) if qtype == QT.Q4_K else (210, (208,))
    raw = rng.integers(0, 256, (out_features * in_features // 256, size), dtype=np.uint8)
    for at in halves:
        raw[:, at:at + 2] = (rng.random((len(raw), 1)) * 0.01).astype(np.float16).view(np.uint8)
    return unpack(raw.reshape(out_features, -1), qtype, (out_features, in_features))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q4_K, QT.Q6_K])
@pytest.mark.parametrize("tokens", [1, 3, 5, 17])  # dot products; the micro-kernel, 16 + 8 token columns
def test_block_linears_compute_with_the_checkpoint_weights(qtype, tokens):
    rng = np.random.default_rng(int(qtype) + tokens)
    out_features, in_features = 70, (256 if qtype in (QT.Q4_K, QT.Q6_K) else 96)
    blocks = random_blocks(rng, qtype, out_features, in_features)

    class Layer:  # what FusedDecode reads from a native Linear
        block_weight = BlockWeight(blocks)
    f2, i8, u8 = np.zeros((1, 1), np.float32), np.zeros((1, 1), np.int8), np.zeros((1, 1), np.uint8)
    fmt, _, codes, nibbles, scales, offsets = FusedDecode._linear(FusedDecode.__new__(FusedDecode), Layer, f2, i8, u8)
    assert fmt == (kernel.INT8 if qtype in (QT.Q8_0, QT.Q5_0, QT.Q6_K) else kernel.NIBBLE)  # 4-bit codes as nibbles

    no_offsets = qtype in (QT.Q8_0, QT.Q5_0, QT.Q6_K)
    assert offsets.shape[1] == (0 if no_offsets else in_features // 32)  # Q8_0 / Q5_0 / Q6_K: no offsets to read
    assert scales.shape[1] == in_features // (16 if qtype == QT.Q6_K else 32)
    x = rng.standard_normal((tokens, in_features)).astype(np.float32)
    results = []
    # GGUF's float16 scales and offsets kept as they are (bits in uint16): exact (K-quants' d * sc_j: float32)
    for half in ((False,) if qtype in (QT.Q4_K, QT.Q6_K) else (False, True)):
        params = [typed_list([np.ascontiguousarray(a, np.float16).view(np.uint16) if half else a])
                  for a in (scales, offsets)]
        lists = (np.array([fmt]), typed_list([f2]), typed_list([codes]), typed_list([nibbles]), *params,
                 *NO_PARTIALS)
        for threads in (1, 2):  # the rows shared by a team of threads through the phase's counters
            out = np.full((tokens, out_features), np.nan, np.float32)
            counters, marks = np.zeros(STRIDE, np.int64), np.zeros((1, out_features), np.int64)
            team = [threading.Thread(target=kernel._linear_phase,
                                     args=(0, x, *lists, out, counters, marks, 1, 0, threads)) for _ in range(threads)]
            for t in team:
                t.start()
            for t in team:
                t.join()
            np.testing.assert_allclose(out, x @ blocks.dequantize().T, rtol=1e-5, atol=1e-4)
            results.append(out)
    for out in results[1:]:
        np.testing.assert_array_equal(out, results[0])


@pytest.mark.parametrize("tokens", [1, 3, 17, 70])
def test_float_linears_give_the_product_on_any_team(tokens):
    """A float32 ``[in, out]`` linear (a weight no block format holds) as one phase: one thread or two
    give the same numbers as ``x @ W`` -- for a few tokens from items of input rows the team shares,
    summed in a fixed order."""
    rng = np.random.default_rng(tokens)
    in_features, out_features = 3 * kernel.K_ROWS + 5, 300
    w = rng.standard_normal((in_features, out_features)).astype(np.float32)
    x = rng.standard_normal((tokens, in_features)).astype(np.float32)
    f2, i8, u8 = np.zeros((1, 1), np.float32), np.zeros((1, 1), np.int8), np.zeros((1, 1), np.uint8)
    starts, size = kernel.float_partials([w.shape])
    lists = (np.array([kernel.FLOAT]), typed_list([w]), typed_list([i8]), typed_list([u8]), typed_list([f2]),
             typed_list([f2]), np.full(size, np.nan, np.float32), starts)
    results = []
    for threads in (1, 2):
        out = np.full((tokens, out_features), np.nan, np.float32)
        counters, marks = np.zeros(STRIDE, np.int64), np.zeros((1, out_features), np.int64)
        team = [threading.Thread(target=kernel._linear_phase, args=(0, x, *lists, out, counters, marks, 1, 0, threads))
                for _ in range(threads)]
        for t in team:
            t.start()
        for t in team:
            t.join()
        np.testing.assert_allclose(out, x @ w, rtol=1e-5, atol=1e-4)
        results.append(out)
        if tokens <= kernel.MATVEC_T:  # four items of input rows, each claimed once, one failed claim a thread
            assert counters[0] == 4 + threads
    np.testing.assert_array_equal(results[1], results[0])


def _one_q8_linear(rng):
    """A random 64 x 96 Q8_0 weight and the per-linear lists `_linear_phase` reads (one linear, int8 codes)."""
    raw = gguf.quants.quantize(rng.standard_normal((64, 96)).astype(np.float32), QT.Q8_0)
    blocks = unpack(raw, QT.Q8_0, (64, 96))
    codes = np.ascontiguousarray(blocks.codes).reshape(64, -1)
    lists = (np.array([kernel.INT8]), typed_list([np.zeros((1, 1), np.float32)]), typed_list([codes]),
             typed_list([np.zeros((1, 1), np.uint8)]), typed_list([blocks.scales]), typed_list([blocks.offsets]),
             *NO_PARTIALS)
    return blocks, lists


def test_a_late_team_member_finds_the_work_done_and_returns():
    """A thread that reaches a phase after the others finished it (descheduled on a busy machine)
    finds every item marked finished in this step and computes nothing; in the next step
    (a new epoch) the same marks no longer count."""
    rng = np.random.default_rng(11)
    blocks, lists = _one_q8_linear(rng)
    x = rng.standard_normal((1, 96)).astype(np.float32)
    counters, marks = np.zeros(STRIDE, np.int64), np.zeros((1, 64), np.int64)
    first = np.full((1, 64), np.nan, np.float32)
    kernel._linear_phase(0, x, *lists, first, counters, marks, 1, 0, 2)  # alone: every item of the phase
    np.testing.assert_allclose(first, x @ blocks.dequantize().T, rtol=1e-5, atol=1e-4)
    late = np.full((1, 64), np.nan, np.float32)
    worker = threading.Thread(target=kernel._linear_phase, args=(0, x, *lists, late, counters, marks, 1, 0, 2))
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert np.isnan(late).all()  # it computed nothing
    counters[:] = 0
    kernel._linear_phase(0, x, *lists, late, counters, marks, 2, 0, 2)  # the next step
    np.testing.assert_array_equal(late, first)


def test_unfinished_items_are_run_by_whoever_gets_there():
    """Items another thread claimed but never finished (it was descheduled) are run by the thread
    that finds them unfinished, instead of being waited for."""
    rng = np.random.default_rng(12)
    blocks, lists = _one_q8_linear(rng)
    x = rng.standard_normal((1, 96)).astype(np.float32)
    counters, marks = np.zeros(STRIDE, np.int64), np.zeros((1, 64), np.int64)
    items = kernel.split_rows(64, kernel.DOT_ROWS, True)[3]
    counters[0] = items  # every item claimed by a thread that went away
    out = np.full((1, 64), np.nan, np.float32)
    kernel._linear_phase(0, x, *lists, out, counters, marks, 1, 0, 2)
    np.testing.assert_allclose(out, x @ blocks.dequantize().T, rtol=1e-5, atol=1e-4)
    assert (marks == 1).sum() == items


@pytest.mark.parametrize("num_out", [3, 31, 64, 70, 576, 961, 3072, 49152])
@pytest.mark.parametrize("rows", [kernel.DOT_ROWS, kernel.TILE])
def test_a_phase_ends_on_small_items_that_keep_the_row_groups(num_out, rows):
    """Whoever finishes a phase first runs the item still held by another thread a second time:
    the last items are a quarter the size, and every output is in exactly one item, the items
    starting on multiples of 4 (the micro-kernel's groups of rows do not move)."""
    big, small, head, items = kernel.split_rows(num_out, rows, True)
    spans = [kernel._item_rows(i, big, rows, small, head, num_out) for i in range(items)]
    assert [lo for lo, _ in spans] == sorted(lo for lo, _ in spans) and spans[0][0] == 0
    assert all(hi == lo2 for (_, hi), (lo2, _) in zip(spans, spans[1:])) and spans[-1][1] == num_out
    assert all(lo % 4 == 0 and hi > lo for lo, hi in spans)
    assert max(hi - lo for lo, hi in spans) <= rows
    tail = spans[-min(items, kernel.TAIL_ITEMS):]
    assert all(hi - lo <= rows // 4 for lo, hi in tail)
    assert items <= -(-num_out // rows) + 8  # the bound `FusedDecode.step` sizes the marks by


def test_fused_decode_team_gives_the_single_threads_numbers(tmp_path):
    """The step's items shared by two threads or run by one: the same logits, bit for bit."""
    llm = LLM(model=make_tiny_model(str(tmp_path), seed=3), cpu_decode="fused", block_size=4,
              enable_prefix_caching=False)  # both rounds prefill the same way
    fused = llm.engine.runner.fused_decode
    outputs = []
    for threads in (1, 2):
        fused.threads = threads
        assert fused.threads == threads
        outputs.append(llm.generate(tiny_prompts(4), GREEDY))
    llm.shutdown()
    for one, two in zip(*outputs):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs):
            assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}


def test_a_member_joins_only_the_open_step_and_the_close_waits_for_it():
    """A member comes in only while its step is open; closing waits for the members inside (they
    need no interpreter lock to finish), not for those that never came."""
    from gpu_kernels.cpu import sync

    control = np.zeros(sync.CONTROL_SIZE, np.int64)
    sync.open_step(control, 7)
    assert not sync.join_step(control, 6)             # an earlier step's member: turned away
    assert control[sync.ACTIVE] == 0
    assert sync.join_step(control, 7)
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (sync.close_step(control), closed.set()))
    closer.start()
    assert not closed.wait(0.2)                        # a member is inside: the close waits
    assert not sync.join_step(control, 7)              # closed: no one else comes in
    sync.leave_step(control)
    assert closed.wait(10)
    closer.join()
    sync.close_step(control)                            # nobody inside: returns at once


def test_a_team_step_does_not_wait_for_a_member_that_wakes_late(tmp_path, monkeypatch):
    """A member needs the interpreter lock to wake, which the app's threads hold at times; the
    step used to wait for every member to wake, run and return to Python. A member that wakes
    after the caller finished the step now leaves it untouched, and the numbers are the single
    thread's."""
    import time

    import engine.fused_decode as fd

    llm = LLM(model=make_tiny_model(str(tmp_path), seed=3), cpu_decode="fused", block_size=4,
              enable_prefix_caching=False)
    fused = llm.engine.runner.fused_decode
    fused.threads = 1
    alone = llm.generate(tiny_prompts(2), GREEDY)
    late = threading.Event()
    wait = threading.Event.wait

    def slow_wait(event, timeout=None):      # a member's wake-up, 0.3 s late (the GIL held elsewhere)
        woke = wait(event, timeout)
        if threading.current_thread().name.startswith("fused-decode-"):
            late.set()
            time.sleep(0.3)
        return woke

    monkeypatch.setattr(threading.Event, "wait", slow_wait)
    fused.threads = 2
    steps = []
    run = fd._Team.run
    monkeypatch.setattr(fd._Team, "run", lambda team, args: (steps.append(time.perf_counter()), run(team, args),
                                                              steps.append(time.perf_counter())))
    together = llm.generate(tiny_prompts(2), GREEDY)
    monkeypatch.setattr(threading.Event, "wait", wait)
    llm.shutdown()
    assert late.is_set() and len(steps) >= 8
    durations = [b - a for a, b in zip(steps[::2], steps[1::2])]
    assert max(durations) < 0.15, durations            # no step waited for the late member
    for one, two in zip(alone, together):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs):
            assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}


def test_fused_decode_falls_back_and_says_why(tmp_path):
    llm = LLM(model=make_tiny_model(str(tmp_path)), attention_backend="reference")
    assert llm.snapshot().decode_path == ("paddle (attention_backend is reference; the fused decode step has the "
                                          "cpu kernel inside)")
    assert llm.engine.runner.fused_decode is None
    out = llm.generate(tiny_prompts(1), GREEDY)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 10
    model = llm.engine.runner.model
    assert fused_decode_support(model, "float32", "gpu") == "device is gpu; the fused decode step is a CPU kernel"
    assert fused_decode_support(model, "bfloat16", "cpu") == ("dtype is bfloat16; the fused decode step computes "
                                                              "in float32")
    assert fused_decode_support(object(), "float32", "cpu") == ("object has no decoder the fused step reads "
                                                                "(no fused_decoder)")
    assert fused_decode_support(model, "float32", "cpu") is None
    llm.shutdown()


def test_cpu_decode_setting_is_validated():
    with pytest.raises(ValueError, match="cpu_decode must be one of fused, paddle; got 'numba'"):
        EngineConfig(cpu_decode="numba")
