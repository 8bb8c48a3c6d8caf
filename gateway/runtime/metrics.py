"""The gateway's own Prometheus metrics: HTTP requests by route and status, and their durations.

They are registered in the registry the gateway serves at ``GET /metrics``:
the server's registry when the gateway runs inside ``protoserve serve`` (so
one scrape has both), or a registry of its own when it runs standalone
(``python -m protoserve.gateway``), where it cannot see the engine. They are labelled by
route template, not by model: the gateway does not interpret request bodies.
Names use the server's ``protoserve_`` prefix (underscores: colons are for
recording rules) and no ``*_created`` series are exported.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

UNMATCHED_ROUTE = "(unmatched)"
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# Process-wide in prometheus-client; also here for the standalone gateway, which
# never imports the server's metrics module.
disable_created_metrics()


class GatewayMetrics:
    """``protoserve_gateway_requests_total`` and ``protoserve_gateway_request_duration_seconds``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "protoserve_gateway_requests",
            "HTTP requests answered by the gateway, by route template, method and status.",
            ["route", "method", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "protoserve_gateway_request_duration_seconds",
            "Time from request to the end of the response (streams included), by route template.",
            ["route", "method"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )

    def observe(self, route: str | None, method: str, status: int | None, seconds: float) -> None:
        """Count one answered request; ``status`` None means the client left before any answer."""
        route = route or UNMATCHED_ROUTE
        self.requests.labels(route, method, str(status) if status is not None else "none").inc()
        self.duration.labels(route, method).observe(seconds)
