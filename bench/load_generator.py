"""Closed-loop load: ``concurrency`` workers each send one request at a time until the work runs out.

Bounded twice: the request list is finite, and once ``max_seconds`` have
passed no worker starts another request (requests in flight still finish, so
their latencies are real; each has the transport's own timeout).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from bench.load_result import LoadResult
from bench.timeline import RequestTimeline
from bench.transports import Transport
from bench.workload import RequestSpec
from protoserve.server.runtime.event_loop import loop_factory

T = TypeVar("T")


def run_clients(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop where it is installed, as the server runs.

    Why: the clients share the two cores with the server they measure, so their own loop's cost
    comes out of the figures. The gateway's SSE client took 0.15 ms of CPU per token on uvloop
    against 0.21-0.25 ms on asyncio's loop (gRPC's client, ~0.27 ms, is grpcio's own either way).
    """
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        return runner.run(main)


async def run_load(
    transport: Transport, specs: Sequence[RequestSpec], concurrency: int, max_seconds: float
) -> tuple[LoadResult, list[RequestTimeline]]:
    """Send ``specs`` in order through ``concurrency`` workers; returns the aggregate and every timeline."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    pending = list(reversed(specs))  # pop() from the end takes them in order
    timelines: list[RequestTimeline] = []
    stop_at = time.perf_counter() + max_seconds

    async def worker() -> None:
        while pending and time.perf_counter() < stop_at:
            timelines.append(await transport.stream(pending.pop()))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
    return LoadResult.of(timelines), timelines


async def warm_up(transport: Transport, specs: Sequence[RequestSpec]) -> None:
    """Send a few requests concurrently, unmeasured: opens connections, fills caches of code paths."""
    await asyncio.gather(*(transport.stream(s) for s in specs))
