"""``GET /v1/ws/completions`` in the OpenAPI document: the upgrade, with its frames in words.

OpenAPI describes HTTP requests and responses, not the messages on a WebSocket, so the
route appears as what an HTTP client sees of it: a GET that upgrades (101), answers 426
without an upgrade, or refuses the upgrade with an OpenAI error body. The messages are
listed in its description (in full: docs/api.md, WebSocket streaming), with links to the
schemas of the bodies and chunks they carry. The upgrade carries the same headers as the
completions route, so it gets that route's ``security``.
"""

from __future__ import annotations

import copy
from typing import Any

from protoserve.gateway.ws.protocol import REQUEST_PATHS
from protoserve.gateway.ws.session import WS_PATH

TAG = "WebSocket"
_ERROR_REF = {"$ref": "#/components/schemas/OpenAIErrorResponse"}


def _description() -> str:
    kinds = ", ".join(f'`"{kind}"` (the body of `POST {path}`)' for kind, path in REQUEST_PATHS.items())
    return "\n\n".join(
        [
            "Upgrades to a WebSocket carrying streamed OpenAI completions and chat completions, several "
            "at once, as JSON text messages matched by `id`. OpenAPI cannot describe a WebSocket's "
            "messages and /docs cannot open one (use a WebSocket client), so they are listed here; "
            "the protocol in full is in docs/api.md (WebSocket streaming).",
            "**Client messages.** "
            '`{"id": "<1-256 characters>", "type": <kind>, "request": <body>}` starts a request, '
            f"with kind {kinds}; `stream` is implied. "
            '`{"id": "<id>", "type": "cancel"}` cancels one.',
            "**Server frames.** For each chunk "
            '`{"id", "type": "chunk", "data": <chunk>}`, the chunk being the JSON the SSE route sends '
            'after `data:`; then one final frame: `{"id", "type": "done"}`, `{"id", "type": "cancelled"}` or '
            '`{"id", "type": "error", "error": <OpenAI error object>, "status": <HTTP status>}`, also '
            "sent when a start message is refused before its request began. A message that starts and "
            "ends nothing (unreadable, a cancel for an id not running, a start whose id is still running) "
            'gets `{"id": null, "type": "rejected", "message_id", "message_type", "error", "status"}`, '
            "which ends no request; the socket stays open.",
            "**Auth.** The upgrade sends the same `authorization` and `x-user-id` headers as the HTTP "
            "routes, checked before it is accepted (401, 403 or 503 answer it in OpenAI's error body). "
            "Browsers cannot set `authorization` on an upgrade: with keys on, use a non-browser client.",
        ]
    )


def _operation(security: list[dict[str, list[str]]]) -> dict[str, Any]:
    error = {"application/json": {"schema": _ERROR_REF}}
    return {
        "operationId": "WebSocket_Completions",
        "tags": [TAG],
        "summary": "Streamed completions over a WebSocket",
        "description": _description(),
        "security": security,
        "responses": {
            "101": {"description": "Switching Protocols: the WebSocket is open."},
            "426": {"description": "A plain GET, without a WebSocket upgrade.", "content": error},
            "default": {"description": "The upgrade refused before it was accepted.", "content": error},
        },
    }


def with_websocket_route(document: dict[str, Any]) -> dict[str, Any]:
    """A copy of the generated document with the WebSocket route and its tag added."""
    served = copy.deepcopy(document)
    completions = served["paths"][REQUEST_PATHS["completion"]]["post"]
    served["paths"][WS_PATH] = {"get": _operation(copy.deepcopy(completions["security"]))}
    served["tags"].append(
        {"name": TAG, "description": "OpenAI completions streamed over one WebSocket, several at once."}
    )
    return served
