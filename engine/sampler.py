"""Token selection and logprobs, on the host (one row per request).

Logprobs are always computed from the model's **raw** logits (a plain
log-softmax, before penalties, min_tokens, temperature, top-k, top-p or min-p),
so a token's logprob and rank describe what the model believed, whatever filter
picked it. A request that sets a penalty or ``min_tokens`` picks from a copy of
its row changed by ``LogitsAdjust``; every other request does no extra work.
``logprobs_mode="processed"`` reports the distribution the token was drawn from
instead (``engine.sampler_pipeline``, which recomputes the stages on demand).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gpu_kernels.cpu.activations import exp_shifted

from .request import Logprob
from .sampling_params import SamplingParams


@njit(cache=True)
def _largest(row, m):
    """The ``m`` largest entries of ``row`` (ids, values as float64), highest first, equal values
    by lower id: one pass with a sorted buffer, which takes an entry only if it beats the last."""
    ids, vals = np.full(m, -1, np.int64), np.full(m, -np.inf)
    filled = 0
    for i in range(row.size):
        x = np.float64(row[i])
        if m and (filled < m or x > vals[m - 1]):
            j = min(filled, m - 1)
            while j > 0 and x > vals[j - 1]:      # shift the smaller ones down; ties keep lower ids first
                ids[j], vals[j] = ids[j - 1], vals[j - 1]
                j -= 1
            ids[j], vals[j] = i, x
            filled = min(filled + 1, m)
    return ids, vals


@njit(cache=True)  # holds the interpreter lock: no NumPy call in between for another thread to cut in
def _scan(row, k):
    """One row of raw logits in a few compiled passes: the index of its first NaN (-1: none), its
    argmax (the first of equal maxima), the log of the softmax denominator (``max + log(sum(exp(x -
    max)))``, in float64) and its ``k`` largest entries (ids, values), highest first, equal values by
    lower id. ``k < 0``: argmax only (no denominator, no entries)."""
    best, top = 0, row[0]
    for i in range(row.size):
        x = row[i]
        if x != x:
            return i, i, np.nan, np.empty(0, np.int64), np.empty(0, np.float64)
        if x > top:
            best, top = i, x
    if k < 0:
        return -1, best, np.nan, np.empty(0, np.int64), np.empty(0, np.float64)
    weights = row.astype(np.float32)              # exp(x - max), eight lanes at a time
    exp_shifted(weights, np.float32(top))
    total = _total(weights[:row.size // 8 * 8])
    for i in range(row.size // 8 * 8, row.size):
        total += np.exp(np.float64(row[i]) - np.float64(top))
    ids, vals = _largest(row, min(k, row.size))
    return -1, best, np.float64(top) + np.log(total), ids, vals


@njit(cache=True)
def _rank(row, token):
    """1 + how many entries of ``row`` are larger than ``row[token]``."""
    above, x = 0, row[token]
    for i in range(row.size):
        above += row[i] > x
    return above + 1


def _row(logits: np.ndarray) -> np.ndarray:
    return logits if logits.dtype in (np.float32, np.float64) else logits.astype(np.float32)


def _checked_scan(row: np.ndarray, k: int):
    """``_scan(row, k)`` without its NaN index: a row with a NaN is a ValueError."""
    nan, best, log_z, ids, vals = _scan(row, k)
    if nan >= 0:
        raise ValueError("the model produced NaN logits")
    return best, log_z, ids, vals


def top_logprobs(logits: np.ndarray, token_id: int, k: int, decode) -> dict[int, Logprob]:
    """From one row of raw logits: the chosen token plus the k most likely ones, each with its
    logprob (log-softmax of the row) and rank (1 = best)."""
    row = _row(logits)
    _, log_z, ids, vals = _checked_scan(row, k)
    return _logprob_dict(row, token_id, log_z, ids, vals, decode)


def _logprob_dict(row, token_id: int, log_z: float, ids, vals, decode) -> dict[int, Logprob]:
    out = {int(t): Logprob(float(v - log_z), rank, decode(int(t)))
           for rank, (t, v) in enumerate(zip(ids.tolist(), vals.tolist()), start=1)}
    if token_id not in out:
        out[token_id] = Logprob(float(np.float64(row[token_id]) - log_z), int(_rank(row, token_id)),
                                decode(token_id))
    return out


@njit(cache=True)
def _tempered(row, top, inv_t):
    """The weights ``exp((x - max) / T)`` in float32 (the largest is 1), ``top`` the row's largest value."""
    n = row.size
    w = np.empty(n, np.float32)
    scale = np.float32(inv_t)
    for i in range(n):
        w[i] = (row[i] - top) * scale
    exp_shifted(w, np.float32(0.0))
    for i in range(n // 8 * 8, n):
        w[i] = np.exp(w[i])
    return w


@njit(cache=True)  # holds the interpreter lock, as _scan
def _pick(row, top, inv_t, top_k, top_p, min_p, u):
    """The token ``u`` (uniform in [0, 1)) selects from the row's distribution under temperature
    (``inv_t = 1 / T``), top-k, min-p and top-p; ``top`` is the row's largest value. Filters, in
    order: top-k keeps tokens with logits >= the k-th largest; min-p drops tokens whose
    probability is below ``min_p`` x the largest; top-p keeps the most likely tokens (highest
    first, equal ones by lower id) until the mass they follow reaches ``top_p`` of the mass after
    top-k. The pick is ``rng.choice``'s rule: the first token whose cumulative probability, in id
    order, is above ``u``."""
    n = row.size
    w = _tempered(row, top, inv_t)
    if 0 < top_k < n:
        kth = _largest(row, top_k)[1][top_k - 1]
        for i in range(n):
            if row[i] < kth:
                w[i] = 0.0
    mass = _total(w)                               # after top-k: what top-p is a share of
    if min_p > 0:
        for i in range(n):
            if w[i] < min_p:
                w[i] = 0.0
    if top_p >= 1.0:
        return _walk(w, np.arange(n), u * (mass if min_p <= 0 else _total(w)))
    need = top_p * (1 - 1e-9) * mass               # float slack, so top_p = 1 - tiny keeps all
    cut, found = 1e-3, np.empty(n, np.int64)
    while True:                                    # sort only the tokens that can be in the nucleus
        count, within = 0, 0.0
        for i in range(n):
            if w[i] >= cut and w[i] > 0:
                found[count] = i
                count += 1
                within += w[i]
        if within >= need or cut == 0:
            break
        cut = cut * 1e-3 if cut > 1e-12 else 0.0
    ids = found[:count]
    ids = ids[np.argsort(-w[ids], kind="mergesort")]
    before, kept = 0.0, 0
    while kept < ids.size and before < need:
        before += w[ids[kept]]
        kept += 1
    nucleus = np.sort(ids[:kept])                  # the pick walks the kept tokens in id order
    total = 0.0
    for i in nucleus:
        total += w[i]
    return _walk(w, nucleus, u * total)


@njit(cache=True, fastmath={"reassoc"})
def _total(w):
    """Sum of float32 weights in float64 (any order: vectorized)."""
    total = 0.0
    for i in range(w.size):
        total += w[i]
    return total


@njit(cache=True)
def _walk(w, ids, target):
    """The first of ``ids`` (ascending) at which the running sum of ``w`` passes ``target``."""
    cumulative, last = 0.0, ids[0]
    for i in ids:
        if w[i] > 0:
            cumulative += w[i]
            last = i
            if cumulative > target:
                return i
    return last


def sample_row(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick one token from a row of raw logits under the request's sampling settings (one draw of
    ``rng``, as ``rng.choice`` makes)."""
    row = _row(logits)
    _, best, _, _, _ = _scan(row, -1)
    if params.greedy:
        return int(best)
    top_k = min(params.top_k, row.size)         # any larger k keeps every token (and fits in int64)
    return int(_pick(row, row[best], 1.0 / params.temperature, top_k, params.top_p, params.min_p, rng.random()))


class LogitsAdjust:
    """One request's changes to the row it picks from (never to its logprobs), following vLLM:
    ``apply_penalties`` (vllm/model_executor/layers/utils.py) and ``MinTokensLogitsProcessor``
    (vllm/v1/sample/logits_processor/builtin.py), in that order.

    - repetition penalty ``r``: a token in the prompt or the output so far gets ``x / r`` if
      ``x > 0``, else ``x * r``;
    - ``x -= frequency_penalty * count + presence_penalty * (count > 0)``, ``count`` = times the
      token is in the output so far;
    - while the output has fewer than ``min_tokens`` tokens, ``banned`` (the tokens that would end
      the request) are set to -inf.

    Built only for a request whose params ``adjusts_logits``. It reads the request's output list
    (which the engine appends to) and counts the tokens added since its last call, so a step
    costs a few passes over the row, not over the output. The row is float32, as the sampler's;
    a penalty that would push a logit to +inf is capped at float32's largest value."""

    def __init__(self, params: SamplingParams, prompt_ids, output_ids: list[int], banned=()):
        self.params, self.prompt_ids, self.output_ids = params, prompt_ids, output_ids
        self.banned = np.array(sorted({int(t) for t in banned}), np.int64)
        self._counts: np.ndarray | None = None   # per token of the row: times in the output
        self._seen: np.ndarray | None = None     # per token: in the prompt or the output
        self._counted = 0

    def _update(self, vocab: int) -> None:
        if self._counts is None or self._counts.size != vocab:
            self._counts, self._seen, self._counted = np.zeros(vocab, np.int32), np.zeros(vocab, bool), 0
            prompt = np.asarray(self.prompt_ids, np.int64)
            self._seen[prompt[prompt < vocab]] = True
        new = np.asarray(self.output_ids[self._counted:], np.int64)
        new = new[new < vocab]
        np.add.at(self._counts, new, 1)
        self._seen[new] = True
        self._counted = len(self.output_ids)

    def __call__(self, row: np.ndarray) -> np.ndarray:
        """The row to pick from: a float32 copy of ``row`` with the changes applied."""
        p = self.params
        out = np.array(row, np.float32)
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            self._update(out.size)
            if p.repetition_penalty != 1.0:
                r = np.float32(p.repetition_penalty)
                seen = out[self._seen]
                with np.errstate(over="ignore"):
                    out[self._seen] = np.where(seen > 0, seen / r, seen * r)
                if p.repetition_penalty < 1.0:
                    np.minimum(out, np.finfo(np.float32).max, out=out)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                used = np.flatnonzero(self._counts)
                out[used] -= (np.float32(p.frequency_penalty) * self._counts[used]
                              + np.float32(p.presence_penalty)).astype(np.float32)
        if len(self.output_ids) < p.min_tokens and self.banned.size:
            out[self.banned[self.banned < out.size]] = -np.inf
        return out


class Sampler:
    def __init__(self, decode_token):
        self.decode_token = decode_token  # token id -> text, for Logprob.decoded_token

    def sample(self, row: np.ndarray, params: SamplingParams, rng: np.random.Generator,
               adjust: LogitsAdjust | None = None):
        """One request's row of raw logits → (token id, logprob dict or None). Greedy picks and
        logprobs come from one compiled scan of the row (``_scan``); it also finds any NaN. With
        ``adjust`` (penalties, min_tokens) the token is picked from ``adjust(row)``; the logprobs
        still describe the raw row."""
        row = _row(row)
        best, log_z, ids, vals = _checked_scan(row, -1 if params.logprobs is None else params.logprobs)
        if adjust is not None:
            picked = adjust(row)
            token = int(_scan(picked, -1)[1]) if params.greedy else sample_row(picked, params, rng)
        else:
            token = best if params.greedy else sample_row(row, params, rng)
        if params.logprobs is None:
            return int(token), None
        if params.logprobs_mode == "processed":
            return int(token), self.processed_logprobs(row, params, adjust, int(token))
        return int(token), _logprob_dict(row, int(token), log_z, ids, vals, self.decode_token)

    def processed_logprobs(self, row, params: SamplingParams, adjust, token: int) -> dict[int, Logprob]:
        """Logprobs of the distribution ``token`` was drawn from (``engine.sampler_pipeline``): the
        top ``params.logprobs`` of its kept set and the token, ranked within it."""
        from .sampler_pipeline import pipeline

        if params.greedy:   # greedy draws nothing: the penalised row's log-softmax (vLLM applies no temperature)
            picked = adjust(row) if adjust is not None else row
            _, log_z, ids, vals = _checked_scan(_row(picked), params.logprobs)
            return _logprob_dict(_row(picked), token, log_z, ids, vals, self.decode_token)
        last = pipeline(row, params, adjust).stages[-1]
        kept = last.kept[np.argsort(-last.probs[last.kept], kind="stable")]
        with np.errstate(divide="ignore"):
            out = {int(t): Logprob(float(np.log(last.probs[t])), rank, self.decode_token(int(t)))
                   for rank, t in enumerate(kept[: params.logprobs].tolist(), start=1)}
            if token not in out:
                p = last.probs[token]
                out[token] = Logprob(float(np.log(p)), int((last.probs > p).sum()) + 1, self.decode_token(token))
        return out

    def warm_up(self) -> None:
        """Compile (or load from Numba's disk cache) the passes for float32 rows, greedy and sampled,
        so the first request after an install does not wait for them."""
        row = np.linspace(-1.0, 1.0, 64, dtype=np.float32)
        self.sample(row, SamplingParams(temperature=0, logprobs=2), np.random.default_rng(0))
        self.sample(row, SamplingParams(temperature=0.7, top_p=0.9, top_k=8, min_p=0.01, logprobs=2),
                    np.random.default_rng(0))

    def __call__(self, logits: np.ndarray, params: list[SamplingParams], rngs: list[np.random.Generator],
                 adjusts=None):
        """logits [n, vocab] → (token ids, per-row logprob dicts or None)."""
        adjusts = adjusts or [None] * len(params)
        pairs = [self.sample(row, p, rng, a) for row, p, rng, a in zip(logits, params, rngs, adjusts)]
        return [t for t, _ in pairs], [lp for _, lp in pairs]

    def prompt_logprobs(self, logits: np.ndarray, next_tokens: list[int], k: int) -> list[dict[int, Logprob]]:
        """For each prompt position: logprob of the actual next prompt token and the top-k."""
        return [top_logprobs(row, tok, k, self.decode_token) for row, tok in zip(logits, next_tokens)]
