"""Clients that stop reading are dropped and their requests cancelled (``--stream-idle-timeout``).

Against ``protoserve serve --stream-idle-timeout 2`` (guarded_server): a WebSocket client and an
SSE client on bare sockets that never read (a 4 KiB receive buffer, never drained), and a gRPC
client that never iterates its stream (a 4 KiB window, BDP probing off so that it stays there). Each
starts a generation far longer than the test waits; the server must cancel it within a few
timeouts, free its KV cache (``GET /v1/metrics``: nothing running, KV usage 0) and close the
connection, without a traceback or an ERROR line in its log. The waits are generous bounds,
not speed targets: before these changes the WebSocket was closed after uvicorn's 40 s keepalive
at the earliest and the SSE and gRPC requests ran to ``max_tokens``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import httpx
import pytest
import raw_clients
from guarded_server import STREAM_IDLE_TIMEOUT_S

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc as pb_grpc

LONG = 7000  # tokens: minutes of generation, far beyond every wait below
# How long a stalled request may take to be cancelled: the buffers between engine and client
# (a few hundred tokens) fill, then the timeout passes, then one more look at the buffer.
CANCEL_WITHIN_S = 25.0


def snapshot(base_url: str) -> dict[str, Any]:
    return httpx.get(base_url + "/v1/metrics", timeout=30).json()["snapshot"]


def cancelled(snap: dict[str, Any], status: str = "CANCELLED") -> int:
    return int(snap["requests_by_status"].get(status, 0))


def wait_ended(base_url: str, status: str, before: int, within: float) -> dict[str, Any]:
    """The metrics once one more request ended with ``status`` and nothing runs; fails after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        snap = snapshot(base_url)
        if cancelled(snap, status) > before and snap["num_requests_running"] == 0:
            return snap
        assert time.monotonic() < deadline, f"the stalled request still runs after {within} s: {snap}"
        time.sleep(0.25)


class Watched:
    """The guarded server and what its log gained since the test began."""

    def __init__(self, guarded) -> None:
        self.url = guarded.url
        self.grpc_target = guarded.server.grpc_target
        self._log_path = guarded.server.log_path
        self._start = self._log_path.stat().st_size

    def new_log(self) -> str:
        with self._log_path.open("rb") as log:
            log.seek(self._start)
            return log.read().decode(errors="replace")


@pytest.fixture
def server(guarded_server):
    """The guarded server, idle, with its log checked for tracebacks and errors afterwards."""
    snap = snapshot(guarded_server.url)
    assert snap["num_requests_running"] == 0 and snap["kv_cache_usage"] == 0
    watched = Watched(guarded_server)
    yield watched
    written = watched.new_log()
    assert "Traceback" not in written and " ERROR " not in written, written[-3000:]


def test_a_websocket_client_that_never_reads_is_dropped(server):
    start = snapshot(server.url)
    before, finished = cancelled(start), start["requests_by_finish_reason"].get("length")
    sock, reply = raw_clients.upgrade(server.url, stalled=True)
    assert reply.status == 101
    request = {"prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True, "temperature": 1.0}
    sock.sendall(raw_clients.text_frame({"id": "stalled", "type": "completion", "request": request}))
    began = time.monotonic()
    snap = wait_ended(server.url, "CANCELLED", before, CANCEL_WITHIN_S)
    assert snap["kv_cache_usage"] == 0 and snap["requests_by_finish_reason"].get("length") == finished
    assert raw_clients.closed_by_server(sock, 10), "the socket is still open"
    sock.close()
    # The keepalive ping or the write watch, whichever saw it first, said why.
    assert "(--stream-idle-timeout)" in server.new_log()
    assert time.monotonic() - began >= STREAM_IDLE_TIMEOUT_S  # dropped for idling, not at once


def test_an_sse_client_that_never_reads_is_dropped(server):
    before = cancelled(snapshot(server.url))
    sock = raw_clients.connect(server.url, stalled=True)
    body = b'{"prompt": "Once upon a time", "max_tokens": %d, "ignore_eos": true, "stream": true}' % LONG
    headers = {"Host": raw_clients.default_host(server.url), "Content-Type": "application/json"}
    raw_clients.send_request(sock, "POST", "/v1/completions", headers, body)
    snap = wait_ended(server.url, "CANCELLED", before, CANCEL_WITHIN_S)
    assert snap["kv_cache_usage"] == 0
    assert raw_clients.closed_by_server(sock, 10), "the connection is still open"
    sock.close()
    assert "read nothing of" in server.new_log()


def test_a_reading_sse_client_is_served_to_the_end(server):
    """The watch drops no client that reads, however long its stream (the timeout is 2 s)."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "stream": True},
        ) as response:
            assert response.status_code == 200
            events = [
                line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")
            ]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_a_grpc_client_that_never_reads_gets_deadline_exceeded(server):
    before = cancelled(snapshot(server.url), "DEADLINE_EXCEEDED")
    # A 4 KiB stream window (BDP probing off keeps it there): the server's writes wait after ~90
    # deltas instead of the default 64 KiB's ~1,400, seconds of generation instead of half a minute.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 4096)]
    channel = grpc.insecure_channel(server.grpc_target, options=options)
    with channel:
        sampling = pb.SamplingParams(max_tokens=LONG, ignore_eos=True, temperature=1.0)
        request = pb.GenerateStreamRequest(
            request=pb.GenerateRequest(prompt="Once upon a time", sampling=sampling)
        )
        stream = pb_grpc.InferenceServiceStub(channel).GenerateStream(request, timeout=600)
        snap = wait_ended(server.url, "DEADLINE_EXCEEDED", before, 300)
        assert snap["kv_cache_usage"] == 0
        deltas = 0
        with pytest.raises(grpc.RpcError) as ended:
            for _ in stream:
                deltas += 1
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "--stream-idle-timeout" in ended.value.details()
    assert 0 < deltas < LONG
