"""The one gRPC channel every route shares, and cached per-method callables on it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

# Responses with many choices and logprobs outgrow gRPC's 4 MiB default.
DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


class SharedChannel:
    """A lazily opened ``grpc.aio`` channel to the backend.

    grpc.aio channels belong to the event loop that creates them, and an ASGI
    app object is built before the server's loop runs, so the channel is
    opened on first use (inside the loop) and closed at shutdown. HTTP/2
    multiplexes every concurrent request over it.
    """

    def __init__(self, target: str, options: Sequence[tuple[str, Any]] = DEFAULT_CHANNEL_OPTIONS) -> None:
        self.target = target
        self.options = tuple(options)
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._callables: dict[tuple[str, bool], Callable[..., Any]] = {}

    @property
    def channel(self) -> grpc.aio.Channel:
        """The open channel, created now if this is the first call."""
        loop = asyncio.get_running_loop()
        if self._channel is None or self._loop is not loop:
            # A new loop (tests that restart the server in-process) needs its own channel.
            self._channel = grpc.aio.insecure_channel(self.target, options=self.options)
            self._loop = loop
            self._callables.clear()
        return self._channel

    def unary_unary(self, method: str, response_type: type[Message]) -> grpc.aio.UnaryUnaryMultiCallable:
        """The callable for a unary method, built once per method."""
        channel = self.channel
        key = (method, False)
        if key not in self._callables:
            self._callables[key] = channel.unary_unary(
                method, request_serializer=_serialize, response_deserializer=response_type.FromString
            )
        return self._callables[key]

    def unary_stream(self, method: str, response_type: type[Message]) -> grpc.aio.UnaryStreamMultiCallable:
        """The callable for a server-streaming method, built once per method."""
        channel = self.channel
        key = (method, True)
        if key not in self._callables:
            self._callables[key] = channel.unary_stream(
                method, request_serializer=_serialize, response_deserializer=response_type.FromString
            )
        return self._callables[key]

    async def close(self) -> None:
        """Close the channel (cancelling calls still running on it)."""
        channel, self._channel = self._channel, None
        self._callables.clear()
        if channel is not None:
            await channel.close()
