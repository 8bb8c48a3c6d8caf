"""Unit tests of the generic gateway runtime: no server, no sockets."""

from __future__ import annotations

import json

import grpc
import pytest
from gateway_fakes import rich_status
from google.protobuf import duration_pb2, json_format, struct_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2

from protoserve.gateway.runtime import framing
from protoserve.gateway.runtime.binding import bind_request
from protoserve.gateway.runtime.errors import HTTP_STATUS_BY_CODE, HttpError, from_rpc_error, gateway_error
from protoserve.gateway.runtime.json_codec import (
    MAX_JSON_DEPTH,
    InvalidJson,
    json_depth,
    loads,
    message_to_json,
    parse_message,
)
from protoserve.gateway.runtime.path_template import PathTemplate
from protoserve.gateway.runtime.route import ErrorStyle, Framing
from protoserve.gateway.runtime.router import Router, RoutingError
from protoserve.generated.routes import ROUTES
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.v1 import inference_pb2 as pb


def _route(grpc_method_suffix: str):
    return next(r for r in ROUTES if r.grpc_method.endswith(grpc_method_suffix))


# ------------------------------------------------------------------ path templates


@pytest.mark.parametrize(
    ("template", "path", "expected"),
    [
        ("/v1/cancel/{request_id}", "/v1/cancel/abc", {"request_id": "abc"}),
        ("/v1/cancel/{request_id}", "/v1/cancel/a%20b%2Fc", {"request_id": "a b/c"}),
        ("/v1/cancel/{request_id}", "/v1/cancel/a/b", None),
        ("/v1/cancel/{request_id}", "/v1/cancel/", None),
        ("/v1/models/{model}", "/v1/models/org:model", {"model": "org:model"}),
        ("/v1/generate:stream", "/v1/generate:stream", {}),
        ("/v1/generate:stream", "/v1/generate", None),
        ("/v1/generate", "/v1/generate:stream", None),
        ("/v1/{name=models/*}:get", "/v1/models/m1:get", {"name": "models/m1"}),
        ("/v1/{name=files/**}", "/v1/files/a/b/c", {"name": "files/a/b/c"}),
        ("/v1/*/x", "/v1/anything/x", {}),
    ],
)
def test_path_template_matching(template, path, expected):
    assert PathTemplate.parse(template).match(path) == expected


def test_path_template_parts():
    template = PathTemplate.parse("/v1/{book.name=shelves/*/books/*}:read")
    assert template.verb == "read"
    assert [(v.field_path, v.pattern) for v in template.variables] == [
        ("book.name", ("shelves", "*", "books", "*"))
    ]
    assert template.openapi_path() == "/v1/{book.name}:read"
    assert template.literal_prefix == ("v1",)


@pytest.mark.parametrize("bad", ["v1/x", "/v1/{a}/{a}", "/v1/{a", "/v1/{a={b}}", "/v1/x:", "/v1/{1a}"])
def test_path_template_rejects(bad):
    with pytest.raises(ValueError, match="path template"):
        PathTemplate.parse(bad)


# ------------------------------------------------------------------ router


def test_router_picks_route_and_reports_404_405_in_the_likely_style():
    router = Router(ROUTES)
    match = router.resolve("POST", "/v1/cancel/r-1")
    assert match.route.grpc_method.endswith("/Cancel") and match.path_values == {"request_id": "r-1"}
    assert router.resolve("GET", "/v1/models").route.grpc_method.endswith("OpenAIService/ListModels")
    assert router.resolve("GET", "/v1/models/m").route.grpc_method.endswith("/RetrieveModel")

    with pytest.raises(RoutingError) as wrong_method:
        router.resolve("DELETE", "/v1/chat/completions")
    assert wrong_method.value.http_status == 405 and wrong_method.value.headers == {"allow": "POST"}
    assert wrong_method.value.style is ErrorStyle.OPENAI

    with pytest.raises(RoutingError) as unknown:
        router.resolve("GET", "/v1/chat/unknown")
    assert unknown.value.http_status == 404 and unknown.value.style is ErrorStyle.OPENAI
    with pytest.raises(RoutingError) as unknown:
        router.resolve("POST", "/v1/images/generations")  # shared by both styles: OpenAI clients need theirs
    assert unknown.value.style is ErrorStyle.OPENAI
    with pytest.raises(RoutingError) as unknown:
        router.resolve("GET", "/nothing/here")  # shares nothing: google.rpc.Status
    assert unknown.value.style is ErrorStyle.GOOGLE_RPC_STATUS
    with pytest.raises(RoutingError) as unknown:
        router.resolve("GET", "/v1/inference/models/a/b")
    assert unknown.value.style is ErrorStyle.GOOGLE_RPC_STATUS


