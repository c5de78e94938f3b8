"""The attention lens (``LLM.attention_lens``, ``engine/lens.py``).

transformers' eager attention probabilities (``output_attentions=True``) on the same GGUF are the
reference: recorded in ``tests/fixtures/attention_lens_<model>.npz`` by
``scripts/record_attention_lens.py``, and, where the ``reference`` extra is installed, computed
again live (the recording must still match it). Weights within 1e-4, each row summing to 1;
Gemma 3's prompt is longer than its 512-token sliding window.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import hf_recorded
import numpy as np
import pytest

from conftest import require_reference
from engine import LLM, SamplingParams
from engine.lens import AttentionLens, attention_row

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
ATOL = 1e-4


def recorded(model: str) -> dict:
    with np.load(FIXTURES / f"attention_lens_{model}.npz") as data:
        return {k: data[k] for k in data.files}


def check_against(llm, reference: dict) -> None:
    ids = reference["token_ids"].tolist()
    for p in reference["positions"].tolist():
        lens = llm.attention_lens(ids, p)
        want = reference[f"weights_{p}"]
        assert lens.weights.shape == want.shape == (llm.engine.num_layers, llm.engine.num_heads, p + 1)
        np.testing.assert_allclose(lens.weights.sum(-1), 1.0, atol=1e-5)
        np.testing.assert_allclose(lens.weights, want, atol=ATOL, rtol=0, err_msg=f"position {p}")
        assert len(lens.block_ids) == p + 1


@pytest.fixture(scope="module")
def smollm2_pf():
    llm = LLM(model="smollm2-135m-instruct", model_impl="paddleformers")
    yield llm
    llm.shutdown()


def test_smollm2_native_matches_transformers(smollm2_llm):
    check_against(smollm2_llm, recorded("smollm2-135m-instruct"))


def test_smollm2_paddleformers_matches_transformers(smollm2_pf):
    check_against(smollm2_pf, recorded("smollm2-135m-instruct"))


@pytest.mark.slow
def test_gemma3_beyond_its_window_matches_transformers():
    reference = recorded("gemma3-270m")
    window = int(reference["sliding_window"])
    assert window and len(reference["token_ids"]) > window + 100
    llm = LLM(model="gemma3-270m", max_model_len=2048)
    try:
        check_against(llm, reference)
        last = int(reference["positions"].max())
        lens = llm.attention_lens(reference["token_ids"].tolist(), last)
        local = [i for i, w in enumerate(lens.sliding_windows) if w]
        assert local and len(local) < lens.num_layers            # Gemma 3: 5 local layers to 1 global
        assert set(lens.sliding_windows[i] for i in local) == {window}
        outside = lens.weights[local][:, :, : last + 1 - window]
        assert outside.size and not outside.any()               # zero outside the window
        glob = [i for i in range(lens.num_layers) if i not in local]
        assert (lens.weights[glob][:, :, : last + 1 - window] > 0).all()
    finally:
        llm.shutdown()


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m"])
def test_recording_is_transformers_answer_now(model, tmp_path):
    """The recording is still what transformers computes: live, in its own process, where the
    comparisons with transformers are computed live (`hf_recorded`: the reference extra, as CI's
    second run has it); without torch, it was recorded by the transformers the extra pins."""
    then = recorded(model)
    if not hf_recorded.live():
        import tomllib

        from packaging.requirements import Requirement

        extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["reference"]
        pins = {Requirement(r).name: str(Requirement(r).specifier) for r in extra}
        assert pins["transformers"] == f"=={then['transformers']}", (pins, str(then["transformers"]))
        return
    require_reference()
    out = tmp_path / "lens.npz"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "record_attention_lens.py"), model, "--out", str(out)],
                   check=True, capture_output=True, cwd=ROOT)
    now = dict(np.load(out))
    assert now["token_ids"].tolist() == then["token_ids"].tolist()
    for p in then["positions"].tolist():
        np.testing.assert_allclose(now[f"weights_{p}"], then[f"weights_{p}"], atol=1e-5, rtol=0)


def test_attention_row_is_the_kernels_softmax():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((4, 8)), rng.standard_normal((10, 2, 8))
    probs = attention_row(q, k, 0.3, window=4)
    for h in range(4):
        scores = k[:, h // 2] @ q[h] * 0.3
        scores[:6] = -np.inf
        want = np.exp(scores - scores.max())
        np.testing.assert_allclose(probs[h], want / want.sum(), atol=1e-6)


def test_lens_reads_the_blocks_the_chat_stored(smollm2_llm):
    """Positions held by the prefix cache map to the very blocks the earlier request stored."""
    llm = smollm2_llm
    bs = llm.config.block_size
    stored = []
    unsubscribe = llm.subscribe(lambda e: stored.extend(e.data["block_ids"]) if e.kind == "blocks_stored" else None)
    try:
        text = "A block table maps each position of a sequence to a physical block of keys and values. " * 3
        out = llm.generate(text + " lens-blocks", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    finally:
        unsubscribe()
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    full = (len(ids) - 1) // bs
    lens = llm.attention_lens(ids, len(ids) - 1)
    assert lens.num_cached_tokens == full * bs
    assert [lens.block_ids[b * bs] for b in range(full)] == stored[:full]
    assert all(lens.block_ids[p] == lens.block_ids[(p // bs) * bs] for p in range(len(ids)))
    again = llm.attention_lens(ids, len(ids) - 1)        # its own last block was cached too meanwhile
    np.testing.assert_allclose(again.weights, lens.weights, atol=1e-5)
    assert not llm.snapshot().requests


def test_lens_beside_a_running_decode_equals_the_lens_alone(smollm2_llm):
    """Recorded for its own row of a batch shared with another request's decode steps."""
    llm = smollm2_llm
    ids = llm.get_tokenizer().encode("Which block holds position seventeen of this sentence, and why? " * 2)
    alone = llm.attention_lens(ids, len(ids) - 1)
    llm.reset_prefix_cache()
    started, done = threading.Event(), threading.Event()

    def decode():
        for i, _ in enumerate(llm.stream("Count slowly from one to fifty.",
                                         SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))):
            if i == 1:
                started.set()
        done.set()

    thread = threading.Thread(target=decode)
    thread.start()
    assert started.wait(120)
    beside = llm.attention_lens(ids, len(ids) - 1)
    thread.join()
    assert done.is_set()
    np.testing.assert_allclose(beside.weights, alone.weights, atol=1e-5)


