"""Request failures and their gRPC form: a ``google.rpc.Status`` with typed details.

Every error a handler reports goes through :func:`to_rpc_status`, so clients get
the same shape everywhere (unary calls, streams, per-item Batch results):
``google.rpc.ErrorInfo`` (reason = ``ErrorReason`` name without its prefix,
domain "protoserve") always, plus ``google.rpc.BadRequest`` field violations for
invalid parameters and ``google.rpc.RetryInfo`` for RESOURCE_EXHAUSTED.
Unexpected exceptions become INTERNAL with a reference id; the traceback stays
in the server log.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import uuid
from collections.abc import Iterable, Mapping

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from protoserve.engine.api import (
    AdapterCapacityError,
    AdapterReloadNeededError,
    ContextLengthError,
    EngineStoppedError,
    InvalidRequestError,
    ModelUnloadedError,
    QueueFullError,
)
from protoserve.server.limits import ECHO_CHARS, MAX_MODEL_NAME_CHARS
from protoserve.v1 import inference_pb2

log = logging.getLogger(__name__)

ERROR_DOMAIN = "protoserve"
_REASON_PREFIX = "ERROR_REASON_"
# A status travels in trailers, which a gRPC client reads only up to 8 KB (grpc-message is
# percent-encoded, up to 3 bytes per byte; the details are base64): a status whose parts stay
# within these budgets can never turn into the client's RESOURCE_EXHAUSTED instead of itself.
MAX_MESSAGE_BYTES = 1024
MAX_VIOLATIONS = 8
MAX_VIOLATION_FIELD_BYTES = 128
MAX_VIOLATION_BYTES = 256
MAX_METADATA_VALUE_BYTES = 128


def utf8_size(text: str) -> int:
    """Bytes of ``text`` as UTF-8 (cheap for ASCII, which needs no encoding to count)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """User text as metadata or a log line may carry it: the first ``limit`` characters, and the
    whole text's size when it was longer."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…({utf8_size(text)} bytes)"


def echo(text: str, limit: int = ECHO_CHARS) -> str:
    """User text as an error message quotes it: ``repr`` of at most ``limit`` characters, then
    the whole text's size when it was longer.

    Every message that repeats caller input goes through here, so no echo can outgrow a
    status's trailers or a log line, whatever the caller sent.
    """
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}…({utf8_size(text)} bytes)"


def _cut_bytes(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (at a character boundary), marked when cut."""
    if utf8_size(text) <= limit:
        return text
    return text.encode("utf-8", "surrogatepass")[: limit - 3].decode("utf-8", "ignore") + "…"


