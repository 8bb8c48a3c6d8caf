"""Three protoserve replicas behind a real Envoy on loopback: the Kubernetes topology without a cluster.

``mesh`` (module-scoped) starts three ``protoserve serve`` processes (the default model, one compute
thread each, a shared identity secret as the Deployment's Secret gives them, traces to an in-test
OTLP collector) and Envoy rendered by the launcher for all three, with a short health-check
interval so rotation changes are quick to observe.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
from mesh_load import HEALTH_CHECK_INTERVAL_S
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from protoserve.gateway.envoy.config import Balancing, Replica
from protoserve.gateway.envoy.launcher import EnvoyGateway, running_envoy
from protoserve.v1 import metrics_pb2, metrics_pb2_grpc

GRACE_PERIOD_S = 8


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - the gRPC method name
        with self.lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id: bytes) -> list[tuple[str, object]]:
        """(service.name, span) of one trace received so far."""
        out = []
        with self.lock:
            for request in self.requests:
                for resource_spans in request.resource_spans:
                    attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    for scope_spans in resource_spans.scope_spans:
                        out += [
                            (attrs.get("service.name", ""), s)
                            for s in scope_spans.spans
                            if s.trace_id == trace_id
                        ]
        return out


@dataclass
class Mesh:
    replicas: list  # LiveServer, in the order of ``Envoy``'s endpoints
    envoy: EnvoyGateway
    collector: Collector
    model: str
    stopped: set[int] = field(default_factory=set)
    homes: dict[str, int] = field(default_factory=dict)  # user id -> the replica its calls land on

    @property
    def alive(self) -> list[int]:
        return [i for i in range(len(self.replicas)) if i not in self.stopped]

    def served(self, index: int, user_id: str) -> int:
        """Requests replica ``index`` finished for ``user_id`` (its own usage row, read directly)."""
        with self.replicas[index].sync_channel() as channel:
            reply = metrics_pb2_grpc.MetricsServiceStub(channel).GetMetrics(
                metrics_pb2.GetMetricsRequest(), metadata=(("x-user-id", user_id),), timeout=10
            )
        return sum(row.requests for row in reply.snapshot.usage_by_identity.values())

    def requests_by_replica(self) -> list[int]:
        """Finished requests of every identity, per live replica (auth off, no user id: all rows)."""
        counts = []
        for index in self.alive:
            with self.replicas[index].sync_channel() as channel:
                reply = metrics_pb2_grpc.MetricsServiceStub(channel).GetMetrics(
                    metrics_pb2.GetMetricsRequest(), timeout=10
                )
            counts.append(sum(row.requests for row in reply.snapshot.usage_by_identity.values()))
        return counts


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


@pytest.fixture(scope="module")
def mesh(spawn_server, collector) -> Iterator[Mesh]:
    servicer, port = collector
    env = {
        "OMP_NUM_THREADS": "1",
        "PROTOSERVE_IDENTITY_SECRET": secrets.token_hex(32),
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "protoserve-replica",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    args = ("--no-embedding-model", "--grace-period", str(GRACE_PERIOD_S))
    replicas = [spawn_server(*args, env=env, wait_ready=False) for _ in range(3)]
    for replica in replicas:
        replica.wait_serving()
    topology = [Replica(r.grpc_target, f"127.0.0.1:{r.http_port}") for r in replicas]
    balancing = Balancing(health_check_interval_s=HEALTH_CHECK_INTERVAL_S, ejection_s=5)
    with running_envoy(topology, balancing=balancing, otlp_target=f"127.0.0.1:{port}") as envoy:
        envoy.wait_healthy(len(replicas))
        from protoserve.v1 import inference_pb2, inference_pb2_grpc

        with replicas[0].sync_channel() as channel:
            model = (
                inference_pb2_grpc.InferenceServiceStub(channel)
                .ListModels(inference_pb2.ListModelsRequest(), timeout=10)
                .models[0]
                .name
            )
        yield Mesh(replicas, envoy, servicer, model)
        # While Envoy still checks them, all at once: each drains once a check has seen it.
        with futures.ThreadPoolExecutor(len(replicas)) as pool:
            list(pool.map(lambda replica: replica.stop(timeout=GRACE_PERIOD_S + 10), replicas))
