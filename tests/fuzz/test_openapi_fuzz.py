"""Schemathesis over the gateway's own /openapi.json: no input, valid or mangled, gets a 5xx.

Every route the gateway serves is driven with the three phases schemathesis has
for a single call: the schema's examples, coverage (boundary values and, in
negative mode, each constraint broken in turn: wrong types, missing required
fields, out-of-range numbers, extra properties) and fuzzing (Hypothesis-built
bodies, positive and negative), from two tenants in turn. The document is the gateway's own, with what
the protos cannot say about a valid request added (valid_requests.py), so
positive cases reach the engine and negative ones break one rule at a time. Each response must be no 5xx, carry a status
and content type the schema declares, and match the schema's body for it (an
error is an OpenAI error body under /v1 OpenAI routes, a google.rpc.Status
elsewhere). Afterwards the server still answers and its KV pool is free.

``GET /v1/metrics:watch`` never ends by itself, so it is fuzzed in
test_watch_metrics_fuzz below, reading the first event only. Bodies no schema
describes (any JSON, JSON nested 1,200 levels deep, bytes that are not JSON)
go to every POST route in test_any_body_gets_a_client_error. The Open Inference
Protocol's infer route also gets tensors a client gets wrong, as JSON or as the
binary tensor data extension with its length header right, wrong or missing
(test_any_tensor_body_gets_a_client_error); its errors are KServe's ``{"error": "..."}``.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
import schemathesis
from fuzz_support import FUZZ_EXAMPLES, assert_idle_and_healthy, next_tenant
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from open_inference_strategies import rest_infer_bodies
from proto_strategies import json_values
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from valid_requests import tightened

from protoserve.gateway.app import served_openapi

WATCH_PATH = "/v1/metrics:watch"
REQUEST_TIMEOUT_S = 60.0
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def fuzz_config() -> SchemathesisConfig:
    return SchemathesisConfig.from_dict(
        {
            "generation": {
                "mode": "all",  # schema-valid inputs and inputs that break it
                "max-examples": FUZZ_EXAMPLES,
                "deterministic": True,  # the same inputs every run: a failure reproduces
            },
            "phases": {
                "examples": {"enabled": True},
                "coverage": {"enabled": True},
                "fuzzing": {"enabled": True},
                "stateful": {"enabled": False},
            },
        }
    )


@pytest.fixture(scope="session")
def gateway_url(fuzz_server) -> str:
    return f"http://127.0.0.1:{fuzz_server.http_port}"


# The document the gateway serves (test_the_gateway_serves_the_fuzzed_document), tightened to say
# what a valid request is (tests/fuzz/valid_requests.py), read when the module loads: schemathesis
# names each operation's test from it. Requests name the default model ("").
SCHEMA = schemathesis.openapi.from_dict(
    tightened(served_openapi(), model=""), config=fuzz_config()
).exclude(path=WATCH_PATH)


def test_the_gateway_serves_the_fuzzed_document(gateway_url: str) -> None:
    served = httpx.get(f"{gateway_url}/openapi.json", timeout=30).raise_for_status().json()
    assert served == served_openapi()


@SCHEMA.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_server_error(case, gateway_url: str) -> None:
    response = case.call(base_url=gateway_url, timeout=REQUEST_TIMEOUT_S, headers=dict(next_tenant()))
    case.validate_response(response, checks=CHECKS)


@given(interval_ms=st.one_of(st.integers(-(2**31), 2**31 - 1), st.text(max_size=12)))
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_watch_metrics_fuzz(gateway_url: str, interval_ms: int | str) -> None:
    """The first event of the watch stream, or a 4xx for an interval it does not take."""
    with httpx.stream(
        "GET", f"{gateway_url}{WATCH_PATH}", params={"interval_ms": interval_ms}, timeout=REQUEST_TIMEOUT_S
    ) as response:
        assert response.status_code < 500, response.read()
        if response.status_code == 200:
            assert response.headers["content-type"].startswith("text/event-stream")
            first = next(line for line in response.iter_lines() if line.strip())
            assert first.startswith("data: {\"snapshot\""), first
        else:
            body = response.read()
            assert response.status_code >= 400 and b'"message"' in body, body


POST_PATHS = sorted(
    path for path, operations in served_openapi()["paths"].items() if "post" in operations
)


def filled(path: str, model: str) -> str:
    """A route's path with its variables filled: the served model, its version, a request id."""
    for variable, value in (("{request_id}", "fuzz"), ("{model_name}", model), ("{model_version}", "1")):
        path = path.replace(variable, quote(value, safe=""))
    return path