class ServiceError(Exception):
    """A failure the server reports to the caller as a gRPC status with details.

    ``reason`` is an ``inference_pb2.ErrorReason`` value. ``violations`` are
    (field path, problem) pairs for INVALID_ARGUMENT; ``retry_after_s`` adds a
    RetryInfo detail.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: int,
        message: str,
        *,
        violations: Iterable[tuple[str, str]] = (),
        retry_after_s: float | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        # Bounded here, so every status and request log line built from this error is.
        message = _cut_bytes(message, MAX_MESSAGE_BYTES)
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        # The first few only (the message says how many more there were).
        self.violations = [
            (_cut_bytes(f, MAX_VIOLATION_FIELD_BYTES), _cut_bytes(p, MAX_VIOLATION_BYTES))
            for f, p in itertools.islice(violations, MAX_VIOLATIONS)
        ]
        self.retry_after_s = retry_after_s
        self.metadata = {k: _cut_bytes(v, MAX_METADATA_VALUE_BYTES) for k, v in (metadata or {}).items()}


def invalid_argument(violations: Iterable[tuple[str, str]]) -> ServiceError:
    """INVALID_ARGUMENT naming every bad field (the first few, and how many more, when there are many)."""
    violations = list(violations)
    summary = "; ".join(f"{f}: {p}" for f, p in violations[:MAX_VIOLATIONS])
    if len(violations) > MAX_VIOLATIONS:
        summary += f"; and {len(violations) - MAX_VIOLATIONS} more"
    return ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT,
        inference_pb2.ERROR_REASON_INVALID_PARAMETER,
        f"invalid request: {summary}",
        violations=violations,
    )


def model_not_found(name: str, available: Iterable[str]) -> ServiceError:
    """NOT_FOUND for a model this server has not loaded (a name over the cap can name none)."""
    names = ", ".join(available) or "none"
    over = f"; model names are at most {MAX_MODEL_NAME_CHARS} characters" if len(name) > MAX_MODEL_NAME_CHARS else ""
    return ServiceError(
        grpc.StatusCode.NOT_FOUND,
        inference_pb2.ERROR_REASON_MODEL_NOT_FOUND,
        f"model {echo(name)} is not loaded (loaded: {names}){over}",
        metadata={"model": clip(name)},
    )


def request_not_found(request_id: str) -> ServiceError:
    """NOT_FOUND for a request id the caller does not own (or that never existed)."""
    return ServiceError(
        grpc.StatusCode.NOT_FOUND,
        inference_pb2.ERROR_REASON_REQUEST_NOT_FOUND,
        f"no request {echo(request_id)} belongs to the caller",
    )


def no_chat_template(model: str) -> ServiceError:
    """FAILED_PRECONDITION: chat input for a model without a chat template."""
    return ServiceError(
        grpc.StatusCode.FAILED_PRECONDITION,
        inference_pb2.ERROR_REASON_NO_CHAT_TEMPLATE,
        f"model {echo(model)} has no chat template; send a plain prompt or token ids",
        metadata={"model": clip(model)},
    )


def feature_disabled(message: str) -> ServiceError:
    """FAILED_PRECONDITION: the server was started without what the call needs."""
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, inference_pb2.ERROR_REASON_FEATURE_DISABLED, message)


def document_not_found(document_id: str) -> ServiceError:
    """NOT_FOUND for a document id the caller does not have."""
    return ServiceError(
        grpc.StatusCode.NOT_FOUND,
        inference_pb2.ERROR_REASON_DOCUMENT_NOT_FOUND,
        f"the caller has no document {echo(document_id)}",
    )


def response_not_found(message: str) -> ServiceError:
    """NOT_FOUND for a stored response the caller does not have (another identity's included)."""
    return ServiceError(grpc.StatusCode.NOT_FOUND, inference_pb2.ERROR_REASON_RESPONSE_NOT_FOUND, message)


def quota_exceeded(message: str) -> ServiceError:
    """RESOURCE_EXHAUSTED: storing this would pass the caller's quota (no retry helps)."""
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, inference_pb2.ERROR_REASON_QUOTA_EXCEEDED, message)


def unauthenticated(message: str) -> ServiceError:
    """UNAUTHENTICATED for a missing or unknown API key."""
    return ServiceError(grpc.StatusCode.UNAUTHENTICATED, inference_pb2.ERROR_REASON_UNAUTHENTICATED, message)


def draining() -> ServiceError:
    """UNAVAILABLE while the server shuts down."""
    return ServiceError(
        grpc.StatusCode.UNAVAILABLE,
        inference_pb2.ERROR_REASON_SERVER_DRAINING,
        "the server is shutting down and takes no new requests",
    )


def not_ready() -> ServiceError:
    """UNAVAILABLE while the model is still loading."""
    return ServiceError(
        grpc.StatusCode.UNAVAILABLE,
        inference_pb2.ERROR_REASON_NOT_READY,
        "the server is still loading its model",
    )


def deadline_exceeded() -> ServiceError:
    """DEADLINE_EXCEEDED: the call's deadline stopped the request; a partial result is not an answer."""
    return ServiceError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        inference_pb2.ERROR_REASON_DEADLINE_EXCEEDED,
        "the deadline passed before the request finished",
    )


