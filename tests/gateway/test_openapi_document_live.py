"""The /openapi.json ``protoserve serve`` serves: valid, honest about auth, an example for every input.

Against the shared server with auth on (live_server_auth): the document passes
openapi-spec-validator; every operation the server refuses without a key (401, asked of the
server itself, the WebSocket upgrade included) carries the bearer scheme in ``security`` and
every other one carries none; the operations that say they need an admin key are refused a
plain key (403); and every operation that takes input shows an example of it: its body, each
path parameter, and at least one of its query parameters. The Open Inference Protocol's /v2
routes are there with KServe's schemas, which their documented examples' answers match.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate
from referencing import Registry
from referencing.jsonschema import DRAFT202012
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from protoserve.gateway.generator.openapi import API_KEY_SCHEME, USER_ID_SCHEME
from protoserve.gateway.runtime.route import BodyCodec
from protoserve.generated.routes import ROUTES

WEBSOCKET_PATH = "/v1/ws/completions"
ADMIN_NOTE = "Needs an admin key"


@pytest.fixture(scope="module")
def api(live_server_auth) -> str:
    return f"http://127.0.0.1:{live_server_auth.http_port}"


@pytest.fixture(scope="module")
def document(api: str) -> dict[str, Any]:
    return httpx.get(f"{api}/openapi.json", timeout=30).raise_for_status().json()


def operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, verbs in document["paths"].items():
        for verb, operation in verbs.items():
            yield path, verb, operation


def test_the_document_is_valid_openapi(document):
    validate(document)
    assert document["openapi"].startswith("3.1")


def test_the_security_schemes(document):
    schemes = document["components"]["securitySchemes"]
    bearer, user_id = schemes[API_KEY_SCHEME], schemes[USER_ID_SCHEME]
    assert (bearer["type"], bearer["scheme"]) == ("http", "bearer")
    assert (user_id["type"], user_id["in"], user_id["name"]) == ("apiKey", "header", "x-user-id")


def _url(api: str, path: str, operation: dict[str, Any]) -> str:
    for parameter in operation.get("parameters", []):
        if parameter["in"] == "path":
            value = quote(str(parameter.get("example", "x")), safe="")
            path = path.replace("{" + parameter["name"] + "}", value)
    return api + path


def _status(api: str, path: str, verb: str, operation: dict[str, Any], headers: dict[str, str]) -> int:
    """The status the server answers the operation's example request with these headers."""
    if path == WEBSOCKET_PATH:
        try:
            with connect(_url(api, path, operation).replace("http://", "ws://"), additional_headers=headers):
                return 101
        except InvalidStatus as refused:
            return refused.response.status_code
    body = None
    if "requestBody" in operation:
        examples = operation["requestBody"]["content"]["application/json"].get("examples", {})
        body = json.dumps(next(iter(examples.values()))["value"] if examples else {})
        headers = {**headers, "content-type": "application/json"}
    # Read only the status: a streaming operation that was let in would go on.
    with httpx.stream(
        verb.upper(), _url(api, path, operation), content=body, headers=headers, timeout=60
    ) as reply:
        return reply.status_code


def test_every_operation_that_needs_a_key_says_so(api, document):
    checked = 0
    for path, verb, operation in operations(document):
        needs_key = _status(api, path, verb, operation, {}) == 401
        security = operation.get("security")
        where = f"{verb.upper()} {path}"
        assert security is not None, f"{where} does not say whether it needs a key"
        if needs_key:
            assert security and all(API_KEY_SCHEME in requirement for requirement in security), (
                where,
                security,
            )
            assert {API_KEY_SCHEME: [], USER_ID_SCHEME: []} in security, f"{where}: x-user-id is not offered"
        else:
            assert security == [], f"{where} answers without a key, but its security is {security}"
        checked += needs_key
    # Not a vacuous pass: nearly everything needs a key, and /health and the Open Inference probes do not.
    probes = ["/v2/health/live", "/v2/health/ready", "/v2/models/{name}/ready", "/v2/models/{name}/versions/{version}/ready"]
    assert checked == len(list(operations(document))) - 1 - len(probes)
    for path in ("/health", *probes):
        assert document["paths"][path]["get"]["security"] == [], path


