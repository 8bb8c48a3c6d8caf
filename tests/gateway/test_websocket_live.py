"""``GET /v1/ws/completions`` with a real WebSocket client (``websockets``) against the real engine.

Our gateway runs in front of the in-process server (``inproc_server``), whose
engine and in-flight registry are reachable, so a cancel can be checked where
it matters: the server's calls and the engine's KV cache.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx
import pytest
import websockets
from gateway_fakes import gateway_thread
from websockets.asyncio.client import connect

from protoserve.gateway.runtime.handler import GatewaySettings

MESSAGE_LIMIT = 64 * 1024  # small, so that an oversize message is cheap to send
LONG = 2000  # far more tokens than a cancel test waits for
SHORT = 12
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def gateway_url(inproc_server):
    with gateway_thread(inproc_server.grpc_target, GatewaySettings(max_body_bytes=MESSAGE_LIMIT)) as url:
        yield url


@pytest.fixture(scope="module")
def auth_gateway_url(inproc_server):
    with gateway_thread(inproc_server.auth_target) as url:
        yield url


@pytest.fixture(scope="module")
def model(gateway_url) -> str:
    return httpx.get(f"{gateway_url}/v1/models", timeout=30).json()["data"][0]["id"]


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://", 1) + "/v1/ws/completions"


def inflight(server) -> int:
    """Calls the server has in flight now (its in-flight registry, on the server's loop)."""
    return server.call(lambda: len(server.apps[0].inflight))


def wait_idle(server, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while inflight(server) or not server.kv_all_free():
        assert time.monotonic() < deadline, f"still {inflight(server)} calls in flight"
        time.sleep(0.01)


async def frames_until(socket, request_id: str, terminal: str) -> list[dict[str, Any]]:
    """Frames of ``request_id`` up to and including its ``terminal`` frame (others are not expected)."""
    seen = []
    while True:
        frame = json.loads(await asyncio.wait_for(socket.recv(), 60))
        assert frame["id"] == request_id, frame
        seen.append(frame)
        if frame["type"] != "chunk":
            assert frame["type"] == terminal, frame
            return seen


def sse_chunks(base: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.Client(base_url=base, timeout=60) as client:
        response = client.post(path, json={**body, "stream": True})
        assert response.status_code == 200, response.text
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def completion_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])


def chat_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"])


def without_identity(chunk: dict[str, Any]) -> dict[str, Any]:
    """A chunk less what differs between two runs of the same request (its id and creation time)."""
    return {k: v for k, v in chunk.items() if k not in ("id", "created")}


async def test_two_multiplexed_streams_match_sse(gateway_url, model):
    completion = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": SHORT,
        "temperature": 0,
        "seed": 7,
    }
    chat = {"model": model, "messages": CHAT, "max_tokens": SHORT, "temperature": 0, "seed": 7}
    frames: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    order = []
    async with connect(ws_url(gateway_url)) as socket:
        await socket.send(json.dumps({"id": "a", "type": "completion", "request": completion}))
        await socket.send(json.dumps({"id": "b", "type": "chat.completion", "request": chat}))
        done = set()
        while done != {"a", "b"}:
            raw = await asyncio.wait_for(socket.recv(), 60)
            frame = json.loads(raw)
            order.append((frame["id"], frame["type"]))
            if frame["type"] == "done":
                done.add(frame["id"])
            else:
                assert frame["type"] == "chunk", frame
                # The chunk is spliced in as the SSE route's bytes: compact JSON, unchanged.
                data = json.dumps(frame["data"], ensure_ascii=False, separators=(",", ":"))
                assert raw == f'{{"id":"{frame["id"]}","type":"chunk","data":{data}}}'
                frames[frame["id"]].append(frame["data"])
    # Both ran at once: b's first chunk came before a finished.
    assert order.index(("b", "chunk")) < order.index(("a", "done"))
    sse_a = sse_chunks(gateway_url, "/v1/completions", completion)
    sse_b = sse_chunks(gateway_url, "/v1/chat/completions", chat)
    assert completion_text(frames["a"]) == completion_text(sse_a) != ""
    assert chat_text(frames["b"]) == chat_text(sse_b) != ""
    assert [without_identity(c) for c in frames["a"]] == [without_identity(c) for c in sse_a]
    assert [without_identity(c) for c in frames["b"]] == [without_identity(c) for c in sse_b]


