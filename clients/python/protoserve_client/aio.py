"""Asynchronous protoserve client on ``grpc.aio``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar, Unpack, cast

import grpc
import grpc.aio

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


class AsyncGenerateStream:
    """Events of one ``GenerateStream`` call as an async iterator: deltas, then one final.

    ``request_id`` is known before the first event, so another task can pass
    it to ``AsyncClient.cancel``. ``cancel()`` (or leaving an ``async with``
    block early) abandons the call from this side instead.
    """

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall[pb.GenerateStreamRequest, pb.GenerateStreamResponse],
        request_id: str,
    ) -> None:
        self._call = call
        self.request_id = request_id
        self.final: StreamFinal | None = None
        self._cancelled = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._cancelled:
            raise StopAsyncIteration
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise ProtoserveError.from_rpc_error(e) from e
        except asyncio.CancelledError:
            # grpc.aio reports a call we cancelled ourselves as CancelledError
            # from read(); only that case is a normal end. A cancelled task
            # must still see its CancelledError.
            if self._cancelled:
                raise StopAsyncIteration from None
            raise
        if msg is grpc.aio.EOF:
            raise StopAsyncIteration
        event = stream_event_from_proto(cast(pb.GenerateStreamResponse, msg))
        if isinstance(event, StreamFinal):
            self.final = event
        return event

    def cancel(self) -> None:
        """Hang up the call; iteration then stops without an error."""
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.final is None and not self._call.done():
            self.cancel()


class AsyncClient:
    """Asyncio client for ``protoserve.v1.InferenceService``; same arguments as ``Client``.

    Create it inside a running event loop (the channel binds to it) and close
    it with ``await client.close()`` or ``async with``. Every method raises
    ``ProtoserveError`` when the call fails.
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
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        self._owns_channel = channel is None
        if channel is None:
            channel = (
                grpc.aio.secure_channel(target, credentials, options=options)
                if credentials is not None
                else grpc.aio.insecure_channel(target, options=options)
            )
        self._channel = channel
        # The grpc plugin generates untyped code; the methods below type each response.
        self.stub = pb_grpc.InferenceServiceStub(channel)  # type: ignore[no-untyped-call,unused-ignore]
        self._opts = CallOptions(api_key, user_id, timeout, metadata)
        self._wait_for_ready = wait_for_ready

    async def close(self) -> None:
        """Close the channel if this client opened it."""
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _unary(
        self,
        method: Callable[..., Awaitable[_Resp]],
        request: Any,
        timeout: float | None,
        metadata: Metadata | None,
    ) -> _Resp:
        try:
            return await method(
                request,
                timeout=self._opts.call_timeout(timeout),
                metadata=self._opts.call_metadata(metadata),
                wait_for_ready=self._wait_for_ready,
            )
        except grpc.aio.AioRpcError as e:
            raise ProtoserveError.from_rpc_error(e) from e

    async def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **kwargs: Unpack[GenerateKwargs],
    ) -> GenerateResult:
        """Run one request to completion; arguments as ``Client.generate``."""
        req = generate_request(prompt, **kwargs)
        return GenerateResult.from_proto(await self._unary(self.stub.Generate, req, timeout, metadata))

    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **kwargs: Unpack[GenerateKwargs],
    ) -> AsyncGenerateStream:
        """Start a streaming generation; ``async for`` over the result yields deltas, then the final.

        Not a coroutine: the call starts at once and events arrive as they are
        read. ``timeout`` bounds the whole stream.
        """
        req = generate_request(prompt, **kwargs)
        call = self.stub.GenerateStream(
            pb.GenerateStreamRequest(request=req),
            timeout=self._opts.call_timeout(timeout),
            metadata=self._opts.call_metadata(metadata),
            wait_for_ready=self._wait_for_ready,
        )
        return AsyncGenerateStream(call, req.request_id)

    async def cancel(
        self, request_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        """Stop a running or queued request of this caller; True if one was stopped."""
        resp: pb.CancelResponse = await self._unary(
            self.stub.Cancel, pb.CancelRequest(request_id=request_id), timeout, metadata
        )
        return resp.cancelled

    async def batch(
        self,
        requests: Iterable[pb.GenerateRequest | Mapping[str, Any]],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> list[GenerateResult | ProtoserveError]:
        """Run many requests concurrently on the server; one result or error per request, in order."""
        resp = await self._unary(self.stub.Batch, batch_request(requests), timeout, metadata)
        return batch_results(resp)

    async def tokenize(
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
        resp = await self._unary(self.stub.Tokenize, req, timeout, metadata)
        return TokenizeResult(tuple(resp.token_ids), tuple(resp.tokens), resp.max_model_len)

    async def detokenize(
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
        resp: pb.DetokenizeResponse = await self._unary(self.stub.Detokenize, req, timeout, metadata)
        return resp.text

    async def list_models(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> list[ModelInfo]:
        """Every loaded model; the first is the default."""
        resp = await self._unary(self.stub.ListModels, pb.ListModelsRequest(), timeout, metadata)
        return [ModelInfo.from_proto(m) for m in resp.models]

    async def get_model(
        self, name: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ModelInfo:
        """One loaded model by name; NOT_FOUND when it is not loaded."""
        resp = await self._unary(self.stub.GetModel, pb.GetModelRequest(name=name), timeout, metadata)
        return ModelInfo.from_proto(resp.model)

    async def health(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> Health:
        """Readiness; raises UNAVAILABLE while the model loads or the server drains."""
        resp = await self._unary(self.stub.CheckHealth, pb.CheckHealthRequest(), timeout, metadata)
        return Health.from_proto(resp)

    async def wait_until_ready(self, timeout: float = 120.0, *, interval: float = 0.25) -> Health:
        """Poll ``health()`` until the server is serving; as ``Client.wait_until_ready``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: ProtoserveError | None = None
        while True:
            try:
                health = await self.health(timeout=probe_timeout(deadline - loop.time()))
                if health.serving:
                    return health
            except ProtoserveError as e:
                if e.code not in NOT_READY_CODES:
                    raise
                last = e
            if loop.time() + interval >= deadline:
                raise not_ready(timeout, last)
            await asyncio.sleep(interval)
