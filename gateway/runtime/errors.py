"""Failed calls as HTTP: status mapping (grpc-gateway's table) and the error body styles.

Every failure, whether the server's (a gRPC status with ``google.rpc``
details in ``grpc-status-details-bin``) or the gateway's own (bad JSON,
unknown route, oversized body), becomes an :class:`HttpError` holding a
``google.rpc.Status``, so both are rendered the same way: as that Status in
JSON, or as OpenAI's ``{"error": {...}}`` or Anthropic's ``{"type": "error", "error": {...}}``
derived from it (Anthropic's with its own statuses: 529 for a busy server). The gateway's own
statuses, and bare ones from grpc itself, get the ``ErrorInfo`` the server
puts in each of its own (an ``ErrorReason`` name, domain "protoserve"), so
every error body has one and OpenAI's ``code`` is never null.
"""

from __future__ import annotations

import base64
import logging
import math
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import json_format
from google.rpc import code_pb2, error_details_pb2, status_pb2

from protoserve.gateway.runtime.route import ErrorStyle
from protoserve.v1 import inference_pb2

log = logging.getLogger(__name__)

STATUS_DETAILS_KEY = "grpc-status-details-bin"
# grpc-gateway's runtime.HTTPStatusFromCode.
HTTP_STATUS_BY_CODE = {
    code_pb2.OK: 200,
    code_pb2.CANCELLED: 499,
    code_pb2.UNKNOWN: 500,
    code_pb2.INVALID_ARGUMENT: 400,
    code_pb2.DEADLINE_EXCEEDED: 504,
    code_pb2.NOT_FOUND: 404,
    code_pb2.ALREADY_EXISTS: 409,
    code_pb2.PERMISSION_DENIED: 403,
    code_pb2.UNAUTHENTICATED: 401,
    code_pb2.RESOURCE_EXHAUSTED: 429,
    code_pb2.FAILED_PRECONDITION: 400,
    code_pb2.ABORTED: 409,
    code_pb2.OUT_OF_RANGE: 400,
    code_pb2.UNIMPLEMENTED: 501,
    code_pb2.INTERNAL: 500,
    code_pb2.UNAVAILABLE: 503,
    code_pb2.DATA_LOSS: 500,
}
# OpenAI's error "type" by HTTP status; anything else 5xx is a server_error.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    426: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled_error",
}
# Anthropic's error "type" by the HTTP status its API answers with.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Anthropic's status for a server that cannot take the request now (queue full, draining, not
# ready): clients back off and retry it, as they do a 429.
ANTHROPIC_OVERLOADED = 529
_BAD_REQUEST_URL = "type.googleapis.com/" + error_details_pb2.BadRequest.DESCRIPTOR.full_name
_RETRY_INFO_URL = "type.googleapis.com/" + error_details_pb2.RetryInfo.DESCRIPTOR.full_name
_ERROR_INFO_URL = "type.googleapis.com/" + error_details_pb2.ErrorInfo.DESCRIPTOR.full_name
ERROR_DOMAIN = "protoserve"
# The reason of a gateway status whose caller names none, and of a bare status from grpc itself:
# its only RESOURCE_EXHAUSTED is a message over the size limit, its UNAVAILABLE an unreachable
# server. Any other code is INTERNAL's, as the server's unexpected failures are; callers name a
# reason that fits better.
_DEFAULT_REASONS = {
    code_pb2.INVALID_ARGUMENT: inference_pb2.ERROR_REASON_INVALID_PARAMETER,
    code_pb2.NOT_FOUND: inference_pb2.ERROR_REASON_ROUTE_NOT_FOUND,
    code_pb2.UNIMPLEMENTED: inference_pb2.ERROR_REASON_ROUTE_NOT_FOUND,
    code_pb2.RESOURCE_EXHAUSTED: inference_pb2.ERROR_REASON_PAYLOAD_TOO_LARGE,
    code_pb2.PERMISSION_DENIED: inference_pb2.ERROR_REASON_PERMISSION_DENIED,
    code_pb2.UNAUTHENTICATED: inference_pb2.ERROR_REASON_UNAUTHENTICATED,
    code_pb2.DEADLINE_EXCEEDED: inference_pb2.ERROR_REASON_DEADLINE_EXCEEDED,
    code_pb2.UNAVAILABLE: inference_pb2.ERROR_REASON_SERVER_UNAVAILABLE,
    code_pb2.INTERNAL: inference_pb2.ERROR_REASON_INTERNAL,
    code_pb2.UNKNOWN: inference_pb2.ERROR_REASON_INTERNAL,
}


