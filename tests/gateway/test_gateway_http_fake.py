"""The gateway over real HTTP in front of a scripted fake gRPC backend.

Every status mapping in both error styles, every kind of bad input (and that
the backend never sees it), header forwarding and deadlines, byte-exact SSE,
and cancellation when the client goes away.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import httpx
import pytest
from gateway_fakes import FakeBackend, gateway_thread
from google.rpc import code_pb2

REPO = Path(__file__).resolve().parents[2]
ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"
STATUS_BY_CODE = {
    "CANCELLED": 499,
    "UNKNOWN": 500,
    "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "PERMISSION_DENIED": 403,
    "UNAUTHENTICATED": 401,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400,
    "ABORTED": 409,
    "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DATA_LOSS": 500,
}
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    499: "cancelled_error",
}


@pytest.fixture(scope="module")
def http(fake_gateway: str):
    with httpx.Client(base_url=fake_gateway, timeout=10) as client:
        yield client


def _calls(backend: FakeBackend) -> int:
    return len(backend.log.calls)


# ------------------------------------------------------------------ status mapping


@pytest.mark.parametrize(("code", "http_status"), STATUS_BY_CODE.items())
def test_native_route_maps_status_and_keeps_rich_details(http, code, http_status):
    response = http.post("/v1/generate", json={"prompt": f"error:{code}"})
    assert response.status_code == http_status
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["code"] == code_pb2.Code.Value(code) and body["message"] == f"scripted {code}"
    assert body["details"][0] == {
        "@type": "type.googleapis.com/google.rpc.ErrorInfo",
        "reason": f"TEST_{code}",
        "domain": "protoserve",
    }
    if code == "RESOURCE_EXHAUSTED":
        assert response.headers["retry-after"] == "3"  # 2.5 s rounded up
        assert body["details"][1] == {
            "@type": "type.googleapis.com/google.rpc.RetryInfo",
            "retry_delay": "2.500s",
        }
    else:
        assert "retry-after" not in response.headers


@pytest.mark.parametrize(("code", "http_status"), STATUS_BY_CODE.items())
def test_openai_route_maps_status_to_openai_error(http, code, http_status):
    response = http.post("/v1/chat/completions", json={"model": f"error:{code}", "messages": []})
    assert response.status_code == http_status
    error = response.json()["error"]
    assert error["type"] == OPENAI_TYPES.get(http_status, "server_error")
    assert error["message"] == f"scripted {code}"
    assert error["code"] == f"test_{code.lower()}"
    assert error["param"] == ("temperature" if code == "INVALID_ARGUMENT" else None)
    if code == "RESOURCE_EXHAUSTED":
        assert response.headers["retry-after"] == "3"


def test_streaming_request_rejected_before_the_first_message_gets_a_real_status(http):
    response = http.post("/v1/completions", json={"model": "missing", "prompt": "x", "stream": True})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "model 'missing' is not loaded",
            "type": "not_found_error",
            "param": None,
            "code": "model_not_found",
        }
    }
    native = http.post("/v1/generate:stream", json={"prompt": "error:RESOURCE_EXHAUSTED"})
    assert native.status_code == 429 and native.headers["retry-after"] == "3"


def test_backend_unreachable_is_503():
    with gateway_thread("127.0.0.1:1") as url:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_error"


# ------------------------------------------------------------------ bad input never reaches the server


@pytest.mark.parametrize(
    ("path", "content", "fragment", "param"),
    [
        ("/v1/generate", b'{"prompt": "x",', "malformed JSON: Expecting", None),
        ("/v1/generate", b"[1, 2]", "expected an object, got an array", None),
        (
            "/v1/generate",
            b'{"prompt": "x", "sampling": {"n": "two"}}',
            "sampling.n: expected an integer",
            "sampling.n",
        ),
        ("/v1/generate", b'{"prompt": "x", "colour": "red"}', "colour: unknown field", "colour"),
        ("/v1/generate", b'{"prompt": "\xff"}', "not UTF-8", None),
        (
            "/v1/tokenize",
            b'{"text": "a", "chat": {"messages": []}}',
            "only one of text, chat may be set",
            "chat",
        ),
        (
            "/v1/completions",
            b'{"prompt": "x", "max_tokens": "lots"}',
            "max_tokens: expected an integer",
            "max_tokens",
        ),
        ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', "stream: expected true or false", "stream"),
        (
            "/v1/chat/completions",
            b'{"messages": {"role": "user"}}',
            "messages: expected an array",
            "messages",
        ),
        ("/v1/chat/completions", b"nope", "malformed JSON", None),
    ],
)
def test_bad_bodies_are_400_in_the_route_style(http, fake_backend, path, content, fragment, param):
    before = _calls(fake_backend)
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    body = response.json()
    if path.startswith("/v1/c"):  # OpenAI routes
        assert fragment in body["error"]["message"]
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    else:
        assert body["code"] == 3 and fragment in body["message"]
        details = {detail["@type"].rsplit(".", 1)[1]: detail for detail in body["details"]}
        assert details["ErrorInfo"] == {"@type": ERROR_INFO, "reason": "INVALID_PARAMETER", "domain": "protoserve"}
        violations = details["BadRequest"]["field_violations"] if "BadRequest" in details else []
        assert (violations[0]["field"] or None) == param if violations else param is None
    assert _calls(fake_backend) == before


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/completions", "best_of"),
        ("/v1/completions", "suffix"),
        ("/v1/completions:stream", "guided_json"),
        ("/v1/chat/completions", "audio"),
        ("/v1/chat/completions", "functions"),
        ("/v1/chat/completions", "function_call"),
        ("/v1/chat/completions:stream", "reasoning_effort"),
    ],
)
def test_fields_the_server_cannot_honour_are_refused_on_openai_routes(http, fake_backend, path, field):
    before = _calls(fake_backend)
    body = {"model": "m", "prompt": "hi"} if "/chat/" not in path else {"model": "m", "messages": []}
    response = http.post(
        path, json={**body, field: {"type": "json_object"}, "stream": path.endswith("completions")}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert f"{field}: unknown field" in error["message"] and "cannot be honoured" in error["message"]
    assert _calls(fake_backend) == before


def test_openai_routes_accept_null_and_the_declared_no_op_fields(http, fake_backend):
    no_ops = {"metadata": {"k": "v"}, "store": True, "safety_identifier": "u1", "prompt_cache_key": "p"}
    response = http.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "best_of": None, **no_ops},
    )
    assert response.status_code == 200
    _, request, _, _ = fake_backend.log.last("CreateChatCompletion")
    assert request.messages[0].content.string_value == "hi"
    # The no-op list is the chat API's: completions has no `store`.
    refused = http.post("/v1/completions", json={"model": "m", "prompt": "hi", "store": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"


def test_oversized_bodies_are_413_with_or_without_content_length(http, fake_backend):
    before = _calls(fake_backend)
    big = json.dumps({"prompt": "x" * 70_000}).encode()
    declared = http.post("/v1/generate", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413
    assert "exceeds the limit of 65536 bytes" in declared.json()["message"]

    def chunks():
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    chunked = http.post("/v1/completions", content=chunks())
    assert chunked.status_code == 413
    assert chunked.json()["error"]["type"] == "invalid_request_error"
    assert _calls(fake_backend) == before


def test_unknown_routes_and_wrong_methods(http):
    missing = http.get("/v9/nothing")
    assert missing.status_code == 404 and missing.json() == {
        "code": 5,
        "message": "no route for GET /v9/nothing",
        "details": [{"@type": ERROR_INFO, "reason": "ROUTE_NOT_FOUND", "domain": "protoserve"}],
    }
    # Under /v2 live the Open Inference Protocol's routes: a KServe client reads {"error": ...}.
    assert http.get("/v2/nothing").json() == {"error": "no route for GET /v2/nothing"}
    openai_missing = http.post("/v1/chat/nothing", json={})
    assert openai_missing.status_code == 404
    assert openai_missing.json()["error"]["type"] == "not_found_error"
    assert openai_missing.json()["error"]["code"] == "route_not_found"
    wrong = http.get("/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["message"] == "method GET is not allowed on /v1/chat/completions; use POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    native_wrong = http.delete("/v1/generate")
    assert native_wrong.status_code == 405 and native_wrong.json()["code"] == 12
    assert native_wrong.json()["details"][0]["reason"] == "METHOD_NOT_ALLOWED"


def test_query_parameters_are_validated_before_the_call(http):
    bad = http.get("/v1/metrics:watch", params={"interval_ms": "often"})
    assert bad.status_code == 400
    assert bad.json()["details"][1]["field_violations"][0]["field"] == "interval_ms"
    # Well-formed: it reaches the backend, which has no MetricsService.
    assert http.get("/v1/metrics:watch", params={"interval_ms": "500"}).status_code == 501


# ------------------------------------------------------------------ successful calls


def test_unary_json_shapes(http, fake_backend):
    response = http.post("/v1/generate", json={"prompt": "hello", "sampling": {"seed": 7}})
    assert response.status_code == 200
    body = response.json()
    assert body["choices"][0] == {
        "index": 0,
        "text": "olleh",
        "token_ids": [1, 2],
        "logprobs": [],
        "finish_reason": "FINISH_REASON_STOP",
        "stop_reason": "",
    }
    assert body["stats"]["kv_bytes"] == "12345678901"  # proto3 JSON: 64-bit ints are strings
    assert fake_backend.log.last("Generate")[1].sampling.seed == 7


def test_path_variables_response_body_and_get_routes(http, fake_backend):
    assert http.post("/v1/cancel/running").json() == {"cancelled": True}
    assert http.post("/v1/cancel/other%2Fid", json={}).json() == {"cancelled": False}
    assert fake_backend.log.last("Cancel")[1].request_id == "other/id"
    assert http.get("/v1/models/fake").json() == {
        "id": "fake",
        "object": "model",
        "created": 1,
        "owned_by": "protoserve",
        "parent": None,  # a base model: vLLM's null (an adapter names its base model here)
        "max_model_len": None,  # the fake backend sets none; a served model always has one
        "kind": "",
    }
    assert http.get("/v1/models/nope").status_code == 404
    assert http.get("/v1/inference/models/fake").json()["model"]["name"] == "fake"
    assert http.get("/health").json() == {"status": "SERVING_STATUS_SERVING", "models": ["fake"]}
    assert http.get("/v1/models").json()["data"][0]["id"] == "fake"


def test_batch_results_carry_per_item_status_json(http):
    body = http.post(
        "/v1/batch", json={"requests": [{"prompt": "a"}, {"prompt": "error:OUT_OF_RANGE"}]}
    ).json()
    assert body["results"][0]["response"]["model"] == "fake"
    assert body["results"][1]["error"]["code"] == 11
    assert body["results"][1]["error"]["details"][0]["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"


def test_forwarded_headers_and_deadline(http, fake_backend):
    headers = {
        "authorization": "Bearer k1",
        "x-user-id": "alice",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "congo=t61rcWkgMzE",
        "cookie": "secret=1",
        "x-request-timeout": "2.5",
    }
    assert http.post("/v1/tokenize", json={"text": "hi"}, headers=headers).status_code == 200
    _, _, metadata, remaining = fake_backend.log.last("Tokenize")
    for name in ("authorization", "x-user-id", "traceparent", "tracestate"):
        assert metadata[name] == headers[name]
    assert "cookie" not in metadata
    assert 1.5 < remaining < 2.6  # grpc-timeout is encoded with rounding
    bad = http.post("/v1/tokenize", json={"text": "hi"}, headers={"x-request-timeout": "soon"})
    assert bad.status_code == 400 and "x-request-timeout" in bad.json()["message"]


def test_deadline_exceeded_is_504(http, fake_backend):
    response = http.post("/v1/generate", json={"prompt": "sleep"}, headers={"x-request-timeout": "0.2"})
    assert response.status_code == 504
    assert response.json()["code"] == 4


# ------------------------------------------------------------------ streams, byte for byte

NATIVE_STREAM = (
    b'data: {"request_id":"s-1","delta":{"index":0,"text":"a","token_ids":[],"logprobs":[]}}\n\n'
    b'data: {"request_id":"s-1","delta":{"index":0,"text":"b","token_ids":[],"logprobs":[]}}\n\n'
    b'data: {"request_id":"s-1","delta":{"index":0,"text":"c","token_ids":[],"logprobs":[]}}\n\n'
    b'data: {"request_id":"s-1","final":{"choices":[{"index":0,"finish_reason":"FINISH_REASON_LENGTH",'
    b'"stop_reason":""}],"usage":{"prompt_tokens":1,"completion_tokens":3,"total_tokens":4,'
    b'"cached_prompt_tokens":0},"stats":null,"model":"fake"}}\n\n'
    b"data: [DONE]\n\n"
)
COMPLETION_CHUNK = b'"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m"'
COMPLETION_STREAM = (
    b"data: {"
    + COMPLETION_CHUNK
    + b',"choices":[{"text":"Hel","index":0,"logprobs":null,"finish_reason":null}],'
    b'"usage":null,"system_fingerprint":""}\n\n'
    b"data: {"
    + COMPLETION_CHUNK
    + b',"choices":[{"text":"lo","index":0,"logprobs":null,"finish_reason":"length"}],'
    b'"usage":null,"system_fingerprint":""}\n\n'
    b"data: {" + COMPLETION_CHUNK + b',"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,'
    b'"total_tokens":3,"prompt_tokens_details":null},"system_fingerprint":""}\n\n'
    b"data: [DONE]\n\n"
)


def test_native_stream_bytes(http):
    response = http.post("/v1/generate:stream", json={"prompt": "hi"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["cache-control"] == "no-cache"
    assert response.content == NATIVE_STREAM


def test_openai_stream_bytes_via_stream_true(http, fake_backend):
    body = {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.content == COMPLETION_STREAM
    assert fake_backend.log.last("CreateCompletionStream")[1].request.stream_options.include_usage
    # The explicit streaming route serves the same bytes.
    assert http.post("/v1/completions:stream", json=body).content == COMPLETION_STREAM


def test_error_after_the_stream_started_is_a_final_error_event(http, caplog):
    with caplog.at_level(logging.WARNING, logger="protoserve.gateway.runtime.handler"):
        native = http.post("/v1/generate:stream", json={"prompt": "mid-error"})
        openai = http.post("/v1/completions", json={"model": "mid-error", "prompt": "x", "stream": True})
    assert native.status_code == 200
    assert native.content.endswith(
        b'\n\ndata: {"error":{"code":13,"message":"engine failed mid-stream","details":[]}}\n\n'
    )
    assert native.content.count(b"data: ") == 3
    assert openai.status_code == 200
    assert openai.content.endswith(
        b'data: {"error":{"message":"engine stopped","type":"server_error","param":null,"code":null}}\n\n'
    )
    assert b"[DONE]" not in openai.content
    assert "stream failed after it started: UNAVAILABLE engine stopped" in caplog.text


def _wait(event, seconds: float = 3.0) -> bool:
    return event.wait(seconds)


def test_client_disconnect_mid_stream_cancels_the_call(fake_gateway, fake_backend):
    fake_backend.log.cancelled.clear()
    with httpx.Client(base_url=fake_gateway, timeout=10) as client:
        with client.stream("POST", "/v1/generate:stream", json={"prompt": "slow"}) as response:
            first = next(response.iter_raw())
            assert first.startswith(b"data: ")
            left_at = time.monotonic()
    # The scripted stream runs 10 s when nobody leaves; ending within half of that shows the
    # disconnect, not the stream's own end, stopped it (generous bounds: this machine is shared).
    assert _wait(fake_backend.log.cancelled, 8.0), "the backend call was not cancelled"
    assert fake_backend.log.stream_cancel_times[-1] - left_at < 5.0


def test_client_disconnect_during_unary_cancels_the_call(fake_gateway, fake_backend):
    fake_backend.log.cancelled.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fake_gateway}/v1/generate", json={"prompt": "sleep"}, timeout=0.3)
    assert _wait(fake_backend.log.cancelled), "the backend call was not cancelled"


# ------------------------------------------------------------------ OpenAPI and docs


def test_openapi_and_docs(http):
    served = http.get("/openapi.json")
    assert served.status_code == 200 and served.headers["content-type"] == "application/json"
    generated = json.loads(
        (REPO / "gen" / "python" / "protoserve" / "generated" / "openapi.json").read_text()
    )
    document = served.json()
    # The generated document, with the WebSocket route the gateway serves itself and the Open Inference
    # routes (not proto JSON: KServe's schemas, gateway/open_inference/openapi.py).
    assert {path: document["paths"][path] for path in generated["paths"]} == generated["paths"]
    added = set(document["paths"]) - set(generated["paths"])
    assert "/v1/ws/completions" in added and "/v2" in added
    assert added - {"/v1/ws/completions"} == {p for p in added if p.startswith("/v2")}
    assert document["components"]["securitySchemes"] == generated["components"]["securitySchemes"]
    schemas = document["components"]["schemas"]
    assert {k: schemas[k] for k in generated["components"]["schemas"]} == generated["components"]["schemas"]
    assert {k.split(".")[0] for k in set(schemas) - set(generated["components"]["schemas"])} == {"kserve", "triton"}
    # The reference: every route and the protos' comments, readable without scripts or the internet.
    reference = http.get("/docs/reference")
    assert reference.status_code == 200 and reference.headers["content-type"].startswith("text/html")
    page = reference.text
    for path in (
        "/v1/chat/completions",
        "/v1/cancel/{request_id}",
        "/v1/generate:stream",
        "/health",
        "/v1/ws/completions",
        "/v2/models/{model_name}/infer",
    ):
        assert path in page
    assert "SamplingParams controls how tokens are chosen" in page
    assert "<script" not in page and "https://" not in page and "http://" not in page
    assert 'href="/docs"' in page


def test_the_interactive_docs_load_nothing_from_elsewhere(http):
    """/docs is Swagger UI from files on this server: its page, start script and the assets they name."""
    page = http.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sources and all(source.startswith("/") for source in sources), sources
    assert {
        "/docs/swagger-ui/swagger-ui-bundle.js",
        "/docs/start.js",
        "/docs/reference",
        "/openapi.json",
    } <= set(sources)
    for source in sources:
        assert http.get(source).status_code == 200, source
    start = http.get("/docs/start.js")
    assert start.headers["content-type"].startswith("text/javascript")
    config = json.loads(start.text.removeprefix("window.ui = SwaggerUIBundle(").removesuffix(");\n"))
    assert config["url"] == "/openapi.json" and config["persistAuthorization"] is True
    assert config["validatorUrl"] is None
    assert http.get("/docs/swagger-ui/index.html").status_code == 404  # only the files the page needs


async def test_gateway_bug_is_a_logged_500_in_the_route_style(monkeypatch, caplog):
    from protoserve.gateway.app import create_app
    from protoserve.gateway.runtime import handler

    def broken(*args, **kwargs):
        raise RuntimeError("bug")

    monkeypatch.setattr(handler, "bind_request", broken)
    transport = httpx.ASGITransport(app=create_app("127.0.0.1:1"))
    # A name the gateway answers to (an arbitrary one is refused: gateway.browser_safety).
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        with caplog.at_level(logging.ERROR, logger="protoserve.gateway.runtime.handler"):
            response = await client.post("/v1/chat/completions", json={"messages": []})
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": "internal gateway error",
        "type": "server_error",
        "param": None,
        "code": "internal",
    }
    assert "unexpected gateway error on POST /v1/chat/completions" in caplog.text