async def test_cancel_mid_stream_frees_the_server(inproc_server, gateway_url, model):
    await asyncio.to_thread(wait_idle, inproc_server, 30)
    body = {"model": model, "prompt": "Tell me a story.", "max_tokens": LONG, "ignore_eos": True}
    async with connect(ws_url(gateway_url)) as socket:
        await socket.send(json.dumps({"id": "long", "type": "completion", "request": body}))
        for _ in range(3):
            frame = json.loads(await asyncio.wait_for(socket.recv(), 60))
            assert (frame["id"], frame["type"]) == ("long", "chunk")
        assert await asyncio.to_thread(inflight, inproc_server) == 1
        await socket.send(json.dumps({"id": "long", "type": "cancel"}))
        rest = await frames_until(socket, "long", "cancelled")
        assert all(f["type"] == "chunk" for f in rest[:-1])  # chunks already queued, then cancelled
        began = time.monotonic()
        await asyncio.to_thread(wait_idle, inproc_server)
        assert time.monotonic() - began < 2.0
        # The id is free again, and the socket still serves requests.
        short = {**body, "max_tokens": 2}
        await socket.send(json.dumps({"id": "long", "type": "completion", "request": short}))
        assert len(await frames_until(socket, "long", "done")) >= 2
        # Closing the socket (1000) cancels what still runs on it.
        await socket.send(json.dumps({"id": "left", "type": "completion", "request": body}))
        assert json.loads(await asyncio.wait_for(socket.recv(), 60))["type"] == "chunk"
    assert socket.close_code == 1000
    await asyncio.to_thread(wait_idle, inproc_server)


def rejected(frame: dict[str, Any], message_id: str | None, message_type: str | None, status: int) -> str:
    """The refused field of a ``rejected`` frame, once the frame is checked to end no request."""
    assert frame["id"] is None and frame["type"] == "rejected", frame
    assert (frame["message_id"], frame["message_type"], frame["status"]) == (message_id, message_type, status)
    return frame["error"]["param"]


async def test_bad_messages_get_error_or_rejected_frames_and_the_socket_stays_open(
    inproc_server, gateway_url, model
):
    bad_body = {"model": model, "prompt": "Hi", "max_tokens": "many"}
    http = httpx.post(f"{gateway_url}/v1/completions", json=bad_body, timeout=30)
    assert http.status_code == 400
    async with connect(ws_url(gateway_url)) as socket:

        async def answer(message: Any) -> dict[str, Any]:
            await socket.send(message if isinstance(message, str | bytes) else json.dumps(message))
            return json.loads(await asyncio.wait_for(socket.recv(), 30))

        # Messages that start nothing are rejected, never answered with a request's error frame.
        frame = await answer("not json")
        assert rejected(frame, None, None, 400) is None and "malformed JSON" in frame["error"]["message"]
        assert rejected(await answer(b"\x00binary"), None, None, 400) == "message"
        assert rejected(await answer({"id": "", "type": "cancel"}), None, None, 400) == "id"
        assert (
            rejected(await answer({"id": "t", "type": "translation", "request": {}}), "t", None, 400)
            == "type"
        )
        assert rejected(await answer({"id": "nobody", "type": "cancel"}), "nobody", "cancel", 404) == "id"
        assert (
            rejected(await answer({"id": "c", "type": "cancel", "extra": 1}), "c", "cancel", 400) == "extra"
        )
        # A start message refused before its request began ends that request: its error frame.
        frame = await answer({"id": "x", "type": "completion", "request": {}, "extra": 1})
        assert (frame["id"], frame["type"], frame["error"]["param"]) == ("x", "error", "extra")
        frame = await answer({"id": "s", "type": "completion", "request": {**bad_body, "stream": False}})
        assert (frame["id"], frame["type"], frame["error"]["param"]) == ("s", "error", "stream")
        # An invalid body gets exactly the error object HTTP answers it with.
        frame = await answer({"id": "v", "type": "completion", "request": bad_body})
        assert frame == {"id": "v", "type": "error", "error": http.json()["error"], "status": 400}

        short = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        await socket.send(json.dumps({"id": "ok", "type": "completion", "request": short}))
        assert [f["type"] for f in await frames_until(socket, "ok", "done")][-1] == "done"
    await asyncio.to_thread(wait_idle, inproc_server)


