"""HTTP and WebSocket clients on a bare socket, for what real client libraries will not do.

They send any Host or Origin (a library derives Host from the URL), and they can stop reading
for good: a receive buffer of a few KiB that the test never drains, as a client whose reader
stalled.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

WS_PATH = "/v1/ws/completions"
# What a client that never reads lets the kernel take in for it.
STALLED_RECEIVE_BUFFER = 4096


@dataclass(frozen=True)
class Reply:
    """An HTTP answer read to the end of its head (and of its body, when it has a length)."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def connect(base_url: str, *, stalled: bool = False) -> socket.socket:
    """A TCP connection to the server of ``base_url``; ``stalled``: with a tiny receive buffer."""
    parts = urlsplit(base_url)
    sock = socket.socket()
    if stalled:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALLED_RECEIVE_BUFFER)
    sock.settimeout(30)
    sock.connect((parts.hostname, parts.port))
    return sock


def default_host(base_url: str) -> str:
    return urlsplit(base_url).netloc


def send_request(
    sock: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> None:
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)


def read_reply(sock: socket.socket) -> Reply:
    """The reply's status, headers and (Content-Length) body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError(f"connection closed before a full reply head: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        rest += chunk
    return Reply(int(status_line.split()[1]), headers, rest[:length])


def upgrade_headers(base_url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The headers of a WebSocket upgrade to ``base_url`` (``extra`` may replace Host)."""
    headers = {
        "Host": default_host(base_url),
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(),
        "Sec-WebSocket-Version": "13",
    }
    for name, value in (extra or {}).items():
        headers = {k: v for k, v in headers.items() if k.lower() != name.lower()}
        headers[name] = value
    return headers


def upgrade(
    base_url: str, extra: dict[str, str] | None = None, *, stalled: bool = False
) -> tuple[socket.socket, Reply]:
    """Send a WebSocket upgrade to ``/v1/ws/completions``; the socket and the server's answer."""
    sock = connect(base_url, stalled=stalled)
    send_request(sock, "GET", WS_PATH, upgrade_headers(base_url, extra))
    return sock, read_reply(sock)


def text_frame(payload: dict[str, Any]) -> bytes:
    """One masked WebSocket text frame carrying ``payload`` as JSON (clients must mask)."""
    data = json.dumps(payload).encode()
    mask = os.urandom(4)
    size = len(data)
    if size < 126:
        head = bytes([0x81, 0x80 | size])
    elif size < 65536:
        head = bytes([0x81, 0x80 | 126]) + struct.pack("!H", size)
    else:
        head = bytes([0x81, 0x80 | 127]) + struct.pack("!Q", size)
    return head + mask + bytes(byte ^ mask[i % 4] for i, byte in enumerate(data))


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server ends the connection (EOF or reset) within ``timeout`` s, draining what it sent."""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False
