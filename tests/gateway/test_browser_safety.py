"""Host, Origin and content-type checks (gateway/browser_safety.py, gateway/runtime/media_type.py).

The rules themselves on their own; then over HTTP against a gateway in front of the fake
backend (which records every call, so a refused request is seen never to reach gRPC); then
against real ``protoserve serve`` processes: auth off and on, the official ``openai`` client,
``--allowed-host``, and a DNS-rebinding request. Browsers themselves are in
test_browser_live.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import raw_clients
import websockets
from gateway_fakes import gateway_thread
from guarded_server import ALLOWED_DOMAIN, ALLOWED_HOST
from websockets.sync.client import connect as ws_connect

from protoserve.gateway.browser_safety import check_allowed_hosts, name_allowed, same_origin
from protoserve.gateway.runtime.media_type import body_type_error

REPO = Path(__file__).resolve().parents[2]
FOREIGN = "http://evil.example"
APP_ORIGIN = "https://app.example"
REBINDING_HOST = "attacker.example"


# ---- the rules -----------------------------------------------------------------------------------


def test_allowed_host_values_are_names_suffixes_or_any():
    assert check_allowed_hosts(["API.Example.com", ".corp.example.", "*", "my_host"]) == (
        "api.example.com",
        ".corp.example",
        "*",
        "my_host",
    )
    for bad in ["http://a.example", "a.example:8000", "a.example/x", "", ".", "a..b", "-a.example"]:
        with pytest.raises(ValueError, match="is not a host name"):
            check_allowed_hosts([bad])


@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        ("127.0.0.1", True),
        ("10.1.2.3", True),
        ("::1", True),
        ("localhost", True),
        ("app.localhost", True),
        ("server.internal", True),  # the listening address
        ("api.example.com", True),
        ("corp.example", True),  # .corp.example: the domain itself
        ("a.b.corp.example", True),
        ("attacker.example", False),
        ("localhost.attacker.example", False),
        ("evilcorp.example", False),  # a suffix is matched at a dot
        ("api.example.com.attacker.example", False),
    ],
)
def test_names_a_server_answers_to(name, allowed):
    assert name_allowed(name, "server.internal", ("api.example.com", ".corp.example")) is allowed


@pytest.mark.parametrize(
    ("origin", "host", "same"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", True),
        ("http://LOCALHOST:8000", "localhost:8000", True),
        ("https://api.example.com", "api.example.com", True),  # default ports left out
        ("https://api.example.com", "api.example.com:443", True),
        ("http://api.example.com", "api.example.com:80", True),
        ("http://[::1]:8000", "[::1]:8000", True),
        ("http://127.0.0.1:8001", "127.0.0.1:8000", False),  # another port is another origin
        ("https://api.example.com", "api.example.com:80", False),
        ("http://localhost:8000", "127.0.0.1:8000", False),
        ("null", "127.0.0.1:8000", False),
        ("file://", "127.0.0.1:8000", False),
        ("http://a.example:x", "a.example", False),
    ],
)
def test_same_origin_is_the_host_and_port_of_the_request(origin, host, same):
    assert same_origin(origin, host) is same


@pytest.mark.parametrize(
    ("content_type", "size", "ok"),
    [
        ("application/json", 10, True),
        ("application/json; charset=utf-8", 10, True),
        ("Application/JSON;charset=UTF-8", 10, True),
        ("application/merge-patch+json", 10, True),
        (None, 0, True),  # no body, no type: the empty request
        (None, 10, False),  # a Blob without a type, fetch's simple request
        ("text/plain", 10, False),
        ("text/plain", 0, False),
        ("application/x-www-form-urlencoded", 10, False),
        ("multipart/form-data; boundary=x", 10, False),
        ("application/jsonp", 10, False),
        ("application/json; charset=latin-1", 10, False),
    ],
)
def test_a_body_must_be_declared_json(content_type, size, ok):
    error = body_type_error(content_type, size)
    assert (error is None) is ok
    if error is not None:
        assert error.http_status == 415


# ---- in front of the fake backend ---------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded_gateway(fake_backend):
    with gateway_thread(
        fake_backend.target, cors_origins=(APP_ORIGIN,), allowed_hosts=(ALLOWED_HOST,)
    ) as url:
        yield url


def _calls(fake_backend) -> int:
    return len(fake_backend.log.calls)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/metrics", "/v1/models", "/health", "/nowhere"])
def test_a_rebinding_host_is_refused_on_every_route(guarded_gateway, fake_backend, path):
    before = _calls(fake_backend)
    for host in (REBINDING_HOST, f"{REBINDING_HOST}:{_port(guarded_gateway)}", "localhost.attacker.example"):
        reply = httpx.get(guarded_gateway + path, headers={"host": host}, timeout=10)
        assert reply.status_code == 403, (host, reply.text)
        message = reply.json()["error"]["message"] if path.startswith("/v1/") else reply.json()["message"]
        assert "is not a name of this server" in message and "--allowed-host" in message
    assert _calls(fake_backend) == before


def test_a_rebinding_host_is_refused_on_posts_in_the_route_style(guarded_gateway, fake_backend):
    before = _calls(fake_backend)
    headers = {"host": REBINDING_HOST}
    native = httpx.post(guarded_gateway + "/v1/generate", json={"prompt": "abc"}, headers=headers, timeout=10)
    assert native.status_code == 403 and native.json()["code"] == 7  # PERMISSION_DENIED
    chat = httpx.post(
        guarded_gateway + "/v1/chat/completions", json={"messages": []}, headers=headers, timeout=10
    )
    assert chat.status_code == 403 and chat.json()["error"]["type"] == "permission_error"
    assert _calls(fake_backend) == before


@pytest.mark.parametrize(
    "host",
    [
        "localhost:{port}",
        "127.0.0.1:{port}",
        "[::1]:{port}",
        "app.localhost:{port}",
        ALLOWED_HOST,
        ALLOWED_HOST + ":1",
    ],
)
def test_names_of_the_server_are_answered(guarded_gateway, host):
    reply = httpx.get(
        guarded_gateway + "/v1/models", headers={"host": host.format(port=_port(guarded_gateway))}
    )
    assert reply.status_code == 200, reply.text


def test_a_rebinding_host_cannot_upgrade_to_a_websocket(guarded_gateway):
    sock, reply = raw_clients.upgrade(guarded_gateway, {"Host": REBINDING_HOST})
    sock.close()
    assert reply.status == 403 and "is not a name of this server" in reply.json()["error"]["message"]


@pytest.mark.parametrize("origin", [FOREIGN, "null", APP_ORIGIN + ":8443", "http://127.0.0.1:1"])
def test_a_foreign_origin_cannot_post(guarded_gateway, fake_backend, origin):
    before = _calls(fake_backend)
    chat = httpx.post(
        guarded_gateway + "/v1/chat/completions",
        json={"messages": []},
        headers={"origin": origin},
        timeout=10,
    )
    assert chat.status_code == 403
    error = chat.json()["error"]
    assert error["type"] == "permission_error" and "--cors-origin" in error["message"]
    native = httpx.post(
        guarded_gateway + "/v1/generate", json={"prompt": "x"}, headers={"origin": origin}, timeout=10
    )
    assert native.status_code == 403 and native.json()["code"] == 7
    # Whatever the body: a text/plain one (the simple request) is refused before it is looked at.
    plain = httpx.post(
        guarded_gateway + "/v1/generate",
        content=b'{"prompt": "x"}',
        headers={"origin": origin, "content-type": "text/plain"},
        timeout=10,
    )
    assert plain.status_code == 403
    assert "access-control-allow-origin" not in plain.headers
    assert _calls(fake_backend) == before


def test_own_and_allowed_origins_may_post_and_anyone_may_read(guarded_gateway):
    same = httpx.post(
        guarded_gateway + "/v1/generate", json={"prompt": "x"}, headers={"origin": guarded_gateway}
    )
    assert same.status_code == 200, same.text
    port = _port(guarded_gateway)
    by_name = httpx.post(
        guarded_gateway + "/v1/generate",
        json={"prompt": "x"},
        headers={"origin": f"http://localhost:{port}", "host": f"localhost:{port}"},
    )
    assert by_name.status_code == 200, by_name.text
    allowed = httpx.post(
        guarded_gateway + "/v1/generate", json={"prompt": "x"}, headers={"origin": APP_ORIGIN}
    )
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == APP_ORIGIN
    no_origin = httpx.post(guarded_gateway + "/v1/generate", json={"prompt": "x"})
    assert no_origin.status_code == 200
    # A GET changes nothing; whether a foreign page may read the answer is CORS's to say.
    read = httpx.get(guarded_gateway + "/v1/models", headers={"origin": FOREIGN})
    assert read.status_code == 200 and "access-control-allow-origin" not in read.headers


def test_a_foreign_origin_cannot_upgrade_but_the_own_one_can(guarded_gateway):
    url = guarded_gateway.replace("http://", "ws://") + raw_clients.WS_PATH
    with pytest.raises(websockets.InvalidStatus) as refused:
        ws_connect(url, origin=FOREIGN, open_timeout=10)
    assert refused.value.response.status_code == 403
    null_sock, null_reply = raw_clients.upgrade(guarded_gateway, {"Origin": "null"})
    null_sock.close()
    assert null_reply.status == 403 and "--cors-origin" in null_reply.json()["error"]["message"]
    for origin in (guarded_gateway, APP_ORIGIN, None):
        with ws_connect(url, origin=origin, open_timeout=10) as socket:
            socket.send('{"id": "1", "type": "cancel"}')
            assert json.loads(socket.recv(timeout=10))["status"] == 404  # served: nothing runs as "1"


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/v1/generate", "text/plain"),
        ("/v1/generate", None),
        ("/v1/chat/completions", "text/plain;charset=UTF-8"),
        ("/v1/completions", "application/x-www-form-urlencoded"),
        ("/v1/chat/completions", "application/json; charset=iso-8859-1"),
    ],
)
def test_a_body_not_declared_json_is_415(guarded_gateway, fake_backend, path, content_type):
    before = _calls(fake_backend)
    headers = {"content-type": content_type} if content_type else {}
    reply = httpx.post(
        guarded_gateway + path, content=b'{"prompt": "x", "messages": []}', headers=headers, timeout=10
    )
    assert reply.status_code == 415
    if path == "/v1/generate":
        assert reply.json()["code"] == 3
    else:
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and "JSON" in error["message"]
    assert _calls(fake_backend) == before


def test_json_types_and_an_empty_body_are_accepted(guarded_gateway):
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        reply = httpx.post(
            guarded_gateway + "/v1/generate",
            content=b'{"prompt": "x"}',
            headers={"content-type": content_type},
        )
        assert reply.status_code == 200, reply.text
    assert httpx.post(guarded_gateway + "/v1/generate").status_code == 200  # no body: the empty request


# ---- protoserve serve ---------------------------------------------------------------------------


def test_foreign_origin_is_refused_with_auth_off(live_server, clean_log):
    url = f"http://127.0.0.1:{live_server.http_port}"
    body = {"prompt": "Hi", "max_tokens": 2}
    refused = httpx.post(url + "/v1/completions", json=body, headers={"origin": FOREIGN}, timeout=60)
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    assert (
        httpx.post(url + "/v1/completions", json=body, headers={"origin": url}, timeout=60).status_code == 200
    )


def test_foreign_origin_is_refused_with_auth_on(live_server_auth):
    url = f"http://127.0.0.1:{live_server_auth.http_port}"
    headers = {"authorization": f"Bearer {live_server_auth.api_keys[0]}"}
    body = {"prompt": "Hi", "max_tokens": 2}
    refused = httpx.post(
        url + "/v1/completions", json=body, headers={**headers, "origin": FOREIGN}, timeout=60
    )
    assert refused.status_code == 403 and "--cors-origin" in refused.json()["error"]["message"]
    # Without a key the refusal is the same (the gateway answers before the server's auth).
    assert (
        httpx.post(url + "/v1/completions", json=body, headers={"origin": FOREIGN}, timeout=60).status_code
        == 403
    )
    assert httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60).status_code == 200
    own = httpx.post(url + "/v1/completions", json=body, headers={**headers, "origin": url}, timeout=60)
    assert own.status_code == 200


def test_the_openai_client_still_works(live_server):
    with openai.OpenAI(
        base_url=f"http://localhost:{live_server.http_port}/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt="Hi", max_tokens=2)
        assert reply.usage.completion_tokens == 2
        with pytest.raises(openai.PermissionDeniedError, match="--cors-origin"):
            client.completions.create(
                model=model, prompt="Hi", max_tokens=2, extra_headers={"origin": FOREIGN}
            )


def test_serve_allowed_host_flag_and_a_rebinding_request(guarded_server):
    url, port = guarded_server.url, guarded_server.server.http_port
    documents = url + "/v1/rag/documents"
    rebound = httpx.get(documents, headers={"host": f"{REBINDING_HOST}:{port}"}, timeout=30)
    assert rebound.status_code == 403 and "is not a name of this server" in rebound.text
    assert httpx.get(url + "/docs", headers={"host": REBINDING_HOST}, timeout=30).status_code == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"{ALLOWED_HOST}:{port}", "x" + ALLOWED_DOMAIN):
        assert httpx.get(documents, headers={"host": host}, timeout=30).status_code == 200, host


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--allowed-host", "http://a.example"], "is not a host name"),
        (["--allowed-host", "a.example:8000"], "is not a host name"),
        (["--allowed-host", "a.example", "--no-http"], "--allowed-host needs the REST gateway"),
        (["--stream-idle-timeout", "0"], "a positive number of seconds"),
        (["--stream-idle-timeout", "nan"], "a positive number of seconds"),
    ],
)
def test_serve_refuses_bad_flags_in_one_line(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "protoserve.server.cli", "serve", "--port", "0", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--allowed-host", "a.example/x"], "is not a host name"),
        (["--stream-idle-timeout", "-1"], "the stream idle timeout must be a positive number of seconds"),
    ],
)
def test_standalone_gateway_refuses_bad_flags(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "protoserve.gateway", "--port", "0", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and message in done.stderr, done.stderr