def to_service_error(exc: BaseException) -> ServiceError:
    """Map any exception to the ServiceError the caller should see.

    Unknown exceptions are logged with their traceback and become INTERNAL with
    only a reference id in the message, so nothing of the server's internals leaks.
    """
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return invalid_argument(exc.violations)
    if isinstance(exc, ContextLengthError):
        message = str(exc)
        if str(exc.limit) not in message:
            # The caller needs the limit to budget its prompt; the engine's text may omit it.
            message = f"{message} (context window: {exc.limit} tokens)"
        return ServiceError(
            grpc.StatusCode.OUT_OF_RANGE,
            inference_pb2.ERROR_REASON_CONTEXT_LENGTH_EXCEEDED,
            message,
            metadata={"requested_tokens": str(exc.requested), "max_model_len": str(exc.limit)},
        )
    if isinstance(exc, QueueFullError):
        return ServiceError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            inference_pb2.ERROR_REASON_QUEUE_FULL,
            str(exc),
            retry_after_s=exc.retry_after_s,
            metadata={"queue_len": str(exc.queue_len)},
        )
    if isinstance(exc, ModelUnloadedError):
        return ServiceError(
            grpc.StatusCode.UNAVAILABLE,
            inference_pb2.ERROR_REASON_MODEL_UNLOADED,
            f"{exc}: an admin unloaded it (UnloadModel)",
            metadata={"model": clip(exc.model)},
        )
    if isinstance(exc, EngineStoppedError):
        return draining()
    if isinstance(exc, AdapterCapacityError):
        return ServiceError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            inference_pb2.ERROR_REASON_ADAPTER_SLOTS_BUSY,
            str(exc),
            retry_after_s=exc.retry_after_s,
            metadata={"adapter": exc.name, "max_loras": str(exc.max_loras)},
        )
    if isinstance(exc, AdapterReloadNeededError):
        return ServiceError(
            grpc.StatusCode.FAILED_PRECONDITION,
            inference_pb2.ERROR_REASON_ADAPTER_RELOAD_NEEDED,
            str(exc),
            metadata={"adapter": exc.name},
        )
    ref = uuid.uuid4().hex[:12]
    log.error("internal error (ref %s)", ref, exc_info=(type(exc), exc, exc.__traceback__))
    return ServiceError(
        grpc.StatusCode.INTERNAL,
        inference_pb2.ERROR_REASON_INTERNAL,
        f"internal server error (ref {ref})",
        metadata={"ref": ref},
    )


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The status code :func:`to_service_error` gives ``exc``, without logging (INTERNAL for the unknown)."""
    if isinstance(exc, ServiceError | InvalidRequestError | ContextLengthError | QueueFullError | EngineStoppedError
                  | AdapterCapacityError | AdapterReloadNeededError):
        return to_service_error(exc).code
    return grpc.StatusCode.INTERNAL


def _pack(message) -> any_pb2.Any:
    detail = any_pb2.Any()
    detail.Pack(message)
    return detail


def to_rpc_status(exc: BaseException) -> status_pb2.Status:
    """The ``google.rpc.Status`` for an exception, with ErrorInfo and the other details."""
    err = to_service_error(exc)
    status = status_pb2.Status(code=getattr(code_pb2, err.code.name), message=err.message)
    reason = inference_pb2.ErrorReason.Name(err.reason).removeprefix(_REASON_PREFIX)
    status.details.append(
        _pack(error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=err.metadata))
    )
    if err.violations:
        status.details.append(
            _pack(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
                        for f, d in err.violations
                    ]
                )
            )
        )
    if err.retry_after_s is not None:
        seconds = max(0.0, err.retry_after_s)
        whole = math.floor(seconds)
        delay = duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
        status.details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return status


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status for ``exc`` (details travel in the trailers)."""
    await context.abort_with_status(rpc_status.to_status(to_rpc_status(exc)))


def reports_errors(handler):
    """Decorate an RPC handler so any exception ends the call with its rich status.

    Handlers are coroutines (streaming ones write with ``context.write``).
    Cancellation is not an error and passes through untouched.
    """

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - the RPC boundary: everything becomes a status
            await abort(context, exc)

    return wrapper