def test_operations_that_need_an_admin_key_refuse_a_plain_one(api, document, live_server_auth):
    key = {"authorization": f"Bearer {live_server_auth.api_keys[0]}"}
    admin = [(p, v, o) for p, v, o in operations(document) if ADMIN_NOTE in o.get("description", "")]
    assert {p for p, _, _ in admin} == {"/v1/adapters", "/v1/adapters/{name}", "/v1/models", "/v1/models/{name}"}
    for path, verb, operation in admin:
        assert _status(api, path, verb, operation, key) == 403, f"{verb.upper()} {path}"


def test_every_operation_with_input_has_an_example(document):
    missing = []
    for path, verb, operation in operations(document):
        where = f"{verb.upper()} {path}"
        body = operation.get("requestBody")
        if body is not None:
            examples = body["content"]["application/json"].get("examples")
            if not examples or not all("value" in example for example in examples.values()):
                missing.append(f"{where}: body")
        parameters = operation.get("parameters", [])
        missing += [
            f"{where}: path parameter {p['name']}"
            for p in parameters
            if p["in"] == "path" and "example" not in p
        ]
        query = [p for p in parameters if p["in"] == "query"]
        if query and not any("example" in p for p in query):
            missing.append(f"{where}: query parameters")
    assert not missing, "operations without an example (GatewayRule.example in the proto):\n" + "\n".join(
        missing
    )


def test_routes_that_stream_on_request_have_a_streamed_example(document):
    chat = document["paths"]["/v1/chat/completions"]["post"]
    examples = chat["requestBody"]["content"]["application/json"]["examples"]
    assert examples["stream"]["value"] == {**examples["request"]["value"], "stream": True}
    assert "data: [DONE]" in chat["description"] and "curl -N" in chat["description"]


def test_the_websocket_route_is_described(document):
    upgrade = document["paths"][WEBSOCKET_PATH]["get"]
    assert upgrade["security"] == document["paths"]["/v1/completions"]["post"]["security"]
    assert set(upgrade["responses"]) == {"101", "426", "default"}
    frames = ('"type": "chunk"', '"type": "done"', '"type": "cancel"', '"type": "error"', '"type": "rejected"')
    for frame in (*frames, "docs/api.md"):
        assert frame in upgrade["description"], frame


def _schema_validator(document: dict[str, Any], name: str):
    """A validator of one component schema, its $refs resolved in the document."""
    registry = Registry().with_resource("urn:served", DRAFT202012.create_resource(document))
    schema = {"$ref": f"urn:served#/components/schemas/{name}"}
    return Draft202012Validator(schema, registry=registry)


def test_the_open_inference_routes_are_described_with_kserves_schemas(api, document, live_server_auth):
    table = {(r.path.openapi_path(), r.http_method.lower()) for r in ROUTES if r.codec is not BodyCodec.PROTO_JSON}
    described = {(p, v) for p, v, _ in operations(document) if p.startswith("/v2")}
    assert table and described == table
    infer = document["paths"]["/v2/models/{model_name}/infer"]["post"]
    body = infer["requestBody"]["content"]
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/kserve.InferenceRequest"}
    assert "application/octet-stream" in body
    assert "inference-header-content-length" in {p["name"] for p in infer["parameters"] if p["in"] == "header"}
    # The documented example, sent as documented, answers what the document says it answers.
    key = {"authorization": f"Bearer {live_server_auth.api_keys[0]}"}
    example = body["application/json"]["examples"]["request"]["value"]
    reply = httpx.post(_url(api, "/v2/models/{model_name}/infer", infer), json=example, headers=key, timeout=60)
    assert reply.status_code == 200, reply.text
    _schema_validator(document, "kserve.InferenceResponse").validate(reply.json())
    generate = document["paths"]["/v2/models/{model_name}/generate"]["post"]
    example = generate["requestBody"]["content"]["application/json"]["examples"]["request"]["value"]
    reply = httpx.post(_url(api, "/v2/models/{model_name}/generate", generate), json=example, headers=key, timeout=60)
    assert reply.status_code == 200, reply.text
    _schema_validator(document, "triton.GenerateResponse").validate(reply.json())
    metadata = httpx.get(_url(api, "/v2/models/{name}", document["paths"]["/v2/models/{name}"]["get"]), headers=key)
    _schema_validator(document, "kserve.ModelMetadataResponse").validate(metadata.raise_for_status().json())
    refused = httpx.post(_url(api, "/v2/models/{model_name}/infer", infer), json={"inputs": []}, headers=key)
    assert refused.status_code == 400
    _schema_validator(document, "kserve.Error").validate(refused.json())