# ------------------------------------------------------------------ JSON → message


def test_parse_reports_every_bad_field_with_its_path():
    document = {
        "prompt": 5,
        "sampling": {
            "max_tokens": "many",
            "temperature": "hot",
            "stop": "x",
            "logit_bias": {"a": 1},
            "extra": 1,
        },
        "context_policy": "SOMETIMES",
        "priority": 2**40,
        "chat": {"messages": [{"role": 1}]},
    }
    with pytest.raises(InvalidJson) as exc:
        parse_message(document, pb.GenerateRequest, reject_unknown_fields=True)
    fields = [field for field, _ in exc.value.violations]
    assert fields == [
        "prompt",
        "sampling.max_tokens",
        "sampling.temperature",
        "sampling.stop",
        'sampling.logit_bias["a"]',
        "sampling.extra",
        "context_policy",
        "priority",
        "chat",
    ]
    problems = dict(exc.value.violations)
    assert problems["prompt"] == "expected a string, got the number 5"
    assert problems["sampling.stop"] == 'expected an array, got the string "x"'
    assert "expected one of CONTEXT_POLICY_UNSPECIFIED" in problems["context_policy"]
    assert "out of range" in problems["priority"]
    assert "only one of prompt, token_ids, chat may be set" in problems["chat"]


def test_parse_accepts_proto3_json_forms():
    message = parse_message(
        {
            "requestId": "r",  # lowerCamelCase JSON names too
            "sampling": {
                "max_tokens": "7",
                "temperature": 0,
                "seed": "123456789012",
                "top_p": None,
                "n": 2.0,
            },
            "token_ids": {"ids": [1, 2]},
            "context_policy": 2,
            "unknown": {"ignored": True},
        },
        pb.GenerateRequest,
        reject_unknown_fields=False,
    )
    assert message.request_id == "r"
    assert message.sampling.max_tokens == 7 and message.sampling.HasField("temperature")
    assert message.sampling.seed == 123456789012 and not message.sampling.HasField("top_p")
    assert message.sampling.n == 2 and list(message.token_ids.ids) == [1, 2]


def test_parse_free_form_values_and_float_limits():
    request = parse_message(
        {"prompt": ["a", "b"], "stop": None}, oa.CreateCompletionRequest, reject_unknown_fields=False
    )
    assert request.prompt.list_value.values[1].string_value == "b"
    with pytest.raises(InvalidJson) as exc:
        parse_message(
            {"temperature": 1e39, "n": True, "stream": "yes"},
            oa.CreateCompletionRequest,
            reject_unknown_fields=False,
        )
    assert [f for f, _ in exc.value.violations] == ["temperature", "n", "stream"]


def _shape(kind: str, depth: int):
    """``depth`` levels of arrays, objects or both, around a string (or an empty array)."""
    value: object = [] if kind == "empty" else "a"
    for level in range(depth):
        value = {"k": value} if kind == "objects" or (kind == "mixed" and level % 2) else [value]
    return value


@pytest.mark.parametrize("kind", ["arrays", "objects", "mixed", "empty"])
def test_gateway_accepts_exactly_the_nesting_the_server_can_decode(kind):
    # The gateway's depth model against protobuf's own decoder, around its limit, for a Value
    # field of the request and of a message in a list, unary and streamed (one level deeper).
    routes = {r.grpc_method.rsplit("/", 1)[1]: r for r in ROUTES}
    for depth in range(25, 54):
        value = _shape(kind, depth)
        for route, body in (
            (routes["CreateCompletion"], {"prompt": value}),
            (routes["CreateCompletion"], {"prompt": value, "stream": True}),
            (routes["CreateChatCompletion"], {"messages": [{"role": "user", "content": value}]}),
        ):
            try:
                bind_request(route, {}, [], json.dumps(body).encode())
                accepted = True
            except HttpError as exc:
                assert "nested too deeply" in exc.status.message
                accepted = False
            # What the server would get, built by json_format (which has no depth limit).
            streamed = body.get("stream") is True
            message = route.stream.request_type() if streamed else route.request_type()
            json_format.ParseDict({"request": body} if streamed else body, message)
            try:
                type(message).FromString(message.SerializeToString())
                decodable = True
            except DecodeError:
                decodable = False
            assert accepted == decodable, (kind, depth, route.grpc_method, streamed)


