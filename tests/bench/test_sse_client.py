"""The harness's SSE client: event parsing on scripted bytes, then the bench transports against the
live gateway (keep-alive reuse, concurrency, HTTP errors, a connection the server closed)."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import pytest

from bench.sse_client import SseClient, SseResponse
from bench.transports import GatewaySseTransport, OpenAiSseTransport
from bench.workload import RequestSpec


def _response(raw: bytes, headers: dict[str, str]) -> SseResponse:
    reader = asyncio.StreamReader()
    reader.feed_data(raw)
    reader.feed_eof()
    return SseResponse(200, headers, reader)


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def test_events_across_chunk_boundaries() -> None:
    async def main() -> tuple[list, bool]:
        # Events split mid-line across chunks, a multi-line data field, a comment, then [DONE].
        body = _chunked(
            b'data: {"a": 1}\n\ndata: {"b"', b": 2}\n\n: keep-alive\n\ndata: [1,\ndata: 2]\n\n", b"data: [DONE]\n\n"
        )
        response = _response(body, {"transfer-encoding": "chunked"})
        return [event async for event in response.events()], response.complete

    events, complete = asyncio.run(main())
    assert events == [{"a": 1}, {"b": 2}, [1, 2]] and complete


def test_content_length_body() -> None:
    async def main() -> tuple[bytes, bool]:
        response = _response(b'{"error": "bad"}', {"content-length": "16"})
        return await response.body(), response.complete

    assert asyncio.run(main()) == (b'{"error": "bad"}', True)


def test_rejects_other_schemes() -> None:
    with pytest.raises(ValueError, match="http://host:port"):
        SseClient("https://127.0.0.1:8000", 1)


# -- against the live gateway -------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_url(live_server) -> str:
    assert live_server.http_port, "the server started no REST gateway"
    return f"http://127.0.0.1:{live_server.http_port}"


def _spec(max_tokens: int = 4) -> RequestSpec:
    rng = random.Random()
    return RequestSpec(tuple(rng.randrange(1000, 20000) for _ in range(8)), max_tokens)


def test_transport_streams_reuses_and_runs_concurrently(base_url: str) -> None:
    async def main() -> None:
        transport = GatewaySseTransport(base_url, concurrency=2)
        try:
            first = await transport.stream(_spec())
            second = await transport.stream(_spec())
            assert first.ok and second.ok, (first.error, second.error)
            assert first.output_tokens == second.output_tokens == 4
            assert len(transport.client._open) == 1  # the keep-alive connection served both
            both = await asyncio.gather(transport.stream(_spec(3)), transport.stream(_spec(3)))
            assert [t.output_tokens for t in both] == [3, 3]
            assert len(transport.client._open) == 2

            # The server dropped an idle connection (as uvicorn does after 5 s): a fresh one is used.
            for _, writer in transport.client._idle:
                writer.transport.abort()
            third = await transport.stream(_spec())
            assert third.ok and third.output_tokens == 4, third.error
        finally:
            await transport.close()

    asyncio.run(main())


def test_http_error_is_a_failed_timeline(base_url: str) -> None:
    async def main() -> None:
        transport = GatewaySseTransport(base_url, concurrency=1)
        try:
            bad = await transport.stream(RequestSpec((10**9,), 4))  # a token id past the vocabulary
            assert not bad.ok and bad.error is not None and "HTTP 400" in bad.error
            good = await transport.stream(_spec())  # the connection is still usable
            assert good.ok and good.output_tokens == 4
        finally:
            await transport.close()

    asyncio.run(main())


def test_openai_transport(base_url: str) -> None:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as reply:
        model = json.load(reply)["data"][0]["id"]

    async def main() -> None:
        transport = OpenAiSseTransport(base_url, 1, model)
        try:
            timeline = await transport.stream(_spec(5))
            assert timeline.ok and timeline.output_tokens == 5, timeline.error
        finally:
            await transport.close()

    asyncio.run(main())
