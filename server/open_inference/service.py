"""``inference.GRPCInferenceService``: the Open Inference Protocol (KServe v2 / Triton) on our port.

Two kinds of model answer it: each served LLM, with the tensors of Triton's vLLM backend
(open_inference.llm_tensors), and the embedding model (open_inference.embedding_tensors). Every
model has the one version "1". Liveness and readiness are probes, answered without a key; the
rest is admitted, metered and scheduled per identity exactly as the native RPCs are: a request is
a native GenerateRequest run through the same in-flight registry. ModelStreamInfer runs the
requests of one stream concurrently and reports a failed request in the stream
(``error_message``), as Triton does, so the others go on. The model repository, statistics,
shared-memory, trace and log RPCs are UNIMPLEMENTED, saying what is served.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from protoserve.open_inference import grpc_service_pb2 as oip
from protoserve.open_inference import grpc_service_pb2_grpc
from protoserve.server import errors
from protoserve.server.calls.admission import Admission, AdmittingServicer
from protoserve.server.calls.inflight import Call
from protoserve.server.calls.request_scope import item_scope, not_generating
from protoserve.server.models.served_model import ServedModel, new_request_id
from protoserve.server.open_inference import embedding_tensors, llm_tensors
from protoserve.server.open_inference.llm_tensors import LlmCall
from protoserve.server.open_inference.tensors import TensorSpec, bytes_output, decode_inputs, fp32_output
from protoserve.server.security.auth import Identity
from protoserve.server.services.embeddings import ServedEmbedder
from protoserve.server.services.inference_service import call_deadline, check_request_id
from protoserve.v1 import inference_pb2

SERVER_NAME = "protoserve"
MODEL_VERSION = "1"
PLATFORM = "protoserve"
# Protocol extensions served: typed request parameters, the REST binary tensor data and generate routes.
EXTENSIONS = ("parameters", "binary_tensor_data", "generate")
FINAL_RESPONSE = "triton_final_response"
SERVED_RPCS = "ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelInfer and ModelStreamInfer"

Send = Callable[[oip.ModelStreamInferResponse], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class _Answer:
    """One response's output tensor and its raw data."""

    tensor: oip.ModelInferResponse.InferOutputTensor
    raw: bytes


def _server_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("protoserve")
    except PackageNotFoundError:
        return "0"