class HttpError(Exception):
    """A call that ends in an error response: the Status and the HTTP status it maps to."""

    def __init__(self, status: status_pb2.Status, http_status: int | None = None) -> None:
        super().__init__(status.message)
        self.status = status
        self.http_status = http_status or HTTP_STATUS_BY_CODE.get(status.code, 500)

    @property
    def headers(self) -> dict[str, str]:
        """Extra response headers: Retry-After when the status carries a RetryInfo."""
        retry = _detail(self.status, _RETRY_INFO_URL, error_details_pb2.RetryInfo)
        if retry is None or not retry.HasField("retry_delay"):
            return {}
        delay = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
        return {"retry-after": str(max(0, math.ceil(delay)))}

    def status_for(self, style: ErrorStyle) -> int:
        """The HTTP status in the route's style: Anthropic's API has its own for a few."""
        if style is not ErrorStyle.ANTHROPIC:
            return self.http_status
        info = _detail(self.status, _ERROR_INFO_URL, error_details_pb2.ErrorInfo)
        queue_full = info is not None and info.reason == "QUEUE_FULL"
        if self.http_status == 503 or (self.http_status == 429 and queue_full):
            return ANTHROPIC_OVERLOADED
        if self.http_status >= 500 and self.http_status != 504:
            return 500
        return self.http_status

    def body(self, style: ErrorStyle) -> dict[str, Any]:
        """The JSON error body of the route's style."""
        if style is ErrorStyle.OPENAI:
            return {"error": self.openai_error()}
        if style is ErrorStyle.ANTHROPIC:
            return {"type": "error", "error": self.anthropic_error()}
        if style is ErrorStyle.KSERVE:
            return {"error": self.status.message}
        return status_to_json(self.status)

    def stream_event(self, style: ErrorStyle) -> dict[str, Any]:
        """The payload of the last event of a stream that failed: always ``{"error": ...}``."""
        if style is ErrorStyle.OPENAI:
            return {"error": self.openai_error()}
        if style is ErrorStyle.ANTHROPIC:
            return {"error": self.anthropic_error()}
        if style is ErrorStyle.KSERVE:
            return {"error": self.status.message}
        return {"error": status_to_json(self.status)}

    def anthropic_error(self) -> dict[str, Any]:
        """Anthropic's error object: its type by Anthropic's status, and the message (which names
        the bad fields: Anthropic's body has no field of its own for them)."""
        status = self.status_for(ErrorStyle.ANTHROPIC)
        default = "invalid_request_error" if status < 500 else "api_error"
        return {"type": _ANTHROPIC_TYPES.get(status, default), "message": self.status.message}

    def openai_error(self) -> dict[str, Any]:
        """OpenAI's error object: message, type, param (first bad field), code (ErrorInfo reason)."""
        bad_request = _detail(self.status, _BAD_REQUEST_URL, error_details_pb2.BadRequest)
        info = _detail(self.status, _ERROR_INFO_URL, error_details_pb2.ErrorInfo)
        error_type = _OPENAI_TYPES.get(
            self.http_status, "server_error" if self.http_status >= 500 else "api_error"
        )
        return {
            "message": self.status.message,
            "type": error_type,
            "param": bad_request.field_violations[0].field
            if bad_request is not None and bad_request.field_violations
            else None,
            "code": info.reason.lower() if info is not None and info.reason else None,
        }


def gateway_error(
    code: int,
    message: str,
    *,
    http_status: int | None = None,
    violations: Iterable[tuple[str, str]] = (),
    reason: int | None = None,
) -> HttpError:
    """An error the gateway itself answers with: an ErrorInfo with ``reason`` (an ``ErrorReason``;
    by default the code's) and, for field ``violations``, a BadRequest detail."""
    status = status_pb2.Status(code=code, message=message)
    _add_error_info(status, _default_reason(code) if reason is None else reason)
    # Whole-body problems (malformed JSON) name no field; the message carries them.
    violations = [(field, problem) for field, problem in violations if field]
    if violations:
        detail = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=field, description=problem)
                for field, problem in violations
            ]
        )
        status.details.add().Pack(detail)
    return HttpError(status, http_status)


def from_rpc_error(error: grpc.RpcError) -> HttpError:
    """The HttpError for a failed gRPC call, keeping the server's rich status when it sent one."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    number = code.value[0] if isinstance(code, grpc.StatusCode) else code_pb2.UNKNOWN
    message = (error.details() if hasattr(error, "details") else None) or ""
    for key, value in _trailers(error):
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            try:
                status = status_pb2.Status.FromString(value)
            except Exception:  # noqa: BLE001 - a corrupt trailer must not hide the real status
                log.warning("ignoring undecodable %s trailer", STATUS_DETAILS_KEY)
                break
            if status.code == number:
                return HttpError(status)
            break
    # Our server explains every RESOURCE_EXHAUSTED it sends (queue, rate limit) in a rich status;
    # a bare one comes from grpc itself, whose only such refusal is a message over
    # --max-message-bytes: the body was too large, not the caller too fast.
    http_status = 413 if number == code_pb2.RESOURCE_EXHAUSTED else None
    status = status_pb2.Status(code=number, message=message or code.name)
    _add_error_info(status, _default_reason(number))
    return HttpError(status, http_status)


def _default_reason(code: int) -> int:
    return _DEFAULT_REASONS.get(code, inference_pb2.ERROR_REASON_INTERNAL)


def _add_error_info(status: status_pb2.Status, reason: int) -> None:
    name = inference_pb2.ErrorReason.Name(reason).removeprefix("ERROR_REASON_")
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=name, domain=ERROR_DOMAIN))


def status_to_json(status: status_pb2.Status) -> dict[str, Any]:
    """A google.rpc.Status as grpc-gateway writes it (proto field names, typed details)."""
    details = []
    for detail in status.details:
        try:
            details.append(json_format.MessageToDict(detail, preserving_proto_field_name=True))
        except (TypeError, KeyError):
            # A detail type this process does not know: keep it, opaque, rather than drop it.
            details.append({"@type": detail.type_url, "value": base64.b64encode(detail.value).decode()})
    return {"code": status.code, "message": status.message, "details": details}


def _trailers(error: grpc.RpcError) -> list[tuple[str, Any]]:
    trailing = getattr(error, "trailing_metadata", None)
    if trailing is None:
        return []
    try:
        return list(trailing() or ())
    except Exception:  # noqa: BLE001 - trailers are optional extra detail
        return []


def _detail(status: status_pb2.Status, type_url: str, message_type):
    for detail in status.details:
        if detail.type_url == type_url:
            message = message_type()
            if detail.Unpack(message):
                return message
    return None
