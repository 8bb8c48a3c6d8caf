"""Opt-in CORS for the REST gateway: Starlette's CORSMiddleware with the gateway's own headers.

Off unless origins are given (``protoserve serve --cors-origin``, ``python -m
protoserve.gateway --cors-origin``); then a browser page on one of those origins (or any,
with ``*``) may call the API and read the answers. CORS only governs reading: that a page
on any other origin cannot change anything (its POSTs and WebSocket upgrades are 403) is
gateway.browser_safety's, which takes its allowed origins from the same list. Preflights (``OPTIONS`` with ``Origin`` and
``Access-Control-Request-Method``) get 204 with the allowed origin, methods,
headers and a max age; a preflight for an origin, method or header that is
not allowed gets 400. Keys travel as ``authorization: Bearer``, never as
cookies, so credentials mode stays off and ``*`` is safe to answer. Without
CORS, ``OPTIONS`` is an unknown method: 405 from the route handler.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

# How long a browser may reuse a preflight answer, in seconds.
MAX_AGE_S = 600
# Response headers a page may read: the back-off of a 429/503 and the request id.
EXPOSED_HEADERS = ("retry-after", "x-request-id")
# Headers the official OpenAI and Anthropic JavaScript SDKs send from a browser on every call: their
# telemetry, the API version and the browser opt-in. The gateway reads none of them (nor does anything
# depend on them), but a preflight refusing them would fail every SDK call from a page.
SDK_REQUEST_HEADERS = (
    "anthropic-version",
    "anthropic-dangerous-direct-browser-access",
    "openai-organization",
    "openai-project",
    "x-stainless-arch",
    "x-stainless-async",
    "x-stainless-helper-method",
    "x-stainless-lang",
    "x-stainless-os",
    "x-stainless-package-version",
    "x-stainless-read-timeout",
    "x-stainless-retry-count",
    "x-stainless-runtime",
    "x-stainless-runtime-version",
    "x-stainless-stream-helper",
    "x-stainless-timeout",
)
# What a browser sends as Origin: scheme://host[:port], nothing after it.
_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s?#]+$", re.IGNORECASE)


def check_origins(origins: Iterable[str]) -> tuple[str, ...]:
    """The origins, checked: ``*`` or ``scheme://host[:port]`` (a trailing slash or path never matches)."""
    checked = []
    for origin in origins:
        if origin != "*" and not _ORIGIN.match(origin):
            raise ValueError(
                f"--cors-origin {origin!r} is not an origin: give scheme://host[:port] "
                "(e.g. https://app.example.com, no path or trailing slash) or *"
            )
        checked.append(origin)
    return tuple(checked)


class _CorsMiddleware(CORSMiddleware):
    """CORSMiddleware whose successful preflight is 204 No Content (Starlette answers 200 "OK")."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 200:
            return response
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return Response(status_code=204, headers=headers)


def cors_middleware(
    origins: Sequence[str], methods: Iterable[str], request_headers: Iterable[str]
) -> Middleware:
    """The middleware allowing ``origins`` to use ``methods`` with ``request_headers`` (plus the safelisted
    and the SDKs' own, SDK_REQUEST_HEADERS)."""
    return Middleware(
        _CorsMiddleware,
        allow_origins=list(check_origins(origins)),
        allow_methods=sorted(set(methods)),
        allow_headers=sorted({h.lower() for h in (*request_headers, *SDK_REQUEST_HEADERS)}),
        expose_headers=list(EXPOSED_HEADERS),
        allow_credentials=False,
        max_age=MAX_AGE_S,
    )
