"""ChatTurnTransport: one turn of a conversation, streamed through a server's OpenAI chat route.

The same accounting as ChatSseTransport (a chunk with content is a token's
arrival, the usage chunk corrects the count), but a turn sends the whole
history and keeps what the conversation needs next: the answer's text, the
response id and the prompt tokens the server says it took from its cache.
``cached_tokens`` is None when the reply does not say (no
``prompt_tokens_details`` in its usage), which is not the same as saying 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from bench.peers.chat_transport import CHAT_ROUTE, apply_usage, content_of
from bench.peers.chat_workload import chat_body
from bench.sse_client import SseClient
from bench.timeline import RequestTimeline
from bench.transports import stream_sse

Message = dict[str, str]


@dataclass
class TurnReply:
    """What one turn returned: its timeline, the answer's text, the response id, the cached prompt tokens."""

    timeline: RequestTimeline
    text: str = ""
    response_id: str = ""
    cached_tokens: int | None = None


class TurnTransport(Protocol):
    """Sends one turn; never raises for a failed request (the timeline says it failed)."""

    name: str

    async def send(self, messages: list[Message], max_tokens: int) -> TurnReply: ...

    async def close(self) -> None: ...


def reported_cached_tokens(usage: dict[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``, or None when the usage has no such details. A details
    object without the count says 0: protoserve's JSON leaves out a proto3 field at its default."""
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    return int(details.get("cached_tokens") or 0)


class ChatTurnTransport:
    """``POST /v1/chat/completions`` with ``stream: true``, the conversation so far as its messages."""

    def __init__(self, name: str, base_url: str, concurrency: int, model: str) -> None:
        self.name = name
        self.model = model
        self.client = SseClient(base_url, concurrency)

    async def send(self, messages: list[Message], max_tokens: int) -> TurnReply:
        reply = TurnReply(RequestTimeline(sent=time.perf_counter()))
        pieces: list[str] = []

        def on_event(event: dict[str, Any]) -> None:
            reply.response_id = reply.response_id or str(event.get("id") or "")
            if text := content_of(event):
                reply.timeline.add_chunk(time.perf_counter(), 1)
                pieces.append(text)
            if usage := event.get("usage"):
                apply_usage(reply.timeline, usage)
                reply.cached_tokens = reported_cached_tokens(usage)

        await stream_sse(
            self.client, CHAT_ROUTE, chat_body(self.model, messages, max_tokens), reply.timeline, on_event
        )
        reply.text = "".join(pieces)
        return reply

    async def close(self) -> None:
        await self.client.aclose()