def test_json_nesting_is_bounded_before_decoding():
    assert json_depth(b"[" * 300 + b"]" * 300) == 300
    assert json_depth(b'{"a": "' + b"[" * 500 + b'"}') == 1  # brackets in strings do not count
    assert json_depth(b'["\\\\", ' + b"[" * 250 + b"]" * 250 + b"]") == 251  # an escaped backslash ends
    # An unterminated string full of escaped quotes: one linear pass (a pattern that needs the
    # closing quote retries from every quote inside, and this input would take hours).
    assert json_depth(b"[" * 300 + b'"' + b'\\"' * 1_000_000) == 300
    for depth in (MAX_JSON_DEPTH + 1, 5000, 1_000_000):
        with pytest.raises(InvalidJson, match="nests deeper than"):
            loads(b"[" * depth + b"]" * depth)
    assert loads(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH) is not None


def test_loads_rejects_malformed_json():
    with pytest.raises(InvalidJson, match="malformed JSON: Expecting"):
        loads(b'{"prompt": ')
    with pytest.raises(InvalidJson, match="not UTF-8"):
        loads(b'{"prompt": "\xff"}')


# ------------------------------------------------------------------ message → JSON


def test_message_to_json_prints_zero_values_and_nulls_like_grpc_gateway():
    chunk = oa.CreateCompletionStreamResponse(
        id="c", choices=[oa.CompletionChoice(text="", index=0)], created=0
    )
    assert message_to_json(chunk) == {
        "id": "c",
        "object": "",
        "created": 0,
        "model": "",
        "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": None}],
        "usage": None,
        "system_fingerprint": "",
    }
    # Real oneof members that are unset are left out; 64-bit integers stay strings.
    event = pb.GenerateStreamResponse(request_id="r", delta=pb.GenerateDelta(index=0))
    assert message_to_json(event) == {
        "request_id": "r",
        "delta": {"index": 0, "text": "", "token_ids": [], "logprobs": []},
    }
    stats = message_to_json(pb.RequestStats(kv_bytes=2**40))
    assert stats["kv_bytes"] == str(2**40)
    # Well-known types keep their own JSON form.
    logprobs = oa.CompletionLogprobs(
        top_logprobs=[struct_pb2.Struct(fields={"a": struct_pb2.Value(number_value=-1)})]
    )
    assert message_to_json(logprobs)["top_logprobs"] == [{"a": -1.0}]


# ------------------------------------------------------------------ binding


def test_bind_body_star_with_path_variable_and_unknown_fields():
    cancel = _route("/Cancel")
    call = bind_request(cancel, {"request_id": "from-path"}, [], b'{"request_id": "from-body"}')
    assert call.request.request_id == "from-path"
    assert bind_request(cancel, {"request_id": "x"}, [], b"").request.request_id == "x"  # empty body is {}
    with pytest.raises(HttpError) as exc:
        bind_request(cancel, {"request_id": "x"}, [], b'{"force": true}')
    assert exc.value.status.code == code_pb2.INVALID_ARGUMENT
    assert "force: unknown field" in exc.value.status.message


def test_bind_body_field_unwraps_and_switches_to_stream_method():
    stream = _route("/GenerateStream")
    call = bind_request(stream, {}, [], b'{"prompt": "hi", "sampling": {"max_tokens": 3}}')
    assert call.request.request.prompt == "hi" and call.server_streaming
    with pytest.raises(HttpError) as exc:
        bind_request(stream, {}, [], b'{"sampling": {"max_tokens": "x"}}')
    # Paths name fields as the client wrote the body, not as the wrapper message nests them.
    assert exc.value.openai_error()["param"] == "sampling.max_tokens"

    completions = _route("/CreateCompletion")
    unary = bind_request(completions, {}, [], b'{"prompt": "a", "stream": false}')
    assert unary.grpc_method.endswith("/CreateCompletion") and not unary.server_streaming
    streamed = bind_request(
        completions, {}, [], b'{"prompt": "a", "stream": true, "stream_options": {"include_usage": true}}'
    )
    assert streamed.grpc_method.endswith("/CreateCompletionStream") and streamed.server_streaming
    assert streamed.request.request.stream_options.include_usage
    assert streamed.response_type is oa.CreateCompletionStreamResponse


