"""RequestScope: what a generating RPC knows about itself, for the requests it runs.

An interceptor opens a scope around each call of a generating method (Generate,
GenerateStream, Batch, the OpenAI completions and chat completions, agent runs, the Open
Inference Protocol's ModelInfer and ModelStreamInfer). It names
the gRPC method and the GenAI operation (``chat`` for chat input, else
``text_completion``) for the in-flight registry, which records each request it
runs and marks the scope, with the model the call named. A call that fails
before any request was opened (bad API key, model still loading, invalid OpenAI
parameters) is recorded here as one refused request, so metrics and the request
log see every error a caller got; without a request id of its own (OpenAI calls
have none), it is logged under a fresh one, so that every line can be told apart.

A client-streaming call (ModelStreamInfer) answers each of its requests in the stream, its
failures included, and the call itself goes on: each request runs in an :func:`item_scope` of its
own, which names its model and records it as refused when it fails before opening a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message

from protoserve.engine.api import CHAT, TEXT_COMPLETION
from protoserve.open_inference import grpc_service_pb2
from protoserve.openai.v1 import openai_pb2
from protoserve.server.calls.request_record import RequestRecord
from protoserve.server.errors import ServiceError
from protoserve.server.models.served_model import new_request_id
from protoserve.v1 import agent_pb2, inference_pb2

_INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]
_OPENAI = openai_pb2.DESCRIPTOR.services_by_name["OpenAIService"]
_AGENT = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
_OPEN_INFERENCE = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]


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
    + [_full(_OPEN_INFERENCE, m) for m in ("ModelInfer", "ModelStreamInfer")]
)


@dataclass
class RequestScope:
    """One generating RPC: its method, operation, the model it named and how many requests it opened."""

    method: str
    operation: str = TEXT_COMPLETION
    model: str = ""  # the request's ``model`` as the caller sent it ("" when it names none)
    opened: int = 0
    # False once the call turned out not to generate (ModelInfer to the embedding model): like
    # Embed, it is then no request of the log's or the request counters'.
    generating: bool = True
    # Records a request refused before it opened one; item scopes record their own with it.
    on_refused: Callable[[RequestRecord], None] | None = None


_current: ContextVar[RequestScope | None] = ContextVar("protoserve_request_scope", default=None)


def current_scope() -> RequestScope | None:
    """The scope of the RPC this task serves (Batch items share their call's), or None."""
    return _current.get()


def _inner(request: Message) -> Message:
    """The request message itself; streaming RPCs wrap it in a ``request`` field."""
    wrapped = getattr(request, "request", None)
    return wrapped if isinstance(wrapped, Message) else request


def requested_model(request: Message) -> str:
    """The ``model`` (Open Inference: ``model_name``) the request names, unchecked ("" when it has
    no such field or leaves it empty)."""
    inner = _inner(request)
    fields = inner.DESCRIPTOR.fields_by_name
    name = next((n for n in ("model", "model_name") if n in fields), None)
    value = getattr(inner, name) if name is not None else ""
    return value if isinstance(value, str) else ""


def _request_id(request: Message | None) -> str:
    """The caller's id for the request (``request_id``, Open Inference's ``id``), else ""."""
    if request is None:
        return ""
    fields = request.DESCRIPTOR.fields_by_name
    name = next((n for n in ("request_id", "id") if n in fields), None)
    value = getattr(request, name) if name is not None else ""
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


def not_generating() -> None:
    """The current call generates nothing after all (see RequestScope.generating)."""
    scope = current_scope()
    if scope is not None:
        scope.generating = False


@contextlib.contextmanager
def item_scope(request: Message, identity_id: str) -> Iterator[None]:
    """One request of a client-streaming call, answered in the stream: its own scope, recorded as
    refused with the error it raises before opening a request (the call itself goes on)."""
    call = current_scope()
    if call is None:
        yield
        return
    scope = RequestScope(call.method, operation_of(call.method, request), requested_model(request),
                         on_refused=call.on_refused)
    token = _current.set(scope)
    try:
        yield
    except Exception as exc:
        if not scope.opened and scope.generating and scope.on_refused is not None:
            record = _record(scope, request, identity_id)
            record.finish(exc)
            scope.on_refused(record)
        raise
    finally:
        _current.reset(token)
        # Each item is a request of the call, recorded here (or, not generating, left out): the
        # call's own failure is recorded only when it had none.
        call.opened += max(scope.opened, 1)


def _record(scope: RequestScope, request: Message | None, identity_id: str) -> RequestRecord:
    """The record of a request refused before it opened one (finished by the caller)."""
    return RequestRecord(
        request_id=_request_id(request) or new_request_id(),
        identity_id=identity_id,
        method=scope.method,
        operation=scope.operation,
        model=scope.model,
    )


_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


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
        if handler is None or method not in self._methods:
            return handler
        if handler.request_streaming:
            behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary
        else:
            behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if not inspect.iscoroutinefunction(behavior):
            return handler

        async def scoped(request, context):
            # A client stream's requests are not known yet: each opens its item_scope.
            first = None if handler.request_streaming else request
            scope = RequestScope(
                method,
                operation_of(method, first) if first is not None else TEXT_COMPLETION,
                requested_model(first) if first is not None else "",
                on_refused=self._on_refused,
            )
            token = _current.set(scope)
            failure: BaseException | None = None
            try:
                return await behavior(request, context)
            except BaseException as exc:
                failure = exc
                raise
            finally:
                _current.reset(token)
                if not scope.opened and scope.generating:
                    self._refused(scope, _inner(first) if first is not None else None, context, failure)

        factory = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
        return factory(
            scoped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _refused(
        self,
        scope: RequestScope,
        request: Message | None,
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
        record = _record(scope, request, identity)
        record.finish()
        record.status = code
        record.error = context.details() or ""
        self._on_refused(record)
