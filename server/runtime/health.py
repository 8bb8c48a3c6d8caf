"""Readiness: one state drives grpc.health.v1, CheckHealth and admission of new calls.

The server starts NOT_SERVING (the model is still loading), turns SERVING once
the engine runs, and goes back to NOT_SERVING for good when it starts draining,
so load balancers stop sending traffic before in-flight streams are finished.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from grpc_health.v1 import health, health_pb2

from protoserve.server import errors


class Phase(enum.Enum):
    """Where the server is in its life."""

    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"


class Readiness:
    """The server's phase, mirrored into the standard health service."""

    def __init__(self, service_names: Iterable[str]) -> None:
        self.phase = Phase.LOADING
        self.health = health.aio.HealthServicer()
        # "" is the whole server; the named services are what clients may ask about.
        self._services = ["", *service_names]

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
        self.phase = Phase.DRAINING
        await self._publish(health_pb2.HealthCheckResponse.NOT_SERVING)

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
