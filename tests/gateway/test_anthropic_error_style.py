"""Anthropic's error style in the gateway: the body, Anthropic's statuses and the routes that use it.

The live behaviour (the official ``anthropic`` client raising the right exception) is in
tests/gateway/test_anthropic_messages_live.py; this is the mapping itself, for every status the
server and the gateway produce.
"""

from __future__ import annotations

import pytest
from gateway_fakes import rich_status
from google.rpc import code_pb2, error_details_pb2

from protoserve.gateway.runtime import framing
from protoserve.gateway.runtime.errors import HttpError, gateway_error
from protoserve.gateway.runtime.route import ErrorStyle, Framing
from protoserve.gateway.runtime.router import Router, RoutingError
from protoserve.generated.routes import ROUTES


def _error(code: int, reason: str, http_status: int | None = None) -> HttpError:
    status = rich_status(code, "what went wrong", error_details_pb2.ErrorInfo(reason=reason, domain="protoserve"))
    return HttpError(status, http_status)


@pytest.mark.parametrize(
    ("code", "reason", "http_status", "status", "error_type"),
    [
        (code_pb2.INVALID_ARGUMENT, "INVALID_PARAMETER", None, 400, "invalid_request_error"),
        (code_pb2.UNAUTHENTICATED, "UNAUTHENTICATED", None, 401, "authentication_error"),
        (code_pb2.PERMISSION_DENIED, "PERMISSION_DENIED", None, 403, "permission_error"),
        (code_pb2.NOT_FOUND, "MODEL_NOT_FOUND", None, 404, "not_found_error"),
        (code_pb2.RESOURCE_EXHAUSTED, "PAYLOAD_TOO_LARGE", 413, 413, "request_too_large"),
        (code_pb2.RESOURCE_EXHAUSTED, "RATE_LIMIT_EXCEEDED", None, 429, "rate_limit_error"),
        # A full queue or a draining server is Anthropic's "overloaded": clients back off and retry.
        (code_pb2.RESOURCE_EXHAUSTED, "QUEUE_FULL", None, 529, "overloaded_error"),
        (code_pb2.UNAVAILABLE, "SERVER_DRAINING", None, 529, "overloaded_error"),
        (code_pb2.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED", None, 504, "timeout_error"),
        (code_pb2.INTERNAL, "INTERNAL", None, 500, "api_error"),
        (code_pb2.UNIMPLEMENTED, "ROUTE_NOT_FOUND", None, 500, "api_error"),
        (code_pb2.UNKNOWN, "METHOD_NOT_ALLOWED", 405, 405, "invalid_request_error"),
    ],
)
def test_anthropic_status_and_type_per_failure(code, reason, http_status, status, error_type):
    error = _error(code, reason, http_status)
    assert error.status_for(ErrorStyle.ANTHROPIC) == status
    assert error.body(ErrorStyle.ANTHROPIC) == {
        "type": "error",
        "error": {"type": error_type, "message": "what went wrong"},
    }


def test_other_styles_keep_grpc_gateway_statuses():
    overloaded = _error(code_pb2.RESOURCE_EXHAUSTED, "QUEUE_FULL")
    assert overloaded.status_for(ErrorStyle.OPENAI) == 429
    assert overloaded.status_for(ErrorStyle.GOOGLE_RPC_STATUS) == 429


def test_a_failed_anthropic_stream_ends_with_an_error_event():
    error = gateway_error(code_pb2.INTERNAL, "engine failed")
    event = framing.typed_error_event(ErrorStyle.ANTHROPIC, error.stream_event(ErrorStyle.ANTHROPIC), None)
    assert framing.error_frame(Framing.SSE_EVENTS, event) == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"engine failed"}}\n\n'
    )


def test_messages_routes_and_paths_below_them_answer_in_anthropic_style():
    router = Router(ROUTES)
    for path in ("/v1/messages", "/v1/messages:stream", "/v1/messages/count_tokens"):
        assert router.resolve("POST", path).route.error_style is ErrorStyle.ANTHROPIC
    with pytest.raises(RoutingError) as unknown:
        router.resolve("POST", "/v1/messages/batches")
    assert unknown.value.style is ErrorStyle.ANTHROPIC
    with pytest.raises(RoutingError) as wrong_method:
        router.resolve("GET", "/v1/messages")
    assert wrong_method.value.http_status == 405 and wrong_method.value.style is ErrorStyle.ANTHROPIC
    with pytest.raises(RoutingError) as elsewhere:
        router.resolve("POST", "/v1/nope")  # a tie with OpenAI's routes stays OpenAI's
    assert elsewhere.value.style is ErrorStyle.OPENAI
