"""ServerMetrics: the server's Prometheus metrics, labelled by model, and the numbers behind GetMetrics.

Names are vLLM's with a ``protoserve:`` prefix (vLLM uses ``vllm:``), so
dashboards and alerts written for vLLM carry over. Every series has a
``model_name`` label.

========================================  =========  ==============================================
metric                                    type       what
========================================  =========  ==============================================
protoserve:num_requests_running           gauge      requests in the engine's running batch
protoserve:num_requests_waiting           gauge      requests queued for the engine
protoserve:kv_cache_usage_perc            gauge      share of KV cache blocks in use, 0 to 1
protoserve:prompt_tokens_total            counter    prompt tokens the engine took in
protoserve:generation_tokens_total        counter    tokens the engine generated
protoserve:prefix_cache_queries_total     counter    prompt tokens looked up in the prefix cache
protoserve:prefix_cache_hits_total        counter    of those, tokens found
protoserve:num_preemptions_total          counter    preemptions
protoserve:request_success_total          counter    finished requests by ``finished_reason``
                                                     (stop, length, cancelled, error)
protoserve:request_status_total           counter    finished requests by gRPC ``status`` name
protoserve:time_to_first_token_seconds    histogram  arrival to first token
protoserve:inter_token_latency_seconds    histogram  between consecutive tokens of a request
protoserve:e2e_request_latency_seconds    histogram  arrival to finish
protoserve:request_queue_time_seconds     histogram  arrival to first scheduling
protoserve:request_prefill_time_seconds   histogram  first scheduling to first token
protoserve:request_decode_time_seconds    histogram  first token to finish
========================================  =========  ==============================================

The gauges and the token, cache and preemption counters are the engine's own
totals, read from ``engine.stats()`` at scrape time (so they also count work
of other servers sharing the engine). Request counters move once per finished
request (see :mod:`server.request_record`); histograms once per finished
engine request, from its RequestStats.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.request import RequestStats
from server.metric_windows import LatencyStats, LatencyWindow, RateWindow
from server.model_registry import ModelRegistry
from server.request_record import RequestRecord

PREFIX = "protoserve:"
MODEL_LABEL = "model_name"

# vLLM's buckets: token latencies from milliseconds, request latencies up to hours.
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                         7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class LatencyMetric:
    """One latency: its histogram name, help, buckets and how to read it from RequestStats."""

    key: str  # MetricsSnapshot field
    name: str
    doc: str
    buckets: tuple[float, ...]
    values: Callable[[RequestStats], Iterable[float]]


def _started(stats: RequestStats) -> bool:
    return stats.generated_tokens > 0


LATENCIES = (
    LatencyMetric("time_to_first_token", "time_to_first_token_seconds", "Arrival to first token.",
                  TOKEN_LATENCY_BUCKETS, lambda s: [s.time_to_first_token_s] if _started(s) else []),
    LatencyMetric("inter_token_latency", "inter_token_latency_seconds", "Time between consecutive tokens.",
                  ITL_BUCKETS, lambda s: s.inter_token_latencies_s),
    LatencyMetric("e2e_request_latency", "e2e_request_latency_seconds", "Arrival to finish.",
                  REQUEST_LATENCY_BUCKETS, lambda s: [s.e2e_time_s]),
    LatencyMetric("request_queue_time", "request_queue_time_seconds", "Arrival to first scheduling.",
                  REQUEST_LATENCY_BUCKETS, lambda s: [s.queue_time_s]),
    LatencyMetric("request_prefill_time", "request_prefill_time_seconds", "Prompt computation.",
                  REQUEST_LATENCY_BUCKETS, lambda s: [s.prefill_time_s] if _started(s) else []),
    LatencyMetric("request_decode_time", "request_decode_time_seconds", "First token to finish.",
                  REQUEST_LATENCY_BUCKETS, lambda s: [s.decode_time_s] if _started(s) else []),
)


class EngineCollector(Collector):
    """Gauges and engine totals of every loaded model, read when scraped."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models

    def collect(self) -> Iterable[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])

        running = gauge("num_requests_running", "Requests in the engine's running batch.")
        waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        kv = gauge("kv_cache_usage_perc", "Share of KV cache blocks in use, 0 to 1.")
        prompt = counter("prompt_tokens", "Prompt tokens processed.")
        generation = counter("generation_tokens", "Tokens generated.")
        queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        preemptions = counter("num_preemptions", "Preemptions.")
        for frontend in self.models.all():
            stats, label = frontend.engine.stats(), [frontend.name]
            running.add_metric(label, stats.running)
            waiting.add_metric(label, stats.waiting)
            kv.add_metric(label, stats.kv_usage)
            prompt.add_metric(label, stats.prompt_tokens_total)
            generation.add_metric(label, stats.generation_tokens_total)
            queries.add_metric(label, stats.prefix_cache_queries)
            hits.add_metric(label, stats.prefix_cache_hits)
            preemptions.add_metric(label, stats.preemptions_total)
        return [running, waiting, kv, prompt, generation, queries, hits, preemptions]


