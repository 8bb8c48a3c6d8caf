"""The gateway's browser rules (gateway/browser_safety.py) as Envoy routes, for what Envoy itself answers.

Envoy transcodes the native REST routes without our gateway behind it, so its config needs the same
two refusals, as routes matched before every other (a direct 403 with a google.rpc.Status body):

* **Host** must name this server: an IP literal, ``localhost`` or a ``*.localhost`` name, the listening
  address, or an allowed name (``name``, ``.name`` for it and its subdomains; ``*`` turns the check
  off). DNS rebinding needs a name the attacker controls, and that is none of these.
* **Origin**, on a state-changing request (POST, PUT, PATCH, DELETE), must be an allowed origin. Envoy
  serves no page of its own, so no same-origin page exists to let through, and a route cannot compare
  two headers; a request without Origin is not a browser's cross-origin one (gRPC clients, curl) and
  passes. The transcoder turns a native GET into a gRPC POST before routes match, so a foreign page's
  GET of a transcoded route is refused too (it could not have read the answer). Envoy's CSRF filter
  does not fit: it refuses every state-changing request without an Origin.

The OpenAI routes and the WebSocket upgrade also reach the replicas' gateways, which check again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from urllib.parse import urlsplit

from protoserve.gateway.browser_safety import ANY_HOST, STATE_CHANGING_METHODS, check_allowed_hosts

PERMISSION_DENIED = 7  # google.rpc.Code
# On a route: Envoy answers it as HTTP. The transcoder picks its route before it rewrites a request, so a
# refusal route's own setting holds, and a refused request is never turned into a gRPC call.
NO_TRANSCODING = {
    "envoy.filters.http.grpc_json_transcoder": {
        "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
        "disabled": True,
    }
}
# Loose on purpose (RE2 programs are size-capped): what matters is that no name an attacker's DNS answers
# for fits. All digits and dots is no registrable name (no top-level domain is numeric).
_LABEL = r"[a-z0-9_-]+"
_IP_LITERAL = r"[0-9.]+|\[[0-9a-f:.]+\]"
_UNSPECIFIED = {"0.0.0.0", "::", "[::]", ""}


def host_pattern(listen_host: str, allowed_hosts: Sequence[str]) -> str:
    """An RE2 pattern of the Host (``:authority``) values to serve, port optional (Envoy matches it whole)."""
    names = [_IP_LITERAL, f"(?:{_LABEL}\\.)*localhost"]
    listen = listen_host.strip().lower().rstrip(".")
    if listen not in _UNSPECIFIED:
        names.append(re.escape(listen))
    for allowed in allowed_hosts:
        if allowed.startswith("."):
            names.append(f"(?:{_LABEL}\\.)*{re.escape(allowed[1:])}")
        else:
            names.append(re.escape(allowed))
    return f"(?i)(?:{'|'.join(names)})\\.?(?::[0-9]+)?"


def check_allowed_origins(values: Sequence[str]) -> tuple[str, ...]:
    """``--allowed-origin`` values as browsers write an Origin (``scheme://host[:port]``, lower-case)."""
    checked = []
    for value in values:
        origin = value.strip().lower().rstrip("/")
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
            raise ValueError(f"--allowed-origin {value!r} is not an origin: give scheme://host[:port]")
        checked.append(origin)
    return tuple(checked)


def browser_refusals(listen_host: str, allowed_hosts: Sequence[str] = (), allowed_origins: Sequence[str] = ()) -> list[dict]:
    """The routes that refuse a foreign Host and a foreign page's state-changing request, in that order."""
    hosts = check_allowed_hosts(allowed_hosts)
    routes = []
    if ANY_HOST not in hosts:
        authority = {"name": ":authority", "string_match": {"safe_regex": {"regex": host_pattern(listen_host, hosts)}},
                     "invert_match": True}
        routes.append(_refusal([authority], "the Host header does not name this server (see --allowed-host)"))
    methods = "|".join(sorted(STATE_CHANGING_METHODS))
    origin = [{"name": ":method", "string_match": {"safe_regex": {"regex": methods}}},
              {"name": "origin", "present_match": True}]
    origins = check_allowed_origins(allowed_origins)
    if origins:
        allowed = "|".join(re.escape(o) for o in origins)
        origin.append({"name": "origin", "string_match": {"safe_regex": {"regex": f"(?i)(?:{allowed})"}},
                       "invert_match": True})
    routes.append(_refusal(origin, "a page on another origin may not send this request (see --allowed-origin)"))
    return routes


def _refusal(headers: list[dict], message: str) -> dict:
    body = json.dumps({"code": PERMISSION_DENIED, "message": message, "details": []})
    return {
        "match": {"prefix": "/", "headers": headers},
        "direct_response": {"status": 403, "body": {"inline_string": body}},
        "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        "typed_per_filter_config": NO_TRANSCODING,
    }
