"""The sampling rule and logprobs in plain NumPy (float64): the definition the compiled passes
of ``engine.sampler`` are tested against, and their peer in ``python -m benchmarks.sampler``.
Not used while serving."""

from __future__ import annotations

import numpy as np

from .request import Logprob
from .sampler import LogitsAdjust, Sampler
from .sampling_params import SamplingParams


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def adjusted(logits: np.ndarray, params: SamplingParams, prompt_ids, output_ids, banned=()) -> np.ndarray:
    """The row a request picks from, token by token from its prompt and output lists (vLLM's
    ``apply_penalties`` and ``MinTokensLogitsProcessor``): repetition penalty on every token seen
    in prompt or output (positive logits divided, negative multiplied), then ``frequency_penalty *
    count + presence_penalty`` subtracted for each token of the output, then, while the output is
    shorter than ``min_tokens``, the ``banned`` tokens set to -inf."""
    x = np.asarray(logits, np.float64).copy()
    counts: dict[int, int] = {}
    for t in output_ids:
        counts[t] = counts.get(t, 0) + 1
    if params.repetition_penalty != 1.0:
        for t in set(prompt_ids) | set(counts):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, c in counts.items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    if len(output_ids) < params.min_tokens:
        for t in banned:
            x[t] = -np.inf
    return x


def probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, then top-k (logits >= the k-th largest), min-p (drop below min_p x the
    largest probability), top-p (most likely first, equal ones by lower id, until the mass before
    a token reaches top_p of the mass after top-k); normalized."""
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.size:
        kth = np.sort(scaled)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    if params.min_p > 0:
        p = np.where(p < params.min_p * p.max(), 0.0, p)
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.concatenate(([0.0], np.cumsum(p[order])[:-1]))
        mask = np.zeros_like(p, dtype=bool)
        mask[order[before < params.top_p * (1 - 1e-9)]] = True
        p = np.where(mask, p, 0.0)
    return p / p.sum()


class NumpySampler(Sampler):
    """``Sampler`` with every pass in NumPy: argmax, ``rng.choice`` over ``probs``, the top-k
    logprobs by ``argpartition`` and a sort."""

    def sample(self, row: np.ndarray, params: SamplingParams, rng: np.random.Generator,
               adjust: LogitsAdjust | None = None):
        if np.isnan(row).any():
            raise ValueError("the model produced NaN logits")
        picked = row if adjust is None else adjusted(row, params, adjust.prompt_ids, adjust.output_ids,
                                                     adjust.banned.tolist())
        token = int(np.argmax(picked)) if params.greedy else int(rng.choice(row.size, p=probs(picked, params)))
        if params.logprobs is None:
            return token, None
        lp, k = log_softmax(row), params.logprobs
        out: dict[int, Logprob] = {}
        if k > 0:
            top = np.argpartition(-lp, k - 1)[:k]
            for rank, t in enumerate(top[np.argsort(-lp[top], kind="stable")].tolist(), start=1):
                out[t] = Logprob(float(lp[t]), rank, self.decode_token(t))
        if token not in out:
            out[token] = Logprob(float(lp[token]), int((lp > lp[token]).sum()) + 1, self.decode_token(token))
        return token, out