@pytest.fixture(scope="session")
def served_model(gateway_url: str) -> str:
    return httpx.get(f"{gateway_url}/v1/models", timeout=30).raise_for_status().json()["data"][0]["id"]


def assert_error_body(response: httpx.Response) -> None:
    """An error in its API's shape: OpenAI's or Anthropic's object, a google.rpc.Status, KServe's string."""
    error = response.json()
    assert isinstance(error.get("error"), dict | str) or "message" in error, error


def any_body() -> st.SearchStrategy[bytes]:
    """Any JSON (nested up to 1,200 levels deep included), and bytes that are not JSON or not UTF-8."""
    as_json = json_values().map(lambda value: json.dumps(value).encode())
    return st.one_of(as_json, st.binary(max_size=64), st.text(max_size=64).map(str.encode))


@pytest.mark.parametrize("path", POST_PATHS)
def test_any_body_gets_a_client_error(gateway_url: str, served_model: str, path: str) -> None:
    """A 4xx with an error body (or, when the body happens to be a valid request, a 200)."""

    @given(body=any_body())
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def check(body: bytes) -> None:
        url = f"{gateway_url}{filled(path, served_model)}"
        headers = {"content-type": "application/json", **dict(next_tenant())}
        response = httpx.post(url, content=body, headers=headers, timeout=REQUEST_TIMEOUT_S)
        assert response.status_code < 500, (response.status_code, response.text[:500])
        if response.status_code >= 400:
            assert_error_body(response)

    check()


def test_any_tensor_body_gets_a_client_error(gateway_url: str, served_model: str) -> None:
    """KServe infer bodies, JSON or binary: a 200 whose JSON part says where its binary part starts,
    or a 4xx with KServe's error body."""
    url = f"{gateway_url}{filled('/v2/models/{model_name}/infer', served_model)}"

    @given(request=rest_infer_bodies())
    @settings(max_examples=4 * FUZZ_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def check(request: tuple[bytes, dict[str, str]]) -> None:
        body, headers = request
        response = httpx.post(url, content=body, headers={**headers, **dict(next_tenant())}, timeout=REQUEST_TIMEOUT_S)
        assert response.status_code < 500, (response.status_code, response.text[:500])
        if response.status_code >= 400:
            assert isinstance(response.json()["error"], str), response.text
            return
        length = response.headers.get("inference-header-content-length")
        document = json.loads(response.content[: int(length)] if length else response.content)
        assert document["model_name"] == served_model and document["outputs"], document

    check()


# Routes with a path variable, and a path no route serves (an OpenAI-looking one under /v1).
PATH_VARIABLE_ROUTES = [
    ("GET", "/v1/models/{}", "openai"),
    ("GET", "/v1/inference/models/{}", "status"),
    ("POST", "/v1/cancel/{}", "status"),
    ("GET", "/v1/chat/{}", "openai"),
    ("GET", "/v2/models/{}", "kserve"),
    ("POST", "/v2/models/{}/infer", "kserve"),
    ("POST", "/v2/models/{}/generate", "kserve"),
]


@pytest.mark.parametrize(("method", "template", "style"), PATH_VARIABLE_ROUTES)
def test_any_path_value_gets_a_json_error(gateway_url: str, method: str, template: str, style: str) -> None:
    """Whatever a path variable holds, the answer is the route's JSON (an error in its API's shape)."""

    @given(value=st.text(min_size=1, max_size=40))
    @example(value="ab\ncd")
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def check(value: str) -> None:
        url = f"{gateway_url}{template.format(quote(value, safe=''))}"
        response = httpx.request(method, url, json={} if method == "POST" else None, timeout=REQUEST_TIMEOUT_S)
        assert response.status_code < 500, (response.status_code, response.text[:500])
        assert response.headers["content-type"].startswith("application/json"), (url, response.text[:200])
        if response.status_code >= 400:
            error = response.json()
            shapes = {"openai": lambda: isinstance(error["error"], dict), "kserve": lambda: isinstance(error["error"], str)}
            assert shapes.get(style, lambda: "message" in error)(), error

    check()


def test_server_is_healthy_and_idle_after_the_http_fuzz(fuzz_server) -> None:
    assert_idle_and_healthy(fuzz_server)
