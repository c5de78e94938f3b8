"""The sampling extras an OpenAI-compatible server passes through, with vLLM's semantics:
repetition / frequency / presence penalties, min_tokens, include_stop_str_in_output.

The rule is checked against the token-by-token NumPy definition (``sampling_reference.adjusted``),
then through the engine: penalties change the pick and never the logprobs, min_tokens holds off
EOS, stop token ids and stop strings, and greedy output with penalties does not depend on batching
or preemption.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.sampler import LogitsAdjust, Sampler
from engine.sampling_reference import NumpySampler, adjusted, log_softmax
from tiny_models import make_tiny_model, tiny_prompts

PROMPT = {"prompt_token_ids": list(range(10, 30))}


# -- the parameters -----------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,accepted", [
    ("repetition_penalty", 0.0, "(0.0, inf)"), ("repetition_penalty", -1.0, "(0.0, inf)"),
    ("repetition_penalty", float("inf"), "finite"), ("repetition_penalty", "2", "finite number"),
    ("presence_penalty", 2.5, "[-2.0, 2.0]"), ("presence_penalty", -2.01, "[-2.0, 2.0]"),
    ("frequency_penalty", float("nan"), "finite"), ("frequency_penalty", 3, "[-2.0, 2.0]"),
    ("min_tokens", -1, ">= 0"), ("min_tokens", 1.5, ">= 0"), ("min_tokens", 200, "max_tokens=128"),
    ("include_stop_str_in_output", 1, "True or False"),
])
def test_bad_extras_name_the_field_and_what_it_accepts(field, value, accepted):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value) and accepted in str(err.value)


def test_defaults_adjust_nothing_and_each_extra_does():
    assert not SamplingParams().adjusts_logits
    for extra in ({"repetition_penalty": 1.1}, {"presence_penalty": -0.5}, {"frequency_penalty": 0.1},
                  {"min_tokens": 1}):
        assert SamplingParams(**extra).adjusts_logits, extra
    assert not SamplingParams(include_stop_str_in_output=True).adjusts_logits


# -- the rule -----------------------------------------------------------------------------------

def test_penalties_follow_the_vllm_rule_by_hand():
    """Token 0 is in the prompt, 1 twice and 3 once in the output, 2 nowhere: r = 2 divides positive
    and multiplies negative logits of seen tokens; then 0.5 per occurrence + 0.25 once is taken off."""
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    out = LogitsAdjust(params, [0], [1, 1, 3])(row)
    assert out.tolist() == pytest.approx([1.0, -4.0 - 1.0 - 0.25, 1.0, 0.25 - 0.5 - 0.25])
    assert row.tolist() == [2.0, -2.0, 1.0, 0.5]                   # the raw row is left alone


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(2, 400),
       rep=st.sampled_from([1.0, 0.5, 1.3, 3.0]), freq=st.sampled_from([0.0, -2.0, 0.7, 2.0]),
       pres=st.sampled_from([0.0, -1.5, 0.4, 2.0]), min_tokens=st.integers(0, 6), n_out=st.integers(0, 40))
def test_logits_adjust_equals_the_token_by_token_definition(seed, size, rep, freq, pres, min_tokens, n_out):
    """Counted incrementally (the output grows between calls, as in the engine) and vectorized, the
    row equals the reference recomputed from the lists, within float32 rounding."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=50, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                            min_tokens=min_tokens)
    prompt = rng.integers(size, size=int(rng.integers(1, 30))).tolist()
    banned = rng.integers(size, size=3).tolist()
    output: list[int] = []
    adjust = LogitsAdjust(params, prompt, output, banned)
    for step in range(n_out + 1):
        row = (rng.standard_normal(size) * 3).astype(np.float32)
        got, want = adjust(row), adjusted(row, params, prompt, output, banned)
        assert np.array_equal(np.isneginf(got), np.isneginf(want)), step
        finite = ~np.isneginf(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)
        output.append(int(rng.integers(size)))


def test_a_penalty_cannot_make_a_logit_infinite():
    row = np.array([3e38, 1.0, -1.0], np.float32)
    out = LogitsAdjust(SamplingParams(repetition_penalty=1e-3), [0], [])(row)
    assert np.isfinite(out).all() and int(np.argmax(out)) == 0


def test_penalties_change_the_pick_not_the_logprobs():
    """Greedy with a repetition penalty picks the best token of the penalized row; the logprobs and
    ranks still describe the raw row (the penalized-away favourite keeps rank 1)."""
    row = np.array([1.0, 4.0, 3.0, 0.0], np.float32)
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=2)
    token, lps = Sampler(str).sample(row, params, np.random.default_rng(0), LogitsAdjust(params, [1], []))
    assert token == 2                                             # 4 / 2 = 2 < 3
    raw = log_softmax(row)
    assert lps[1].rank == 1 and lps[2].rank == 2
    assert lps[1].logprob == pytest.approx(raw[1]) and lps[2].logprob == pytest.approx(raw[2])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.3, logprobs=3),
    SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=1.0, frequency_penalty=0.5, logprobs=3),
    SamplingParams(temperature=1.0, top_k=40, repetition_penalty=0.7, min_tokens=10, logprobs=2),
], ids=["greedy", "top-p", "top-k-min-tokens"])
def test_compiled_sampler_with_extras_equals_the_numpy_one(params):
    """Seeded alike, row after row with the output growing, the compiled sampler (incremental
    counts) and the NumPy one (the definition from the lists) pick the same tokens."""
    rows = np.random.default_rng(5).standard_normal((30, 3000)).astype(np.float32) * 2.5
    prompt = list(range(0, 3000, 7))
    banned = [int(np.argmax(rows[0])), 17]
    outs = {"fast": [], "slow": []}
    samplers = {"fast": Sampler(str), "slow": NumpySampler(str)}
    adjusts = {k: LogitsAdjust(params, prompt, outs[k], banned) for k in outs}
    rngs = {k: np.random.default_rng(3) for k in outs}
    for row in rows:
        for k in outs:
            token, _ = samplers[k].sample(row, params, rngs[k], adjusts[k])
            outs[k].append(token)
    assert outs["fast"] == outs["slow"]
    if params.min_tokens:
        assert banned[0] not in outs["fast"][:params.min_tokens]


