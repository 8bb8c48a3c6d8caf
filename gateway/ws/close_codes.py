"""The WebSocket close codes the gateway uses (RFC 6455 section 7.4.1) and the reason's size limit."""

from __future__ import annotations

NORMAL = 1000  # the client closed; the server echoes its close
GOING_AWAY = 1001  # the gateway is shutting down
POLICY_VIOLATION = 1008  # the upgrade was refused after accepting (an ASGI server that cannot refuse first)
MESSAGE_TOO_BIG = 1009  # a message over the size limit
INTERNAL_ERROR = 1011  # a gateway bug, or no answer to the keepalive ping (gateway.slow_clients)
TRY_AGAIN_LATER = 1013  # refused after accepting because the server is busy, loading or draining

# A close frame's payload is at most 125 bytes: 2 for the code, 123 for the UTF-8 reason.
MAX_REASON_BYTES = 123


def close_reason(text: str) -> str:
    """``text`` cut to fit a close frame, never inside a UTF-8 character."""
    data = text.encode("utf-8")
    if len(data) <= MAX_REASON_BYTES:
        return text
    return data[: MAX_REASON_BYTES - 3].decode("utf-8", errors="ignore") + "..."