async def test_a_duplicate_id_is_rejected_without_ending_the_running_request(
    inproc_server, gateway_url, model
):
    long = {"model": model, "prompt": "Count:", "max_tokens": LONG, "ignore_eos": True}
    of_d: list[dict[str, Any]] = []  # every frame a client matching by id gives to request "d"
    refusals: list[dict[str, Any]] = []

    async def read_until(predicate) -> None:
        while True:
            frame = json.loads(await asyncio.wait_for(socket.recv(), 60))
            (of_d if frame["id"] == "d" else refusals).append(frame)
            if predicate(frame):
                return

    async with connect(ws_url(gateway_url)) as socket:
        await socket.send(json.dumps({"id": "d", "type": "completion", "request": long}))
        await read_until(lambda f: f["type"] == "chunk")
        duplicates = [
            {"id": "d", "type": "completion", "request": long},
            {"id": "d", "type": "chat.completion", "request": {"model": model, "messages": CHAT}},
            # Refused as a duplicate, not as a request of its own: nothing ends "d".
            {"id": "d", "type": "completion", "request": {**long, "max_tokens": "many"}},
            {"id": "d", "type": "cancel", "extra": 1},
        ]
        for message in duplicates:
            await socket.send(json.dumps(message))
        await read_until(lambda f: len(refusals) == len(duplicates))
        chunks_before = len(of_d)
        await read_until(lambda f: f["id"] == "d")  # "d" goes on after its duplicates were rejected
        await socket.send(json.dumps({"id": "d", "type": "cancel"}))
        await read_until(lambda f: f["id"] == "d" and f["type"] != "chunk")
    kinds = ["completion", "chat.completion", "completion"]
    assert [rejected(f, "d", kind, 409) for f, kind in zip(refusals, kinds, strict=False)] == ["id"] * 3
    assert rejected(refusals[3], "d", "cancel", 400) == "extra"
    assert "already running" in refusals[0]["error"]["message"]
    assert len(of_d) > chunks_before
    assert [f["type"] for f in of_d] == ["chunk"] * (len(of_d) - 1) + ["cancelled"]
    await asyncio.to_thread(wait_idle, inproc_server)


async def test_auth_is_checked_on_the_upgrade(inproc_server, auth_gateway_url, model):
    for headers, status in (({}, 401), ({"authorization": "Bearer wrong"}, 401)):
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with connect(ws_url(auth_gateway_url), additional_headers=headers):
                pass
        response = refused.value.response
        assert response.status_code == status
        assert json.loads(response.body)["error"]["type"] == "authentication_error"
    headers = {"authorization": f"Bearer {inproc_server.api_keys[0]}", "x-user-id": "ws-user"}
    async with connect(ws_url(auth_gateway_url), additional_headers=headers) as socket:
        request = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        await socket.send(json.dumps({"id": "1", "type": "completion", "request": request}))
        assert [f["type"] for f in await frames_until(socket, "1", "done")][-1] == "done"


