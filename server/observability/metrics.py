"""ServerMetrics: the server's Prometheus metrics, labelled by model, and the numbers behind GetMetrics.

Names are vLLM's with a ``protoserve_`` prefix where vLLM has ``vllm:``
(``vllm:num_requests_running`` is ``protoserve_num_requests_running``), so a
dashboard or alert written for vLLM ports over by that one substitution. The
prefix ends in an underscore, not a colon: colons are reserved for recording
rules (``promtool check metrics`` flags them), and a colon name reaches
Prometheus escaped to underscores when it negotiates OpenMetrics, so the stored
name would differ from the exposed one. Every series has a ``model_name``
label, as in vLLM.

========================================  =========  ==============================================
metric                                    type       what
========================================  =========  ==============================================
protoserve_num_requests_running           gauge      requests in the engine's running batch
protoserve_num_requests_waiting           gauge      requests queued for the engine
protoserve_queue_capacity                 gauge      waiting requests accepted before RESOURCE_EXHAUSTED
protoserve_kv_cache_usage_perc            gauge      share of KV cache blocks in use, 0 to 1
protoserve_prompt_tokens_total            counter    prompt tokens the engine took in
protoserve_generation_tokens_total        counter    tokens the engine generated
protoserve_prefix_cache_queries_total     counter    prompt tokens looked up in the prefix cache
protoserve_prefix_cache_hits_total        counter    of those, tokens found
protoserve_num_preemptions_total          counter    preemptions
protoserve_num_fair_preemptions_total     counter    of those, made to admit a less-served caller
protoserve_request_success_total          counter    finished requests by ``finished_reason``
                                                     (stop, length, cancelled, error)
protoserve_request_status_total           counter    finished requests by gRPC ``status`` name
protoserve_time_to_first_token_seconds    histogram  arrival to first token
protoserve_inter_token_latency_seconds    histogram  between consecutive tokens of a request
protoserve_e2e_request_latency_seconds    histogram  arrival to finish
protoserve_request_queue_time_seconds     histogram  arrival to first scheduling
protoserve_request_prefill_time_seconds   histogram  first scheduling to first token
protoserve_request_decode_time_seconds    histogram  first token to finish
protoserve_model_loaded                   gauge      1 for each served model, with its ``kind``
                                                     (chat, completion, embedding)
protoserve_model_load_seconds             histogram  a model's load, from its file to serving (at start,
                                                     LoadModel, reloads after idle eviction)
protoserve_identity_requests_total        counter    finished requests by ``identity`` (opt-in)
protoserve_identity_input_tokens_total    counter    their prompt tokens by ``identity`` (opt-in)
protoserve_identity_output_tokens_total   counter    their generated tokens by ``identity`` (opt-in)
========================================  =========  ==============================================

Speculative decoding adds three counters, vLLM's ``vllm:spec_decode_*`` under the same
prefix: ``protoserve_spec_decode_num_drafts_total`` (verification steps that had drafts),
``protoserve_spec_decode_num_draft_tokens_total`` (tokens drafted) and
``protoserve_spec_decode_num_accepted_tokens_total`` (drafts accepted); acceptance rate is
accepted / draft tokens, mean acceptance length 1 + accepted / drafts.

The registry also carries prometheus-client's process and Python collectors
(``process_*``, ``python_info``, ``python_gc_*``), and no ``*_created``
series: they double the series count and no dashboard reads them.

The gauges and the token, cache and preemption counters are the engine's own
totals, read from ``protoserve.engine.stats()`` at scrape time (so they also count work
of other servers sharing the engine). Request counters move once per finished
request (see :mod:`protoserve.server.calls.request_record`); histograms once per finished
engine request, from its RequestStats. The per-identity counters read the
usage ledger at scrape time; they are off unless asked for, because every
identity (API key and ``x-user-id``) becomes a series of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protoserve.engine.api import RequestStats
from protoserve.server.calls.request_record import CANCELLED, ERROR, LENGTH, STOP, RequestRecord
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.observability.metric_windows import LatencyStats, LatencyWindow, RateWindow
from protoserve.server.observability.usage import UsageLedger

PREFIX = "protoserve_"
MODEL_LABEL = "model_name"
IDENTITY_LABEL = "identity"

# Process-wide in prometheus-client: counters and histograms made from here on
# export no ``*_created`` gauge next to each series.
disable_created_metrics()

# vLLM's buckets: token latencies from milliseconds, request latencies up to hours.
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                         7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
# From a small model off a warm page cache to a big one off a cold disk.
LOAD_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
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
        capacity = gauge("queue_capacity", "Waiting requests accepted before new ones are refused.")
        kv = gauge("kv_cache_usage_perc", "Share of KV cache blocks in use, 0 to 1.")
        prompt = counter("prompt_tokens", "Prompt tokens processed.")
        generation = counter("generation_tokens", "Tokens generated.")
        queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        preemptions = counter("num_preemptions", "Preemptions.")
        fair = counter("num_fair_preemptions", "Preemptions that made room for a less-served caller.")
        drafts = counter("spec_decode_num_drafts", "Speculative verification steps with drafted tokens.")
        draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative tokens drafted.")
        accepted = counter("spec_decode_num_accepted_tokens", "Speculative drafted tokens accepted.")
        loaded = GaugeMetricFamily(
            PREFIX + "model_loaded", "1 for each served model, by kind.", labels=[MODEL_LABEL, "kind"]
        )
        for entry in self.models.listing():
            loaded.add_metric([entry.name, entry.kind], 1)
        for served in self.models.all():
            stats, label = served.engine.stats(), [served.name]
            running.add_metric(label, stats.running)
            waiting.add_metric(label, stats.waiting)
            capacity.add_metric(label, served.engine.config.max_queue)
            kv.add_metric(label, stats.kv_usage)
            prompt.add_metric(label, stats.prompt_tokens_total)
            generation.add_metric(label, stats.generation_tokens_total)
            queries.add_metric(label, stats.prefix_cache_queries)
            hits.add_metric(label, stats.prefix_cache_hits)
            preemptions.add_metric(label, stats.preemptions_total)
            fair.add_metric(label, stats.fair_preemptions_total)
            drafts.add_metric(label, stats.spec_decode_num_drafts)
            draft_tokens.add_metric(label, stats.spec_decode_num_draft_tokens)
            accepted.add_metric(label, stats.spec_decode_num_accepted_tokens)
        return [running, waiting, capacity, kv, prompt, generation, queries, hits, preemptions, fair,
                drafts, draft_tokens, accepted, loaded]


class IdentityUsageCollector(Collector):
    """Requests and tokens of every identity, read from the usage ledger when scraped."""

    def __init__(self, usage: UsageLedger) -> None:
        self.usage = usage

    def collect(self) -> Iterable[Metric]:
        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, labels=[IDENTITY_LABEL])

        requests = counter("identity_requests", "Finished requests by caller identity.")
        input_tokens = counter("identity_input_tokens", "Prompt tokens of finished requests by caller identity.")
        output_tokens = counter("identity_output_tokens", "Generated tokens of finished requests by caller identity.")
        for identity, usage in self.usage.snapshot().items():
            requests.add_metric([identity], usage.requests)
            input_tokens.add_metric([identity], usage.input_tokens)
            output_tokens.add_metric([identity], usage.output_tokens)
        return [requests, input_tokens, output_tokens]


@dataclass
class ModelWindows:
    """Recent latencies and token rates of one model, for snapshots."""

    latencies: dict[str, LatencyWindow] = field(default_factory=lambda: {m.key: LatencyWindow() for m in LATENCIES})
    prompt_tokens: RateWindow = field(default_factory=RateWindow)
    generation_tokens: RateWindow = field(default_factory=RateWindow)


class ServerMetrics:
    """Prometheus metrics of one server (in its own registry) and the windows behind its snapshots."""

    def __init__(self, models: ModelRegistry, identity_usage: UsageLedger | None = None) -> None:
        """``identity_usage``: the ledger to export per identity; None exports none."""
        self.models = models
        # A registry per server, not the process-global one: several servers may share a process.
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(EngineCollector(models))
        if identity_usage is not None:
            self.registry.register(IdentityUsageCollector(identity_usage))
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
        self.load_seconds = Histogram(
            PREFIX + "model_load_seconds",
            "Time to load a model, from its file to serving.",
            [MODEL_LABEL],
            buckets=LOAD_BUCKETS,
            registry=self.registry,
        )
        self._windows: dict[str, ModelWindows] = {}

    def _model_windows(self, model: str) -> ModelWindows:
        windows = self._windows.get(model)
        if windows is None:
            windows = self._windows.setdefault(model, ModelWindows())
        return windows

    def add_model(self, model: str) -> None:
        """Start a model's request counters and histograms at zero, before its first request.

        A series that first appears with a non-zero value has no earlier sample
        for rate() to start from, so whatever happened before its first scrape
        (a first burst of errors, say) would never show in a rate or an alert.
        """
        for reason in (STOP, LENGTH, CANCELLED, ERROR):
            self.request_success.labels(model, reason)
        for code in grpc.StatusCode:
            self.request_status.labels(model, code.name)
        for histogram in self.histograms.values():
            histogram.labels(model)

    # ---- observations ------------------------------------------------------------

    def observe_load(self, model: str, seconds: float) -> None:
        """A model finished loading (at start, or when loaded at run time)."""
        self.load_seconds.labels(model).observe(seconds)

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

    def observe_request(self, record: RequestRecord, model: str) -> None:
        """One request ended: its finish reason and status, under the loaded ``model`` it counts for."""
        self.request_success.labels(model, record.finish_reason).inc()
        self.request_status.labels(model, record.status.name).inc()

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
            # Series started at zero by add_model are left out: the maps list what happened.
            if sample.name.endswith("_total") and sample.labels.get(MODEL_LABEL) == model and sample.value:
                out[sample.labels[label]] = int(sample.value)
    return out
