"""The sampler's pipeline for one token: the distribution and the kept set after each stage.

``engine.sampler`` picks a token from a row of raw logits in compiled passes that never
materialise the stages. `pipeline(row, params, ...)` recomputes them, on demand, with the same
float32 arithmetic and the same compiled helpers (the weights ``exp((x - max) / T)``, the k-th
largest logit, the float64 sums, the nucleus rule), in the sampler's order:

    raw -> penalties (repetition / frequency / presence, min_tokens) -> temperature -> top_k -> min_p -> top_p

so the last stage's kept set is exactly the set ``_pick`` draws from (``tests/test_sampler_pipeline.py``
checks it draw by draw). Greedy requests end at ``penalties``: the argmax of that row is the pick.

``SamplingParams(logprobs_mode="processed")`` reports logprobs from the last stage (`processed_logprobs`):
the log of the distribution the token was drawn from, over the kept set only (FastDeploy's
``processed_logprobs``, ``fastdeploy/model_executor/layers/sample/sampler.py`` @ fb8b7170, computes
them after ``apply_penalty_multi_scores`` -- penalties and temperature -- and renormalises over the
top-p set with ``top_p_normalized_logprobs``; vLLM's ``processed_logprobs`` are after every processor,
top-k / top-p included; both are this). Greedy requests report the penalised row's log-softmax.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field

import numpy as np

from .sampler import _largest, _tempered, _total
from .sampling_params import SamplingParams


@dataclass(frozen=True, eq=False)
class Stage:
    name: str                  # raw, penalties, temperature, top_k, min_p, top_p
    probs: np.ndarray          # float64 [vocab]: the distribution after this stage (zero outside kept)
    kept: np.ndarray           # int64: token ids still possible, ascending

    def prob(self, token: int) -> float:
        return float(self.probs[token])

    def rank(self, token: int) -> int | None:
        """1 + how many kept tokens are more likely; None when ``token`` was dropped here."""
        p = self.probs[token]
        return int((self.probs > p).sum()) + 1 if p > 0 else None


@dataclass(frozen=True, eq=False)
class SamplerPipeline:
    stages: tuple[Stage, ...]
    token: int | None = None   # the token the sampler picked, when known
    texts: dict = field(default_factory=dict)   # token id -> its text, for the ids a view shows (``top``)

    @property
    def kept(self) -> np.ndarray:
        """The set the token is drawn from (the last stage's)."""
        return self.stages[-1].kept

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage {name!r}; stages: {', '.join(s.name for s in self.stages)}")

    def where(self, token: int | None = None) -> list[dict]:
        """Per stage: the token's probability, rank (None: dropped) and the kept set's size."""
        token = self.token if token is None else token
        return [{"stage": s.name, "prob": s.prob(token), "rank": s.rank(token), "kept": int(s.kept.size)}
                for s in self.stages]

    def top(self, n: int = 8) -> list[int]:
        """The ids a view draws: each stage's ``n`` most likely, and the token, in a stable order."""
        ids: dict[int, None] = {}
        for s in self.stages:
            k = min(n, s.probs.size)
            best = np.argpartition(-s.probs, k - 1)[:k]
            ids.update((int(t), None) for t in best[np.argsort(-s.probs[best], kind="stable")])
        if self.token is not None:
            ids[int(self.token)] = None
        return list(ids)

    def to_dict(self) -> dict:
        """JSON for ``POST /engine/sampler_pipeline``: each stage's distribution as base64 float32 and its
        kept set as a packed bit mask (exact)."""
        def b64(a):
            return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()

        stages = []
        for s in self.stages:
            mask = np.zeros(s.probs.size, bool)
            mask[s.kept] = True
            stages.append({"name": s.name, "probs": b64(s.probs.astype("<f4")), "kept": b64(np.packbits(mask))})
        return {"vocab_size": int(self.stages[0].probs.size), "token": self.token, "stages": stages,
                "texts": {str(k): v for k, v in self.texts.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "SamplerPipeline":
        n = int(data["vocab_size"])
        stages = []
        for s in data["stages"]:
            probs = np.frombuffer(base64.b64decode(s["probs"]), "<f4").astype(np.float64)
            mask = np.unpackbits(np.frombuffer(base64.b64decode(s["kept"]), np.uint8), count=n).astype(bool)
            stages.append(Stage(s["name"], probs, np.flatnonzero(mask)))
        return cls(tuple(stages), data.get("token"), {int(k): v for k, v in (data.get("texts") or {}).items()})

    def processed_logprobs(self) -> np.ndarray:
        """log of the last stage's distribution (-inf outside the kept set)."""
        with np.errstate(divide="ignore"):
            return np.log(self.stages[-1].probs)

    def _repr_html_(self) -> str:
        try:
            from playground.sampler_view import sampler_pipeline_html
        except ImportError:       # the engine alone: a table
            return self._table_html()
        return sampler_pipeline_html(self)

    def _table_html(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(w['stage'])}</td><td>{w['kept']}</td><td>{w['prob']:.4f}</td>"
            f"<td>{w['rank'] if w['rank'] is not None else 'dropped'}</td></tr>"
            for w in (self.where() if self.token is not None else []))
        return (f"<table><tr><th>stage</th><th>kept</th><th>p(token {self.token})</th><th>rank</th></tr>"
                f"{rows}</table>")


def _dist(w: np.ndarray) -> np.ndarray:
    p = w.astype(np.float64)
    return p / p.sum()


def pipeline(row: np.ndarray, params: SamplingParams, adjust=None, token: int | None = None) -> SamplerPipeline:
    """Every stage of picking from ``row`` (raw logits) under ``params``; ``adjust`` is the request's
    ``LogitsAdjust`` (penalties, min_tokens) in the state it had for this token."""
    raw = np.asarray(row, np.float32)
    picked = adjust(raw) if adjust is not None else raw
    stages = [Stage("raw", _softmax(raw), np.arange(raw.size)), Stage("penalties", _softmax(picked),
                                                                       np.flatnonzero(np.isfinite(picked)))]
    if params.greedy:
        best = int(np.argmax(picked))
        only = np.zeros(raw.size)
        only[best] = 1.0
        return SamplerPipeline((*stages, Stage("greedy", only, np.array([best]))), token)
    n = picked.size
    w = _tempered(picked, picked[int(np.argmax(picked))], 1.0 / params.temperature)    # as _pick
    stages.append(Stage("temperature", _dist(w), np.flatnonzero(w > 0)))
    top_k = min(params.top_k, n)
    if 0 < top_k < n:
        kth = _largest(picked, top_k)[1][top_k - 1]
        w[picked < kth] = 0.0
    stages.append(Stage("top_k", _dist(w), np.flatnonzero(w > 0)))
    mass = _total(w)
    if params.min_p > 0:
        w[w.astype(np.float64) < params.min_p] = 0.0
    stages.append(Stage("min_p", _dist(w), np.flatnonzero(w > 0)))
    if params.top_p < 1.0:
        need = params.top_p * (1 - 1e-9) * mass
        live = np.flatnonzero(w > 0)
        order = live[np.argsort(-w[live], kind="stable")]          # most likely first, ties by lower id
        before = np.concatenate(([0.0], np.cumsum(w[order].astype(np.float64))[:-1]))
        nucleus = order[before < need]
        cut = np.zeros_like(w)
        cut[nucleus] = w[nucleus]
        w = cut
    stages.append(Stage("top_p", _dist(w), np.flatnonzero(w > 0)))
    return SamplerPipeline(tuple(stages), token)


def _softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    finite = np.isfinite(x)
    p = np.zeros_like(x)
    p[finite] = np.exp(x[finite] - x[finite].max())
    return p / p.sum()
