"""A scriptable fake gRPC backend and a gateway-in-a-thread helper for the gateway tests.

The fake backend (a plain ``grpc.server`` with the generated servicer bases)
answers on demand with any status, rich detail, stream shape or delay, which
the real model cannot do; the live-server tests cover real behaviour. Each
gateway runs on its own event loop in a background thread so that sync
clients (httpx, the sync ``openai`` client) can talk to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from google.protobuf import duration_pb2, json_format
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from protoserve.gateway.app import GatewayServer
from protoserve.gateway.runtime.handler import GatewaySettings
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.openai.v1 import openai_pb2_grpc as oa_grpc
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc as pb_grpc


def rich_status(code: int, message: str, *details) -> status_pb2.Status:
    """A google.rpc.Status with packed details."""
    status = status_pb2.Status(code=code, message=message)
    for detail in details:
        status.details.add().Pack(detail)
    return status


def scripted_error(code_name: str) -> status_pb2.Status:
    """The status the fake answers for a prompt ``error:<CODE_NAME>``: ErrorInfo plus code-specific details."""
    code = code_pb2.Code.Value(code_name)
    details: list = [error_details_pb2.ErrorInfo(reason=f"TEST_{code_name}", domain="protoserve")]
    if code == code_pb2.INVALID_ARGUMENT:
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field="temperature", description="must be >= 0"
                    ),
                    error_details_pb2.BadRequest.FieldViolation(field="top_p", description="must be <= 1"),
                ]
            )
        )
    if code == code_pb2.RESOURCE_EXHAUSTED:
        details.append(
            error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=2, nanos=500_000_000))
        )
    return rich_status(code, f"scripted {code_name}", *details)


@dataclass
class CallLog:
    """What the fake saw: per call, the method, request, metadata and deadline; cancellations."""

    calls: list[tuple[str, object, dict[str, str], float | None]] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    stream_cancel_times: list[float] = field(default_factory=list)

    def record(self, method: str, request, context: grpc.ServicerContext) -> None:
        self.calls.append((method, request, dict(context.invocation_metadata()), context.time_remaining()))

    def last(self, method: str):
        for call in reversed(self.calls):
            if call[0] == method:
                return call
        raise AssertionError(f"{method} was never called")


def _abort(context: grpc.ServicerContext, status: status_pb2.Status):
    context.abort_with_status(rpc_status.to_status(status))


def _wait_while_active(context: grpc.ServicerContext, log: CallLog, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while context.is_active() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not context.is_active():
        log.cancelled.set()


class FakeInference(pb_grpc.InferenceServiceServicer):
    """InferenceService scripted by the prompt: ``error:<CODE>``, ``sleep``, ``mid-error``, ``slow``."""

    def __init__(self, log: CallLog) -> None:
        self.log = log

    def Generate(self, request, context):
        self.log.record("Generate", request, context)
        if request.prompt.startswith("error:"):
            _abort(context, scripted_error(request.prompt.removeprefix("error:")))
        if request.prompt == "sleep":
            _wait_while_active(context, self.log, 10)
        return pb.GenerateResponse(
            request_id=request.request_id or "gen-1",
            model=request.model or "fake",
            choices=[
                pb.Choice(
                    index=0, text=request.prompt[::-1], token_ids=[1, 2], finish_reason=pb.FINISH_REASON_STOP
                )
            ],
            usage=pb.Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5),
            stats=pb.RequestStats(kv_bytes=12_345_678_901, e2e_time_s=0.5),
        )

    def GenerateStream(self, request, context):
        self.log.record("GenerateStream", request, context)
        prompt = request.request.prompt
        if prompt.startswith("error:"):
            _abort(context, scripted_error(prompt.removeprefix("error:")))
        count = 200 if prompt == "slow" else 3
        context.add_callback(lambda: self.log.stream_cancel_times.append(time.monotonic()))
        for index in range(count):
            if not context.is_active():
                self.log.cancelled.set()
                return
            yield pb.GenerateStreamResponse(
                request_id="s-1", delta=pb.GenerateDelta(index=0, text="abc"[index % 3])
            )
            if prompt == "mid-error" and index == 1:
                _abort(context, rich_status(code_pb2.INTERNAL, "engine failed mid-stream"))
            if prompt == "slow":
                time.sleep(0.05)
        yield pb.GenerateStreamResponse(
            request_id="s-1",
            final=pb.GenerateFinal(
                choices=[pb.ChoiceFinish(index=0, finish_reason=pb.FINISH_REASON_LENGTH)],
                usage=pb.Usage(prompt_tokens=1, completion_tokens=3, total_tokens=4),
                model="fake",
            ),
        )

    def Cancel(self, request, context):
        self.log.record("Cancel", request, context)
        return pb.CancelResponse(cancelled=request.request_id == "running")

    def Batch(self, request, context):
        self.log.record("Batch", request, context)
        results = []
        for item in request.requests:
            if item.prompt.startswith("error:"):
                results.append(pb.BatchResult(error=scripted_error(item.prompt.removeprefix("error:"))))
            else:
                results.append(pb.BatchResult(response=pb.GenerateResponse(model="fake")))
        return pb.BatchResponse(results=results)

    def Tokenize(self, request, context):
        self.log.record("Tokenize", request, context)
        return pb.TokenizeResponse(
            token_ids=[ord(c) for c in request.text], tokens=list(request.text), max_model_len=2048
        )

    def Detokenize(self, request, context):
        self.log.record("Detokenize", request, context)
        return pb.DetokenizeResponse(text="".join(chr(i) for i in request.token_ids))

    def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.ModelInfo(name="fake", num_parameters=135_000_000)])

    def GetModel(self, request, context):
        self.log.record("GetModel", request, context)
        if request.name != "fake":
            _abort(context, rich_status(code_pb2.NOT_FOUND, f"model {request.name!r} is not loaded"))
        return pb.GetModelResponse(model=pb.ModelInfo(name="fake"))

    def CheckHealth(self, request, context):
        return pb.CheckHealthResponse(status=pb.SERVING_STATUS_SERVING, models=["fake"])


class FakeOpenAI(oa_grpc.OpenAIServiceServicer):
    """OpenAIService: echoes the parsed prompt; model ``missing`` is NOT_FOUND, negative temperature invalid,
    model ``error:<CODE>`` fails with that code, model ``mid-error`` fails a stream after its first chunk."""

    def __init__(self, log: CallLog) -> None:
        self.log = log

    def _check(self, request, context) -> None:
        if request.model == "missing":
            _abort(
                context,
                rich_status(
                    code_pb2.NOT_FOUND,
                    "model 'missing' is not loaded",
                    error_details_pb2.ErrorInfo(reason="MODEL_NOT_FOUND", domain="protoserve"),
                ),
            )
        if request.HasField("temperature") and request.temperature < 0:
            _abort(context, scripted_error("INVALID_ARGUMENT"))
        if request.model.startswith("error:"):
            _abort(context, scripted_error(request.model.removeprefix("error:")))

    def CreateCompletion(self, request, context):
        self.log.record("CreateCompletion", request, context)
        self._check(request, context)
        prompt = json_format.MessageToJson(request.prompt, indent=None)
        return oa.CreateCompletionResponse(
            id="cmpl-1",
            object="text_completion",
            created=1700000000,
            model=request.model,
            choices=[oa.CompletionChoice(text=prompt, index=0, finish_reason="stop")],
            usage=oa.Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
        )

    def CreateCompletionStream(self, request, context):
        self.log.record("CreateCompletionStream", request, context)
        self._check(request.request, context)
        chunk = dict(id="cmpl-1", object="text_completion", created=1700000000, model=request.request.model)
        for index, text in enumerate(["Hel", "lo"]):
            if index == 1 and request.request.model == "mid-error":
                _abort(context, rich_status(code_pb2.UNAVAILABLE, "engine stopped"))
            finish = {"finish_reason": "length"} if index == 1 else {}
            yield oa.CreateCompletionStreamResponse(
                **chunk, choices=[oa.CompletionChoice(text=text, index=0, **finish)]
            )
        if request.request.stream_options.include_usage:
            yield oa.CreateCompletionStreamResponse(
                **chunk, usage=oa.Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
            )

    def CreateChatCompletion(self, request, context):
        self.log.record("CreateChatCompletion", request, context)
        self._check(request, context)
        return oa.CreateChatCompletionResponse(
            id="chatcmpl-1",
            object="chat.completion",
            created=1700000000,
            model=request.model,
            choices=[
                oa.ChatCompletionChoice(
                    index=0,
                    message=oa.ChatCompletionMessage(role="assistant", content="Hi!"),
                    finish_reason="stop",
                )
            ],
            usage=oa.Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7),
        )

    def CreateChatCompletionStream(self, request, context):
        self.log.record("CreateChatCompletionStream", request, context)
        self._check(request.request, context)
        chunk = dict(
            id="chatcmpl-1", object="chat.completion.chunk", created=1700000000, model=request.request.model
        )
        yield oa.CreateChatCompletionStreamResponse(
            **chunk,
            choices=[
                oa.ChatCompletionChunkChoice(
                    index=0, delta=oa.ChatCompletionDelta(role="assistant", content="")
                )
            ],
        )
        yield oa.CreateChatCompletionStreamResponse(
            **chunk,
            choices=[oa.ChatCompletionChunkChoice(index=0, delta=oa.ChatCompletionDelta(content="Hi!"))],
        )
        yield oa.CreateChatCompletionStreamResponse(
            **chunk,
            choices=[
                oa.ChatCompletionChunkChoice(index=0, delta=oa.ChatCompletionDelta(), finish_reason="stop")
            ],
        )

    def ListModels(self, request, context):
        return oa.ListModelsResponse(
            object="list", data=[oa.Model(id="fake", object="model", created=1, owned_by="protoserve")]
        )

    def RetrieveModel(self, request, context):
        self.log.record("RetrieveModel", request, context)
        if request.model != "fake":
            _abort(
                context,
                rich_status(
                    code_pb2.NOT_FOUND,
                    f"model {request.model!r} is not loaded",
                    error_details_pb2.ErrorInfo(reason="MODEL_NOT_FOUND", domain="protoserve"),
                ),
            )
        return oa.RetrieveModelResponse(
            model=oa.Model(id="fake", object="model", created=1, owned_by="protoserve")
        )


@dataclass
class FakeBackend:
    """The fake gRPC server and what it recorded."""

    target: str
    log: CallLog
    server: grpc.Server


def start_fake_backend() -> FakeBackend:
    """InferenceService + OpenAIService fakes on a free loopback port (MetricsService left unimplemented)."""
    log = CallLog()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_InferenceServiceServicer_to_server(FakeInference(log), server)
    oa_grpc.add_OpenAIServiceServicer_to_server(FakeOpenAI(log), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return FakeBackend(f"127.0.0.1:{port}", log, server)


@contextlib.contextmanager
def gateway_thread(
    grpc_target: str,
    settings: GatewaySettings | None = None,
    cors_origins: tuple[str, ...] = (),
    allowed_hosts: tuple[str, ...] = (),
) -> Iterator[str]:
    """A gateway on an ephemeral loopback port, served from its own thread; yields its base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="gateway", daemon=True)
    thread.start()
    server = GatewayServer(
        "127.0.0.1", 0, grpc_target, settings=settings, cors_origins=cors_origins, allowed_hosts=allowed_hosts
    )
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield server.url
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
