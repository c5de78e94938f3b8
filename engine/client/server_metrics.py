"""An OpenAI-compatible server's Prometheus ``/metrics``, read as the engine's snapshots and events.

Which server it is comes from its own metric names: ``vllm:`` (vLLM, and this project's server),
``fastdeploy:`` (FastDeploy), ``llamacpp:`` (llama.cpp's ``llama-server --metrics``). Read from them:
KV usage, requests running and waiting, prefix-cache queries and hits (in tokens), prompt tokens
computed and tokens generated, preemptions, and the block size and pool size where a server names
them (``vllm:cache_config_info``, ``fastdeploy:max_gpu_block_num``).

What no metric says is not made up: an ``EngineSnapshot`` built here has no blocks and says why
(``blocks_hidden``); its ``requests`` are the running and waiting counts as placeholders
(``server:running:1``: nothing is known of them but their state); each poll of ``/metrics`` is one
``step`` event covering the time since the previous poll, its ``prefill`` the prompt tokens computed
meanwhile and its ``decode`` one entry per token generated meanwhile (a server's counters count
tokens, not which request they belong to). Where a server has no metric for something (llama.cpp
exports no KV usage) it reads as 0.

Metric names: vLLM's ``vllm/v1/metrics/loggers.py``; FastDeploy's ``fastdeploy/metrics/metrics.py``;
llama.cpp's observed on ``llama-server`` built from llama.cpp commit 0c1e570
(``/work/shared/design/serving-reference.md``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..snapshot import EngineEvent, EngineSnapshot, PrefixCacheInfo, RequestInfo, StepInfo

# flavour -> quantity -> the sample names to read, first found wins (older names last)
NAMES = {
    "vllm": {"kv": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
             "running": ("vllm:num_requests_running",), "waiting": ("vllm:num_requests_waiting",),
             "queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
             "hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
             "generated": ("vllm:generation_tokens_total",), "preempted": ("vllm:num_preemptions_total",)},
    "fastdeploy": {"kv": ("fastdeploy:gpu_cache_usage_perc",),
                   "running": ("fastdeploy:num_requests_running",), "waiting": ("fastdeploy:num_requests_waiting",),
                   "hits": ("fastdeploy:prefix_cache_token_num_total",), "hit_rate": ("fastdeploy:hit_token_rate",),
                   "prompt": ("fastdeploy:prompt_tokens_total",), "generated": ("fastdeploy:generation_tokens_total",),
                   "num_blocks": ("fastdeploy:max_gpu_block_num",)},
    "llamacpp": {"running": ("llamacpp:requests_processing",), "waiting": ("llamacpp:requests_deferred",),
                 "computed": ("llamacpp:prompt_tokens_total",), "hits": ("llamacpp:prompt_tokens_cached_total",),
                 "generated": ("llamacpp:tokens_predicted_total",)},
}
INFO = {"vllm": "vllm:cache_config_info", "fastdeploy": "fastdeploy:cache_config_info"}
logger = logging.getLogger("engine")


@dataclass(frozen=True)
class Reading:
    """One scrape of ``/metrics``, in the engine's terms (tokens; ``kv`` None: not exported)."""

    time: float
    kv: float | None
    running: int
    waiting: int
    queries: int
    hits: int
    computed: int       # prompt tokens computed (not read from the prefix cache)
    generated: int
    preempted: int
    block_size: int
    num_blocks: int


def samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Every sample of a Prometheus text exposition: ``{sample name: [(labels, value)]}``."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def flavour_of(found: dict) -> str | None:
    """The server's metric family by its names: vllm, fastdeploy or llamacpp (None: none of them)."""
    for flavour, prefix in (("vllm", "vllm:"), ("fastdeploy", "fastdeploy:"), ("llamacpp", "llamacpp:")):
        if any(name.startswith(prefix) for name in found):
            return flavour
    return None


def read(found: dict, flavour: str, now: float) -> Reading:
    names = NAMES[flavour]

    def value(key: str, mean: bool = False) -> float | None:
        for name in names.get(key, ()):
            if name in found:       # summed over engines (vLLM labels each), usage averaged
                values = [v for _, v in found[name]]
                return sum(values) / len(values) if mean else sum(values)
        return None

    hits = int(value("hits") or 0)
    generated = int(value("generated") or 0)
    if flavour == "llamacpp":       # prompt_tokens_total counts the prompt tokens computed, cached apart
        computed = int(value("computed") or 0)
        queries = computed + hits
    elif flavour == "fastdeploy":   # a hit rate and the hits: the tokens queried follow
        rate, prompt = value("hit_rate"), value("prompt")
        queries = int(prompt) if prompt is not None else (round(hits / rate) if rate else hits)
        computed = max(queries - hits, 0)
    else:
        queries = int(value("queries") or 0)
        computed = max(queries - hits, 0)
    info = dict(found.get(INFO.get(flavour, ""), [({}, 0)])[0][0])
    return Reading(time=now, kv=value("kv", mean=True), running=int(value("running") or 0),
                   waiting=int(value("waiting") or 0), queries=queries, hits=hits, computed=computed,
                   generated=generated, preempted=int(value("preempted") or 0),
                   block_size=int(info.get("block_size") or 0),
                   num_blocks=int(info.get("num_gpu_blocks") or value("num_blocks") or 0))