class OpenInferenceService(AdmittingServicer, grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    """The Open Inference Protocol over the served LLMs and the embedding model."""

    def __init__(self, admission: Admission) -> None:
        super().__init__(admission)
        self.version = _server_version()

    # ---- health and metadata -------------------------------------------------------------

    async def ServerLive(self, request: oip.ServerLiveRequest, context) -> oip.ServerLiveResponse:
        """Live while the process answers (a probe: no key)."""
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(self, request: oip.ServerReadyRequest, context) -> oip.ServerReadyResponse:
        """Ready once the model is loaded, until draining (a probe: no key)."""
        return oip.ServerReadyResponse(ready=self.readiness.serving)

    async def ModelReady(self, request: oip.ModelReadyRequest, context) -> oip.ModelReadyResponse:
        """Whether that model (and version) is served now; an unknown one is not ready (a probe: no key)."""
        if not self.readiness.serving or request.version not in ("", MODEL_VERSION):
            return oip.ModelReadyResponse(ready=False)
        try:
            self.models.describe(request.name)
        except errors.ServiceError:
            return oip.ModelReadyResponse(ready=False)
        return oip.ModelReadyResponse(ready=True)

    @errors.reports_errors
    async def ServerMetadata(self, request: oip.ServerMetadataRequest, context) -> oip.ServerMetadataResponse:
        """The server's name, version and the protocol extensions it serves."""
        self.auth.identify(context.invocation_metadata())
        return oip.ServerMetadataResponse(name=SERVER_NAME, version=self.version, extensions=EXTENSIONS)

    @errors.reports_errors
    async def ModelMetadata(self, request: oip.ModelMetadataRequest, context) -> oip.ModelMetadataResponse:
        """A model's tensors: what ModelInfer takes and gives."""
        self._admit(context)
        model = self._model(request.name, request.version, "name", "version")
        if isinstance(model, ServedEmbedder):
            inputs, outputs = embedding_tensors.inputs(), embedding_tensors.outputs(model.dimensions)
        else:
            inputs, outputs = llm_tensors.INPUTS, llm_tensors.OUTPUTS
        return oip.ModelMetadataResponse(
            name=model.name,
            versions=[MODEL_VERSION],
            platform=PLATFORM,
            inputs=[spec.to_proto() for spec in inputs],
            outputs=[spec.to_proto() for spec in outputs],
        )

    # ---- inference -------------------------------------------------------------------------

    @errors.reports_errors
    async def ModelInfer(self, request: oip.ModelInferRequest, context) -> oip.ModelInferResponse:
        """One request, answered once (an LLM request with ``stream`` true needs ModelStreamInfer)."""
        identity = self._admit(context)
        model = self._model(request.model_name, request.model_version)
        if isinstance(model, ServedEmbedder):
            answer = await self._embed(identity, model, request)
        else:
            llm = self._llm_call(model, request, streaming_rpc=False)
            answer = await self._generate_once(identity, model, llm, call_deadline(context))
        return self._response(model.name, request, answer)

    @errors.reports_errors
    async def ModelStreamInfer(self, requests: AsyncIterator[oip.ModelInferRequest], context) -> None:
        """Every request of the stream runs as it arrives; its responses (or its error) come back in order."""
        identity = self._admit(context)
        lock = asyncio.Lock()

        async def send(response: oip.ModelStreamInferResponse) -> None:
            async with lock:  # one writer at a time: the requests of a stream run concurrently
                await context.write(response)

        deadline = call_deadline(context)
        try:
            async with asyncio.TaskGroup() as group:
                async for request in requests:
                    group.create_task(self._stream_one(identity, request, send, deadline))
        except BaseExceptionGroup as failed:
            # What ended the stream (a request refused as it was decoded aborts the call), as itself:
            # the group would reach reports_errors as an unknown error.
            raise failed.exceptions[0] from None

    async def _stream_one(self, identity: Identity, request: oip.ModelInferRequest, send: Send, deadline) -> None:
        try:
            with item_scope(request, identity.id):  # logged and counted as its own request
                await self._stream_answer(identity, request, send, deadline)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - reported in the stream, as Triton does; the stream goes on
            await send(oip.ModelStreamInferResponse(error_message=errors.to_service_error(exc).message))

    async def _stream_answer(self, identity: Identity, request: oip.ModelInferRequest, send: Send, deadline) -> None:
        self.readiness.check()
        model = self._model(request.model_name, request.model_version)
        if isinstance(model, ServedEmbedder):
            answer = await self._embed(identity, model, request)
            await send(self._stream_response(model.name, request, answer, final=True))
            return
        llm = self._llm_call(model, request, streaming_rpc=True)
        if not llm.stream:
            answer = await self._generate_once(identity, model, llm, deadline)
            await send(self._stream_response(model.name, request, answer, final=True))
            return
        await self._generate_stream(identity, model, llm, request, send, deadline)

    def _model(self, name: str, version: str, name_field: str = "model_name",
               version_field: str = "model_version") -> ServedModel | ServedEmbedder:
        if not name:
            raise errors.invalid_argument([(name_field, "is required")])
        # Either kind, by name or alias: the tensors it takes follow from the model it names.
        model = self.models.describe(name)
        if version not in ("", MODEL_VERSION):
            raise errors.ServiceError(
                grpc.StatusCode.NOT_FOUND,
                inference_pb2.ERROR_REASON_MODEL_NOT_FOUND,
                f"{version_field}: model {errors.echo(name)} has no version {errors.echo(version)}; "
                f"its one version is {MODEL_VERSION!r}",
            )
        return model

    def _llm_call(self, served: ServedModel, request: oip.ModelInferRequest, *, streaming_rpc: bool) -> LlmCall:
        _check_requested_outputs(request, llm_tensors.OUTPUTS)
        check_request_id(request.id, "id")
        return llm_tensors.read_llm_call(served.name, request, decode_inputs(request), streaming_rpc=streaming_rpc)

    async def _run(self, call: Call, served: ServedModel, llm: LlmCall) -> AsyncIterator[str]:
        """The request's text as the engine produces it, each new piece once."""
        try:
            tokenized = await served.tokenized_request(
                llm.request, request_id=f"{call.public_id}.{new_request_id('e')}",
                cache_salt=call.identity.cache_salt,
            )
        except errors.ServiceError as exc:
            if not exc.violations:
                raise
            # The native request's field paths, renamed to the tensors and keys this caller sent.
            raise errors.invalid_argument([(llm.field_path(f), p) for f, p in exc.violations]) from None
        async for output in self.inflight.generate(call, served.engine, tokenized):
            for delta in output.deltas:
                if delta.text:
                    yield delta.text

    async def _generate_once(self, identity: Identity, served: ServedModel, llm: LlmCall, deadline) -> _Answer:
        request_id = llm.request.request_id or new_request_id()
        async with self.inflight.call(identity, request_id, deadline) as call:
            pieces = [piece async for piece in self._run(call, served, llm)]
        text = ("" if llm.exclude_input else llm.prompt) + "".join(pieces)
        return _Answer(*bytes_output(llm_tensors.TEXT_OUTPUT.name, [text]))

    async def _generate_stream(
        self, identity: Identity, served: ServedModel, llm: LlmCall, request: oip.ModelInferRequest, send: Send,
        deadline,
    ) -> None:
        """Deltas as they come; the last one flagged final, or an empty final response when asked for."""
        request_id = llm.request.request_id or new_request_id()
        name = llm_tensors.TEXT_OUTPUT.name
        pending: str | None = None  # held back one piece, so the last can carry the final flag
        async with self.inflight.call(identity, request_id, deadline) as call:
            async for piece in self._run(call, served, llm):
                if pending is not None:
                    await send(self._stream_response(served.name, request, _Answer(*bytes_output(name, [pending])),
                                                     final=False))
                pending = piece
        if llm.empty_final_response:
            if pending is not None:
                await send(self._stream_response(served.name, request, _Answer(*bytes_output(name, [pending])),
                                                 final=False))
            await send(self._stream_response(served.name, request, None, final=True))
        else:
            answer = _Answer(*bytes_output(name, [pending or ""]))
            await send(self._stream_response(served.name, request, answer, final=True))

    async def _embed(self, identity: Identity, embedder: ServedEmbedder, request: oip.ModelInferRequest) -> _Answer:
        not_generating()  # an embedding call, as Embed: not a request of the request log's
        specs = embedding_tensors.outputs(embedder.dimensions)
        _check_requested_outputs(request, specs)
        if request.parameters:
            key = sorted(request.parameters)[0]
            raise errors.invalid_argument([(f"parameters.{key}", f"{embedder.name} takes no parameters")])
        texts = embedding_tensors.read_texts(embedder.name, decode_inputs(request))
        meter = embedder.meter(self.inflight, identity)
        meter.admit()
        try:
            done = await embedder.embed_texts(
                texts, embedding_tensors.TEXT_INPUT.name, tenant=identity.id, charge=meter.charge
            )
        finally:
            meter.record()
        return _Answer(*fp32_output(embedding_tensors.EMBEDDING, done.vectors))

    @staticmethod
    def _response(model: str, request: oip.ModelInferRequest, answer: _Answer | None) -> oip.ModelInferResponse:
        response = oip.ModelInferResponse(model_name=model, model_version=MODEL_VERSION, id=request.id)
        if answer is not None:
            response.outputs.append(answer.tensor)
            response.raw_output_contents.append(answer.raw)
        return response

    def _stream_response(
        self, model: str, request: oip.ModelInferRequest, answer: _Answer | None, *, final: bool
    ) -> oip.ModelStreamInferResponse:
        response = self._response(model, request, answer)
        response.parameters[FINAL_RESPONSE].bool_param = final
        return oip.ModelStreamInferResponse(infer_response=response)

    # ---- the rest of Triton's RPCs ---------------------------------------------------------

    async def _unimplemented(self, rpc: str, context) -> None:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"{rpc} is not served: protoserve serves {SERVED_RPCS} of inference.GRPCInferenceService "
            "(ModelMetadata describes each model's tensors)",
        )

    async def ModelConfig(self, request, context):
        await self._unimplemented("ModelConfig", context)

    async def ModelStatistics(self, request, context):
        await self._unimplemented("ModelStatistics", context)

    async def RepositoryIndex(self, request, context):
        await self._unimplemented("RepositoryIndex", context)

    async def RepositoryModelLoad(self, request, context):
        await self._unimplemented("RepositoryModelLoad", context)

    async def RepositoryModelUnload(self, request, context):
        await self._unimplemented("RepositoryModelUnload", context)

    async def SystemSharedMemoryStatus(self, request, context):
        await self._unimplemented("SystemSharedMemoryStatus", context)

    async def SystemSharedMemoryRegister(self, request, context):
        await self._unimplemented("SystemSharedMemoryRegister", context)

    async def SystemSharedMemoryUnregister(self, request, context):
        await self._unimplemented("SystemSharedMemoryUnregister", context)

    async def CudaSharedMemoryStatus(self, request, context):
        await self._unimplemented("CudaSharedMemoryStatus", context)

    async def CudaSharedMemoryRegister(self, request, context):
        await self._unimplemented("CudaSharedMemoryRegister", context)

    async def CudaSharedMemoryUnregister(self, request, context):
        await self._unimplemented("CudaSharedMemoryUnregister", context)

    async def TraceSetting(self, request, context):
        await self._unimplemented("TraceSetting", context)

    async def LogSettings(self, request, context):
        await self._unimplemented("LogSettings", context)


def _check_requested_outputs(request: oip.ModelInferRequest, outputs: tuple[TensorSpec, ...]) -> None:
    names = {spec.name for spec in outputs}
    for index, wanted in enumerate(request.outputs):
        where = wanted.name or f"outputs[{index}]"
        if wanted.name not in names:
            raise errors.invalid_argument([(where, f"is not an output of {request.model_name}; it gives {', '.join(sorted(names))}")])
        if wanted.parameters:
            raise errors.invalid_argument([(where, f"output parameters are not supported (got {', '.join(sorted(wanted.parameters))})")])
