"""Sampler and SamplingParams: validation, filters, seeds, logprob bookkeeping."""

import numpy as np
import pytest

from engine.sampler import Sampler, log_softmax, sample_row, top_logprobs
from engine.sampling_params import SamplingParams


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
    lp = log_softmax(np.array([5.0, 4.0, 3.0, 2.0]))
    out = top_logprobs(lp, token_id=3, k=1, decode=str)
    assert set(out) == {0, 3} and out[3].rank == 4


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
