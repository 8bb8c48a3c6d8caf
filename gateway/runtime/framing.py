"""Byte framing of a server stream on the HTTP side (GatewayRule.framing).

SSE writes each message as one ``data: <json>\\n\\n`` event (the JSON is
compact, so it never spans lines) and ends with OpenAI's ``data: [DONE]\\n\\n``,
on the native routes too, so every SSE client tells a stream's end the same
way; NDJSON writes ``{"result": <json>}`` lines as grpc-gateway does. A stream
that fails after its first byte cannot change its HTTP status any more, so the
failure is written as a last ``{"error": ...}`` frame and the stream ends
without ``[DONE]``: a client can tell a complete stream from a broken one.

SSE_EVENTS is the typed-event protocol of OpenAI's Responses and Anthropic's
Messages streams: each message names its event by its own JSON ``type`` field
(``event: <type>\\ndata: <json>\\n\\n``), the last message says the stream is
complete, so there is no ``[DONE]``, and a failure after the start is an
``error`` event (``typed_error_event``).
"""

from __future__ import annotations

from typing import Any

from protoserve.gateway.runtime.json_codec import dumps
from protoserve.gateway.runtime.route import ErrorStyle, Framing

CONTENT_TYPES = {
    Framing.SSE: "text/event-stream; charset=utf-8",
    Framing.SSE_EVENTS: "text/event-stream; charset=utf-8",
    Framing.NDJSON: "application/x-ndjson",
}


def content_type(framing: Framing) -> str:
    """The Content-Type of a stream with this framing."""
    return CONTENT_TYPES[framing]


def _event_line(payload: Any) -> bytes:
    """``event: <type>\\n`` for a typed message; nothing when its ``type`` is not a one-line string."""
    kind = payload.get("type") if isinstance(payload, dict) else None
    if not isinstance(kind, str) or not kind or any(c in kind for c in "\r\n"):
        return b""
    return b"event: " + kind.encode("utf-8") + b"\n"


def message_frame(framing: Framing, payload: Any) -> bytes:
    """One message of the stream."""
    if framing is Framing.NDJSON:
        return dumps({"result": payload}) + b"\n"
    if framing is Framing.SSE_EVENTS:
        return _event_line(payload) + b"data: " + dumps(payload) + b"\n\n"
    return b"data: " + dumps(payload) + b"\n\n"


def error_frame(framing: Framing, event: dict[str, Any]) -> bytes:
    """The last frame of a failed stream: ``event`` is ``{"error": ...}``, or for SSE_EVENTS a
    ``typed_error_event``."""
    if framing is Framing.NDJSON:
        return dumps(event) + b"\n"
    if framing is Framing.SSE_EVENTS:
        return _event_line(event) + b"data: " + dumps(event) + b"\n\n"
    return b"data: " + dumps(event) + b"\n\n"


def typed_error_event(style: ErrorStyle, event: dict[str, Any], last_payload: Any) -> dict[str, Any]:
    """The ``error`` event of a failed SSE_EVENTS stream, from the route's ``{"error": ...}`` event.

    OpenAI's Responses streams flatten the error object into the event (``code``, ``message``,
    ``param``) and number it after the last message's ``sequence_number``, as every event of theirs
    is; other styles keep ``error`` as a field (Anthropic's ``{"type": "error", "error": {...}}``).
    """
    if style is not ErrorStyle.OPENAI:
        return {"type": "error", **event}
    error = event["error"]
    typed: dict[str, Any] = {
        "type": "error",
        "code": error.get("code"),
        "message": error.get("message"),
        "param": error.get("param"),
    }
    last = last_payload.get("sequence_number") if isinstance(last_payload, dict) else None
    typed["sequence_number"] = last + 1 if isinstance(last, int) and not isinstance(last, bool) else 0
    return typed


def end_frame(framing: Framing) -> bytes:
    """What a stream that finished normally ends with."""
    return b"data: [DONE]\n\n" if framing is Framing.SSE else b""
