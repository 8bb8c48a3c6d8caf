"""Issue 43, item 4: one error shape per surface, on every route and every RPC.

Each HTTP route of the gateway's generated route table and each RPC of the services our protos
define gets one bad field (an unknown body field, an unknown query parameter, an unknown field
number in the binary message) from a live server, and must answer in its surface's documented
shape (docs/api.md, Errors): a ``google.rpc.Status`` with ``ErrorInfo`` (``INVALID_PARAMETER``,
domain ``protoserve``) and a ``BadRequest`` naming the field over gRPC and on native routes,
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with ``param`` the field and
``code`` ``"invalid_parameter"`` on OpenAI routes. The cases are derived from the route table and
the service descriptors, so a route or RPC added later is walked too.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

import grpc
import httpx
import pytest
import pytest_asyncio
from grpc_status_helpers import failure_of

from protoserve.anthropic.v1 import messages_pb2
from protoserve.gateway.runtime.path_template import Variable
from protoserve.gateway.runtime.route import ErrorStyle, Route
from protoserve.generated.routes import ROUTES
from protoserve.open_inference import grpc_service_pb2 as oip
from protoserve.openai.v1 import openai_pb2, responses_pb2
from protoserve.v1 import (
    adapters_pb2,
    agent_pb2,
    embeddings_pb2,
    inference_pb2,
    metrics_pb2,
    models_pb2,
    rag_pb2,
)

BAD_FIELD = "bogus_field"
BAD_NUMBER = 9999  # no message of ours has a field this high
SERVICES = [
    service
    for module in (inference_pb2, metrics_pb2, agent_pb2, embeddings_pb2, adapters_pb2, rag_pb2, models_pb2,
                   openai_pb2, responses_pb2, messages_pb2, oip)
    for service in module.DESCRIPTOR.services_by_name.values()
]
RPCS = [method for service in SERVICES for method in service.methods]
ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"
BAD_REQUEST = "type.googleapis.com/google.rpc.BadRequest"


@dataclass(frozen=True)
class BadCall:
    """One HTTP request with one bad field, and the field its error must name (None: no field)."""

    route: Route
    method: str
    url: str
    body: bytes | None
    field: str | None

    @property
    def id(self) -> str:
        return f"{self.method} {self.url} {self.body[:24]!r}" if self.body is not None else f"{self.method} {self.url}"


def _path(route: Route) -> str:
    """The route's path with every variable filled."""
    parts = [quote("x", safe="") if isinstance(s, Variable) else s for s in route.path.segments]
    return "/" + "/".join(parts) + (":" + route.path.verb if route.path.verb else "")


def bad_calls(route: Route) -> list[BadCall]:
    """The bad requests a route gets: an unknown field where its input goes (body or query string);
    with a body, also malformed JSON and, on routes that stream on request, the unknown field in a
    streaming body."""
    path = _path(route)
    if not route.body:
        return [BadCall(route, route.http_method, f"{path}?{BAD_FIELD}=1", None, BAD_FIELD)]
    calls = [
        BadCall(route, route.http_method, path, b'{"%s": 1}' % BAD_FIELD.encode(), BAD_FIELD),
        BadCall(route, route.http_method, path, b'{"unterminated', None),
    ]
    if route.stream is not None:
        calls.append(
            BadCall(route, route.http_method, path, b'{"stream": true, "%s": 1}' % BAD_FIELD.encode(), BAD_FIELD)
        )
    return calls


CASES = [call for route in ROUTES for call in bad_calls(route)]


def test_every_route_and_rpc_is_walked():
    """The table derives its cases from the route table, and the route table covers every RPC."""
    walked = {(call.route.http_method, call.route.path.template) for call in CASES}
    assert walked == {(route.http_method, route.path.template) for route in ROUTES}
    routed = {route.grpc_method for route in ROUTES}
    methods = {f"/{rpc.containing_service.full_name}/{rpc.name}": rpc for rpc in RPCS}
    assert routed <= set(methods)
    # Every RPC of ours has a route; Triton's own (repository, shared memory, ...) answer UNIMPLEMENTED and
    # have none, while KServe's REST side routes the ones served.
    ours = {name for name, rpc in methods.items() if not rpc.containing_service.full_name.startswith("inference.")}
    assert ours <= routed and routed - ours
    assert len(RPCS) >= 30 and len(ROUTES) >= 30  # the descriptors and the table were found


@pytest.fixture(scope="module")
def http(live_server):
    assert live_server.http_port, "the server started no REST gateway"
    with httpx.Client(base_url=f"http://127.0.0.1:{live_server.http_port}", timeout=60) as client:
        yield client


@pytest.mark.parametrize("call", CASES, ids=lambda call: call.id)
def test_a_bad_field_gets_the_documented_shape_on_every_route(http, clean_log, call: BadCall):
    headers = {"content-type": "application/json"} if call.body is not None else {}
    reply = http.request(call.method, call.url, content=call.body, headers=headers)
    assert reply.status_code == 400, reply.text
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    if call.route.error_style is ErrorStyle.OPENAI:
        assert_openai_shape(body, call.field)
    elif call.route.error_style is ErrorStyle.ANTHROPIC:
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error", body
        assert call.field is None or call.field in body["error"]["message"], body
    elif call.route.error_style is ErrorStyle.KSERVE:  # the Open Inference Protocol's {"error": "<message>"}
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        assert call.field is None or call.field in body["error"], body
    else:
        assert_status_shape(body, call.field)


def assert_openai_shape(body: dict, field: str | None) -> None:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_parameter", error
    assert error["param"] == field and error["message"], error
    if field is not None:
        assert field in error["message"]


