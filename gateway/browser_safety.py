"""What a web page may make the gateway do: the Host and Origin checks in front of every route.

CORS only decides whether a page may *read* an answer. A browser still sends a page's
"simple" cross-origin requests (a POST with a ``text/plain`` body, a ``no-cors`` fetch) and
its WebSocket upgrades to any server, and DNS rebinding turns a page at ``attacker.example``
into a same-origin caller of ``127.0.0.1``. So before any route runs, HTTP or WebSocket:

* **Host** must name this server: an IP literal (rebinding needs a DNS name the attacker
  controls), ``localhost`` or a ``*.localhost`` name (browsers resolve those to loopback
  themselves), the listening address, or an ``--allowed-host`` value (``name``, ``.name``
  for it and every subdomain, ``*`` for any Host at all). A request without Host (HTTP/1.0
  tools; no browser omits it) passes. Anything else is 403, as Vite, webpack-dev-server
  and Jupyter answer it (Ollama too, for the same CVE class).
* **Origin**, on a state-changing request (POST, PUT, PATCH, DELETE) and on a WebSocket
  upgrade, must be the server's own (the Origin's host and port are the Host's) or a
  ``--cors-origin`` one (``*``: any); ``Origin: null`` (sandboxed frames, ``file:`` pages,
  cross-origin redirects) is foreign. A request without Origin is not a browser's
  cross-origin one (browsers send it on every such request) and passes. 403 otherwise.

Both hold with auth on or off: a key in a page is no reason to let other pages use the
server. The refusal is the route's error body (OpenAI's under OpenAI paths, a
google.rpc.Status elsewhere); an upgrade is refused before it is accepted. That a JSON
body is declared JSON (415 otherwise) is the handler's check: it knows which routes take one.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from google.rpc import code_pb2

from protoserve.gateway.runtime.errors import HttpError, gateway_error
from protoserve.gateway.runtime.handler import AsgiMessage, Receive, Scope, Send, send_error
from protoserve.gateway.runtime.metrics import GatewayMetrics
from protoserve.gateway.runtime.route import ErrorStyle
from protoserve.gateway.ws.endpoint import refuse_upgrade

log = logging.getLogger(__name__)

ANY_HOST = "*"
STATE_CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
# A DNS name, or with a leading dot a domain and all its subdomains (no port, scheme or path).
_HOST_NAME = re.compile(
    r"^\.?(?:[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$"
)
# How much of a header value an error message or log line quotes back.
_SHOWN_CHARS = 64


def check_allowed_hosts(values: Iterable[str]) -> tuple[str, ...]:
    """The ``--allowed-host`` values, lower-cased: ``*``, ``name`` or ``.name``; ValueError otherwise."""
    checked = []
    for value in values:
        name = value.strip().lower()
        if name.endswith(".") and len(name) > 1:
            name = name[:-1]  # the fully qualified form of the same name
        if name != ANY_HOST and not _HOST_NAME.match(name):
            raise ValueError(
                f"--allowed-host {value!r} is not a host name: give a name (api.example.com), "
                ".example.com for that domain and its subdomains, or * for any (no scheme, port or path)"
            )
        checked.append(name)
    return tuple(checked)


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header's name (lower-case, no brackets or trailing dot) and port; None when malformed."""
    try:
        parts = urlsplit("//" + value.strip())
        port = parts.port
    except ValueError:
        return None
    name = (parts.hostname or "").rstrip(".")
    if not name or parts.username is not None or parts.path or parts.query or parts.fragment:
        return None
    return name, port


def is_ip_literal(name: str) -> bool:
    """Whether ``name`` is an IPv4 or IPv6 address (as urlsplit leaves it: no brackets)."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def name_allowed(name: str, listen_host: str, allowed_hosts: Iterable[str]) -> bool:
    """Whether a request addressed to host ``name`` may be served (see the module docstring)."""
    if is_ip_literal(name) or name == "localhost" or name.endswith(".localhost"):
        return True
    if name == listen_host.strip("[]").lower().rstrip("."):
        return True
    for allowed in allowed_hosts:
        if allowed == ANY_HOST or name == allowed.lstrip("."):
            return True
        if allowed.startswith(".") and name.endswith(allowed):
            return True
    return False


def same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` (scheme://host[:port]) names the server the request's ``host`` header names."""
    try:
        parts = urlsplit(origin)
        origin_port = parts.port
    except ValueError:
        return False
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        return False
    target = split_host(host)
    if target is None:
        return False
    default = DEFAULT_PORTS[scheme]
    return (parts.hostname.rstrip("."), origin_port or default) == (target[0], target[1] or default)


@dataclass(frozen=True, slots=True)
class BrowserPolicy:
    """The names this gateway answers to and the origins it takes state-changing requests from."""

    listen_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()  # as check_allowed_hosts returns them
    cors_origins: tuple[str, ...] = ()  # lower-case, as browsers write an Origin

    def host_refusal(self, host: str | None) -> HttpError | None:
        """The 403 for a Host that does not name this server, else None."""
        if host is None or ANY_HOST in self.allowed_hosts:
            return None
        parsed = split_host(host)
        if parsed is not None and name_allowed(parsed[0], self.listen_host, self.allowed_hosts):
            return None
        name = parsed[0] if parsed is not None else host
        return _forbidden(
            f"Host {_shown(host)} is not a name of this server (other names are refused against DNS "
            f"rebinding); if clients reach it by that name, start it with --allowed-host {_shown(name, quote=False)}"
        )

    def origin_refusal(self, origin: str | None, host: str | None, what: str) -> HttpError | None:
        """The 403 for ``what`` (a method, or a WebSocket upgrade) sent by a foreign page, else None."""
        if origin is None:
            return None
        if origin != "null":
            if host is not None and same_origin(origin, host):
                return None
            if ANY_HOST in self.cors_origins or origin.lower() in self.cors_origins:
                return None
        return _forbidden(
            f"{what} from a page at Origin {_shown(origin)} refused: browsers may call this server "
            "only from its own origin or from one given with --cors-origin"
        )


class BrowserSafety:
    """ASGI middleware applying a :class:`BrowserPolicy` before the app sees a request."""

    def __init__(
        self,
        app: Callable,
        policy: BrowserPolicy,
        style_for_path: Callable[[str], ErrorStyle],
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.app = app
        self.policy = policy
        self.style_for_path = style_for_path
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        began = time.monotonic()
        method = scope.get("method", "GET") if kind == "http" else "GET"
        host, origin = _header(scope, b"host"), _header(scope, b"origin")
        error = self.policy.host_refusal(host)
        if error is None and (kind == "websocket" or method in STATE_CHANGING_METHODS):
            what = "a WebSocket upgrade" if kind == "websocket" else method
            error = self.policy.origin_refusal(origin, host, what)
        if error is None:
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        log.info(
            "refused %s %s (Host %s, Origin %s): %s",
            method, _shown(path), _shown(host or ""), _shown(origin or ""), error.status.message,
        )  # fmt: skip
        style = self.style_for_path(path)
        if kind == "websocket":
            message: AsgiMessage = await receive()
            if message["type"] == "websocket.connect":
                await refuse_upgrade(scope, send, error, style)
        else:
            await send_error(send, error, style)
        if self.metrics is not None:
            self.metrics.observe(None, method, error.http_status, time.monotonic() - began)


def _forbidden(message: str) -> HttpError:
    return gateway_error(code_pb2.PERMISSION_DENIED, message, http_status=403)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return value.decode("latin-1")
    return None


def _shown(text: str, quote: bool = True) -> str:
    cut = text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."
    return repr(cut) if quote else cut
