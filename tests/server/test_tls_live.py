"""TLS on a live server: gRPC and the REST gateway on one certificate, mutual TLS, and rotation.

Certificates are made here (tests/server/tls_certs.py): a CA, a server certificate for localhost and
127.0.0.1, client certificates from that CA and from another. Clients are the real ones: a
``grpc.secure_channel``, the official ``openai`` client over https, and plain TLS sockets to read the
certificate a new connection is served. ``make run`` stays plaintext on loopback.
"""

from __future__ import annotations

import signal
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_certs import Issued, issue, make_ca

from protoserve.server import exit_codes
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

READY_TIMEOUT_S = 180.0
MODEL = "SmolLM2-135M-Instruct"
FIRST_SERIAL, ROTATED_SERIAL = 1000, 2000


@dataclass
class Pki:
    """The files a test server and its clients use."""

    root: Path
    ca: Issued
    other_ca: Issued
    client: Issued  # from ca
    stranger: Issued  # a client certificate from other_ca

    @property
    def ca_file(self) -> Path:
        return self.root / "ca.crt"

    def client_files(self, who: Issued) -> tuple[str, str]:
        name = "client" if who is self.client else "stranger"
        return str(self.root / f"{name}.crt"), str(self.root / f"{name}.key")

    def server_files(self, name: str) -> tuple[Path, Path]:
        return self.root / f"{name}.crt", self.root / f"{name}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    root = tmp_path_factory.mktemp("tls")
    ca, other_ca = make_ca(), make_ca("another CA")
    pki = Pki(root, ca, other_ca, issue(ca, "client", client=True), issue(other_ca, "stranger", client=True))
    pki.ca_file.write_bytes(ca.cert_pem)
    (root / "other-ca.crt").write_bytes(other_ca.cert_pem)
    pki.client.write(*map(Path, pki.client_files(pki.client)))
    pki.stranger.write(*map(Path, pki.client_files(pki.stranger)))
    return pki


def _server(spawn_server, pki: Pki, name: str, *extra: str):
    cert, key = pki.server_files(name)
    issue(pki.ca, "server", serial=FIRST_SERIAL).write(cert, key)
    return spawn_server(
        "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--no-embedding-model", *extra, wait_ready=False
    )


