"""Envoy's TLS variant: rendered with EnvoyTls, Envoy accepts it, and a live https call goes through it.

Envoy terminates the client's TLS with its own certificate and reaches a TLS replica
(``protoserve serve --tls-cert-file``) over TLS, checking the replica's certificate against the CA
for the name ``localhost``; certificates are made in the test (tests/server/tls_certs.py).
"""

from __future__ import annotations

import ssl
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import yaml

from protoserve.gateway.envoy import launcher
from protoserve.gateway.envoy.config import EnvoyTls, Replica, render_config
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc
from tests.server.tls_certs import issue, make_ca

READY_TIMEOUT_S = 180.0
TLS_TYPES = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("envoy-tls")
    ca = make_ca()
    paths = {name: root / name for name in ("ca.crt", "envoy.crt", "envoy.key", "replica.crt", "replica.key")}
    paths["ca.crt"].write_bytes(ca.cert_pem)
    issue(ca, "envoy").write(paths["envoy.crt"], paths["envoy.key"])
    issue(ca, "replica").write(paths["replica.crt"], paths["replica.key"])
    return paths


def _tls(files: dict[str, Path]) -> EnvoyTls:
    return EnvoyTls(str(files["envoy.crt"]), str(files["envoy.key"]), str(files["ca.crt"]), "localhost")


def _transport(node: dict) -> dict:
    return node["transport_socket"]["typed_config"]


def test_the_tls_variant_terminates_tls_and_checks_the_replicas(files, tmp_path):
    config = yaml.safe_load(
        render_config([Replica("10.0.0.1:50051", "10.0.0.1:8000")], 8443, 9901, tmp_path / "d.binpb", tls=_tls(files))
    )
    listener = _transport(config["static_resources"]["listeners"][0]["filter_chains"][0])
    assert listener["@type"] == TLS_TYPES + "DownstreamTlsContext"
    assert listener["common_tls_context"]["tls_certificates"] == [
        {"certificate_chain": {"filename": str(files["envoy.crt"])}, "private_key": {"filename": str(files["envoy.key"])}}
    ]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    for name, alpn in (("protoserve_grpc", "h2"), ("protoserve_http", "http/1.1")):
        upstream = _transport(clusters[name])
        assert upstream["@type"] == TLS_TYPES + "UpstreamTlsContext"
        assert upstream["sni"] == "localhost"
        assert upstream["common_tls_context"]["alpn_protocols"] == [alpn]
        validation = upstream["common_tls_context"]["validation_context"]
        assert validation["trusted_ca"] == {"filename": str(files["ca.crt"])}
        assert validation["match_typed_subject_alt_names"] == [{"san_type": "DNS", "matcher": {"exact": "localhost"}}]


def test_without_tls_nothing_is_encrypted(tmp_path):
    config = yaml.safe_load(render_config("127.0.0.1:50051", 8080, 9901, tmp_path / "d.binpb"))
    assert "transport_socket" not in config["static_resources"]["listeners"][0]["filter_chains"][0]
    assert all("transport_socket" not in c for c in config["static_resources"]["clusters"])


def test_mutual_tls_both_ways_renders_client_certificates(files, tmp_path):
    tls = EnvoyTls(
        str(files["envoy.crt"]), str(files["envoy.key"]), str(files["ca.crt"]), "localhost",
        client_ca_file=str(files["ca.crt"]),
        upstream_cert_file=str(files["envoy.crt"]), upstream_key_file=str(files["envoy.key"]),
    )  # fmt: skip
    config = yaml.safe_load(render_config("127.0.0.1:50051", 8080, 9901, tmp_path / "d.binpb", tls=tls))
    listener = _transport(config["static_resources"]["listeners"][0]["filter_chains"][0])
    assert listener["require_client_certificate"] is True
    assert listener["common_tls_context"]["validation_context"] == {"trusted_ca": {"filename": str(files["ca.crt"])}}
    grpc_cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "protoserve_grpc")
    assert _transport(grpc_cluster)["common_tls_context"]["tls_certificates"][0]["certificate_chain"] == {
        "filename": str(files["envoy.crt"])
    }
    with pytest.raises(ValueError, match="go together"):
        EnvoyTls("c", "k", "ca", "localhost", upstream_cert_file="c")


def test_envoy_accepts_the_tls_variant(files, tmp_path):
    pytest.importorskip("envoy")
    descriptor = tmp_path / "protoserve.binpb"
    descriptor.write_bytes(launcher.descriptor_set_with_error_details(launcher.generated_descriptor_set()))
    replicas = [Replica("127.0.0.1:50051", "127.0.0.1:8000"), Replica("127.0.0.1:50052", "127.0.0.1:8001")]
    launcher.validate_config(render_config(replicas, 8443, 9901, descriptor, tls=_tls(files)))


@pytest.fixture(scope="module")
def tls_replica(spawn_server, files):
    server = spawn_server(
        "--tls-cert-file", str(files["replica.crt"]), "--tls-key-file", str(files["replica.key"]),
        "--no-embedding-model", wait_ready=False,
    )  # fmt: skip
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not any(line.startswith("protoserve ready") for line in server.stdout_lines):
        assert server.process.poll() is None and time.monotonic() < deadline, server.log()
        time.sleep(0.2)
    return server


def test_an_https_call_goes_through_envoy_to_a_tls_replica(tls_replica, files):
    pytest.importorskip("envoy")
    grpc_port = tls_replica.grpc_target.rpartition(":")[2]
    replica = Replica(f"127.0.0.1:{grpc_port}", f"127.0.0.1:{tls_replica.http_port}")
    with launcher.running_envoy([replica], tls=_tls(files)) as envoy:
        envoy.wait_healthy(1)  # Envoy's health checks reach the replica over TLS
        assert envoy.url.startswith("https://")
        client = openai.OpenAI(
            base_url=f"https://localhost:{envoy.http_port}/v1",
            api_key="unused",
            max_retries=0,
            http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(files["ca.crt"])), timeout=60),
        )
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 3
        credentials = grpc.ssl_channel_credentials(files["ca.crt"].read_bytes())
        with grpc.secure_channel(f"localhost:{envoy.http_port}", credentials) as channel:
            tokens = inference_pb2_grpc.InferenceServiceStub(channel).Tokenize(pb.TokenizeRequest(text="Hi"), timeout=10)
        assert tokens.token_ids
        with pytest.raises(httpx.TransportError):  # plaintext to Envoy's TLS listener
            httpx.get(f"http://127.0.0.1:{envoy.http_port}/v1/models", timeout=10)
