"""protoserve's GetMetrics sampled while a load runs: KV blocks in use, prefix-cache counters, preemptions.

``kv_cache_usage`` is the share of the pool's blocks referenced by requests
(blocks a finished request left cached for reuse count as free), so with the
pool's size it gives the blocks in use, and over ``num_requests_running`` the
blocks each running conversation holds: less than its context's blocks when
conversations share their system prompt's blocks. The prefix-cache counters
(prompt tokens looked up and found) and preemptions are read from the first
and last snapshot of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from bench.stats import median


@dataclass(frozen=True)
class MetricsSample:
    """The parts of one MetricsSnapshot the conversation section reads."""

    kv_usage: float
    running: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int


Fetch = Callable[[], Awaitable[MetricsSample]]


def grpc_fetch(target: str) -> tuple[Fetch, Callable[[], Awaitable[None]]]:
    """GetMetrics over a grpc.aio channel to ``target`` (made in the running loop), and its closer."""
    import grpc

    from protoserve.v1 import metrics_pb2, metrics_pb2_grpc

    channel = grpc.aio.insecure_channel(target)
    stub = metrics_pb2_grpc.MetricsServiceStub(channel)

    async def fetch() -> MetricsSample:
        snap = (await stub.GetMetrics(metrics_pb2.GetMetricsRequest(), timeout=30)).snapshot
        return MetricsSample(
            snap.kv_cache_usage,
            snap.num_requests_running,
            snap.prefix_cache_queries,
            snap.prefix_cache_hits,
            snap.preemptions_total,
        )

    return fetch, channel.close


class MetricsSampler:
    """Samples every ``interval`` s while the block runs, and once at each end."""

    def __init__(self, fetch: Fetch, interval: float = 0.25) -> None:
        self.fetch = fetch
        self.interval = interval
        self.samples: list[MetricsSample] = []
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.samples.append(await self.fetch())

    async def __aenter__(self) -> MetricsSampler:
        self.samples.append(await self.fetch())
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.samples.append(await self.fetch())


@dataclass(frozen=True)
class PrefixCacheUse:
    """What the counters moved by over one run: prompt tokens looked up, found, and preemptions."""

    queries: int
    hits: int
    preemptions: int

    @classmethod
    def between(cls, first: MetricsSample, last: MetricsSample) -> PrefixCacheUse:
        return cls(
            last.prefix_cache_queries - first.prefix_cache_queries,
            last.prefix_cache_hits - first.prefix_cache_hits,
            last.preemptions - first.preemptions,
        )

    def __add__(self, other: PrefixCacheUse) -> PrefixCacheUse:
        return PrefixCacheUse(
            self.queries + other.queries, self.hits + other.hits, self.preemptions + other.preemptions
        )

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


def blocks_per_running(samples: Sequence[MetricsSample], pool_blocks: int) -> float | None:
    """Median over the samples with requests running of blocks in use per running request."""
    per = [s.kv_usage * pool_blocks / s.running for s in samples if s.running > 0]
    return median(per) if per else None
