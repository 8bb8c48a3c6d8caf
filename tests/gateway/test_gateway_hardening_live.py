"""Issue 21, items 2, 4, 6 and 7, against the live gateway in front of the real server.

Each test sends the issue's own input: deeply nested JSON, free-form fields nested past
what protobuf decodes, an overflowing ``x-request-timeout``, OpenAI fields the server
cannot honour (through the official ``openai`` client), unknown ``/v1`` paths and
oversized lists. Every answer must be a 4xx in the route's error style naming the
problem, with no traceback in the server's log.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_params

from protoserve.openai.v1 import openai_pb2 as oa

CHAT = [{"role": "user", "content": "Say hi."}]
# The chat routes' declared no-op fields (GatewayRule.ignored_fields in openai.proto).
CHAT_NO_OPS = {"metadata", "store", "safety_identifier", "prompt_cache_key"}


@pytest.fixture(scope="module")
def base_url(live_server) -> str:
    assert live_server.http_port, "the server started no REST gateway"
    return f"http://127.0.0.1:{live_server.http_port}"


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def nested(depth: int, leaf: object = "a") -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def openai_error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# ------------------------------------------------------------------ item 2: deep nesting


@pytest.mark.parametrize("depth", [900, 1000, 100_000])
def test_deeply_nested_json_is_400_in_each_route_style(http, clean_log, depth):
    body = b'{"x": ' + b"[" * depth + b"]" * depth + b"}"
    json_type = {"content-type": "application/json"}  # an untyped body is 415 (gateway/runtime/media_type.py)
    error = openai_error(http.post("/v1/completions", content=body, headers=json_type))
    assert error["type"] == "invalid_request_error" and "nests deeper than" in error["message"]
    native = http.post("/v1/generate", content=body, headers=json_type)
    assert native.status_code == 400 and native.json()["code"] == 3
    assert "nests deeper than" in native.json()["message"]


def test_free_form_fields_nested_past_what_the_server_decodes_are_400_naming_the_field(
    http, model, clean_log
):
    # 49 levels of arrays still decode: the server itself judges the prompt's shape.
    decodable = openai_error(http.post("/v1/completions", json={"model": model, "prompt": nested(49)}))
    assert decodable["param"] == "prompt" and "nested" not in decodable["message"]
    cases = [
        ("/v1/completions", {"model": model, "prompt": nested(50)}, "prompt"),
        ("/v1/completions", {"model": model, "prompt": "hi", "stop": nested(60)}, "stop"),
        ("/v1/completions", {"model": model, "prompt": nested(49), "stream": True}, None),
        (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": nested(50)}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions:stream",
            {"model": model, "messages": [{"role": "user", "content": nested(49)}]},
            "messages[0].content",
        ),
    ]
    for path, body, param in cases:
        error = openai_error(http.post(path, json=body))
        if param is None:  # decodable when streamed too: the wrapper is one level, within the limit
            assert error["param"] == "prompt" and "nested" not in error["message"]
            continue
        assert error["param"] == param, (path, error)
        assert "nested too deeply" in error["message"] and "100 levels" in error["message"]


# ------------------------------------------------------------------ item 4: x-request-timeout


@pytest.mark.parametrize("value", ["9999999999", "86401", "1e308", "nan", "inf", "-1", "0"])
def test_unusable_request_timeouts_are_400_naming_the_header(http, model, value):
    response = http.post(
        "/v1/completions",
        json={"model": model, "prompt": "hi", "max_tokens": 1},
        headers={"x-request-timeout": value},
    )
    error = openai_error(response)
    assert "x-request-timeout" in error["message"] and "at most 86400" in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/rag/search", "/v1/rag/documents"])
@pytest.mark.parametrize("header", ["x-user-id", "authorization"])
def test_a_forwarded_header_grpc_cannot_carry_is_400_naming_it(http, model, clean_log, path, header):
    # A tab passes HTTP but not gRPC metadata: the call failed when sent, a 500 (found by the fuzzer).
    body = {"model": model, "prompt": "hi", "max_tokens": 1} if path == "/v1/completions" else {"query": "x"}
    request = http.build_request("GET" if path == "/v1/rag/documents" else "POST", path,
                                 json=None if path == "/v1/rag/documents" else body, headers={header: "a\tb"})
    response = http.send(request)
    assert response.status_code == 400, response.text
    assert f"header {header} must be printable ASCII" in response.text


def test_the_largest_request_timeout_is_a_working_deadline(http, model):
    response = http.post(
        "/v1/completions",
        json={"model": model, "prompt": "hi", "max_tokens": 1},
        headers={"x-request-timeout": "86400"},
    )
    assert response.status_code == 200 and response.json()["choices"][0]["text"] is not None


# ------------------------------------------------------------------ item 6: fields the server cannot honour


def test_openai_client_typed_options_the_server_cannot_honour_are_bad_requests(client, model, clean_log):
    attempts = {
        "functions": lambda: client.chat.completions.create(
            model=model,
            messages=CHAT,
            max_tokens=2,
            functions=[{"name": "f", "parameters": {"type": "object"}}],
        ),
        "reasoning_effort": lambda: client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=2, reasoning_effort="low"
        ),
        "suffix": lambda: client.completions.create(model=model, prompt="hi", max_tokens=2, suffix="!"),
        "best_of": lambda: client.completions.create(model=model, prompt="hi", max_tokens=2, best_of=2),
    }
    for field, attempt in attempts.items():
        with pytest.raises(openai.BadRequestError) as exc:
            attempt()
        assert exc.value.param == field, (field, exc.value.body)
        assert exc.value.type == "invalid_request_error" and field in exc.value.message


def test_streamed_requests_refuse_them_before_the_stream_starts(client, model):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=2, stream=True, extra_body={"function_call": "auto"}
        )
    assert exc.value.param == "function_call"


def _unsupported(params: type, proto: type, no_ops: set[str]) -> list[str]:
    """The official client's parameters that are neither proto fields nor declared no-ops."""
    names = set(typing.get_type_hints(params)) - set(proto.DESCRIPTOR.fields_by_name) - no_ops
    return sorted(names - {"extra_headers", "extra_query", "extra_body", "timeout"})


