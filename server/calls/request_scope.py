"""RequestScope: what a generating RPC knows about itself, for the requests it runs.

An interceptor opens a scope around each call of a generating method (Generate,
GenerateStream, Batch, the OpenAI completions and chat completions, agent runs). It names
the gRPC method and the GenAI operation (``chat`` for chat input, else
``text_completion``) for the in-flight registry, which records each request it
runs and marks the scope, with the model the call named. A call that fails
before any request was opened (bad API key, model still loading, invalid OpenAI
parameters) is recorded here as one refused request, so metrics and the request
log see every error a caller got; without a request id of its own (OpenAI calls
have none), it is logged under a fresh one, so that every line can be told apart.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message

from protoserve.engine.api import CHAT, TEXT_COMPLETION
from protoserve.openai.v1 import openai_pb2
from protoserve.server.calls.request_record import RequestRecord
from protoserve.server.errors import ServiceError
from protoserve.server.models.served_model import new_request_id
from protoserve.v1 import agent_pb2, inference_pb2

_INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]
_OPENAI = openai_pb2.DESCRIPTOR.services_by_name["OpenAIService"]
_AGENT = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]


def _full(service, method: str) -> str:
    return f"/{service.full_name}/{service.methods_by_name[method].name}"


# An agent run's model steps are chat requests with tools.
CHAT_METHODS = frozenset(
    [_full(_OPENAI, m) for m in ("CreateChatCompletion", "CreateChatCompletionStream")]
    + [_full(_AGENT, "RunAgent")]
)
GENERATING_METHODS = CHAT_METHODS | frozenset(
    [_full(_INFERENCE, m) for m in ("Generate", "GenerateStream", "Batch")]
    + [_full(_OPENAI, m) for m in ("CreateCompletion", "CreateCompletionStream")]
)


@dataclass
class RequestScope:
    """One generating RPC: its method, operation, the model it named and how many requests it opened."""

    method: str
    operation: str = TEXT_COMPLETION
    model: str = ""  # the request's ``model`` as the caller sent it ("" when it names none)
    opened: int = 0


_current: ContextVar[RequestScope | None] = ContextVar("protoserve_request_scope", default=None)


def current_scope() -> RequestScope | None:
    """The scope of the RPC this task serves (Batch items share their call's), or None."""
    return _current.get()


def _inner(request: Message) -> Message:
    """The request message itself; streaming RPCs wrap it in a ``request`` field."""
    wrapped = getattr(request, "request", None)
    return wrapped if isinstance(wrapped, Message) else request


def requested_model(request: Message) -> str:
    """The ``model`` the request names, unchecked ("" when it has no such field or leaves it empty)."""
    inner = _inner(request)
    if "model" not in inner.DESCRIPTOR.fields_by_name:
        return ""
    value = inner.model
    return value if isinstance(value, str) else ""


def _is_chat_input(message: Message) -> bool:
    return "input" in message.DESCRIPTOR.oneofs_by_name and message.WhichOneof("input") == "chat"


def operation_of(method: str, request: Message) -> str:
    """``chat`` for the chat methods and chat input; a Batch is chat only when every item is."""
    if method in CHAT_METHODS:
        return CHAT
    if "requests" in request.DESCRIPTOR.fields_by_name:
        items = list(request.requests)
    else:
        items = [_inner(request)]
    return CHAT if items and all(_is_chat_input(i) for i in items) else TEXT_COMPLETION


class RequestScopeInterceptor(grpc.aio.ServerInterceptor):
    """Opens a RequestScope per generating call and records calls refused before any request."""

    def __init__(
        self,
        on_refused: Callable[[RequestRecord], None],
        identify: Callable[[Sequence[tuple[str, str | bytes]] | None], str],
        methods: Iterable[str] = GENERATING_METHODS,
    ) -> None:
        self._on_refused = on_refused
        self._identify = identify
        self._methods = frozenset(methods)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self._methods or handler.request_streaming:
            return handler
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if not inspect.iscoroutinefunction(behavior):
            return handler

        async def scoped(request, context):
            scope = RequestScope(method, operation_of(method, request), requested_model(request))
            token = _current.set(scope)
            failure: BaseException | None = None
            try:
                return await behavior(request, context)
            except BaseException as exc:
                failure = exc
                raise
            finally:
                _current.reset(token)
                if not scope.opened:
                    self._refused(scope, _inner(request), context, failure)

        factory = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return factory(
            scoped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _refused(
        self,
        scope: RequestScope,
        request: Message,
        context: grpc.aio.ServicerContext,
        failure: BaseException | None,
    ) -> None:
        code = context.code()
        if isinstance(failure, asyncio.CancelledError):
            code = grpc.StatusCode.CANCELLED
        if code is None or code == grpc.StatusCode.OK:
            return  # e.g. an empty Batch: no request, no error
        try:
            identity = self._identify(context.invocation_metadata())
        except ServiceError:
            identity = ""  # the refusal was for the key itself
        record = RequestRecord(
            request_id=str(getattr(request, "request_id", "")) or new_request_id(),
            identity_id=identity,
            method=scope.method,
            operation=scope.operation,
            model=scope.model,
        )
        record.finish()
        record.status = code
        record.error = context.details() or ""
        self._on_refused(record)
