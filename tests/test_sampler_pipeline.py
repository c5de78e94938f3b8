"""The sampler's pipeline (``engine/sampler_pipeline.py``) and ``logprobs_mode="processed"``: the
last stage's kept set is exactly the set the compiled sampler draws from, the processed logprobs'
support is that set, and the sampled token is always in it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from engine import SamplingParams
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.sampler import LogitsAdjust, Sampler, _pick, _walk
from engine.sampler_pipeline import SamplerPipeline, pipeline
from engine.sampling_reference import probs as reference_probs

VOCAB = 300


def cases(n):
    rng = np.random.default_rng(7)
    for i in range(n):
        row = (rng.standard_normal(VOCAB) * rng.uniform(0.5, 6)).astype(np.float32)
        row[rng.integers(VOCAB, size=5)] = row.max()          # ties at the top
        params = SamplingParams(temperature=float(rng.uniform(0.2, 1.8)), top_k=int(rng.choice([0, 1, 5, 40, 299])),
                                top_p=float(rng.choice([1.0, 0.95, 0.6, 0.1])), min_p=float(rng.choice([0, 0.01, 0.2])),
                                seed=i, logprobs=20, logprobs_mode="processed")
        yield row, params


def test_kept_set_is_exactly_what_the_compiled_pick_draws_from():
    for row, p in cases(60):
        last = pipeline(row, p).stages[-1]
        kept = set(last.kept.tolist())
        top = row[int(np.argmax(row))]
        args = (row, top, 1.0 / p.temperature, min(p.top_k, VOCAB), p.top_p, p.min_p)
        for u in np.linspace(0, 1, 401, endpoint=False):           # nothing outside the kept set is drawn
            assert int(_pick(*args, u)) in kept
        order = np.sort(last.kept)                                 # every kept token can be drawn
        cdf = np.cumsum(last.probs[order])
        for t, lo, hi in zip(order, np.concatenate(([0.0], cdf[:-1])), cdf):
            if hi - lo > 1e-6:
                assert int(_pick(*args, (lo + hi) / 2)) == t
        np.testing.assert_allclose(last.probs, reference_probs(row, p), atol=1e-5)


def test_processed_logprobs_support_is_the_kept_set_and_holds_the_sampled_token():
    sampler = Sampler(str)
    for row, p in cases(60):
        last = pipeline(row, p).stages[-1]
        rng_a, rng_b = np.random.default_rng(p.seed), np.random.default_rng(p.seed)
        token, lps = sampler.sample(row, p, rng_a)
        raw_token, _ = sampler.sample(row, dataclasses.replace(p, logprobs_mode="raw"), rng_b)
        assert token == raw_token                                  # the mode changes the report, not the draw
        assert token in set(last.kept.tolist()) and np.isfinite(lps[token].logprob)
        assert set(lps) <= set(last.kept.tolist())
        if last.kept.size <= 20:
            assert set(lps) == set(last.kept.tolist())
            assert abs(sum(np.exp(lp.logprob) for lp in lps.values()) - 1) < 1e-6
        best = max(lps.values(), key=lambda lp: lp.logprob)
        assert best.rank == 1


def test_stages_in_order_and_the_token_is_followed():
    row = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0], np.float32)
    p = SamplingParams(temperature=0.5, top_k=6, min_p=0.01, top_p=0.9, repetition_penalty=2.0)
    adjust = LogitsAdjust(p, prompt_ids=[0], output_ids=[])
    pipe = pipeline(row, p, adjust, token=1)
    assert [s.name for s in pipe.stages] == ["raw", "penalties", "temperature", "top_k", "min_p", "top_p"]
    assert pipe.stage("raw").rank(1) == 2 and pipe.stage("penalties").rank(1) == 1   # 5 / 2 = 2.5 < 4
    assert pipe.stage("top_k").kept.tolist() == [0, 1, 2, 3, 4, 5]
    assert pipe.stage("min_p").kept.tolist() == [0, 1, 2, 3]
    assert pipe.stage("top_p").kept.tolist() == [1, 2]
    assert [w["rank"] for w in pipe.where()] == [2, 1, 1, 1, 1, 1]
    assert pipe.where(4)[-1]["rank"] is None                       # dropped
    assert "dropped" not in pipe._repr_html_() and "top_p" in pipe._repr_html_()
    greedy = pipeline(row, SamplingParams(temperature=0), token=0)
    assert greedy.kept.tolist() == [0]


def test_logprobs_mode_values():
    assert SamplingParams(logprobs_mode="processed_logprobs").logprobs_mode == "processed"
    assert SamplingParams().logprobs_mode == "raw"
    with pytest.raises(ValueError, match="logprobs_mode must be 'raw' or 'processed'"):
        SamplingParams(logprobs_mode="processed_logits")
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs_mode="processed")
    assert body.sampling_params(8, 3).logprobs_mode == "processed"


def test_engine_reports_processed_logprobs_and_its_pipeline_agrees(smollm2_llm):
    llm = smollm2_llm
    params = SamplingParams(max_tokens=6, temperature=0.9, top_k=30, top_p=0.8, seed=3, logprobs=20,
                            logprobs_mode="processed", ignore_eos=True)
    out = llm.generate("The three primary colours are", params)[0]
    raw = llm.generate("The three primary colours are", dataclasses.replace(params, logprobs_mode="raw"))[0]
    assert out.outputs[0].token_ids == raw.outputs[0].token_ids
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    n = len(out.prompt_token_ids)
    for i, (token, lps) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        pipe = llm.sampler_pipeline(ids, n + i, params, num_prompt_tokens=n)
        kept = set(pipe.kept.tolist())
        assert pipe.token == token and token in kept
        assert set(lps) <= kept and (len(kept) > 20 or set(lps) == kept)
        np.testing.assert_allclose(lps[token].logprob, np.log(pipe.stages[-1].prob(token)), atol=1e-4)
    with pytest.raises(ValueError, match="num_prompt_tokens must be"):
        llm.sampler_pipeline(ids, n, params, num_prompt_tokens=n + 1)
    assert not llm.snapshot().requests


def test_walk_is_the_pick_rule():
    w = np.array([0.0, 0.5, 0.0, 0.25, 0.25], np.float32)
    assert _walk(w, np.arange(5), 0.6) == 3 and _walk(w, np.arange(5), 0.1) == 1


def test_it_crosses_the_wire_with_exact_kept_sets():
    row, p = next(cases(1))
    pipe = pipeline(row, p, token=int(np.argmax(row)))
    back = SamplerPipeline.from_dict(json.loads(json.dumps(pipe.to_dict())))
    assert [s.name for s in back.stages] == [s.name for s in pipe.stages] and back.token == pipe.token
    for a, b in zip(pipe.stages, back.stages):
        assert np.array_equal(a.kept, b.kept)
        np.testing.assert_allclose(b.probs, a.probs, rtol=1e-6, atol=1e-12)


def test_pipeline_on_our_server_as_in_process_and_refused_on_a_foreign_one(smollm2_llm):
    import httpx

    from engine.client.http import RemoteLLM
    from engine.client.openai_server import OpenAIServer
    from test_engine_client import serve

    srv, url = serve(smollm2_llm)
    try:
        remote = RemoteLLM(url)
        ids = smollm2_llm.get_tokenizer().encode("The sampler keeps a few tokens and draws one of them. " * 2)
        params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3, seed=5)
        here = smollm2_llm.sampler_pipeline(ids, len(ids) - 3, params, num_prompt_tokens=len(ids) - 6)
        there = remote.sampler_pipeline(ids, len(ids) - 3, params, num_prompt_tokens=len(ids) - 6)
        assert [s.name for s in there.stages] == [s.name for s in here.stages]
        for a, b in zip(here.stages, there.stages):
            assert np.array_equal(a.kept, b.kept), a.name
            np.testing.assert_allclose(b.probs, a.probs, atol=2e-6)    # the second pass reads cached blocks
        assert there.token == here.token == ids[-3] and there.texts == here.texts and here.token in here.texts
        for a, b in zip(here.where(), there.where()):
            assert (a["stage"], a["rank"], a["kept"]) == (b["stage"], b["rank"], b["kept"])
            assert abs(a["prob"] - b["prob"]) < 2e-6
        with pytest.raises(ValueError, match="num_prompt_tokens must be"):
            remote.sampler_pipeline(ids, 4, params, num_prompt_tokens=9)
        answer = httpx.post(url + "/engine/sampler_pipeline", json={"token_ids": ids, "position": 3, "seed": 1})
        assert answer.status_code == 400 and "unknown field(s) ['seed']" in answer.text
        answer = httpx.post(url + "/engine/sampler_pipeline",
                            json={"token_ids": ids, "position": 3, "sampling_params": {"temp": 1}})
        assert answer.status_code == 400 and "unknown sampling parameter(s) ['temp']" in answer.text
        remote.shutdown()
    finally:
        srv.should_exit = True
    server = object.__new__(OpenAIServer)
    server.server, server._ours = "vLLM", False
    with pytest.raises(NotImplementedError, match="sampler's pipeline is not available on vLLM"):
        server.sampler_pipeline([1, 2], 1, SamplingParams())
    assert not smollm2_llm.snapshot().requests