def test_bind_query_parameters():
    route = _route("OpenAIService/RetrieveModel")
    assert bind_request(route, {"model": "m"}, [("model", "ignored")], b"").request.model == "m"
    get_model = _route("InferenceService/GetModel")
    assert bind_request(get_model, {"name": "m"}, [], b"").request.name == "m"
    with pytest.raises(HttpError, match="unknown: unknown query parameter"):
        bind_request(get_model, {"name": "m"}, [("unknown", "1")], b"")


# ------------------------------------------------------------------ errors


def test_status_mapping_table_matches_grpc_gateway():
    expected = {
        "OK": 200, "CANCELLED": 499, "UNKNOWN": 500, "INVALID_ARGUMENT": 400, "DEADLINE_EXCEEDED": 504,
        "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "PERMISSION_DENIED": 403, "UNAUTHENTICATED": 401,
        "RESOURCE_EXHAUSTED": 429, "FAILED_PRECONDITION": 400, "ABORTED": 409, "OUT_OF_RANGE": 400,
        "UNIMPLEMENTED": 501, "INTERNAL": 500, "UNAVAILABLE": 503, "DATA_LOSS": 500,
    }  # fmt: skip
    assert {code_pb2.Code.Name(code): status for code, status in HTTP_STATUS_BY_CODE.items()} == expected


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, trailers=()):
        self._code, self._details, self._trailers = code, details, trailers

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers


def test_rich_status_to_both_error_styles_with_retry_after():
    status = rich_status(
        code_pb2.RESOURCE_EXHAUSTED,
        "queue full",
        error_details_pb2.ErrorInfo(reason="QUEUE_FULL", domain="protoserve"),
        error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1, nanos=200_000_000)),
    )
    error = from_rpc_error(
        _FakeRpcError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "queue full",
            [("grpc-status-details-bin", status.SerializeToString())],
        )
    )
    assert error.http_status == 429 and error.headers == {"retry-after": "2"}
    assert error.body(ErrorStyle.OPENAI) == {
        "error": {"message": "queue full", "type": "rate_limit_error", "param": None, "code": "queue_full"}
    }
    body = error.body(ErrorStyle.GOOGLE_RPC_STATUS)
    assert body["code"] == 8 and body["details"][1] == {
        "@type": "type.googleapis.com/google.rpc.RetryInfo",
        "retry_delay": "1.200s",
    }
    assert error.stream_event(ErrorStyle.GOOGLE_RPC_STATUS) == {"error": body}


def test_plain_status_and_unknown_detail_types():
    plain = from_rpc_error(_FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connect failed"))
    assert plain.http_status == 503 and plain.body(ErrorStyle.OPENAI)["error"]["type"] == "server_error"
    status = rich_status(code_pb2.INTERNAL, "boom")
    status.details.add(type_url="type.googleapis.com/acme.Secret", value=b"\x01")
    body = HttpError(status).body(ErrorStyle.GOOGLE_RPC_STATUS)
    assert body["details"] == [{"@type": "type.googleapis.com/acme.Secret", "value": "AQ=="}]
    cancelled = gateway_error(code_pb2.CANCELLED, "gone")
    assert cancelled.http_status == 499


# ------------------------------------------------------------------ framing


def test_frames_are_exact_bytes():
    payload = {"text": "line\nbreak", "n": 0}
    assert framing.message_frame(Framing.SSE, payload) == b'data: {"text":"line\\nbreak","n":0}\n\n'
    assert framing.message_frame(Framing.NDJSON, payload) == b'{"result":{"text":"line\\nbreak","n":0}}\n'
    assert framing.end_frame(Framing.SSE) == b"data: [DONE]\n\n"
    assert framing.end_frame(Framing.NDJSON) == b""
    assert (
        framing.error_frame(Framing.SSE, {"error": {"message": "x"}})
        == b'data: {"error":{"message":"x"}}\n\n'
    )
    assert framing.content_type(Framing.NDJSON) == "application/x-ndjson"
