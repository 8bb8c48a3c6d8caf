"""One HTTP request is one trace: gateway SERVER span → gRPC SERVER span → engine span.

Runs server and gateway in this process with the SDK's in-memory exporter
(see obs_stack), so every finished span can be inspected.
"""

from __future__ import annotations

import json
import random
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from obs_stack import API_KEYS, MODEL_NAME, auth_headers, grpc_metadata
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN_ID = 0xB7AD6B7169203331
TRACEPARENT = f"00-{TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"
SECRET = "the launch code is 4512"


def _chain(spans: list[ReadableSpan]) -> tuple[ReadableSpan, ReadableSpan, ReadableSpan]:
    """(gateway, gRPC server, engine) spans; fails unless there is exactly one of each."""
    by_scope: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        by_scope.setdefault(span.instrumentation_scope.name, []).append(span)
    [gateway] = by_scope.pop("protoserve.gateway")
    [engine] = by_scope.pop("protoserve.engine")
    [server] = by_scope.pop("opentelemetry.instrumentation.grpc")
    assert not by_scope, f"unexpected spans: {by_scope}"
    return gateway, server, engine


def _trace(exporter, trace_id: int, count: int, timeout: float = 5.0) -> list[ReadableSpan]:
    """The finished spans of one trace once there are ``count`` of them. An earlier test's call can
    end its span after this test's exporter was cleared (a stream the server is still closing): that
    span is in the exporter too, but in its own trace."""
    deadline = time.monotonic() + timeout
    while True:
        mine = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        if len(mine) >= count or time.monotonic() > deadline:
            return mine
        time.sleep(0.01)


def _traceparent() -> tuple[int, str]:
    """A fresh trace id and the traceparent header that continues it."""
    trace_id = random.getrandbits(128) | 1
    return trace_id, f"00-{trace_id:032x}-{CLIENT_SPAN_ID:016x}-01"


def _all_text(spans: list[ReadableSpan]) -> str:
    """Everything a span exporter would ship, as one string."""
    return json.dumps([json.loads(s.to_json()) for s in spans])


def test_http_request_is_one_trace_continuing_traceparent(obs, spans):
    body = {
        "prompt": "Hello, observability",
        "sampling": {"max_tokens": 4, "temperature": 0.5, "top_p": 0.75, "top_k": 5, "seed": 11, "ignore_eos": True},
    }
    reply = httpx.post(
        obs.http_url + "/v1/generate", json=body, headers=auth_headers(traceparent=TRACEPARENT), timeout=60
    )
    assert reply.status_code == 200, reply.text
    result = reply.json()
    gateway, server, engine = _chain(_trace(spans, TRACE_ID, 3))

    # One trace, continued from the caller's traceparent, parent → child all the way down.
    assert {s.context.trace_id for s in (gateway, server, engine)} == {TRACE_ID}
    assert gateway.parent.span_id == CLIENT_SPAN_ID and gateway.parent.is_remote
    assert server.parent.span_id == gateway.context.span_id
    assert engine.parent.span_id == server.context.span_id
    # Children start after and end before their parents.
    assert gateway.start_time <= server.start_time <= engine.start_time
    assert engine.end_time <= server.end_time <= gateway.end_time

    assert (gateway.name, gateway.kind) == ("POST /v1/generate", SpanKind.SERVER)
    assert gateway.attributes["http.route"] == "/v1/generate"
    assert gateway.attributes["http.response.status_code"] == 200
    assert (server.name, server.kind) == ("/protoserve.v1.InferenceService/Generate", SpanKind.SERVER)
    assert server.attributes["rpc.grpc.status_code"] == 0

    assert (engine.name, engine.kind) == (f"text_completion {MODEL_NAME}", SpanKind.INTERNAL)
    assert {k: engine.attributes.get(k) for k in (
        "gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model", "gen_ai.request.max_tokens",
        "gen_ai.request.temperature", "gen_ai.request.top_p", "gen_ai.request.top_k", "gen_ai.request.seed",
        "gen_ai.response.id", "gen_ai.response.finish_reasons", "gen_ai.usage.input_tokens",
        "gen_ai.usage.output_tokens",
    )} == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "protoserve",
        "gen_ai.request.model": MODEL_NAME,
        "gen_ai.request.max_tokens": 4,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.75,
        "gen_ai.request.top_k": 5,
        "gen_ai.request.seed": 11,
        "gen_ai.response.id": result["request_id"],
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": result["usage"]["prompt_tokens"],
        "gen_ai.usage.output_tokens": 4,
    }
    assert [e.name for e in engine.events] == ["queued", "scheduled", "first_token", "finished"]


