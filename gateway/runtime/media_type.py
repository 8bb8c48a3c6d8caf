"""A request body must say it is JSON: ``application/json`` or ``application/<x>+json``.

A browser page may send a cross-origin POST without asking first only when its body is
``text/plain``, form data or of no declared type (a ``Blob`` without one): a "simple"
request. Refusing every body not declared JSON (415) leaves a page no way to deliver one
without a CORS preflight, which only ``--cors-origin`` origins pass. Parameters may follow
the type (``; charset=utf-8``); a charset other than UTF-8 is refused, since JSON bodies
are read as UTF-8 (RFC 8259). A request with no body at all (0 bytes) needs no type: it
is the empty request, as grpc-gateway reads it.
"""

from __future__ import annotations

import re

from google.rpc import code_pb2

from protoserve.gateway.runtime.errors import HttpError, gateway_error
from protoserve.v1 import inference_pb2

UNSUPPORTED_MEDIA_TYPE = 415
# type/subtype, case-insensitive: application/json, or a structured syntax suffix (RFC 6839).
_JSON_TYPE = re.compile(r"^application/(?:json|[a-z0-9!#$&^_.+-]+\+json)$")
_SHOWN_CHARS = 64


def body_type_error(content_type: str | None, body_size: int | None) -> HttpError | None:
    """The 415 for a body whose declared type is not JSON, else None.

    ``body_size`` None: not read yet (the type alone is judged; a missing one waits for the
    body, since an empty body needs none).
    """
    if content_type is None:
        if body_size is None or body_size == 0:
            return None
        return _unsupported("none")
    media_type, _, parameters = content_type.partition(";")
    if not _JSON_TYPE.match(media_type.strip().lower()):
        return _unsupported(repr(_cut(content_type.strip())))
    charset = _charset(parameters)
    if charset is not None and charset.lower() not in ("utf-8", "utf8"):
        return gateway_error(
            code_pb2.INVALID_ARGUMENT,
            f"request body charset {_cut(charset)!r} is not supported: JSON bodies are UTF-8",
            http_status=UNSUPPORTED_MEDIA_TYPE,
            reason=inference_pb2.ERROR_REASON_UNSUPPORTED_MEDIA_TYPE,
        )
    return None


def _unsupported(got: str) -> HttpError:
    return gateway_error(
        code_pb2.INVALID_ARGUMENT,
        f"request body must be JSON: send content-type: application/json (got {got})",
        http_status=UNSUPPORTED_MEDIA_TYPE,
        reason=inference_pb2.ERROR_REASON_UNSUPPORTED_MEDIA_TYPE,
    )


def _charset(parameters: str) -> str | None:
    for parameter in parameters.split(";"):
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"')
    return None


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."
