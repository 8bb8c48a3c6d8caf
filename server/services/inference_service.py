"""InferenceService: protoserve's own gRPC API on top of the served model and the engine."""

from __future__ import annotations

import asyncio

import grpc

from protoserve.server import errors
from protoserve.server.calls.admission import AdmittingServicer
from protoserve.server.calls.inflight import Call
from protoserve.server.limits import MAX_BATCH_REQUESTS, MAX_REQUEST_ID_CHARS
from protoserve.server.models.served_model import CollectedOutput, new_request_id
from protoserve.server.runtime.health import CHECK_HEALTH
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc


def check_request_id(request_id: str, path: str = "request_id") -> None:
    """INVALID_ARGUMENT for a client-chosen id over the cap, before any call is registered under it."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise errors.invalid_argument([(path, f"must be at most {MAX_REQUEST_ID_CHARS} characters")])


def call_deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline in event-loop time, or None when the client set none."""
    remaining = context.time_remaining()
    if remaining is None:
        return None
    return asyncio.get_running_loop().time() + max(0.0, remaining)


class InferenceService(AdmittingServicer, inference_pb2_grpc.InferenceServiceServicer):
    """Generate, stream, batch, cancel, tokenize and describe models over gRPC."""

    async def _run(self, call: Call, request: pb.GenerateRequest, request_id: str, path_prefix: str = ""):
        """Validate and run one GenerateRequest inside ``call``; returns its CollectedOutput."""
        served = self.models.get(request.model)
        tokenized = await served.tokenized_request(
            request,
            request_id=f"{request_id}.{new_request_id('e')}",
            cache_salt=call.identity.cache_salt,
            path_prefix=path_prefix,
        )
        result = CollectedOutput(n=tokenized.sampling.n)
        async for output in self.inflight.generate(call, served.engine, tokenized):
            result.add(output)
        return served, result

    @errors.reports_errors
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        """Run one request to completion and return every choice."""
        identity = self._admit(context)
        check_request_id(request.request_id)
        request_id = request.request_id or new_request_id()
        async with self.inflight.call(identity, request_id, call_deadline(context)) as call:
            served, result = await self._run(call, request, request_id)
        return served.response_to_proto(request_id, result)

    @errors.reports_errors
    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Stream each delta as soon as the engine yields it, then one final message."""
        # Written with context.write (not yield) so a client going away cancels this
        # coroutine at the write and the engine request is aborted right there.
        identity = self._admit(context)
        inner = request.request
        check_request_id(inner.request_id)
        request_id = inner.request_id or new_request_id()
        async with self.inflight.call(identity, request_id, call_deadline(context)) as call:
            served = self.models.get(inner.model)
            tokenized = await served.tokenized_request(
                inner, request_id=f"{request_id}.{new_request_id('e')}", cache_salt=identity.cache_salt
            )
            result = CollectedOutput(n=tokenized.sampling.n)
            async for output in self.inflight.generate(call, served.engine, tokenized):
                result.add(output)
                for delta in output.deltas:
                    # A delta may only carry a finish reason; that goes in the final message.
                    if delta.text or delta.token_ids or delta.logprobs:
                        await context.write(
                            pb.GenerateStreamResponse(
                                request_id=request_id, delta=served.delta_to_proto(delta)
                            )
                        )
        await context.write(
            pb.GenerateStreamResponse(request_id=request_id, final=served.final_to_proto(result))
        )

    @errors.reports_errors
    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        """Stop the caller's own running or queued request; others' requests are NOT_FOUND."""
        identity = self.auth.identify(context.invocation_metadata())
        if not request.request_id:
            raise errors.invalid_argument([("request_id", "is required")])
        check_request_id(request.request_id)
        return pb.CancelResponse(cancelled=self.inflight.cancel(identity, request.request_id))

    @errors.reports_errors
    async def Batch(self, request: pb.BatchRequest, context: grpc.aio.ServicerContext) -> pb.BatchResponse:
        """Run every request concurrently; a failing request fails only its own result."""
        identity = self._admit(context)
        if len(request.requests) > MAX_BATCH_REQUESTS:
            raise errors.invalid_argument([("requests", f"at most {MAX_BATCH_REQUESTS} requests per batch")])
        for index, item in enumerate(request.requests):
            check_request_id(item.request_id, f"requests[{index}].request_id")
        ids = [r.request_id or new_request_id() for r in request.requests]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            shown = ", ".join(errors.echo(i) for i in duplicates[:3])
            more = f" and {len(duplicates) - 3} more" if len(duplicates) > 3 else ""
            raise errors.invalid_argument([("requests", f"request ids must be unique; repeated: {shown}{more}")])
        deadline = call_deadline(context)

        async def one(index: int) -> pb.BatchResult:
            try:
                async with self.inflight.call(identity, ids[index], deadline) as call:
                    served, result = await self._run(
                        call, request.requests[index], ids[index], path_prefix=f"requests[{index}]."
                    )
                return pb.BatchResult(response=served.response_to_proto(ids[index], result))
            except Exception as exc:  # noqa: BLE001 - reported in this item's result, as the unary RPC would
                return pb.BatchResult(error=errors.to_rpc_status(exc))

        # A TaskGroup (not gather) so a cancelled Batch waits for every item to abort.
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i)) for i in range(len(request.requests))]
        return pb.BatchResponse(results=[t.result() for t in tasks])

    @errors.reports_errors
    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        """Text or chat → token ids and their texts."""
        self._admit(context)
        return await self.models.get(request.model).tokenize(request)

    @errors.reports_errors
    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        """Token ids → text."""
        self._admit(context)
        return self.models.get(request.model).detokenize(request)

    @errors.reports_errors
    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        """Every loaded model, the default first, embedding models after the generative ones."""
        with_path = self.auth.is_operator(self._admit(context))
        return pb.ListModelsResponse(models=[f.model_info(with_path=with_path) for f in self.models.listing()])

    @errors.reports_errors
    async def GetModel(self, request: pb.GetModelRequest, context: grpc.aio.ServicerContext):
        """One loaded model, of any kind, by name or alias."""
        with_path = self.auth.is_operator(self._admit(context))
        if not request.name:
            raise errors.invalid_argument([("name", "is required")])
        return pb.GetModelResponse(model=self.models.describe(request.name).model_info(with_path=with_path))

    @errors.reports_errors
    async def CheckHealth(self, request: pb.CheckHealthRequest, context: grpc.aio.ServicerContext):
        """SERVING with the model names, or UNAVAILABLE while loading or draining (no auth: it is a probe)."""
        self.readiness.note_check(CHECK_HEALTH)
        self.readiness.check()
        return pb.CheckHealthResponse(status=pb.SERVING_STATUS_SERVING, models=[m.name for m in self.models.listing()])
