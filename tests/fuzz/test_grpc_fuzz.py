"""Hypothesis over every RPC's request message against a live gRPC server.

Each method of InferenceService, OpenAIService, MessagesService, MetricsService and the Open
Inference Protocol's GRPCInferenceService gets arbitrary request messages
(tests/fuzz/proto_strategies.py; ModelInfer and ModelStreamInfer also tensors a client gets wrong,
tests/fuzz/open_inference_strategies.py), raw bytes, and
valid messages' bytes truncated or with a byte flipped, over a real channel
with a short deadline, from two tenants in turn. Whatever a client sends, the answer is a status that
blames the client (or OK, or the client's own deadline): never UNKNOWN or
INTERNAL (a server bug), UNAVAILABLE (a crash) or DATA_LOSS, and every message
the server sends parses as the method's response type; a request ModelStreamInfer refuses in its
stream is no internal error either. Afterwards the server still answers and its KV pool is free.
"""

from __future__ import annotations

import grpc
import pytest
from fuzz_support import FUZZ_EXAMPLES, assert_idle_and_healthy, next_tenant
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from open_inference_strategies import infer_requests
from proto_strategies import messages
from valid_requests import field_schemas, strategy

from protoserve.anthropic.v1 import messages_pb2
from protoserve.open_inference import grpc_service_pb2 as oip
from protoserve.openai.v1 import openai_pb2, responses_pb2
from protoserve.v1 import inference_pb2, metrics_pb2

SERVICES = (
    inference_pb2.DESCRIPTOR.services_by_name["InferenceService"],
    openai_pb2.DESCRIPTOR.services_by_name["OpenAIService"],
    messages_pb2.DESCRIPTOR.services_by_name["MessagesService"],
    responses_pb2.DESCRIPTOR.services_by_name["ResponsesService"],
    metrics_pb2.DESCRIPTOR.services_by_name["MetricsService"],
    oip.DESCRIPTOR.services_by_name["GRPCInferenceService"],
)
METHODS = [method for service in SERVICES for method in service.methods]
# A server bug, a crash, or corruption: never the answer to anything a client sends.
SERVER_FAULTS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}
# Enough for a whole 128-token context at n=16; a longer call is cut by this deadline, which is fine.
CALL_TIMEOUT_S = 20.0
# Streams that never end by themselves: the first message is enough.
ENDLESS = {"WatchMetrics"}
CHAT_ROLES = ("system", "user", "assistant")  # mixed into every string field
INTERNAL_ERROR = "internal server error"  # server.errors' words for a server bug

FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same inputs every run: a failure reproduces
    database=None,
    suppress_health_check=list(HealthCheck),
)


def method_id(method: MethodDescriptor) -> str:
    return f"{method.containing_service.name}.{method.name}"


@pytest.fixture(scope="module")
def channel(fuzz_server):
    with fuzz_server.sync_channel() as channel:
        yield channel


@pytest.fixture(scope="module")
def model_name(channel: grpc.Channel) -> str:
    stub = channel.unary_unary(
        "/protoserve.v1.InferenceService/ListModels",
        request_serializer=inference_pb2.ListModelsRequest.SerializeToString,
        response_deserializer=inference_pb2.ListModelsResponse.FromString,
    )
    return stub(inference_pb2.ListModelsRequest(), timeout=10).models[0].name


@pytest.fixture(scope="module")
def model_kinds(channel: grpc.Channel) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the LLMs, the embedding models) served: the Open Inference Protocol serves both."""
    stub = channel.unary_unary(
        "/protoserve.v1.InferenceService/ListModels",
        request_serializer=inference_pb2.ListModelsRequest.SerializeToString,
        response_deserializer=inference_pb2.ListModelsResponse.FromString,
    )
    models = stub(inference_pb2.ListModelsRequest(), timeout=10).models
    embedders = tuple(m.name for m in models if m.kind == "embedding")
    return tuple(m.name for m in models if m.name not in embedders), embedders


@pytest.fixture(scope="module")
def requests_of(model_name: str, model_kinds: tuple[tuple[str, ...], tuple[str, ...]]):
    """The request strategy of a method: anything its type allows, half the time leaning valid."""
    hints = {field: strategy(schema) for field, schema in field_schemas(model_name).items()}
    names = model_kinds[0] + model_kinds[1]

    def of(method: MethodDescriptor):
        anything = messages(method.input_type, words=(*names, *CHAT_ROLES), hints=hints)
        if method.input_type.full_name == oip.ModelInferRequest.DESCRIPTOR.full_name:
            return st.one_of(anything, infer_requests(*model_kinds))
        return anything

    return of


def call(channel: grpc.Channel, method: MethodDescriptor, payload: bytes) -> tuple[grpc.StatusCode, str]:
    """Send raw request bytes (a client stream sends them twice); returns the final status.
    Response messages must parse."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    parse = GetMessageClass(method.output_type).FromString
    tenant = next_tenant()
    try:
        if method.client_streaming:
            requests = iter([payload, payload])
            if not method.server_streaming:
                parse(channel.stream_unary(path)(requests, timeout=CALL_TIMEOUT_S, metadata=tenant))
                return grpc.StatusCode.OK, ""
            stream = channel.stream_stream(path)(requests, timeout=CALL_TIMEOUT_S, metadata=tenant)
        elif not method.server_streaming:
            parse(channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT_S, metadata=tenant))
            return grpc.StatusCode.OK, ""
        else:
            stream = channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT_S, metadata=tenant)
        for reply in stream:
            message = parse(reply)
            if method.name in ENDLESS:
                stream.cancel()
                return grpc.StatusCode.OK, ""
            error = getattr(message, "error_message", "")  # ModelStreamInfer's in-stream refusals
            assert not error.startswith(INTERNAL_ERROR), f"{method.name} reported {error!r} in its stream"
        return stream.code(), stream.details() or ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""


def assert_client_status(channel: grpc.Channel, method: MethodDescriptor, payload: bytes) -> None:
    code, details = call(channel, method, payload)
    assert code not in SERVER_FAULTS, f"{method_id(method)} answered {code.name}: {details[:500]!r}"


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_any_request_message_gets_a_client_status(channel: grpc.Channel, method: MethodDescriptor, requests_of) -> None:
    @FUZZ_SETTINGS
    @given(request=requests_of(method))
    def check(request) -> None:
        assert_client_status(channel, method, request.SerializeToString())

    check()


@st.composite
def damaged_bytes(draw: st.DrawFn, requests: st.SearchStrategy) -> bytes:
    """Random bytes, or a message's bytes cut short or with one byte changed."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=256))
    payload = bytearray(draw(requests).SerializeToString())
    if not payload:
        return draw(st.binary(min_size=1, max_size=16))
    at = draw(st.integers(0, len(payload) - 1))
    if draw(st.booleans()):
        return bytes(payload[:at])
    payload[at] ^= draw(st.integers(1, 255))
    return bytes(payload)


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_any_request_bytes_get_a_client_status(channel: grpc.Channel, method: MethodDescriptor, requests_of) -> None:
    @FUZZ_SETTINGS
    @given(payload=damaged_bytes(requests_of(method)))
    def check(payload: bytes) -> None:
        assert_client_status(channel, method, payload)

    check()


def test_server_is_healthy_and_idle_after_the_grpc_fuzz(fuzz_server) -> None:
    assert_idle_and_healthy(fuzz_server)
