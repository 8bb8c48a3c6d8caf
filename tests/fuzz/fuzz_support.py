"""What the fuzz suite shares: how many examples each property gets, its two tenants, the after-run check.

``PROTOSERVE_FUZZ_EXAMPLES`` sets how many generated inputs each property
tries: small in ``make test``, larger in ``make fuzz``. Calls alternate between
two tenants (user ids of the auth-off server: two identities the fair scheduler
shares the engine between). After a run the server must answer health checks
and hold no request and no KV block.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

from grpc_health.v1 import health_pb2

from protoserve.v1 import metrics_pb2, metrics_pb2_grpc

FUZZ_EXAMPLES = int(os.environ.get("PROTOSERVE_FUZZ_EXAMPLES", "8"))
# The fuzz server's context: whatever max_tokens a fuzzer sends, a request ends within about a second.
FUZZ_CONTEXT_TOKENS = 128

TENANTS = ("fuzz-tenant-a", "fuzz-tenant-b")
_turns = itertools.cycle(TENANTS)


def next_tenant() -> tuple[tuple[str, str]]:
    """The next call's tenant, as its ``x-user-id`` (gRPC metadata or an HTTP header), in turn."""
    return (("x-user-id", next(_turns)),)


# Cancelled and timed-out calls free their blocks on the engine's next step; give them a moment.
SETTLE_S = 30.0


def snapshot(server: Any) -> metrics_pb2.MetricsSnapshot:
    with server.sync_channel() as channel:
        stub = metrics_pb2_grpc.MetricsServiceStub(channel)
        return stub.GetMetrics(metrics_pb2.GetMetricsRequest(), timeout=10).snapshot


def assert_idle_and_healthy(server: Any) -> None:
    assert server.process.poll() is None, f"the server exited:\n{server.log()}"
    assert server.health() == health_pb2.HealthCheckResponse.SERVING, server.log()
    deadline = time.monotonic() + SETTLE_S
    snap = snapshot(server)
    while (snap.kv_cache_usage, snap.num_requests_running, snap.num_requests_waiting) != (0, 0, 0):
        assert time.monotonic() < deadline, f"not idle after {SETTLE_S}s: {snap}"
        time.sleep(0.2)
        snap = snapshot(server)
    assert "Traceback" not in server.log_path.read_text(errors="replace"), server.log()
