"""``/metrics``: the engine's state under the names both vLLM's and FastDeploy's dashboards read.

Names, types and units follow ``vllm/v1/metrics/loggers.py`` (labels ``model_name``, ``engine``)
and FastDeploy's ``fastdeploy/metrics/metrics.py`` (no labels), with their histogram buckets.
prometheus_client adds ``_total`` to counters. Gauges are read from one engine snapshot when
scraped (no work between scrapes); latencies are observed when a request finishes, from the
engine's own timestamps (``RequestMetrics``).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vllm/v1/metrics/loggers.py
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0]
VLLM_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0]
# fastdeploy/metrics/metrics.py
FD_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0]
FD_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0]


class ServerMetrics:
    """The server's Prometheus registry; ``observe(delta)`` for every delta the engine produces."""

    def __init__(self, llm, model_name: str):
        disable_created_metrics()       # as vLLM: no *_created series beside each counter and histogram
        self.llm, self.model_name = llm, model_name
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        self._labels = labels
        names = list(labels)

        def vllm(kind, name, doc, **kw):
            return kind(name, doc, names, registry=self.registry, **kw).labels(**labels)

        def fd(kind, name, doc, **kw):
            return kind(name, doc, registry=self.registry, **kw)

        self.ttft = [vllm(Histogram, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                          buckets=VLLM_TTFT_BUCKETS),
                     fd(Histogram, "fastdeploy:time_to_first_token_seconds", "Time to first token in seconds",
                        buckets=FD_TTFT_BUCKETS)]
        self.tpot = [vllm(Histogram, "vllm:time_per_output_token_seconds",
                          "Histogram of time per output token in seconds.", buckets=VLLM_TPOT_BUCKETS),
                     vllm(Histogram, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          buckets=VLLM_TPOT_BUCKETS),
                     fd(Histogram, "fastdeploy:time_per_output_token_seconds", "Time per output token in seconds",
                        buckets=FD_TPOT_BUCKETS)]
        self.e2e = [vllm(Histogram, "vllm:e2e_request_latency_seconds",
                         "Histogram of e2e request latency in seconds.", buckets=VLLM_E2E_BUCKETS),
                    fd(Histogram, "fastdeploy:e2e_request_latency_seconds", "End-to-end request latency in seconds",
                       buckets=VLLM_E2E_BUCKETS)]
        self.prompt_tokens = [vllm(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed."),
                              fd(Counter, "fastdeploy:prompt_tokens", "Total number of prompt tokens")]
        self.generation_tokens = [vllm(Counter, "vllm:generation_tokens", "Number of generation tokens processed."),
                                  fd(Counter, "fastdeploy:generation_tokens",
                                     "Total number of generation tokens processed")]
        self.vllm_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                    [*names, "finished_reason"], registry=self.registry)
        self.fd_success = fd(Counter, "fastdeploy:request_success", "Total number of successfully processed requests")
        self.registry.register(_StateCollector(self))
        self._lock = threading.Lock()
        self.preemptions = 0
        self.requests = self.requests_hit = 0
        llm.subscribe(self._on_event)

    def _on_event(self, event) -> None:
        if event.kind == "request_preempted":
            with self._lock:
                self.preemptions += 1

    def observe(self, delta) -> None:
        """Every delta as the engine produces it: tokens counted as they come (a smooth rate, as
        vLLM's per-step counters), latencies and outcomes when the request finishes."""
        m = delta.metrics
        if m is None:
            return
        if delta.token_ids:
            for c in self.generation_tokens:
                c.inc(len(delta.token_ids))
            if m.num_output_tokens == len(delta.token_ids):     # its first tokens: the prompt is read
                for c in self.prompt_tokens:
                    c.inc(delta.num_prompt_tokens)
        if delta.finished:
            self._finished(delta, m)

    def _finished(self, delta, m) -> None:
        if m.ttft is not None:
            for h in self.ttft:
                h.observe(m.ttft)
        if m.tpot is not None:
            for h in self.tpot:
                h.observe(m.tpot)
        if m.finished_time is not None:
            for h in self.e2e:
                h.observe(m.finished_time - m.arrival_time)
        if delta.finish_reason in ("stop", "length", "abort"):
            self.vllm_success.labels(**self._labels, finished_reason=delta.finish_reason).inc()
            if delta.finish_reason != "abort":
                self.fd_success.inc()
        with self._lock:
            self.requests += 1
            self.requests_hit += delta.num_cached_tokens > 0


class _StateCollector:
    """Gauges and cumulative counters read from one snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        m = self.m
        snap = m.llm.snapshot()
        running = sum(r.status == "running" for r in snap.requests)
        waiting = len(snap.requests) - running
        free = sum(b.state == "free" for b in snap.blocks)
        available = free + sum(b.state == "cached" for b in snap.blocks)
        pc = snap.prefix_cache
        names, values = list(m._labels), list(m._labels.values())

        def gauge(name, doc, value, labelled=True):
            g = GaugeMetricFamily(name, doc, labels=names if labelled else None)
            g.add_metric(values, value) if labelled else g.add_metric([], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", snap.kv_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      pc.queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", pc.hits)
        with m._lock:
            preemptions, requests, hit = m.preemptions, m.requests, m.requests_hit
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", preemptions)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"])
        cfg = m.llm.config
        info.add_metric([str(snap.block_size), str(snap.num_blocks), str(cfg.enable_prefix_caching), "auto"], 1)
        yield info
        yield gauge("fastdeploy:num_requests_running", "Number of requests currently running", running, False)
        yield gauge("fastdeploy:num_requests_waiting", "Number of requests currently waiting", waiting, False)
        yield gauge("fastdeploy:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage",
                    snap.kv_usage, False)
        yield gauge("fastdeploy:free_gpu_block_num", "Number of free blocks in cache", free, False)
        yield gauge("fastdeploy:available_gpu_block_num", "Number of available gpu blocks in cache, including "
                    "prefix caching blocks that are not officially released", available, False)
        yield gauge("fastdeploy:max_gpu_block_num", "Number of total blocks determined when service started",
                    snap.num_blocks, False)
        yield gauge("fastdeploy:hit_token_rate", "Token-level prefix cache hit rate", pc.hit_rate, False)
        yield gauge("fastdeploy:hit_req_rate", "Request-level prefix cache hit rate",
                    hit / requests if requests else 0.0, False)
        yield gauge("fastdeploy:batch_size", "Real batch size during inference",
                    snap.last_step.batch_size if snap.last_step else 0, False)
        fd_info = GaugeMetricFamily("fastdeploy:cache_config_info", "Information of the engine's CacheConfig",
                                    labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"])
        fd_info.add_metric([str(snap.block_size), str(snap.num_blocks), str(cfg.enable_prefix_caching)], 1)
        yield fd_info