async def test_refused_upgrades_answer_their_status_and_log_no_error(inproc_server, auth_gateway_url, caplog):
    root = auth_gateway_url.replace("http://", "ws://", 1)
    key = {"authorization": f"Bearer {inproc_server.api_keys[0]}"}
    refusals = [
        (ws_url(auth_gateway_url), {}, {}, 401, "authentication_error"),
        (ws_url(auth_gateway_url), {"x-request-timeout": "soon"}, {}, 400, "invalid_request_error"),
        (root + "/v1/ws/nothing", key, {}, 404, "not_found_error"),
        (ws_url(auth_gateway_url), key, {"origin": "https://elsewhere.example"}, 403, "permission_error"),
    ]
    for _ in range(3):  # enough to see a flood of lines, were there one a refusal
        for url, headers, options, status, error_type in refusals:
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with connect(url, additional_headers=headers, **options):
                    pass
            response = refused.value.response
            assert response.status_code == status
            assert json.loads(response.body)["error"]["type"] == error_type
    # The gateway's loop answers this after it has finished with every refusal above, log included.
    assert httpx.get(f"{auth_gateway_url}/metrics", timeout=30).status_code == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def test_oversize_message_closes_with_1009(gateway_url):
    async with connect(ws_url(gateway_url), max_size=None) as socket:
        await socket.send(
            json.dumps({"id": "big", "type": "completion", "request": {"prompt": "x" * MESSAGE_LIMIT}})
        )
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(socket.recv(), 30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


async def test_shutdown_closes_with_1001_and_cancels_requests(inproc_server, model):
    await asyncio.to_thread(wait_idle, inproc_server, 30)
    body = {"model": model, "prompt": "Tell me a story.", "max_tokens": LONG, "ignore_eos": True}
    gateway = gateway_thread(inproc_server.grpc_target)
    url = gateway.__enter__()
    try:
        async with connect(ws_url(url)) as socket:
            await socket.send(json.dumps({"id": "s", "type": "completion", "request": body}))
            assert json.loads(await asyncio.wait_for(socket.recv(), 60))["type"] == "chunk"
            await asyncio.to_thread(gateway.__exit__, None, None, None)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    await asyncio.wait_for(socket.recv(), 30)
    finally:
        gateway.__exit__(None, None, None)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    await asyncio.to_thread(wait_idle, inproc_server)


async def test_plain_get_is_426_and_unknown_websocket_path_is_404(gateway_url):
    response = httpx.get(f"{gateway_url}/v1/ws/completions", timeout=30)
    assert response.status_code == 426 and response.headers["upgrade"] == "websocket"
    assert response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with connect(gateway_url.replace("http://", "ws://") + "/v1/ws/nothing"):
            pass
    assert refused.value.response.status_code == 404


class EndlessStream:
    """A grpc.aio stream call that always has another chunk ready (a fast engine)."""

    def __init__(self, message) -> None:
        self.message = message
        self.reads = 0
        self.cancelled = False

    async def read(self):
        self.reads += 1
        await asyncio.sleep(0)
        return self.message

    def cancel(self) -> None:
        self.cancelled = True


class OneStreamChannel:
    def __init__(self, rpc: EndlessStream) -> None:
        self.rpc = rpc

    def unary_stream(self, method, response_type):
        return lambda request, metadata, timeout: self.rpc


@pytest.mark.parametrize("ending", ["client leaves", "server closes"])
async def test_a_client_that_stops_reading_holds_its_streams_not_the_gateways_memory(ending):
    from protoserve.gateway.app import generated_routes
    from protoserve.gateway.runtime.handler import GatewayHandler
    from protoserve.gateway.ws.session import Session, SessionConfig
    from protoserve.openai.v1 import openai_pb2 as oa

    queue_frames = 4
    rpc = EndlessStream(oa.CreateCompletionStreamResponse(id="cmpl-1", object="text_completion"))
    handler = GatewayHandler(
        generated_routes(), OneStreamChannel(rpc), GatewaySettings(ws_send_queue_frames=queue_frames)
    )
    route = handler.router.resolve("POST", "/v1/completions").route
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    sent: list[str] = []
    client_gone = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if len(sent) >= 3:  # the client stops reading: the transport never takes another frame
            await client_gone.wait()
            raise OSError("client disconnected")
        sent.append(message["text"])

    session = Session(
        {"type": "websocket", "headers": []},
        inbox.get,
        send,
        SessionConfig(handler, {"completion": route}, None, MESSAGE_LIMIT),
    )
    running = asyncio.create_task(session.run())
    start = {"id": "r", "type": "completion", "request": {"model": "m", "prompt": "x"}}
    await inbox.put({"type": "websocket.receive", "text": json.dumps(start)})
    await asyncio.sleep(0.3)
    stalled_at = rpc.reads
    # Three frames sent, one in the writer's hand, the queue full, one in the stream task's hand.
    assert stalled_at == len(sent) + 1 + queue_frames + 1
    await asyncio.sleep(0.3)
    assert rpc.reads == stalled_at and not rpc.cancelled
    # A bad message's error frame waits for room too, so the receive loop waits with it.
    await inbox.put({"type": "websocket.receive", "text": "not json"})
    await asyncio.sleep(0.1)
    assert inbox.empty()
    if ending == "client leaves":
        client_gone.set()  # the transport reports the disconnect
    else:
        # Shutdown: the close frame cannot be sent either, and is given up on after a while.
        await asyncio.wait_for(session.close(1001, "server shutting down"), 2)
    await inbox.put({"type": "websocket.disconnect", "code": 1006})  # receive() reports the end
    await asyncio.wait_for(running, 2)
    assert rpc.cancelled and session.running == 0
