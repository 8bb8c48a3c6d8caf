"""Readiness: one state drives grpc.health.v1, CheckHealth and admission of new calls.

The server starts NOT_SERVING (the model is still loading), turns SERVING once
the engine runs, and goes back to NOT_SERVING for good when it starts draining,
so load balancers stop sending traffic before in-flight streams are finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import deque
from collections.abc import Callable, Iterable

from grpc_health.v1 import health, health_pb2

from protoserve.server import errors


class Phase(enum.Enum):
    """Where the server is in its life."""

    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"


# A server checked at a steady pace while serving is behind something that routes by it (Envoy, a
# Kubernetes readiness probe): draining, it waits for that checker to see it. Steady: at least two
# checks while serving, the last within a few of the longest gaps between the recent ones. A one-off
# readiness poll (a script waiting for SERVING) is not a checker.
RECENT_CHECKS = 4
CHECKER_GONE_AFTER_GAPS = 3
# A floor under the gap: two checks close together (a script that polled twice) set no pace.
SHORTEST_GAP_S = 1.0
# After that check is answered, the time the checker takes to act on it before the ports close.
SEEN_SETTLE_S = 0.25


# Who checks: a balancer checks each of its clusters on its own schedule (Envoy: grpc.health.v1 for
# the gRPC port, GET /health, which is CheckHealth, for the gateway's), and each must see the drain.
GRPC_HEALTH = "grpc.health.v1"
CHECK_HEALTH = "CheckHealth"


class _CountedHealth(health.aio.HealthServicer):
    """grpc.health.v1, noting each Check with the readiness that drives it."""

    def __init__(self, on_check: Callable[[str], None]) -> None:
        super().__init__()
        self._on_check = on_check

    async def Check(self, request, context):  # noqa: N802 - the gRPC method name
        self._on_check(GRPC_HEALTH)
        return await super().Check(request, context)


class Readiness:
    """The server's phase, mirrored into the standard health service."""

    def __init__(self, service_names: Iterable[str], clock: Callable[[], float] = time.monotonic) -> None:
        self.phase = Phase.LOADING
        self._clock = clock
        self.health = _CountedHealth(self.note_check)
        # "" is the whole server; the named services are what clients may ask about.
        self._services = ["", *service_names]
        # Per kind of check: the times of the recent ones while SERVING, and whether one came since the drain.
        self._serving_checks: dict[str, deque[float]] = {}
        self._seen_draining: dict[str, asyncio.Event] = {}
        self._drain_started: float | None = None

    async def start(self) -> None:
        """Publish NOT_SERVING for every service (the health servicer starts SERVING for "")."""
        await self._publish(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def set_serving(self) -> None:
        """The model is loaded and the engine runs."""
        if self.phase is Phase.LOADING:
            self.phase = Phase.SERVING
            await self._publish(health_pb2.HealthCheckResponse.SERVING)

    async def set_draining(self) -> None:
        """Shutdown began: report NOT_SERVING and refuse new calls from now on."""
        if self._drain_started is None:
            self._drain_started = self._clock()
        self.phase = Phase.DRAINING
        await self._publish(health_pb2.HealthCheckResponse.NOT_SERVING)

    def note_check(self, kind: str = CHECK_HEALTH) -> None:
        """A health check of ``kind`` (GRPC_HEALTH, or CHECK_HEALTH behind the gateway's /health) is
        answered now."""
        if self.phase is Phase.SERVING:
            self._serving_checks.setdefault(kind, deque(maxlen=RECENT_CHECKS)).append(self._clock())
        elif self.phase is Phase.DRAINING:
            self._seen(kind).set()

    def _seen(self, kind: str) -> asyncio.Event:
        return self._seen_draining.setdefault(kind, asyncio.Event())

    def _checker_gone_at(self, kind: str) -> float | None:
        """When a steady checker of ``kind`` counts as gone if no check comes (None: no steady checker)."""
        times = list(self._serving_checks.get(kind, ()))
        if len(times) < 2:
            return None
        longest_gap = max(SHORTEST_GAP_S, *(b - a for a, b in zip(times, times[1:], strict=False)))
        return times[-1] + CHECKER_GONE_AFTER_GAPS * longest_gap

    async def wait_seen_draining(self, timeout_s: float) -> bool:
        """Once draining: wait (at most ``timeout_s``) until every health checker has seen it, if one watches.

        A load balancer keeps sending calls to a replica until a check fails. Closing the ports before
        then would drop calls it just sent: over HTTP/1.1 a request written onto a keep-alive connection
        the replica closes gets no answer, and a proxy cannot tell whether it started. A server nobody
        checks at a steady pace (``make run``, a script that waited for SERVING) does not wait, nor for a
        checker that stops checking (it went away first). True unless the grace period ended first.
        """
        assert self._drain_started is not None, "wait_seen_draining before set_draining"
        steady = {kind: gone_at for kind in self._serving_checks
                  if (gone_at := self._checker_gone_at(kind)) is not None and gone_at > self._drain_started}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for kind, gone_at in steady.items():
            seen = self._seen(kind)
            until_gone, left = gone_at - self._clock(), deadline - loop.time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(seen.wait(), max(0.0, min(left, until_gone)))
            if not seen.is_set() and until_gone > left:
                return False
        if any(self._seen(kind).is_set() for kind in steady):
            await asyncio.sleep(SEEN_SETTLE_S)
        return True

    async def close(self) -> None:
        """End Watch streams so the gRPC server can stop."""
        await self.health.enter_graceful_shutdown()

    @property
    def serving(self) -> bool:
        return self.phase is Phase.SERVING

    def check(self) -> None:
        """Raise UNAVAILABLE unless new work is accepted now."""
        if self.phase is Phase.LOADING:
            raise errors.not_ready()
        if self.phase is Phase.DRAINING:
            raise errors.draining()

    async def _publish(self, status: int) -> None:
        for name in self._services:
            await self.health.set(name, status)
