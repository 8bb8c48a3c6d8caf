"""MetricsService: typed snapshots of the server's metrics over gRPC (and ``GET /v1/metrics`` via the gateway).

A snapshot is about the default model (the first loaded) and the server: the
engine's gauges and totals, requests by finish reason and status, latency
percentiles, token throughput over the last minute, and usage per identity
keyed by the identity hash; and every generative model's memory (weights, KV
pool, resident or evicted) against the server's memory budget. With auth on, a valid API key is required; the
server does not have to be ready, so metrics can be watched while the model
loads.

Usage rows are private: a caller sees its own identity's row only (its key and
x-user-id), an admin key sees every row. With auth off nothing is secret (any
caller may send any x-user-id), so, as on vLLM or llama.cpp without an API key,
a caller without x-user-id gets the operator's view of every row, and one with
x-user-id its own row. Server-wide figures are the same for everyone.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc

from protoserve.server import errors
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.observability.metric_windows import LatencyStats
from protoserve.server.observability.metrics import ServerMetrics
from protoserve.server.observability.usage import IdentityUsage, UsageLedger
from protoserve.server.runtime.health import Phase, Readiness
from protoserve.server.runtime.memory_budget import MemoryBudget
from protoserve.server.security.auth import Authenticator, Identity
from protoserve.v1 import metrics_pb2 as pb
from protoserve.v1 import metrics_pb2_grpc

if TYPE_CHECKING:
    from protoserve.engine.runtime import AsyncEngine

DEFAULT_INTERVAL_MS = 1000
MIN_INTERVAL_MS = 100


def _memory(engine: AsyncEngine) -> pb.ModelMemory:
    """What one model's engine holds now; zeros while it is evicted."""
    if not engine.resident:
        return pb.ModelMemory(name=engine.model_name, resident=False)
    stats = engine.stats()
    return pb.ModelMemory(name=engine.model_name, resident=True, weight_bytes=engine.weight_bytes,
                          kv_pool_bytes=engine.kv_pool_bytes, kv_blocks_total=stats.kv_blocks_total,
                          kv_blocks_free=stats.kv_blocks_free)


def _summary(stats: LatencyStats) -> pb.LatencySummary:
    return pb.LatencySummary(count=stats.count, p50=stats.p50, p90=stats.p90, p99=stats.p99, mean=stats.mean)


class MetricsService(metrics_pb2_grpc.MetricsServiceServicer):
    """GetMetrics and WatchMetrics."""

    def __init__(
        self,
        models: ModelRegistry,
        auth: Authenticator,
        metrics: ServerMetrics,
        usage: UsageLedger,
        readiness: Readiness,
        *,
        budget: MemoryBudget | None = None,
    ) -> None:
        """``budget``: the memory budget models load within; None reports none."""
        self.models = models
        self.budget = budget
        self.auth = auth
        self.metrics = metrics
        self.usage = usage
        self.readiness = readiness

    def _usage_of(self, identity: Identity) -> dict[str, IdentityUsage]:
        """The usage rows ``identity`` may see (see the module doc)."""
        operator = identity.admin or (not self.auth.enabled and not identity.user_id)
        return self.usage.snapshot(None if operator else identity.id)

    def snapshot(self, identity: Identity) -> pb.MetricsSnapshot:
        """The metrics of the default model and of the server, now, as ``identity`` may see them."""
        snap = pb.MetricsSnapshot(timestamp=time.time())
        served_models = self.models.all()
        if served_models:
            served = served_models[0]
            name, stats = served.name, served.engine.stats()
            snap.model = name
            snap.num_requests_running = stats.running
            snap.num_requests_waiting = stats.waiting
            snap.kv_cache_usage = stats.kv_usage
            snap.prompt_tokens_total = stats.prompt_tokens_total
            snap.generation_tokens_total = stats.generation_tokens_total
            snap.prefix_cache_queries = stats.prefix_cache_queries
            snap.prefix_cache_hits = stats.prefix_cache_hits
            snap.preemptions_total = stats.preemptions_total
            snap.fair_preemptions_total = stats.fair_preemptions_total
            snap.requests_by_finish_reason.update(self.metrics.requests_by_finish_reason(name))
            snap.requests_by_status.update(self.metrics.requests_by_status(name))
            for key, latency in self.metrics.latencies(name).items():
                getattr(snap, key).CopyFrom(_summary(latency))
            snap.prompt_throughput, snap.generation_throughput = self.metrics.throughput(name)
        snap.models.extend(_memory(served.engine) for served in served_models)
        if self.budget is not None:
            snap.memory_budget_bytes = self.budget.total_bytes
            snap.memory_reserved_bytes = self.budget.reserved_bytes
        for identity_id, usage in self._usage_of(identity).items():
            snap.usage_by_identity[identity_id].CopyFrom(
                pb.IdentityUsage(
                    requests=usage.requests, input_tokens=usage.input_tokens, output_tokens=usage.output_tokens
                )
            )
        return snap

    @errors.reports_errors
    async def GetMetrics(self, request: pb.GetMetricsRequest, context: grpc.aio.ServicerContext):
        """One snapshot."""
        identity = self.auth.identify(context.invocation_metadata())
        return pb.GetMetricsResponse(snapshot=self.snapshot(identity))

    @errors.reports_errors
    async def WatchMetrics(self, request: pb.WatchMetricsRequest, context: grpc.aio.ServicerContext) -> None:
        """A snapshot now and one per interval, until the client leaves or the server drains."""
        identity = self.auth.identify(context.invocation_metadata())
        interval_ms = request.interval_ms or DEFAULT_INTERVAL_MS
        if interval_ms < MIN_INTERVAL_MS:
            raise errors.invalid_argument([("interval_ms", f"must be at least {MIN_INTERVAL_MS}")])
        while True:
            await context.write(pb.WatchMetricsResponse(snapshot=self.snapshot(identity)))
            await asyncio.sleep(interval_ms / 1000)
            if self.readiness.phase is Phase.DRAINING:
                # End cleanly so shutdown does not wait on a stream that never finishes.
                return
