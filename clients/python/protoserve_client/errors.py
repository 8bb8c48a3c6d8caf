"""ProtoserveError: a failed call with its gRPC code and decoded ``google.rpc.Status`` details."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message as ProtoMessage
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

# The standard detail types (google/rpc/error_details.proto); the server sends
# BadRequest, RetryInfo and ErrorInfo, the rest are decoded for completeness.
_DETAIL_TYPES: tuple[type[ProtoMessage], ...] = (
    error_details_pb2.ErrorInfo,
    error_details_pb2.RetryInfo,
    error_details_pb2.BadRequest,
    error_details_pb2.DebugInfo,
    error_details_pb2.QuotaFailure,
    error_details_pb2.PreconditionFailure,
    error_details_pb2.RequestInfo,
    error_details_pb2.ResourceInfo,
    error_details_pb2.Help,
    error_details_pb2.LocalizedMessage,
)

_CODES_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One invalid request field from a ``google.rpc.BadRequest`` detail."""

    field: str
    description: str
    reason: str = ""


def _unpack(detail: any_pb2.Any) -> ProtoMessage:
    """Unpack a standard detail type; unknown types stay as the ``Any``."""
    for cls in _DETAIL_TYPES:
        if detail.TypeName() == cls.DESCRIPTOR.full_name:
            out = cls()
            detail.Unpack(out)
            return out
    return detail


class ProtoserveError(Exception):
    """A call that failed, with the gRPC status code, message and decoded rich details.

    ``details`` holds every ``google.rpc.Status`` detail, unpacked when it is a
    standard type. The most used parts are also lifted out: ``reason`` and
    ``domain`` (``ErrorInfo``), ``field_violations`` (``BadRequest``) and
    ``retry_delay`` in seconds (``RetryInfo``). Errors that never reached the
    server (a local deadline, an unreachable address) have no details.
    """

    code: grpc.StatusCode
    message: str
    status: status_pb2.Status | None
    details: tuple[ProtoMessage, ...]
    reason: str | None
    domain: str | None
    error_metadata: dict[str, str]
    field_violations: tuple[FieldViolation, ...]
    retry_delay: float | None

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        status: status_pb2.Status | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.details = tuple(_unpack(d) for d in status.details) if status is not None else ()
        self.reason = None
        self.domain = None
        self.error_metadata = {}
        self.retry_delay = None
        violations: list[FieldViolation] = []
        for detail in self.details:
            if isinstance(detail, error_details_pb2.ErrorInfo) and self.reason is None:
                self.reason = detail.reason
                self.domain = detail.domain
                self.error_metadata = dict(detail.metadata)
            elif isinstance(detail, error_details_pb2.BadRequest):
                violations.extend(
                    FieldViolation(v.field, v.description, v.reason) for v in detail.field_violations
                )
            elif isinstance(detail, error_details_pb2.RetryInfo) and self.retry_delay is None:
                self.retry_delay = detail.retry_delay.ToTimedelta().total_seconds()
        self.field_violations = tuple(violations)

    def __reduce__(
        self,
    ) -> tuple[type[ProtoserveError], tuple[grpc.StatusCode, str, status_pb2.Status | None]]:
        # Exceptions pickle their args by default; ours are richer, keep them
        # so errors survive multiprocessing and concurrent.futures.
        return (type(self), (self.code, self.message, self.status))

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> ProtoserveError:
        """Build from a failed sync or ``grpc.aio`` call, decoding ``grpc-status-details-bin``."""
        # Both grpc.RpcError raised by sync calls and grpc.aio.AioRpcError are
        # grpc.Call-like with synchronous code()/details()/trailing_metadata().
        code: grpc.StatusCode = error.code()
        text: str = error.details() or ""
        try:
            status = rpc_status.from_call(error)  # type: ignore[arg-type]
        except ValueError:
            # The status proto disagrees with the gRPC code or message (a proxy
            # rewrote one of them); the wire status wins, the details still help.
            status = _status_from_trailers(error)
        return cls(code, text, status)

    @classmethod
    def from_status(cls, status: status_pb2.Status) -> ProtoserveError:
        """Build from a ``google.rpc.Status`` message, as a Batch result carries it."""
        code = _CODES_BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN)
        return cls(code, status.message, status)


def _status_from_trailers(error: grpc.RpcError) -> status_pb2.Status | None:
    """Decode the rich status without rpc_status's consistency checks."""
    # Sync calls give (key, value) namedtuples, grpc.aio a Metadata of pairs.
    trailers = cast(Iterable[tuple[str, str | bytes]], error.trailing_metadata() or ())
    for key, value in trailers:
        if key == "grpc-status-details-bin":
            return status_pb2.Status.FromString(value if isinstance(value, bytes) else value.encode())
    return None
