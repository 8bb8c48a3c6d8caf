"""uvicorn's WebSocket protocol, told that an upgrade answered with an HTTP response is over.

The gateway refuses upgrades (401, 403, 404, 503, ...) with the ASGI ``websocket.http.response``
extension (gateway.ws.endpoint). uvicorn's websockets-sansio protocol sends that response but
leaves ``handshake_complete`` unset, so when the app returns it logs ERROR "ASGI callable returned
without completing handshake" for every refusal, and any client without a key could fill the
error log. uvicorn's wsproto protocol marks the handshake complete there; this mixin does the
same (as uvicorn pull request #3138 proposes), so a refusal leaves only uvicorn's INFO line.
"""

from __future__ import annotations

from typing import Any


class DenialEndsHandshake:
    """Mixin for uvicorn's WebSocketsSansIOProtocol: a sent denial response completes the handshake."""

    handshake_complete: bool

    async def send(self, message: Any) -> None:
        await super().send(message)  # type: ignore[misc]
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            # The response is on the wire and the transport closing: the handshake is over.
            self.handshake_complete = True