@dataclass
class ModelWindows:
    """Recent latencies and token rates of one model, for snapshots."""

    latencies: dict[str, LatencyWindow] = field(default_factory=lambda: {m.key: LatencyWindow() for m in LATENCIES})
    prompt_tokens: RateWindow = field(default_factory=RateWindow)
    generation_tokens: RateWindow = field(default_factory=RateWindow)


class ServerMetrics:
    """Prometheus metrics of one server (in its own registry) and the windows behind its snapshots."""

    def __init__(self, models: ModelRegistry, registry: CollectorRegistry | None = None) -> None:
        self.models = models
        # A registry per server, not the process-global one: several servers may share a process.
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(EngineCollector(models))
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason (stop, length, cancelled, error).",
            [MODEL_LABEL, "finished_reason"],
            registry=self.registry,
        )
        self.request_status = Counter(
            PREFIX + "request_status",
            "Finished requests by gRPC status code name.",
            [MODEL_LABEL, "status"],
            registry=self.registry,
        )
        self.histograms = {
            m.key: Histogram(PREFIX + m.name, m.doc, [MODEL_LABEL], buckets=m.buckets, registry=self.registry)
            for m in LATENCIES
        }
        self._windows: dict[str, ModelWindows] = {}

    def _model_windows(self, model: str) -> ModelWindows:
        windows = self._windows.get(model)
        if windows is None:
            windows = self._windows.setdefault(model, ModelWindows())
        return windows

    # ---- observations ------------------------------------------------------------

    def observe_tokens(self, model: str, prompt_tokens: int, generated_tokens: int) -> None:
        """Tokens that just went through the engine (for throughput)."""
        windows = self._model_windows(model)
        if prompt_tokens:
            windows.prompt_tokens.add(prompt_tokens)
        if generated_tokens:
            windows.generation_tokens.add(generated_tokens)

    def observe_engine_request(self, model: str, stats: RequestStats) -> None:
        """One engine request ended: its latencies."""
        windows = self._model_windows(model)
        for metric in LATENCIES:
            histogram = self.histograms[metric.key].labels(model)
            window = windows.latencies[metric.key]
            for value in metric.values(stats):
                histogram.observe(value)
                window.observe(value)

    def observe_request(self, record: RequestRecord) -> None:
        """One request ended: its finish reason and status."""
        self.request_success.labels(record.model, record.finish_reason).inc()
        self.request_status.labels(record.model, record.status.name).inc()

    # ---- reading back (for MetricsService) ---------------------------------------

    def latencies(self, model: str) -> dict[str, LatencyStats]:
        windows = self._model_windows(model)
        return {key: window.stats() for key, window in windows.latencies.items()}

    def throughput(self, model: str) -> tuple[float, float]:
        """Prompt and generated tokens per second over the last minute."""
        windows = self._model_windows(model)
        return windows.prompt_tokens.rate(), windows.generation_tokens.rate()

    def requests_by_finish_reason(self, model: str) -> dict[str, int]:
        return _counts(self.request_success, model, "finished_reason")

    def requests_by_status(self, model: str) -> dict[str, int]:
        return _counts(self.request_status, model, "status")


def _counts(counter: Counter, model: str, label: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get(MODEL_LABEL) == model:
                out[sample.labels[label]] = int(sample.value)
    return out
