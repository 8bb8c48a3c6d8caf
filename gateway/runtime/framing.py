"""Byte framing of a server stream on the HTTP side (GatewayRule.framing).

SSE writes each message as one ``data: <json>\\n\\n`` event (the JSON is
compact, so it never spans lines) and ends with OpenAI's ``data: [DONE]\\n\\n``,
on the native routes too, so every SSE client tells a stream's end the same
way; NDJSON writes ``{"result": <json>}`` lines as grpc-gateway does. A stream
that fails after its first byte cannot change its HTTP status any more, so the
failure is written as a last ``{"error": ...}`` frame and the stream ends
without ``[DONE]``: a client can tell a complete stream from a broken one.
"""

from __future__ import annotations

from typing import Any

from protoserve.gateway.runtime.json_codec import dumps
from protoserve.gateway.runtime.route import Framing

CONTENT_TYPES = {
    Framing.SSE: "text/event-stream; charset=utf-8",
    Framing.NDJSON: "application/x-ndjson",
}


def content_type(framing: Framing) -> str:
    """The Content-Type of a stream with this framing."""
    return CONTENT_TYPES[framing]


def message_frame(framing: Framing, payload: Any) -> bytes:
    """One message of the stream."""
    if framing is Framing.NDJSON:
        return dumps({"result": payload}) + b"\n"
    return b"data: " + dumps(payload) + b"\n\n"


def error_frame(framing: Framing, event: dict[str, Any]) -> bytes:
    """The last frame of a failed stream; ``event`` is already ``{"error": ...}``."""
    if framing is Framing.NDJSON:
        return dumps(event) + b"\n"
    return b"data: " + dumps(event) + b"\n\n"


def end_frame(framing: Framing) -> bytes:
    """What a stream that finished normally ends with."""
    return b"" if framing is Framing.NDJSON else b"data: [DONE]\n\n"
