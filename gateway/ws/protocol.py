"""The WebSocket completion protocol: the client's messages in, the server's frames out.

Every message is one JSON object in a text frame. The client sends

    {"id": "<id>", "type": "completion" | "chat.completion", "request": {<POST body>}}
    {"id": "<id>", "type": "cancel"}

and the server answers each request with ``chunk`` frames, then exactly one
terminal frame (``done``, ``cancelled`` or ``error``), after which the id may
be used again:

    {"id": "<id>", "type": "chunk", "data": <what SSE writes after "data: ">}
    {"id": "<id>", "type": "done"}
    {"id": "<id>", "type": "cancelled"}
    {"id": "<id>", "type": "error", "error": <OpenAI error object>, "status": <HTTP status>}

A frame's ``id`` names a request only, and a terminal frame is only ever a
request's end: a start message refused before its request began (an invalid
body, too many requests) gets that request's ``error`` frame. A message that
starts and ends nothing (one the server cannot read, a cancel it cannot
honour, a start whose id is still running) gets a ``rejected`` frame instead,
with ``id`` null and the message's own id and type apart, so that it cannot
be taken for the end of the request running under that id:

    {"id": null, "type": "rejected", "message_id": "<id>" | null,
     "message_type": "completion" | "chat.completion" | "cancel" | null,
     "error": <OpenAI error object>, "status": <HTTP status>}

``request`` is the body of ``POST /v1/completions`` / ``POST /v1/chat/completions``
and is validated by the same binding; ``stream`` is implied (absent or true).
A chunk's ``data`` is spliced in as the very bytes the SSE route writes, so the
two transports cannot drift apart. Messages are checked strictly: an unknown
key, a missing or malformed id, an unknown type is an error naming the field.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from google.rpc import code_pb2

from protoserve.gateway.runtime.binding import invalid_request
from protoserve.gateway.runtime.errors import HttpError, gateway_error
from protoserve.gateway.runtime.json_codec import MAX_JSON_DEPTH, InvalidJson, dumps, loads

# Which POST route's body a request message carries.
REQUEST_PATHS = {"completion": "/v1/completions", "chat.completion": "/v1/chat/completions"}
CANCEL = "cancel"
MAX_ID_CHARS = 256
_START_KEYS = frozenset({"id", "type", "request"})
_CANCEL_KEYS = frozenset({"id", "type"})


@dataclass(frozen=True, slots=True)
class StartRequest:
    """Run ``request`` (a POST body, ``stream`` set) on the route of ``kind``."""

    id: str
    kind: str
    request: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CancelRequest:
    """Cancel the running request ``id``."""

    id: str


class BadMessage(Exception):
    """A message the server refuses: ``request_id`` and ``message_type`` when the message had valid ones."""

    def __init__(
        self, error: HttpError, request_id: str | None = None, message_type: str | None = None
    ) -> None:
        super().__init__(error.status.message)
        self.error = error
        self.request_id = request_id
        self.message_type = message_type


def invalid_field(field: str, problem: str) -> HttpError:
    """400 naming one field of a message (the OpenAI error's ``param``)."""
    return gateway_error(
        code_pb2.INVALID_ARGUMENT, f"invalid message: {field}: {problem}", violations=[(field, problem)]
    )


def parse_message(text: str | None) -> StartRequest | CancelRequest:
    """The client message in a text frame (None: a binary frame); raises BadMessage."""
    if text is None:
        raise BadMessage(invalid_field("message", "must be a text frame holding a JSON object, got binary"))
    try:
        # The envelope wraps a request body in one more level than an HTTP body has.
        document = loads(text.encode("utf-8"), max_depth=MAX_JSON_DEPTH + 1)
    except InvalidJson as exc:
        raise BadMessage(invalid_request(exc)) from None
    if not isinstance(document, dict):
        raise BadMessage(invalid_field("message", f"must be a JSON object, got {_kind(document)}"))
    request_id = document.get("id")
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_ID_CHARS:
        raise BadMessage(invalid_field("id", f"must be a string of 1 to {MAX_ID_CHARS} characters"))
    kind = document.get("type")
    if kind == CANCEL:
        _check_keys(document, _CANCEL_KEYS, request_id, kind)
        return CancelRequest(request_id)
    if kind not in REQUEST_PATHS:
        allowed = ", ".join(sorted([*REQUEST_PATHS, CANCEL]))
        raise BadMessage(invalid_field("type", f"must be one of {allowed}, got {kind!r}"), request_id)
    _check_keys(document, _START_KEYS, request_id, kind)
    body = document.get("request")
    if not isinstance(body, dict):
        problem = f"must be a JSON object, got {_kind(body)}"
        raise BadMessage(invalid_field("request", problem), request_id, kind)
    stream = body.get("stream")
    if stream is not None and stream is not True:
        # The same field the HTTP body has, named as there.
        problem = "must be true or absent: the WebSocket route always streams"
        raise BadMessage(invalid_field("stream", problem), request_id, kind)
    return StartRequest(request_id, kind, {**body, "stream": True})


def _check_keys(document: dict[str, Any], allowed: frozenset[str], request_id: str, kind: str) -> None:
    if "request" in allowed and "request" not in document:
        raise BadMessage(invalid_field("request", "is required"), request_id, kind)
    for key in document:
        if key not in allowed:
            raise BadMessage(invalid_field(key, f"unknown field for type {kind!r}"), request_id, kind)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(type(value), "number")


def chunk_frame(request_id: str, payload: Any) -> str:
    """One chunk; ``data`` is byte for byte the JSON the SSE route writes after ``data: ``."""
    return f'{{"id":{_id(request_id)},"type":"chunk","data":{dumps(payload).decode()}}}'


def done_frame(request_id: str) -> str:
    """The request finished; its last chunk went before this."""
    return f'{{"id":{_id(request_id)},"type":"done"}}'


def cancelled_frame(request_id: str) -> str:
    """The request was cancelled by the client's cancel message; nothing follows for it."""
    return f'{{"id":{_id(request_id)},"type":"cancelled"}}'


def error_frame(request_id: str, error: HttpError) -> str:
    """The request failed, or was refused before it began; nothing follows for it."""
    return dumps({"id": request_id, "type": "error", **_error_fields(error)}).decode()


def rejected_frame(refused: BadMessage) -> str:
    """A message the server did not act on; it ends no request, whatever its id names."""
    frame = {
        "id": None,
        "type": "rejected",
        "message_id": refused.request_id,
        "message_type": refused.message_type,
        **_error_fields(refused.error),
    }
    return dumps(frame).decode()


def refusal_frame(refused: BadMessage, running: Container[str]) -> str:
    """The frame answering ``refused`` on a socket whose requests ``running`` holds the ids of.

    Only a start message whose id is free gets an ``error`` frame, as its request's end: a request
    under that id still running would otherwise seem to end there, and go on.
    """
    starts = refused.message_type in REQUEST_PATHS
    if starts and refused.request_id is not None and refused.request_id not in running:
        return error_frame(refused.request_id, refused.error)
    return rejected_frame(refused)


def _error_fields(error: HttpError) -> dict[str, Any]:
    """OpenAI's error object and the HTTP status it would have had, with ``retry_after`` (whole
    seconds) when HTTP would have sent ``Retry-After``."""
    fields: dict[str, Any] = {"error": error.openai_error(), "status": error.http_status}
    retry_after = error.headers.get("retry-after")
    if retry_after is not None:
        fields["retry_after"] = int(retry_after)
    return fields


def _id(request_id: str) -> str:
    return dumps(request_id).decode()
