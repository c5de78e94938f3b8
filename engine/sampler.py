"""Token selection and logprobs, on the host in NumPy (one row per request).

Logprobs are always computed from the model's **raw** logits (a plain
log-softmax, before temperature, top-k, top-p or min-p), so a token's logprob
and rank describe what the model believed, whatever filter picked it.
"""

from __future__ import annotations

import numpy as np

from .request import Logprob
from .sampling_params import SamplingParams


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def top_logprobs(logprobs: np.ndarray, token_id: int, k: int, decode) -> dict[int, Logprob]:
    """The chosen token plus the k most likely ones, each with logprob and rank (1 = best)."""
    out: dict[int, Logprob] = {}
    if k > 0:
        top = np.argpartition(-logprobs, k - 1)[:k]
        top = top[np.argsort(-logprobs[top], kind="stable")]
        for rank, tid in enumerate(top.tolist(), start=1):
            out[tid] = Logprob(float(logprobs[tid]), rank, decode(tid))
    if token_id not in out:
        rank = int((logprobs > logprobs[token_id]).sum()) + 1
        out[token_id] = Logprob(float(logprobs[token_id]), rank, decode(token_id))
    return out


def sample_row(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick one token from a row of raw logits under the request's sampling settings."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.size:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.min_p > 0:
        probs = np.where(probs < params.min_p * probs.max(), 0.0, probs)
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        before = np.concatenate(([0.0], cumulative[:-1]))
        keep = before < params.top_p * (1 - 1e-9)  # keep tokens until the mass reaches top_p (float slack)
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
    probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


class Sampler:
    def __init__(self, decode_token):
        self.decode_token = decode_token  # token id -> text, for Logprob.decoded_token

    def sample(self, row: np.ndarray, params: SamplingParams, rng: np.random.Generator):
        """One request's row of raw logits → (token id, logprob dict or None)."""
        if params.greedy:
            # one pass over the vocabulary: argmax lands on the first NaN when the row has one
            token = int(np.argmax(row))
            if np.isnan(row[token]):
                raise ValueError("the model produced NaN logits")
        else:
            if np.isnan(row).any():
                raise ValueError("the model produced NaN logits")
            token = sample_row(row, params, rng)
        if params.logprobs is None:
            return token, None
        return token, top_logprobs(log_softmax(row), token, params.logprobs, self.decode_token)

    def __call__(self, logits: np.ndarray, params: list[SamplingParams], rngs: list[np.random.Generator]):
        """logits [n, vocab] → (token ids, per-row logprob dicts or None)."""
        pairs = [self.sample(row, p, rng) for row, p, rng in zip(logits, params, rngs)]
        return [t for t, _ in pairs], [lp for _, lp in pairs]

    def prompt_logprobs(self, logits: np.ndarray, next_tokens: list[int], k: int) -> list[dict[int, Logprob]]:
        """For each prompt position: logprob of the actual next prompt token and the top-k."""
        lp = log_softmax(logits)
        return [top_logprobs(row, tok, k, self.decode_token) for row, tok in zip(lp, next_tokens)]