def test_without_traceparent_the_gateway_starts_the_trace(obs, spans):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    reply = httpx.post(obs.http_url + "/v1/chat/completions", json=body, headers=auth_headers(), timeout=60)
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 5
    while not (ours := [s for s in spans.get_finished_spans()
                        if s.attributes.get("gen_ai.response.id") == reply.json()["id"]]):
        assert time.monotonic() < deadline, "no engine span for the response"
        time.sleep(0.01)
    gateway, server, engine = _chain(_trace(spans, ours[0].context.trace_id, 3))
    assert gateway.parent is None
    assert len({s.context.trace_id for s in (gateway, server, engine)}) == 1
    assert server.parent.span_id == gateway.context.span_id
    assert engine.parent.span_id == server.context.span_id
    assert engine.name == f"chat {MODEL_NAME}"
    assert engine.attributes["gen_ai.operation.name"] == "chat"
    assert engine.attributes["gen_ai.response.id"] == reply.json()["id"]


def test_streams_are_traced_to_the_end(obs, spans):
    body = {"prompt": "stream me", "sampling": {"max_tokens": 5, "ignore_eos": True}}
    trace_id, traceparent = _traceparent()
    with httpx.stream(
        "POST", obs.http_url + "/v1/generate:stream", json=body, headers=auth_headers(traceparent=traceparent),
        timeout=60,
    ) as reply:
        assert reply.status_code == 200
        events = [line for line in reply.iter_lines() if line.startswith("data:")]
    assert len(events) >= 2
    gateway, server, engine = _chain(_trace(spans, trace_id, 3))
    assert server.name == "/protoserve.v1.InferenceService/GenerateStream"
    assert engine.parent.span_id == server.context.span_id
    assert engine.attributes["gen_ai.usage.output_tokens"] == 5
    assert engine.end_time <= server.end_time <= gateway.end_time


def test_no_prompt_or_completion_text_in_spans_by_default(obs, spans):
    body = {"prompt": SECRET, "sampling": {"max_tokens": 6, "ignore_eos": True}}
    trace_id, traceparent = _traceparent()
    reply = httpx.post(obs.http_url + "/v1/generate", json=body, headers=auth_headers(traceparent=traceparent),
                       timeout=60)
    assert reply.status_code == 200
    finished = _trace(spans, trace_id, 3)
    _, _, engine = _chain(finished)
    assert "gen_ai.input.messages" not in engine.attributes
    assert "gen_ai.output.messages" not in engine.attributes
    exported = _all_text(finished)
    assert SECRET not in exported and "4512" not in exported
    assert not any(key in exported for key in API_KEYS)


def test_content_capture_is_opt_in(obs, spans):
    app = obs.run(obs.start_app(trace_content=True))
    with grpc.insecure_channel(app.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = pb.GenerateRequest(prompt=SECRET, sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
        trace_id, traceparent = _traceparent()
        metadata = (*grpc_metadata(), ("traceparent", traceparent))
        response = stub.Generate(request, metadata=metadata, timeout=60)
    [engine] = [s for s in _trace(spans, trace_id, 2) if s.instrumentation_scope.name == "protoserve.engine"]
    [message] = json.loads(engine.attributes["gen_ai.input.messages"])
    assert message["parts"][0]["content"] == SECRET
    [choice] = json.loads(engine.attributes["gen_ai.output.messages"])
    assert choice["parts"][0]["content"] == response.choices[0].text
    assert choice["finish_reason"] == "length"


def test_errors_are_on_the_spans_and_health_checks_are_not_traced(obs, spans):
    bad = {"prompt": "x", "sampling": {"temperature": -1}}
    trace_id, traceparent = _traceparent()
    reply = httpx.post(obs.http_url + "/v1/generate", json=bad, headers=auth_headers(traceparent=traceparent),
                       timeout=60)
    assert reply.status_code == 400
    finished = _trace(spans, trace_id, 2)
    assert not [s for s in finished if s.instrumentation_scope.name == "protoserve.engine"]
    [server] = [s for s in finished if s.kind == SpanKind.SERVER and s.name.startswith("/protoserve")]
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    [gateway] = [s for s in finished if s.instrumentation_scope.name == "protoserve.gateway"]
    assert gateway.attributes["http.response.status_code"] == 400
    assert server.parent.span_id == gateway.context.span_id

    spans.clear()
    with grpc.insecure_channel(obs.grpc_target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    time.sleep(0.2)  # a span, if there were one, could end just after the answer
    assert [s.name for s in spans.get_finished_spans() if "grpc.health" in s.name] == []