@pytest.mark.parametrize("args, message", [
    (([], 0), "token_ids is empty"),
    (([1, 2, 3], 3), r"position must be an integer in \[0, 2\]"),
    (([1, 2, 3], -1), r"position must be an integer in \[0, 2\]"),
    (([1, 2, 3], True), "position must be an integer"),
    (([1, 2, 3], 2, 30), r"layer must be an integer in \[0, 30\)"),
    (([1, 2, 3], 2, 0, 9), r"head must be an integer in \[0, 9\)"),
    (([1, 10**9], 1), r"token_ids must be integers in \[0, 49152\)"),
    (("hello", 0), "token_ids must be a list"),
])
def test_bad_input_is_refused_before_any_work(smollm2_llm, args, message):
    llm = smollm2_llm
    before = (llm.engine.step_count, llm.snapshot().prefix_cache)
    seen = []
    unsubscribe = llm.subscribe(seen.append)
    try:
        with pytest.raises(ValueError, match=message):
            llm.attention_lens(*args)
    finally:
        unsubscribe()
    assert (llm.engine.step_count, llm.snapshot().prefix_cache) == before and not seen


def test_heat_block_mass_and_html(smollm2_llm):
    ids = smollm2_llm.get_tokenizer().encode("<b>bold</b> & a heat strip")
    lens = smollm2_llm.attention_lens(ids, len(ids) - 1, layer=2, head=1)
    np.testing.assert_allclose(lens.heat(), lens.weights[2, 1])
    np.testing.assert_allclose(lens.heat(None, None), lens.weights.mean(axis=(0, 1)), atol=1e-7)
    assert abs(sum(lens.block_mass().values()) - 1) < 1e-5
    with pytest.raises(ValueError, match="head must be"):
        lens.heat(0, 99)
    page = lens._repr_html_()
    assert page.count("<span ") == len(ids) and "&lt;" in page and "<b>" not in page and "&amp;" in page
    assert "rgba(230,80,20,1.000)" in page                    # the most attended token is full heat
    back = AttentionLens.from_dict(lens.to_dict())
    assert np.array_equal(back.weights, lens.weights) and back.block_ids == lens.block_ids


def test_openai_server_says_the_lens_is_not_available():
    from engine.client.openai_server import OpenAIServer

    server = object.__new__(OpenAIServer)
    server.server, server._ours = "llama.cpp's llama-server", False
    with pytest.raises(NotImplementedError, match="not available on llama.cpp's llama-server"):
        server.attention_lens([1, 2], 1)


@pytest.mark.slow
def test_lens_through_the_engine_process():
    from engine.llm_process import LLMProcess

    llm = LLMProcess(model="smollm2-135m-instruct")
    try:
        reference = recorded("smollm2-135m-instruct")
        ids, p = reference["token_ids"].tolist(), int(reference["positions"].max())
        lens = llm.attention_lens(ids, p)
        np.testing.assert_allclose(lens.weights, reference[f"weights_{p}"], atol=ATOL, rtol=0)
        with pytest.raises(ValueError, match="position must be"):
            llm.attention_lens(ids, len(ids))
        pipe = llm.sampler_pipeline(ids, p, SamplingParams(temperature=0.8, top_p=0.9))
        assert pipe.token == ids[p] and pipe.stages[-1].name == "top_p" and pipe.kept.size >= 1
    finally:
        llm.shutdown()


def test_lens_on_our_server_as_in_process(smollm2_llm):
    import httpx

    from engine.client.http import RemoteLLM
    from test_engine_client import serve

    srv, url = serve(smollm2_llm)
    try:
        remote = RemoteLLM(url)
        ids = smollm2_llm.get_tokenizer().encode("The server's engine reads its own KV blocks, block by block. " * 3)
        here = smollm2_llm.attention_lens(ids, len(ids) - 2, layer=1)
        there = remote.attention_lens(ids, len(ids) - 2, layer=1)
        np.testing.assert_allclose(there.weights, here.weights, atol=1e-5)
        cached = there.num_cached_tokens                     # the full blocks: the ones the first pass stored
        assert cached >= 16 and there.block_ids[:cached] == here.block_ids[:cached]
        assert (there.layer, there.tokens) == (1, here.tokens)
        with pytest.raises(ValueError, match="layer must be an integer in"):
            remote.attention_lens(ids, 1, layer=99)
        answer = httpx.post(url + "/engine/attention_lens", json={"token_ids": ids, "position": 0, "heads": 1})
        assert answer.status_code == 400 and "unknown field(s) ['heads']" in answer.text
        remote.shutdown()
    finally:
        srv.should_exit = True