def step_data(before: Reading | None, now: Reading) -> dict | None:
    """A ``step`` event's data for the time between two readings (None when nothing ran)."""
    if before is None:
        return None
    prefill = max(now.computed - before.computed, 0)
    decode = max(now.generated - before.generated, 0)
    if not (prefill or decode or now.running):
        return None
    return {"batch_size": now.running, "num_tokens": prefill + decode,
            "prefill": {"server": prefill} if prefill else {}, "decode": ("server",) * decode,
            "duration_s": now.time - before.time, "polled": True}


def events(step: int, before: Reading | None, now: Reading) -> list[EngineEvent]:
    """The events a poll stands for: a ``step`` when anything ran, a ``request_preempted`` per preemption."""
    out = []
    data = step_data(before, now)
    if data is not None:
        out.append(EngineEvent("step", step, data, time=now.time))
    for _ in range(max(now.preempted - before.preempted, 0) if before else 0):
        out.append(EngineEvent("request_preempted", step, {"request_id": "server"}, time=now.time))
    return out


def snapshot(reading: Reading, step: int, last_step: dict | None, *, model: str, model_impl: str,
             device: str, why: str) -> EngineSnapshot:
    requests = tuple(RequestInfo(f"server:{status}:{i + 1}", status, (), 0, 0, 0, 0)
                     for status, n in (("running", reading.running), ("waiting", reading.waiting))
                     for i in range(n))
    hit_rate = reading.hits / reading.queries if reading.queries else 0.0
    last = None if last_step is None else StepInfo(step, last_step["batch_size"], last_step["num_tokens"],
                                                    dict(last_step["prefill"]), tuple(last_step["decode"]),
                                                    last_step["duration_s"])
    return EngineSnapshot(step=step, model=model, model_impl=model_impl, device=device,
                          block_size=reading.block_size, num_blocks=reading.num_blocks,
                          kv_usage=reading.kv or 0.0, blocks=(), requests=requests,
                          prefix_cache=PrefixCacheInfo(reading.queries, reading.hits, hit_rate, 0),
                          last_step=last, attention_backend="not exposed", decode_path="not exposed",
                          prefill_path="not exposed",
                          blocks_hidden=why)


class MetricsPoller:
    """A server's ``/metrics``: ``latest()`` (a reading at most ``fresh_s`` old, the step count, the last
    step's data), and while anyone listens (``subscribe``) a thread that reads it every ``poll_s``
    seconds and hands each listener the events of what changed."""

    def __init__(self, http: httpx.Client, poll_s: float = 1.0, fresh_s: float = 0.2):
        self._http, self.poll_s, self.fresh_s = http, poll_s, fresh_s
        self.flavour = flavour_of(self._samples())
        self._reading = self.read()
        self._listeners: list = []
        self._step, self._last_step = 0, None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _samples(self) -> dict:
        try:
            response = self._http.get("/metrics")
            return samples(response.text) if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}

    def read(self) -> Reading:
        found, now = self._samples(), time.time()
        if self.flavour is None or not found:      # no /metrics (llama-server without --metrics): zeros
            return Reading(now, None, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        return read(found, self.flavour, now)

    def latest(self) -> tuple[Reading, int, dict | None]:
        with self._lock:
            if time.time() - self._reading.time > self.fresh_s:
                self._reading = self.read()
            return self._reading, self._step, self._last_step

    def subscribe(self, callback):
        with self._lock:
            self._listeners.append(callback)
            if self._thread is None:    # the counters now are the baseline: work from here on is counted
                self._thread = threading.Thread(target=self._poll, args=(self.read(),), name="server-metrics",
                                                daemon=True)
                self._thread.start()
        return lambda: self._listeners.remove(callback) if callback in self._listeners else None

    def _poll(self, before) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                now = self._reading = self.read()
                found = events(self._step + 1, before, now)
                if found:
                    self._step += 1
                    self._last_step = next((e.data for e in found if e.kind == "step"), self._last_step)
            before = now
            for event in found:
                for listener in list(self._listeners):
                    try:
                        listener(event)
                    except Exception:   # noqa: BLE001  (as LLM: a failing listener is logged, skipped)
                        logger.exception("subscribe callback %r failed", listener)

    def close(self) -> None:
        self._stop.set()