def _wait_ready(server) -> None:
    """Until the server prints its ready line (its health port speaks TLS, the fixture's probe does not)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not any(line.startswith("protoserve ready") for line in server.stdout_lines):
        assert server.process.poll() is None, server.log()
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tls_server(spawn_server, pki):
    server = _server(spawn_server, pki, "tls")
    _wait_ready(server)
    return server


@pytest.fixture(scope="module")
def mtls_server(spawn_server, pki):
    # The handshake answers while the model loads: no need to wait for it.
    return _server(spawn_server, pki, "mtls", "--tls-client-ca-file", str(pki.ca_file))


def _grpc_port(server) -> int:
    return int(server.grpc_target.rpartition(":")[2])


def _credentials(pki: Pki, root: Path | None = None, client: Issued | None = None) -> grpc.ChannelCredentials:
    root_pem = (root or pki.ca_file).read_bytes()
    if client is None:
        return grpc.ssl_channel_credentials(root_pem)
    return grpc.ssl_channel_credentials(root_pem, client.key_pem, client.cert_pem)


def _health(target: str, credentials: grpc.ChannelCredentials | None) -> int:
    """grpc.health.v1 Check over a new channel (insecure when ``credentials`` is None)."""
    channel = grpc.insecure_channel(target) if credentials is None else grpc.secure_channel(target, credentials)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _localhost(server) -> str:
    return f"localhost:{_grpc_port(server)}"


def _https(server) -> str:
    return f"https://localhost:{server.http_port}"


def _client_context(pki: Pki, ca_file: Path | None = None, client: Issued | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca_file or pki.ca_file))
    if client is not None:
        context.load_cert_chain(*pki.client_files(client))
    return context


def _served_serial(port: int, alpn: str, context: ssl.SSLContext) -> int:
    """The serial of the certificate a new connection to ``port`` is served."""
    context.set_alpn_protocols([alpn])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with context.wrap_socket(sock, server_hostname="localhost") as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def _openai(server, context: ssl.SSLContext, base_url: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base_url or _https(server) + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(verify=context, timeout=60),
    )


def _no_traceback(server) -> None:
    assert "Traceback" not in server.log_path.read_text(errors="replace"), server.log()


# --- TLS, server certificate only ---


def test_grpc_secure_channel_generates(tls_server, pki):
    with grpc.secure_channel(_localhost(tls_server), _credentials(pki)) as channel:
        reply = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            pb.GenerateRequest(prompt="The capital of France is", sampling=pb.SamplingParams(max_tokens=4, temperature=0)),
            timeout=60,
        )
    assert reply.choices[0].text and reply.usage.completion_tokens == 4


def test_openai_client_over_https(tls_server, pki):
    client = _openai(tls_server, _client_context(pki))
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 4


def test_plaintext_clients_are_refused(tls_server, pki):
    with pytest.raises(grpc.RpcError) as refused:
        _health(tls_server.grpc_target, None)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    plain = _openai(tls_server, _client_context(pki), base_url=f"http://127.0.0.1:{tls_server.http_port}/v1")
    with pytest.raises(openai.APIConnectionError):
        plain.models.list()
    _no_traceback(tls_server)


def test_a_client_trusting_another_ca_is_refused(tls_server, pki):
    with pytest.raises(grpc.RpcError) as refused:
        _health(_localhost(tls_server), _credentials(pki, root=pki.root / "other-ca.crt"))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(openai.APIConnectionError):
        _openai(tls_server, _client_context(pki, pki.root / "other-ca.crt")).models.list()
    _no_traceback(tls_server)


# --- mutual TLS ---


def test_mtls_admits_a_client_certificate_from_the_ca(mtls_server, pki):
    assert _health(_localhost(mtls_server), _credentials(pki, client=pki.client)) in (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,  # still loading the model: the handshake is what counts
    )
    with httpx.Client(verify=_client_context(pki, client=pki.client), timeout=10) as http:
        assert http.get(_https(mtls_server) + "/health").status_code in (200, 503)


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate"])
def test_mtls_refuses_other_clients_at_the_handshake(mtls_server, pki, who):
    client = None if who == "no certificate" else pki.stranger
    with pytest.raises(grpc.RpcError) as refused:
        _health(_localhost(mtls_server), _credentials(pki, client=client))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # Under TLS 1.3 the client's side of the handshake ends before the server has checked its
    # certificate: the refusal (an alert) arrives with the first read.
    with httpx.Client(verify=_client_context(pki, client=client), timeout=10) as http:
        with pytest.raises(httpx.TransportError):
            http.get(_https(mtls_server) + "/health")
    _no_traceback(mtls_server)


# --- rotation ---


def test_rotation_keeps_running_streams_and_serves_new_connections_the_new_certificate(tls_server, pki):
    rotated = ROTATED_SERIAL
    context = _client_context(pki)
    grpc_port, http_port = _grpc_port(tls_server), tls_server.http_port
    before = _served_serial(grpc_port, "h2", context)
    assert before == _served_serial(http_port, "http/1.1", context) != rotated
    request = pb.GenerateRequest(
        prompt="Count: one, two,", sampling=pb.SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    )
    with grpc.secure_channel(_localhost(tls_server), _credentials(pki)) as channel:
        grpc_stream = inference_pb2_grpc.InferenceServiceStub(channel).GenerateStream(
            pb.GenerateStreamRequest(request=request), timeout=120
        )
        sse = _openai(tls_server, context).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to fifty."}], max_tokens=64,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        grpc_events = [next(grpc_stream)]
        sse_chunks = [next(iter(sse))]

        issue(pki.ca, "server", serial=rotated).write(*pki.server_files("tls"))

        assert _served_serial(grpc_port, "h2", context) == rotated
        assert _served_serial(http_port, "http/1.1", context) == rotated
        grpc_events += list(grpc_stream)
        sse_chunks += list(sse)
    tokens = sum(len(e.delta.token_ids) for e in grpc_events if e.HasField("delta"))
    assert grpc_events[-1].HasField("final") and tokens == 64
    assert sse_chunks[-1].usage is None or sse_chunks[-1].usage.completion_tokens == 64
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in sse_chunks)
    # And the old channel's successor, a new one, works on the new certificate.
    assert _health(_localhost(tls_server), _credentials(pki)) == health_pb2.HealthCheckResponse.SERVING
    _no_traceback(tls_server)


def test_sighup_rereads_the_files_and_the_server_keeps_serving(tls_server, pki):
    log = tls_server.log_path
    loaded = log.read_text(errors="replace").count("TLS certificate loaded")
    tls_server.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while log.read_text(errors="replace").count("TLS certificate loaded") == loaded:
        assert time.monotonic() < deadline, tls_server.log()
        time.sleep(0.1)
    assert tls_server.process.poll() is None
    assert _health(_localhost(tls_server), _credentials(pki)) == health_pb2.HealthCheckResponse.SERVING


def test_files_that_do_not_load_keep_the_current_certificate(tls_server, pki):
    context = _client_context(pki)
    serving = _served_serial(_grpc_port(tls_server), "h2", context)
    cert, key = pki.server_files("tls")
    good_key = key.read_bytes()
    key.write_bytes(issue(pki.ca, "server").key_pem)  # a key that is not the certificate's
    try:
        assert _served_serial(_grpc_port(tls_server), "h2", context) == serving
        assert _served_serial(tls_server.http_port, "http/1.1", context) == serving
        assert "TLS files not reloaded" in tls_server.log_path.read_text(errors="replace")
    finally:
        key.write_bytes(good_key)
    _no_traceback(tls_server)


# --- the CLI refuses TLS flags it cannot use, before anything listens ---


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (lambda p: ["--tls-cert-file", str(p.server_files("cli")[0])], "--tls-cert-file needs --tls-key-file"),
        (lambda p: ["--tls-client-ca-file", str(p.ca_file)], "--tls-client-ca-file needs --tls-cert-file"),
        (lambda p: ["--tls-cert-file", str(p.root / "missing.crt"), "--tls-key-file", str(p.root / "client.key")],
         "--tls-cert-file: cannot read"),
        (lambda p: ["--tls-cert-file", str(p.server_files("cli")[0]), "--tls-key-file", str(p.root / "client.key")],
         "do not load together"),
        (lambda p: [*_server_flags(p), "--tls-client-ca-file", str(p.root / "client.key")],
         "--tls-client-ca-file"),
    ],
    ids=["cert without key", "client CA without cert", "missing file", "key of another cert", "CA file without a CA"],
)  # fmt: skip
def test_unusable_tls_flags_are_one_line_usage_errors(pki, flags, needle):
    from test_cli_errors import assert_one_line_error, serve

    cert, key = pki.server_files("cli")
    issue(pki.ca, "server").write(cert, key)
    assert_one_line_error(serve(*flags(pki)), exit_codes.USAGE, needle)


def _server_flags(pki: Pki) -> list[str]:
    cert, key = pki.server_files("cli")
    return ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]


def test_make_run_serves_plaintext_on_loopback():
    from protoserve.server.cli import build_parser

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = makefile.split("\nrun:", 1)[1].split("\n\n", 1)[0]
    [serve] = [line for line in recipe.splitlines() if " serve" in line and "@echo" not in line]
    assert "--tls" not in serve and "--host" not in serve, serve
    args = build_parser().parse_args(serve.split("protoserve ", 1)[1].split())
    assert args.host == "127.0.0.1"
    assert (args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file) == (None, None, None)