# -- through the engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("llama-extras")), seed=3)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4)
    yield llm
    assert not llm.snapshot().requests


def _out(llm, prompt, params):
    return llm.generate(prompt, params)[0].outputs[0]


def test_engine_picks_from_the_penalized_row_of_its_own_prompt_and_output(llm, monkeypatch):
    """Each greedy pick is the argmax of the reference rule applied to that step's raw row, with
    that request's prompt and output so far; a plain request in the same batch is untouched."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.8,
                            frequency_penalty=0.6, presence_penalty=0.4)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = _out(llm, tiny_prompts(1)[0], plain).token_ids
    seen = []
    real = llm.engine.sampler.sample

    def spy(row, p, rng, adjust=None):
        token, lp = real(row, p, rng, adjust)
        if adjust is not None:
            ref = adjusted(row, p, adjust.prompt_ids, list(adjust.output_ids), adjust.banned.tolist())
            seen.append((token, int(np.argmax(ref))))
        return token, lp

    monkeypatch.setattr(llm.engine.sampler, "sample", spy)
    penalized, bystander = llm.generate([PROMPT, tiny_prompts(1)[0]], [params, plain])
    assert len(seen) == 12 and all(t == ref for t, ref in seen)
    assert bystander.outputs[0].token_ids == alone
    assert penalized.outputs[0].token_ids != _out(llm, PROMPT, plain).token_ids


def test_default_requests_never_build_or_call_an_adjust(llm, monkeypatch):
    def boom(self, row):
        raise AssertionError("LogitsAdjust called for a request at the defaults")

    monkeypatch.setattr(LogitsAdjust, "__call__", boom)
    out = _out(llm, PROMPT, SamplingParams(max_tokens=6, temperature=0.7, seed=1, ignore_eos=True))
    assert out.finish_reason == "length" and not llm.engine._adjust


def test_min_tokens_holds_off_stop_token_ids_and_eos(llm, monkeypatch):
    base = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = _out(llm, PROMPT, base).token_ids[0]
    stopped = _out(llm, PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[first]))
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"

    held = _out(llm, PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[first],
                                           min_tokens=4, logprobs=2))
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]
    assert held.logprobs[0][first].rank == 1                      # masked for the pick, not in the logprobs

    monkeypatch.setattr(llm.engine.tokenizer, "eos_token_ids", frozenset({first}))
    eos = _out(llm, PROMPT, SamplingParams(max_tokens=8, temperature=0))
    assert eos.token_ids == [first] and eos.finish_reason == "stop"
    eos_held = _out(llm, PROMPT, SamplingParams(max_tokens=8, temperature=0, min_tokens=3))
    assert len(eos_held.token_ids) >= 3 and first not in eos_held.token_ids[:3]


def test_min_tokens_holds_off_stop_strings(llm):
    base = _out(llm, PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    stop = base.text.split()[0]
    assert _out(llm, PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=stop)).text == ""
    late = _out(llm, PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=stop, min_tokens=1))
    assert late.text.startswith(stop) and len(late.token_ids) >= 2


def test_min_tokens_that_bans_every_token_is_refused(llm):
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=list(range(256)))
    with pytest.raises(ValueError, match="min_tokens=2.*no token to pick"):
        llm.generate(PROMPT, params)


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(llm, include):
    """The text is cut before the stop string, or right after it when it is to be kept; the stream
    shows exactly the final text either way."""
    base = _out(llm, PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)).text
    words = base.split()
    stop = f"{words[2]} {words[3][:1]}"                           # across two tokens, ends inside one
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=stop,
                            include_stop_str_in_output=include)
    final = _out(llm, PROMPT, params)
    cut = base.index(stop)
    assert final.text == (base[:cut + len(stop)] if include else base[:cut])
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert "".join(d.text for d in llm.stream(PROMPT, params)) == final.text


def test_penalized_greedy_output_survives_batching_and_preemption(tiny_dir, llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.5, presence_penalty=0.2, min_tokens=3, stop_token_ids=[7])
    prompts = tiny_prompts(6)
    alone = [_out(llm, p, params).token_ids for p in prompts]
    small = LLM(model=tiny_dir, block_size=4, kv_cache_memory=12 * 2048, max_num_batched_tokens=7)
    kinds = []
    small.subscribe(lambda e: kinds.append(e.kind))
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == alone
    assert kinds.count("request_preempted") > 0
