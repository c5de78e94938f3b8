"""Sampler and SamplingParams: validation, filters, seeds, logprob bookkeeping."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.sampler import Sampler, sample_row, top_logprobs
from engine.sampling_params import SamplingParams
from engine.sampling_reference import NumpySampler, log_softmax
from engine.sampling_reference import probs as reference_probs


@pytest.mark.parametrize("field,value,accepted", [
    ("max_tokens", 0, ">= 1"), ("max_tokens", 1.5, ">= 1"), ("temperature", -0.1, "[0.0"),
    ("top_p", 0.0, "(0.0, 1.0]"), ("top_p", 1.5, "(0.0, 1.0]"), ("top_k", -2, ">= 0"),
    ("min_p", 2.0, "[0.0, 1.0]"), ("logprobs", 21, "[0, 20]"), ("prompt_logprobs", -1, "[0, 20]"),
    ("seed", "x", "integer"), ("stop", [""], "non-empty"), ("stop_token_ids", [-1], "non-negative"),
    ("temperature", float("nan"), "number"),
])
def test_bad_fields_name_field_and_range(field, value, accepted):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value) and accepted in str(err.value)


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0])
    assert sample_row(logits, SamplingParams(temperature=0), np.random.default_rng(0)) == 1


def test_top_k_and_top_p_restrict_support():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    top_k = {sample_row(logits, SamplingParams(temperature=1.0, top_k=2), rng) for _ in range(300)}
    assert top_k == {0, 1}
    top_p = {sample_row(logits, SamplingParams(temperature=1.0, top_p=0.8), rng) for _ in range(300)}
    assert top_p == {0, 1}  # 0.5 + 0.3 reaches 0.8
    min_p = {sample_row(logits, SamplingParams(temperature=1.0, min_p=0.5), rng) for _ in range(300)}
    assert min_p == {0, 1}  # 0.15 < 0.5 * 0.5


def test_temperature_sampling_follows_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    rng = np.random.default_rng(1)
    draws = [sample_row(np.log(probs), SamplingParams(temperature=1.0), rng) for _ in range(4000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.allclose(freq, probs, atol=0.03)


def test_logprobs_come_from_raw_logits_with_ranks():
    logits = np.array([[1.0, 4.0, 2.0, 3.0, 0.0]])
    sampler = Sampler(lambda t: f"<{t}>")
    tokens, lps = sampler(logits, [SamplingParams(temperature=5.0, top_k=1, logprobs=2)],
                          [np.random.default_rng(0)])
    assert tokens == [1]
    raw = log_softmax(logits[0])
    assert list(lps[0]) == [1, 3]
    assert lps[0][1].rank == 1 and lps[0][3].rank == 2
    assert lps[0][1].logprob == pytest.approx(raw[1]) and lps[0][1].decoded_token == "<1>"


def test_chosen_token_outside_top_k_is_added_with_its_rank():
    out = top_logprobs(np.array([5.0, 4.0, 3.0, 2.0]), token_id=3, k=1, decode=str)
    assert set(out) == {0, 3} and out[3].rank == 4
    assert out[3].logprob == pytest.approx(log_softmax(np.array([5.0, 4.0, 3.0, 2.0]))[3])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(1, 3000), k=st.integers(0, 20),
       dtype=st.sampled_from([np.float32, np.float64]), spread=st.sampled_from([0.01, 1.0, 30.0]))
def test_logprobs_equal_the_numpy_definition(seed, size, k, dtype, spread):
    """The compiled scan against a float64 log-softmax and a full sort: the same top k (highest
    first, equal values by lower id) ranked by place as vLLM does, the chosen token beyond them
    ranked 1 + the number of larger logits, logprobs within float32 rounding."""
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(size) * spread).astype(dtype)
    if size > 4:
        row[rng.integers(size, size=3)] = row.max()          # ties at the top
    token = int(rng.integers(size))
    out = top_logprobs(row, token, k, decode=str)
    ref = log_softmax(row)
    order = np.argsort(-row.astype(np.float64), kind="stable")[:k].tolist()
    assert list(out)[:len(order)] == order
    for place, (t, lp) in enumerate(out.items(), start=1):
        assert lp.logprob == pytest.approx(ref[t], abs=1e-5)
        assert lp.rank == (place if place <= k else int((row > row[t]).sum()) + 1)
        assert lp.decoded_token == str(t)
    assert token in out


class FixedDraw:
    """A generator whose one draw is ``u``: ``sample_row`` draws once, as ``rng.choice`` does."""

    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(2, 3000), spread=st.sampled_from([0.3, 2.0, 8.0]),
       temperature=st.sampled_from([0.05, 0.7, 1.0, 1.8]), top_k=st.sampled_from([0, 1, 5, 40]),
       top_p=st.sampled_from([1.0, 0.95, 0.9, 0.5, 0.05]), min_p=st.sampled_from([0.0, 0.05, 0.3]))
@example(seed=1, size=1500, spread=2.0, temperature=1.0, top_k=0, top_p=1.0, min_p=0.05)   # each filter alone,
@example(seed=1, size=1500, spread=2.0, temperature=1.0, top_k=40, top_p=1.0, min_p=0.0)   # on a row where it
@example(seed=1, size=1500, spread=2.0, temperature=0.7, top_k=0, top_p=0.9, min_p=0.0)    # drops many tokens
def test_sampling_picks_the_token_the_numpy_rule_gives(seed, size, spread, temperature, top_k, top_p, min_p):
    """A draw ``u`` in the middle of a kept token's span of the reference's cumulative
    probabilities (id order, as ``rng.choice``) picks that token, for every kept token (up to 64,
    spread over them): a token kept or dropped differently moves the spans after it. Spans under
    1e-5 are left out (float rounding)."""
    row = (np.random.default_rng(seed).standard_normal(size) * spread).astype(np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    cdf = np.cumsum(reference_probs(row, params))
    cdf /= cdf[-1]                                            # as rng.choice normalizes it
    starts = np.concatenate(([0.0], cdf[:-1]))
    kept = np.flatnonzero(cdf - starts > 1e-5)
    for token in kept[np.linspace(0, len(kept) - 1, min(64, len(kept))).astype(int)].tolist():
        assert sample_row(row, params, FixedDraw((starts[token] + cdf[token]) / 2)) == token


def test_greedy_picks_the_first_of_equal_maxima():
    row = np.array([1.0, 3.0, 0.5, 3.0], np.float32)
    token, lps = Sampler(str).sample(row, SamplingParams(temperature=0, logprobs=2), np.random.default_rng(0))
    assert token == 1 == int(np.argmax(row)) and list(lps) == [1, 3] and lps[3].rank == 2


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("nan_at", [0, 2, 3])
def test_nan_anywhere_in_the_row_is_an_error(temperature, nan_at):
    """Greedy finds a NaN through its argmax alone (NumPy's argmax returns the first NaN), so a NaN
    that is not the largest finite value's neighbour must still be caught, as when sampling."""
    row = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    row[nan_at] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        Sampler(str).sample(row, SamplingParams(temperature=temperature), np.random.default_rng(0))


def test_greedy_sample_matches_sample_row_with_logprobs():
    row = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    token, lps = Sampler(str).sample(row, SamplingParams(temperature=0, logprobs=2), np.random.default_rng(0))
    assert token == sample_row(row, SamplingParams(temperature=0), np.random.default_rng(0)) == int(np.argmax(row))
    assert lps[token].rank == 1 and len(lps) == 2


def test_warm_up_readies_the_passes_a_float32_row_takes():
    """In a fresh process (no earlier test compiled anything): after ``warm_up`` the compiled
    passes hold the float32-row versions that sampling a float32 row of another length uses, so
    the first request does not compile them."""
    code = textwrap.dedent("""
        import numpy as np
        from engine import sampler
        from engine.sampling_params import SamplingParams
        sampler.Sampler(str).warm_up()
        before = {f.__name__: len(f.signatures) for f in (sampler._scan, sampler._pick, sampler._rank)}
        assert all(before.values()), before
        row = np.random.default_rng(0).standard_normal(49152).astype(np.float32)
        s = sampler.Sampler(str)
        s.sample(row, SamplingParams(temperature=0, logprobs=5), np.random.default_rng(0))
        s.sample(row, SamplingParams(temperature=0.9, top_p=0.8, top_k=50, min_p=0.02, logprobs=3), np.random.default_rng(0))
        after = {f.__name__: len(f.signatures) for f in (sampler._scan, sampler._pick, sampler._rank)}
        assert after == before, (before, after)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1], timeout=300)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, logprobs=5),
    SamplingParams(temperature=0.7, top_p=0.9, logprobs=5),
    SamplingParams(temperature=1.0, top_k=40, min_p=0.02, logprobs=3),
], ids=["greedy", "app-defaults", "top-k-min-p"])
def test_compiled_sampler_equals_the_numpy_one_draw_for_draw(params):
    """Seeded alike, the compiled sampler and the NumPy one (``rng.choice``, the benchmark's peer)
    pick the same tokens and report the same top logprobs and ranks, row after row."""
    rows = np.random.default_rng(7).standard_normal((40, 49152)).astype(np.float32) * 2.5
    fast, slow = Sampler(str), NumpySampler(str)
    rng_fast, rng_slow = np.random.default_rng(3), np.random.default_rng(3)
    for row in rows:
        (t1, lp1), (t2, lp2) = fast.sample(row, params, rng_fast), slow.sample(row, params, rng_slow)
        assert t1 == t2
        assert list(lp1) == list(lp2) and [v.rank for v in lp1.values()] == [v.rank for v in lp2.values()]
        assert [v.logprob for v in lp1.values()] == pytest.approx([v.logprob for v in lp2.values()], abs=1e-5)
