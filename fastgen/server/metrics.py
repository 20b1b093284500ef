"""Prometheus metrics of one server (``GET /metrics``).

State (queue depth, running sequences, KV blocks, preemptions) is read from the engine
loop's latest :class:`~fastgen.engine.EngineStats` at scrape time; counters and histograms
are updated on the event loop as each step's deltas arrive. Each app has its own registry,
so several servers can live in one process (tests).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine_loop import EngineLoop, LoopState, StepReport
from .http import CONTENT_TYPE  # noqa: F401  (re-exported: the text format of /metrics)

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)
_STEP_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class _StateCollector:
    """Gauges read from the engine loop when scraped."""

    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop

    def collect(self):
        stats = self._loop.stats
        ready = GaugeMetricFamily("fastgen_engine_ready", "1 when the engine is loaded and serving")
        ready.add_metric([], float(self._loop.state is LoopState.READY))
        yield ready
        queued = GaugeMetricFamily("fastgen_requests_queued",
                                   "sequences accepted by the server and not yet scheduled (bounded by --max-queue)")
        queued.add_metric([], self._loop.num_queued)
        yield queued
        if stats is None:
            return
        for name, doc, value in (
            ("fastgen_requests_waiting", "sequences waiting in the engine (new or preempted)", stats.num_waiting),
            ("fastgen_requests_running", "sequences running (holding KV blocks)", stats.num_running),
            ("fastgen_kv_blocks_used", "KV cache blocks in use", stats.num_used_blocks),
            ("fastgen_kv_blocks_free", "KV cache blocks free", stats.num_free_blocks),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        pre = CounterMetricFamily("fastgen_preemptions", "sequences preempted to free KV blocks")
        pre.add_metric([], stats.num_preemptions)
        yield pre
        cached = GaugeMetricFamily("fastgen_kv_blocks_cached_free",
                                   "KV blocks no request holds, kept for prefix-cache hits (counted as free)")
        cached.add_metric([], stats.num_cached_free_blocks)
        yield cached
        for name, doc, value in (
            ("fastgen_prefix_cache_queries", "prompt tokens looked up in the prefix cache", stats.prefix_queried_tokens),
            ("fastgen_prefix_cache_hits", "prompt tokens found in the prefix cache", stats.prefix_hit_tokens),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c


class ServerMetrics:
    def __init__(self, loop: EngineLoop) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("fastgen_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("fastgen_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter("fastgen_requests_finished", "engine requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("fastgen_requests_rejected", "HTTP requests refused before reaching the engine",
                                ["reason"], registry=r)
        self.steps = Counter("fastgen_steps", "engine steps (forward passes)", registry=r)
        self.ttft = Histogram("fastgen_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("fastgen_inter_token_latency_seconds", "time between consecutive generated tokens",
                             buckets=_ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("fastgen_e2e_request_latency_seconds", "arrival to finish",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.queue_wait = Histogram("fastgen_queue_wait_seconds", "arrival to first scheduled",
                                    buckets=_LATENCY_BUCKETS_S, registry=r)
        self.step_prompt_tokens = Histogram("fastgen_step_prompt_tokens", "prompt tokens per step",
                                            buckets=_STEP_TOKEN_BUCKETS, registry=r)
        self.step_decode_tokens = Histogram("fastgen_step_decode_tokens", "decode tokens per step",
                                            buckets=_STEP_TOKEN_BUCKETS, registry=r)
        r.register(_StateCollector(loop))

    def on_step(self, report: StepReport) -> None:
        if report.stepped:
            self.steps.inc()
            self.step_prompt_tokens.observe(report.stats.last_step_prompt_tokens)
            self.step_decode_tokens.observe(report.stats.last_step_decode_tokens)
        if report.num_new_tokens:
            self.generation_tokens.inc(report.num_new_tokens)
        for d in report.deltas:
            if d.finish_reason is None:
                continue
            self.requests.labels(d.finish_reason.value).inc()
            r = d.response
            if r is None:
                continue
            self.prompt_tokens.inc(r.prompt_length)
            t = r.timings
            if t.queue_wait_s is not None:
                self.queue_wait.observe(t.queue_wait_s)
            if t.time_to_first_token_s is not None:
                self.ttft.observe(t.time_to_first_token_s)
            for gap in t.inter_token_s:
                self.itl.observe(gap)
            if t.e2e_s is not None:
                self.e2e.observe(t.e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