def test_every_client_parameter_is_served_declared_a_no_op_or_refused(http, model, clean_log):
    chat = _unsupported(
        chat_params.CompletionCreateParamsNonStreaming, oa.CreateChatCompletionRequest, CHAT_NO_OPS
    )
    completion = _unsupported(
        completion_create_params.CompletionCreateParamsNonStreaming, oa.CreateCompletionRequest, set()
    )
    assert {"functions", "function_call", "audio"} <= set(chat) and {"suffix", "best_of"} <= set(
        completion
    )
    for path, base, names in (
        ("/v1/chat/completions", {"model": model, "messages": CHAT}, chat),
        ("/v1/completions", {"model": model, "prompt": "hi"}, completion),
    ):
        for name in names:
            # Any value: the field is refused for existing, whatever it says.
            error = openai_error(http.post(path, json={**base, "max_tokens": 1, name: {"any": "value"}}))
            assert error["param"] == name, (path, name, error)


def test_declared_no_op_fields_and_nulls_are_accepted(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=2,
        metadata={"team": "a"},
        store=False,
        user="u-1",
        extra_body={"safety_identifier": "s", "prompt_cache_key": "k", "best_of": None},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


# ------------------------------------------------------------------ item 7: /v1 errors and list caps


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/v1/nope"), ("POST", "/v1/images/generations"), ("GET", "/v1/")]
)
def test_unknown_v1_paths_answer_in_openai_style(http, method, path):
    error = openai_error(http.request(method, path), 404)
    assert error["type"] == "not_found_error" and path in error["message"]


def test_unknown_paths_elsewhere_keep_google_rpc_status(http):
    response = http.get("/v9/nothing")  # (/v2 is the Open Inference Protocol's, with KServe's errors)
    assert response.status_code == 404 and response.json()["code"] == 5


def test_wrong_methods_on_openai_paths_are_405_in_openai_style(http, client):
    for method, path in (
        ("DELETE", "/v1/completions"),
        ("GET", "/v1/chat/completions"),
        ("PUT", "/v1/models"),  # (POST is ModelService.LoadModel)
    ):
        response = http.request(method, path)
        assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.images.generate(prompt="a cat")


@pytest.mark.parametrize(
    ("path", "body", "param", "cap"),
    [
        ("/v1/completions", {"prompt": ["hello"] * 5000}, "prompt", "256 prompts"),
        ("/v1/completions", {"prompt": [[1, 2]] * 257}, "prompt", "256 prompts"),
        ("/v1/chat/completions", {"messages": CHAT * 3000}, "messages", "2048 messages"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "4 stop strings"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "logit_bias": {str(i): 1 for i in range(1025)}},
            "logit_bias",
            "1024 entries",
        ),
        ("/v1/completions", {"prompt": "hi", "n": 17}, "n", "[1, 16]"),
    ],
)
def test_oversized_lists_are_400_naming_the_cap(http, model, clean_log, path, body, param, cap):
    error = openai_error(http.post(path, json={"model": model, "max_tokens": 1, **body}))
    assert error["param"] == param and cap in error["message"], error


def test_the_server_still_serves_after_the_bad_requests(client, model):
    reply = client.completions.create(model=model, prompt=["one", "two"], max_tokens=1)
    assert len(reply.choices) == 2
    assert json.loads(reply.model_dump_json())["usage"]["completion_tokens"] == 2