def assert_status_shape(body: dict, field: str | None) -> None:
    assert set(body) == {"code", "message", "details"}, body
    assert body["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and body["message"], body
    details = {detail["@type"]: detail for detail in body["details"]}
    assert len(details) == len(body["details"]), body  # one detail of each type
    info = details[ERROR_INFO]
    assert info["reason"] == "INVALID_PARAMETER" and info["domain"] == "protoserve", info
    if field is None:
        assert set(details) == {ERROR_INFO}, body
    else:
        assert set(details) == {ERROR_INFO, BAD_REQUEST}, body
        assert details[BAD_REQUEST]["field_violations"][0]["field"] == field, body


def test_the_gateway_and_the_server_answer_in_one_shape_per_surface(http, live_server):
    """A field the gateway refuses (unknown) and one the server refuses (out of range) read alike."""
    model = http.get("/v1/models").json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    unknown = http.post("/v1/chat/completions", json={**chat, BAD_FIELD: 1}).json()["error"]
    out_of_range = http.post("/v1/chat/completions", json={**chat, "top_p": 7}).json()["error"]
    assert (unknown["param"], out_of_range["param"]) == (BAD_FIELD, "top_p")
    assert {k: unknown[k] for k in ("type", "code")} == {k: out_of_range[k] for k in ("type", "code")}
    native_unknown = http.post("/v1/generate", json={"prompt": "x", BAD_FIELD: 1}).json()
    native_range = http.post("/v1/generate", json={"prompt": "x", "sampling": {"temperature": -2}}).json()
    for body, field in ((native_unknown, BAD_FIELD), (native_range, "sampling.temperature")):
        assert_status_shape(body, field)


# ------------------------------------------------------------------ gRPC


@pytest_asyncio.fixture(loop_scope="function")
async def channel(live_server):
    async with live_server.channel() as ch:
        yield ch


def _unknown_field(number: int) -> bytes:
    """A varint field ``number`` = 1 in wire format: a field the message does not define."""
    key, out = number << 3, bytearray()
    while key >= 0x80:
        out.append(key & 0x7F | 0x80)
        key >>= 7
    return bytes(out) + bytes([key, 1])


@pytest.mark.parametrize("rpc", RPCS, ids=lambda rpc: f"{rpc.containing_service.name}.{rpc.name}")
async def test_an_unknown_field_gets_the_documented_status_on_every_rpc(channel, clean_log, rpc):
    method = f"/{rpc.containing_service.full_name}/{rpc.name}"
    data = _unknown_field(BAD_NUMBER)
    if rpc.client_streaming:
        call = (channel.stream_stream if rpc.server_streaming else channel.stream_unary)(method)(iter([data]), timeout=30)
    else:
        call = (channel.unary_stream if rpc.server_streaming else channel.unary_unary)(method)(data, timeout=30)
    failure = await failure_of(call)
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT, (method, failure)
    assert failure.reason == "INVALID_PARAMETER" and failure.details["ErrorInfo"].domain == "protoserve"
    assert failure.fields == {str(BAD_NUMBER)}, failure
    assert f"unknown field number {BAD_NUMBER}" in failure.message


async def test_an_unknown_field_inside_a_message_is_named_by_its_path(channel):
    sampling = inference_pb2.SamplingParams(max_tokens=1).SerializeToString() + _unknown_field(BAD_NUMBER)
    number = inference_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["sampling"].number
    request = inference_pb2.GenerateRequest(prompt="x").SerializeToString()
    request += bytes([number << 3 | 2, len(sampling)]) + sampling
    failure = await failure_of(channel.unary_unary("/protoserve.v1.InferenceService/Generate")(request, timeout=30))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.fields == {f"sampling.{BAD_NUMBER}"}
    assert "protoserve.v1.SamplingParams has no such field" in failure.message


def _length_delimited(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload


async def test_an_unknown_field_in_an_open_inference_tensor_or_parameter_is_named(channel):
    """tritonclient sends only known fields; one that is not, however deep, is named on both infer RPCs."""
    bad = _unknown_field(BAD_NUMBER)
    fields = oip.ModelInferRequest.DESCRIPTOR.fields_by_name
    tensor = oip.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"hi")
    value = oip.InferParameter(int64_param=1).SerializeToString() + bad
    entry = _length_delimited(1, b"seed") + _length_delimited(2, value)  # map entry: key 1, value 2
    data = oip.ModelInferRequest(model_name="x").SerializeToString()
    data += _length_delimited(fields["inputs"].number, tensor.SerializeToString() + bad)
    data += _length_delimited(fields["parameters"].number, entry)
    for method, call in (
        ("ModelInfer", lambda m: channel.unary_unary(m)(data, timeout=30)),
        ("ModelStreamInfer", lambda m: channel.stream_stream(m)(iter([data]), timeout=30)),
    ):
        failure = await failure_of(call(f"/inference.GRPCInferenceService/{method}"))
        assert failure.code == grpc.StatusCode.INVALID_ARGUMENT, (method, failure)
        assert failure.fields == {f"inputs[0].{BAD_NUMBER}", f"parameters['seed'].{BAD_NUMBER}"}, failure
        assert "inference.ModelInferRequest.InferInputTensor has no such field" in failure.message


async def test_a_known_field_in_the_wrong_wire_type_is_named(channel):
    number = inference_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["model"].number
    request = bytes([number << 3 | 0, 5])  # a varint where the model's name (a string) goes
    failure = await failure_of(channel.unary_unary("/protoserve.v1.InferenceService/Generate")(request, timeout=30))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and failure.fields == {"model"}
    assert "wrong wire type" in failure.message
