"""Tracing is configured by the standard OTEL_* variables and is off (no SDK at all) by default.

The end-to-end test runs ``protoserve serve`` as a subprocess pointed at an
OTLP collector in this test (a small gRPC TraceService), the way it runs in
production: env → SDK provider → gateway, gRPC and engine spans of one trace.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from obs_stack import parse_metrics, sample
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from protoserve.server.observability.grpc_tracing import traced_calls_filter
from protoserve.server.observability.tracing_setup import (
    build_tracer_provider,
    otlp_protocol,
    requested_exporters,
    span_exporter,
)

pytestmark = pytest.mark.live  # each test runs the CLI in a process of its own

REPO = Path(__file__).resolve().parents[2]
TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
LISTEN = re.compile(r"listening on (\S+) \(grpc\), http on \S+:(\d+), metrics on \S+:(\d+)")


@pytest.mark.parametrize(
    ("env", "force", "expected"),
    [
        ({}, False, []),
        ({}, True, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, False, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, False, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console"}, False, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, False, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, True, []),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, True, []),
    ],
)
def test_which_exporters(env, force, expected):
    assert requested_exporters(env, force=force) == expected


def test_bad_settings_fail_loudly():
    with pytest.raises(ValueError, match="zipkin"):
        requested_exporters({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="http/json"):
        requested_exporters({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"})


def test_otlp_protocol_picks_the_transport():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    assert otlp_protocol({}) == "grpc"
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    assert otlp_protocol(env) == "http/protobuf"
    assert isinstance(span_exporter("otlp", env), HttpExporter)
    assert isinstance(span_exporter("otlp", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}), GrpcExporter)


def test_provider_only_when_asked_for():
    assert build_tracer_provider("protoserve", {}) is None
    provider = build_tracer_provider("protoserve-unit", {"OTEL_TRACES_EXPORTER": "console"})
    try:
        assert provider.resource.attributes["service.name"] == "protoserve-unit"
    finally:
        provider.shutdown()


def test_health_and_reflection_are_not_traced(monkeypatch):
    class Details:
        def __init__(self, method: str) -> None:
            self.method = method

    monkeypatch.setenv("OTEL_PYTHON_GRPC_EXCLUDED_SERVICES", "protoserve.v1.MetricsService")
    traced = traced_calls_filter()
    assert traced(Details("/protoserve.v1.InferenceService/Generate"))
    assert not traced(Details("/grpc.health.v1.Health/Check"))
    assert not traced(Details("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"))
    assert not traced(Details("/protoserve.v1.MetricsService/GetMetrics"))


def test_tracing_off_imports_no_sdk():
    """With no OTEL_* settings, configuring tracing and building the server load no SDK."""
    code = (
        "import sys\n"
        "from protoserve.server.observability.tracing_setup import configure_tracing\n"
        "from protoserve.server.app import ServerApp, ServerConfig\n"
        "assert configure_tracing() is None\n"
        "app = ServerApp(ServerConfig())\n"
        "assert app.telemetry.tracer_provider is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _healthy(http: str) -> bool:
    try:
        return httpx.get(http + "/health", timeout=10).status_code == 200
    except httpx.TimeoutException:
        return False  # answers can stall while the model loading thread imports torch


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - the gRPC method name
        with self.lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) pairs received so far."""
        out = []
        with self.lock:
            for request in self.requests:
                for resource_spans in request.resource_spans:
                    attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    for scope_spans in resource_spans.scope_spans:
                        out += [(attrs, span) for span in scope_spans.spans]
        return out


@pytest.fixture
def collector():
    servicer = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


def test_serve_exports_one_trace_over_otlp(tiny_obs_model, collector):
    servicer, port = collector
    # No OTEL_ or server settings from the outer environment, but the same kernel build: a
    # PROTOSERVE_KERNEL_CACHE dropped here made the server compile the kernels afresh.
    build = ("PROTOSERVE_KERNEL_CACHE", "PROTOSERVE_CPU_KERNELS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PROTOSERVE_")) or k in build}
    env |= {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "protoserve-e2e",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    stderr = tempfile.NamedTemporaryFile(prefix="protoserve-otlp-", suffix=".log", delete=False)
    args = [
        sys.executable, "-m", "protoserve.server.cli", "serve", "--model", str(tiny_obs_model), "--model-name", "tiny-otlp",
        "--port", "0", "--http-port", "0", "--metrics-port", "0", "--max-kv-blocks", "128", "--no-progress",
    ]
    process = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        line = process.stdout.readline()
        found = LISTEN.search(line)
        assert found, f"no listen line: {line!r}\n{Path(stderr.name).read_text()}"
        http = f"http://127.0.0.1:{found.group(2)}"
        deadline = time.monotonic() + 90
        while not _healthy(http):
            assert process.poll() is None and time.monotonic() < deadline, Path(stderr.name).read_text()
            time.sleep(0.1)

        traceparent = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"
        body = {"prompt": "over the wire", "sampling": {"max_tokens": 3, "ignore_eos": True}}
        reply = httpx.post(http + "/v1/generate", json=body, headers={"traceparent": traceparent}, timeout=60)
        assert reply.status_code == 200, reply.text

        deadline = time.monotonic() + 15
        while len([s for _, s in servicer.spans() if s.trace_id == TRACE_ID.to_bytes(16, "big")]) < 3:
            assert time.monotonic() < deadline, f"collector got {servicer.spans()}"
            time.sleep(0.05)
        received = [(res, s) for res, s in servicer.spans() if s.trace_id == TRACE_ID.to_bytes(16, "big")]
        assert {res["service.name"] for res, _ in received} == {"protoserve-e2e"}
        by_name = {s.name: s for _, s in received}
        gateway = by_name["POST /v1/generate"]
        server = by_name["/protoserve.v1.InferenceService/Generate"]
        engine = by_name["text_completion tiny-otlp"]
        assert gateway.parent_span_id == PARENT_ID.to_bytes(8, "big")
        assert server.parent_span_id == gateway.span_id
        assert engine.parent_span_id == server.span_id
        attrs = {a.key: a.value for a in engine.attributes}
        assert attrs["gen_ai.usage.output_tokens"].int_value == 3
        assert attrs["gen_ai.response.id"].string_value == reply.json()["request_id"]

        # Both Prometheus endpoints serve the one registry of the serving process.
        for url in (http + "/metrics", f"http://127.0.0.1:{found.group(3)}/metrics"):
            metrics = parse_metrics(httpx.get(url, timeout=10).text)
            assert sample(metrics, "protoserve_request_status_total", model_name="tiny-otlp", status="OK") == 1
            assert sample(metrics, "protoserve_generation_tokens_total", model_name="tiny-otlp") == 3
    finally:
        process.terminate()
        process.wait(30)
    lines = [json.loads(x) for x in Path(stderr.name).read_text().splitlines() if x.startswith("{")]
    [request_line] = [x for x in lines if x.get("event") == "request_finished"]
    assert request_line["request_id"] == reply.json()["request_id"] and request_line["output_tokens"] == 3
