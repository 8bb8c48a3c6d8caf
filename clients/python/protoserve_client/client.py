"""Synchronous protoserve client."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar, Unpack

import grpc

from protoserve_client._common import (
    DEFAULT_TARGET,
    NOT_READY_CODES,
    CallOptions,
    Metadata,
    batch_results,
    not_ready,
    probe_timeout,
)
from protoserve_client._stubs import inference_pb2 as pb
from protoserve_client._stubs import inference_pb2_grpc as pb_grpc
from protoserve_client.builders import (
    GenerateKwargs,
    Message,
    batch_request,
    detokenize_request,
    generate_request,
    tokenize_request,
)
from protoserve_client.errors import ProtoserveError
from protoserve_client.types import (
    GenerateResult,
    Health,
    ModelInfo,
    StreamEvent,
    StreamFinal,
    TokenizeResult,
    stream_event_from_proto,
)

_Resp = TypeVar("_Resp")


class GenerateStream:
    """Events of one ``GenerateStream`` call: deltas, then one final; iterate it once.

    ``request_id`` is known before the first event, so another thread can pass
    it to ``Client.cancel``. ``cancel()`` (or leaving a ``with`` block early)
    abandons the call from this side instead; the server then stops the
    request as it does for any client that goes away.
    """

    def __init__(self, call: Any, request_id: str) -> None:
        self._call = call
        self.request_id = request_id
        self.final: StreamFinal | None = None
        self._cancelled = False

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> StreamEvent:
        try:
            msg = next(self._call)
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                # We hung up ourselves; that is the end, not an error.
                raise StopIteration from None
            raise ProtoserveError.from_rpc_error(e) from e
        event = stream_event_from_proto(msg)
        if isinstance(event, StreamFinal):
            self.final = event
        return event

    def cancel(self) -> None:
        """Hang up the call; iteration then stops without an error."""
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Leaving early must not leave the server generating for nobody.
        if self.final is None and not self._call.done():
            self.cancel()


class Client:
    """Blocking client for ``protoserve.v1.InferenceService``.

    Args:
        target: ``host:port`` of the gRPC server.
        api_key: sent as ``authorization: Bearer <key>`` on every call.
        user_id: sent as ``x-user-id`` on every call; the server scopes Cancel by it.
        timeout: default deadline in seconds for every call (None: no deadline);
            each method's ``timeout`` overrides it.
        metadata: extra metadata for every call.
        credentials: TLS channel credentials; plaintext when None.
        options: gRPC channel options.
        wait_for_ready: queue calls while the channel connects instead of failing fast.
        channel: an existing channel to use instead of opening one; the
            client does not close a channel it did not open.

    Every method raises ``ProtoserveError`` when the call fails.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        user_id: str | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        wait_for_ready: bool = False,
        channel: grpc.Channel | None = None,
    ) -> None:
        self._owns_channel = channel is None
        if channel is None:
            channel = (
                grpc.secure_channel(target, credentials, options=options)
                if credentials is not None
                else grpc.insecure_channel(target, options=options)
            )
        self._channel = channel
        # The grpc plugin generates untyped code; the methods below type each response.
        self.stub = pb_grpc.InferenceServiceStub(channel)  # type: ignore[no-untyped-call,unused-ignore]
        self._opts = CallOptions(api_key, user_id, timeout, metadata)
        self._wait_for_ready = wait_for_ready

    def close(self) -> None:
        """Close the channel if this client opened it."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _unary(
        self,
        method: Callable[..., _Resp],
        request: Any,
        timeout: float | None,
        metadata: Metadata | None,
    ) -> _Resp:
        try:
            return method(
                request,
                timeout=self._opts.call_timeout(timeout),
                metadata=self._opts.call_metadata(metadata),
                wait_for_ready=self._wait_for_ready,
            )
        except grpc.RpcError as e:
            raise ProtoserveError.from_rpc_error(e) from e

    def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **kwargs: Unpack[GenerateKwargs],
    ) -> GenerateResult:
        """Run one request to completion.

        Give the input as ``prompt`` text, ``token_ids=[...]`` or
        ``messages=[{"role": "user", "content": "..."}]``; the other keywords
        are sampling parameters (``max_tokens``, ``temperature``, ``stop``, ...),
        ``model``, ``request_id``, ``context_policy`` and ``priority``.
        """
        req = generate_request(prompt, **kwargs)
        return GenerateResult.from_proto(self._unary(self.stub.Generate, req, timeout, metadata))

    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **kwargs: Unpack[GenerateKwargs],
    ) -> GenerateStream:
        """Start a streaming generation; iterate the result for deltas and then the final.

        Takes the same arguments as ``generate``. ``timeout`` bounds the whole stream.
        """
        req = generate_request(prompt, **kwargs)
        call = self.stub.GenerateStream(
            pb.GenerateStreamRequest(request=req),
            timeout=self._opts.call_timeout(timeout),
            metadata=self._opts.call_metadata(metadata),
            wait_for_ready=self._wait_for_ready,
        )
        return GenerateStream(call, req.request_id)

    def cancel(
        self, request_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        """Stop a running or queued request of this caller; True if one was stopped."""
        resp: pb.CancelResponse = self._unary(
            self.stub.Cancel, pb.CancelRequest(request_id=request_id), timeout, metadata
        )
        return resp.cancelled

    def batch(
        self,
        requests: Iterable[pb.GenerateRequest | Mapping[str, Any]],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> list[GenerateResult | ProtoserveError]:
        """Run many requests concurrently on the server; one result or error per request, in order.

        Each request is a ``GenerateRequest`` (see ``builders.generate_request``)
        or a dict of ``generate`` keywords such as ``{"prompt": "Hi", "max_tokens": 8}``.
        A failed request comes back as a ``ProtoserveError`` in its slot; only a
        failure of the whole call raises.
        """
        resp = self._unary(self.stub.Batch, batch_request(requests), timeout, metadata)
        return batch_results(resp)

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Iterable[Message] | None = None,
        add_generation_prompt: bool | None = None,
        model: str = "",
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> TokenizeResult:
        """Token ids and token texts of ``text`` or of chat ``messages`` rendered with the chat template."""
        req = tokenize_request(
            text,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            model=model,
            add_special_tokens=add_special_tokens,
        )
        resp = self._unary(self.stub.Tokenize, req, timeout, metadata)
        return TokenizeResult(tuple(resp.token_ids), tuple(resp.tokens), resp.max_model_len)

    def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        model: str = "",
        skip_special_tokens: bool | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> str:
        """Text of ``token_ids``."""
        req = detokenize_request(token_ids, model=model, skip_special_tokens=skip_special_tokens)
        resp: pb.DetokenizeResponse = self._unary(self.stub.Detokenize, req, timeout, metadata)
        return resp.text

    def list_models(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> list[ModelInfo]:
        """Every loaded model; the first is the default."""
        resp = self._unary(self.stub.ListModels, pb.ListModelsRequest(), timeout, metadata)
        return [ModelInfo.from_proto(m) for m in resp.models]

    def get_model(
        self, name: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ModelInfo:
        """One loaded model by name; NOT_FOUND when it is not loaded."""
        resp = self._unary(self.stub.GetModel, pb.GetModelRequest(name=name), timeout, metadata)
        return ModelInfo.from_proto(resp.model)

    def health(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> Health:
        """Readiness; raises UNAVAILABLE while the model loads or the server drains."""
        resp = self._unary(self.stub.CheckHealth, pb.CheckHealthRequest(), timeout, metadata)
        return Health.from_proto(resp)

    def wait_until_ready(self, timeout: float = 120.0, *, interval: float = 0.25) -> Health:
        """Poll ``health()`` until the server is serving, for at most ``timeout`` seconds.

        A server that is starting, loading its model or unreachable counts as
        "not yet"; after ``timeout`` the last such failure is raised. Other
        errors (say UNAUTHENTICATED from a proxy) are raised at once.
        """
        deadline = time.monotonic() + timeout
        last: ProtoserveError | None = None
        while True:
            try:
                health = self.health(timeout=probe_timeout(deadline - time.monotonic()))
                if health.serving:
                    return health
            except ProtoserveError as e:
                if e.code not in NOT_READY_CODES:
                    raise
                last = e
            if time.monotonic() + interval >= deadline:
                raise not_ready(timeout, last)
            time.sleep(interval)
