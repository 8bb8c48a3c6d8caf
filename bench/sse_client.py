"""SseClient: the harness's HTTP/1.1 client for Server-Sent Events, as light as the gRPC one.

The load generator runs on the same two cores as the server, so whatever CPU
the client spends per streamed event is taken from the engine. httpx parses
each SSE line in several layers of Python: measured at one stream, 0.38 ms of
client CPU per token against 0.26 ms for grpc's C-core client, which made the
gateway figure partly a measure of httpx. This client keeps one keep-alive
connection per concurrent stream, writes the request in one piece and reads
chunked bodies straight into SSE events (0.20 ms per token), so the gRPC and
SSE figures compare servers, not client libraries.

Only what the gateway speaks: plain HTTP/1.1, JSON requests, responses with
``Content-Length`` or ``Transfer-Encoding: chunked``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class SseResponse:
    """One response: its status and headers, then its body as SSE events (or as bytes)."""

    status: int
    headers: dict[str, str]
    reader: asyncio.StreamReader
    complete: bool = field(default=False, init=False)  # the body was read to its end

    async def _chunks(self) -> AsyncIterator[bytes]:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readline()).split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while (await self.reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                data = await self.reader.readexactly(size)
                await self.reader.readexactly(2)  # the chunk's CRLF
                yield data
        else:
            length = int(self.headers.get("content-length", "0"))
            if length:
                yield await self.reader.readexactly(length)
        self.complete = True

    async def body(self) -> bytes:
        """The whole body (error responses)."""
        return b"".join([chunk async for chunk in self._chunks()])

    async def events(self) -> AsyncIterator[Any]:
        """The JSON payload of each ``data:`` event, until the body ends or ``data: [DONE]``."""
        pending = b""
        async for chunk in self._chunks():
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                data = b"\n".join(
                    line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
                )
                if data == b"[DONE]":
                    continue  # the body's end follows
                if data:
                    yield json.loads(data)


class SseClient:
    """POSTs JSON to one ``http://host:port`` over at most ``max_connections`` keep-alive connections."""

    def __init__(self, base_url: str, max_connections: int) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"SseClient takes http://host:port, not {base_url!r}")
        self.host, self.port = parts.hostname, parts.port
        self.max_connections = max_connections
        self._idle: list[Connection] = []
        self._open: set[asyncio.StreamWriter] = set()
        self._slots: asyncio.Semaphore | None = None

    @contextlib.asynccontextmanager
    async def post(self, path: str, payload: Any) -> AsyncIterator[SseResponse]:
        """Send ``payload`` as JSON; the response's body must be read inside the block for the
        connection to be reused (otherwise it is closed)."""
        if self._slots is None:  # made in the running loop
            self._slots = asyncio.Semaphore(self.max_connections)
        async with self._slots:
            body = json.dumps(payload).encode()
            request = (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
            )
            reader, writer, response = await self._send(request)
            try:
                yield response
            finally:
                if response.complete and response.headers.get("connection", "").lower() != "close":
                    self._idle.append((reader, writer))
                else:
                    self._drop(writer)

    async def _send(self, request: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, SseResponse]:
        """Write the request on an idle connection, or a new one when the server has closed the idle
        one meanwhile (uvicorn drops keep-alive connections after 5 idle seconds)."""
        while True:
            reused = bool(self._idle)
            reader, writer = self._idle.pop() if reused else await self._connect()
            try:
                writer.write(request)
                return reader, writer, await self._read_head(reader)
            except (ConnectionError, asyncio.IncompleteReadError):
                self._drop(writer)
                if not reused:
                    raise

    def _drop(self, writer: asyncio.StreamWriter) -> None:
        self._open.discard(writer)
        writer.close()

    async def _connect(self) -> Connection:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self._open.add(writer)
        return reader, writer

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader) -> SseResponse:
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return SseResponse(status, headers, reader)

    async def aclose(self) -> None:
        for writer in self._open:
            writer.close()
        self._open.clear()
        self._idle.clear()
