"""The engine's records as JSON, and back: what crosses HTTP between a server and its clients.

``StreamDelta`` (with its ``Logprob`` dicts keyed by token id), ``SamplingParams``,
``EngineSnapshot`` and ``EngineEvent`` are plain dataclasses of ids, numbers and strings, so each
goes out as ``dataclasses.asdict`` and comes back through its constructor; JSON turns int keys
into strings and tuples into lists, which ``*_from_dict`` undo.
"""

from __future__ import annotations

import dataclasses
import math

from ..outputs import StreamDelta
from ..provenance import Provenance
from ..request import Logprob, RequestMetrics
from ..sampling_params import SamplingParams
from ..snapshot import BlockInfo, EngineEvent, EngineSnapshot, PrefixCacheInfo, RequestInfo, StepInfo


def _lp_to(entries) -> dict | None:
    if entries is None:
        return None
    return {str(t): [lp.logprob if math.isfinite(lp.logprob) else None, lp.rank, lp.decoded_token]
            for t, lp in entries.items()}


def _lp_from(entries) -> dict | None:
    if entries is None:
        return None
    return {int(t): Logprob(-math.inf if v[0] is None else v[0], v[1], v[2]) for t, v in entries.items()}


def delta_to_dict(d: StreamDelta, *, with_prompt_ids: bool) -> dict:
    return {"request_id": d.request_id, "text": d.text, "token_ids": d.token_ids,
            "logprobs": [_lp_to(e) for e in d.logprobs], "finished": d.finished, "finish_reason": d.finish_reason,
            "num_prompt_tokens": d.num_prompt_tokens, "num_cached_tokens": d.num_cached_tokens,
            "prompt_token_ids": d.prompt_token_ids if with_prompt_ids else None,
            "metrics": dataclasses.asdict(d.metrics) if d.metrics is not None else None, "error": d.error,
            "prompt_logprobs": None if d.prompt_logprobs is None else [_lp_to(e) for e in d.prompt_logprobs],
            "provenance": None if d.provenance is None else d.provenance.to_dict()}


def delta_from_dict(data: dict) -> StreamDelta:
    data = dict(data)
    data["logprobs"] = [_lp_from(e) for e in data["logprobs"]]
    if data.get("prompt_logprobs") is not None:
        data["prompt_logprobs"] = [_lp_from(e) for e in data["prompt_logprobs"]]
    if data.get("metrics") is not None:
        data["metrics"] = RequestMetrics(**data["metrics"])
    if data.get("provenance") is not None:
        data["provenance"] = Provenance.from_dict(data["provenance"])
    return StreamDelta(**data)


def params_to_dict(p: SamplingParams) -> dict:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}


def params_from_dict(data: dict) -> SamplingParams:
    if not isinstance(data, dict):
        raise ValueError(f"sampling_params must be an object of SamplingParams fields; got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}; accepted: {', '.join(sorted(names))}")
    return SamplingParams(**data)


def snapshot_to_dict(s: EngineSnapshot) -> dict:
    return s.to_dict()


def snapshot_from_dict(data: dict) -> EngineSnapshot:
    data = dict(data)
    data["blocks"] = tuple(BlockInfo(**{**b, "owners": tuple(b["owners"]),
                                        "token_range": None if b["token_range"] is None else tuple(b["token_range"])})
                           for b in data["blocks"])
    data["requests"] = tuple(RequestInfo(**{**r, "block_table": tuple(r["block_table"])}) for r in data["requests"])
    data["prefix_cache"] = PrefixCacheInfo(**data["prefix_cache"])
    if data.get("last_step") is not None:
        data["last_step"] = StepInfo(**{**data["last_step"], "decode": tuple(data["last_step"]["decode"])})
    return EngineSnapshot(**data)


def event_from_dict(data: dict) -> EngineEvent:
    return EngineEvent(**data)
