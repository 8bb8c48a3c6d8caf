"""protoserve_client against a small in-test grpc.aio servicer: exact wire behaviour the real model cannot show on demand.

The live-server tests (test_python_client.py) cover the real behaviour; these
pin the client's side of the contract: the exact auth headers it sends, every
rich-status detail it decodes (RetryInfo included, which needs a full queue on
a real server), request building, and stream cancellation from the client side.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import grpc.aio
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc as pb_grpc
from protoserve_client import (
    AsyncClient,
    ChatMessage,
    Client,
    FinishReason,
    ProtoserveError,
    StreamDelta,
    StreamFinal,
    generate_request,
    sampling_params,
)


def _rich_status(code: int, message: str, *details: object) -> status_pb2.Status:
    status = status_pb2.Status(code=code, message=message)
    for d in details:
        packed = any_pb2.Any()
        packed.Pack(d)
        status.details.append(packed)
    return status


BAD_MAX_TOKENS = _rich_status(
    code_pb2.INVALID_ARGUMENT,
    "invalid request: sampling.max_tokens: must be >= 1",
    error_details_pb2.ErrorInfo(reason="INVALID_PARAMETER", domain="protoserve", metadata={"k": "v"}),
    error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(
                field="sampling.max_tokens", description="must be >= 1"
            )
        ]
    ),
)
QUEUE_FULL = _rich_status(
    code_pb2.RESOURCE_EXHAUSTED,
    "the waiting queue is full",
    error_details_pb2.ErrorInfo(reason="QUEUE_FULL", domain="protoserve"),
    error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1, nanos=500_000_000)),
)

NOT_READY = _rich_status(
    code_pb2.UNAVAILABLE,
    "the server is still loading its model",
    error_details_pb2.ErrorInfo(reason="NOT_READY", domain="protoserve"),
)


class FakeInferenceService(pb_grpc.InferenceServiceServicer):
    """Echoes what it received; prompts "bad", "busy" and "slow" trigger errors and delays."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        # CheckHealth answers UNAVAILABLE this many more times, as while a model loads.
        self.loading_probes = 0

    @staticmethod
    def _echo(context: grpc.aio.ServicerContext) -> str:
        md = dict(context.invocation_metadata())
        return json.dumps({k: md.get(k, "") for k in ("authorization", "x-user-id", "x-extra")})

    async def _fail_for(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        if request.prompt == "bad":
            await context.abort_with_status(rpc_status.to_status(BAD_MAX_TOKENS))
        if request.prompt == "busy":
            await context.abort_with_status(rpc_status.to_status(QUEUE_FULL))
        if request.prompt == "slow":
            await asyncio.sleep(5)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        await self._fail_for(request, context)
        return pb.GenerateResponse(
            request_id=request.request_id,
            model="fake",
            choices=[
                pb.Choice(
                    index=0, text=self._echo(context), token_ids=[1, 2], finish_reason=pb.FINISH_REASON_STOP
                )
            ],
            usage=pb.Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5),
            stats=pb.RequestStats(e2e_time_s=0.5, generated_tokens=2),
        )

    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        inner = request.request
        await self._fail_for(inner, context)
        for i, piece in enumerate(["a", "b", "c"]):
            if inner.prompt == "endless" and i:
                await asyncio.sleep(0.2)
            yield pb.GenerateStreamResponse(
                request_id=inner.request_id, delta=pb.GenerateDelta(text=piece, token_ids=[i])
            )
        if inner.prompt == "endless":
            await asyncio.sleep(30)
        yield pb.GenerateStreamResponse(
            request_id=inner.request_id,
            final=pb.GenerateFinal(
                model="fake",
                choices=[pb.ChoiceFinish(index=0, finish_reason=pb.FINISH_REASON_LENGTH)],
                usage=pb.Usage(completion_tokens=3),
            ),
        )

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        self.cancelled.append(request.request_id)
        return pb.CancelResponse(cancelled=request.request_id == "known")

    async def Batch(self, request: pb.BatchRequest, context: grpc.aio.ServicerContext) -> pb.BatchResponse:
        results = []
        for r in request.requests:
            if r.sampling.max_tokens < 0:
                results.append(pb.BatchResult(error=BAD_MAX_TOKENS))
            else:
                choice = pb.Choice(text=r.prompt.upper(), finish_reason=pb.FINISH_REASON_LENGTH)
                results.append(
                    pb.BatchResult(response=pb.GenerateResponse(request_id=r.request_id, choices=[choice]))
                )
        return pb.BatchResponse(results=results)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        text = request.text or "".join(m.content for m in request.chat.messages)
        return pb.TokenizeResponse(token_ids=list(text.encode()), tokens=list(text), max_model_len=99)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        return pb.DetokenizeResponse(text=bytes(request.token_ids).decode())

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        return pb.ListModelsResponse(
            models=[pb.ModelInfo(name="fake", max_model_len=99, has_chat_template=True, kind="chat",
                                 aliases=["fake-alias"])]
        )

    async def GetModel(self, request: pb.GetModelRequest, context: grpc.aio.ServicerContext):
        if request.name != "fake":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.name!r} is not loaded")
        return pb.GetModelResponse(model=pb.ModelInfo(name="fake"))

    async def CheckHealth(self, request: pb.CheckHealthRequest, context: grpc.aio.ServicerContext):
        if dict(context.invocation_metadata()).get("authorization") == "Bearer revoked":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        if self.loading_probes > 0:
            self.loading_probes -= 1
            await context.abort_with_status(rpc_status.to_status(NOT_READY))
        return pb.CheckHealthResponse(status=pb.SERVING_STATUS_SERVING, models=["fake"])


class _ServerThread:
    """A grpc.aio server on its own loop and thread, so blocking sync clients can call it."""

    def __init__(self) -> None:
        self.service = FakeInferenceService()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server: grpc.aio.Server = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        pb_grpc.add_InferenceServiceServicer_to_server(self.service, server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def fake_server() -> Iterator[_ServerThread]:
    srv = _ServerThread()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def fake_target(fake_server: _ServerThread) -> str:
    return f"127.0.0.1:{fake_server.port}"


@pytest.fixture
def client(fake_target: str) -> Iterator[Client]:
    with Client(fake_target, api_key="sk-test", user_id="alice", timeout=5) as c:
        yield c


# --- request building -------------------------------------------------------


def test_generate_request_sets_only_given_sampling_fields() -> None:
    req = generate_request("hi", max_tokens=-1, temperature=0.0, stop="END", logit_bias={5: -100.0}, seed=7)
    assert req.prompt == "hi" and req.request_id
    s = req.sampling
    assert s.HasField("max_tokens") and s.max_tokens == -1
    assert s.HasField("temperature") and s.temperature == 0.0
    assert not s.HasField("top_p")  # left to the server's default
    assert list(s.stop) == ["END"] and dict(s.logit_bias) == {5: -100.0} and s.seed == 7


def test_generate_request_inputs_and_policy() -> None:
    chat = generate_request(
        messages=[ChatMessage("system", "be brief"), {"role": "user", "content": "hi", "name": "bob"}],
        add_generation_prompt=False,
        context_policy="truncate_left",
        request_id="r1",
    )
    assert [(m.role, m.content, m.name) for m in chat.chat.messages] == [
        ("system", "be brief", ""),
        ("user", "hi", "bob"),
    ]
    assert chat.chat.HasField("add_generation_prompt") and not chat.chat.add_generation_prompt
    assert chat.context_policy == pb.CONTEXT_POLICY_TRUNCATE_LEFT and chat.request_id == "r1"
    assert list(generate_request(token_ids=[1, 2, 3]).token_ids.ids) == [1, 2, 3]
    with pytest.raises(TypeError, match="exactly one"):
        generate_request("a", token_ids=[1])
    with pytest.raises(TypeError, match="exactly one"):
        generate_request()
    with pytest.raises(TypeError, match="unknown sampling parameter 'temprature'"):
        sampling_params(temprature=0.5)  # type: ignore[call-arg]


# --- sync client ------------------------------------------------------------


def test_auth_and_call_metadata_are_sent(client: Client) -> None:
    echoed = json.loads(client.generate("hi", metadata=[("x-extra", "1")]).text)
    assert echoed == {"authorization": "Bearer sk-test", "x-user-id": "alice", "x-extra": "1"}


def test_result_conversion(client: Client) -> None:
    result = client.generate("hi", request_id="mine")
    assert result.request_id == "mine" and result.model == "fake"
    assert result.finish_reason is FinishReason.STOP and result.choices[0].token_ids == (1, 2)
    assert result.usage.total_tokens == 5 and result.stats.generated_tokens == 2
    assert result.raw.choices[0].text == result.text


def test_rich_status_details_are_decoded(client: Client) -> None:
    with pytest.raises(ProtoserveError) as info:
        client.generate("bad")
    err = info.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message == BAD_MAX_TOKENS.message and err.status == BAD_MAX_TOKENS
    assert (err.reason, err.domain, err.error_metadata) == ("INVALID_PARAMETER", "protoserve", {"k": "v"})
    assert [(v.field, v.description) for v in err.field_violations] == [
        ("sampling.max_tokens", "must be >= 1")
    ]
    assert err.retry_delay is None
    assert "INVALID_ARGUMENT" in str(err)

    with pytest.raises(ProtoserveError) as info:
        client.generate("busy")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.reason == "QUEUE_FULL" and info.value.retry_delay == pytest.approx(1.5)

    copy = pickle.loads(pickle.dumps(info.value))
    assert copy.code == info.value.code and copy.retry_delay == info.value.retry_delay


def test_plain_status_and_local_deadline(client: Client) -> None:
    with pytest.raises(ProtoserveError) as info:
        client.get_model("nope")
    assert (
        info.value.code == grpc.StatusCode.NOT_FOUND
        and info.value.status is None
        and info.value.details == ()
    )

    with pytest.raises(ProtoserveError) as info:
        client.generate("slow", timeout=0.2)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_stream_cancel_batch_and_small_rpcs(client: Client) -> None:
    stream = client.stream("hi", max_tokens=3)
    events = list(stream)
    assert [e.text for e in events if isinstance(e, StreamDelta)] == ["a", "b", "c"]
    assert isinstance(events[-1], StreamFinal) and stream.final is events[-1]
    assert stream.final.finish_reason is FinishReason.LENGTH
    assert {e.request_id for e in events} == {stream.request_id}

    assert client.cancel("known") is True and client.cancel("other") is False

    results = client.batch([{"prompt": "ab", "max_tokens": 2}, generate_request("x", max_tokens=-1)])
    assert not isinstance(results[0], ProtoserveError) and results[0].text == "AB"
    assert isinstance(results[1], ProtoserveError) and results[1].code == grpc.StatusCode.INVALID_ARGUMENT
    assert results[1].field_violations[0].field == "sampling.max_tokens"

    tok = client.tokenize("hé")
    assert tok.max_model_len == 99 and client.detokenize(tok.token_ids) == "hé"
    assert client.tokenize(messages=[{"role": "user", "content": "x"}]).tokens == ("x",)
    assert client.list_models()[0].name == "fake" and client.get_model("fake").name == "fake"
    health = client.health()
    assert health.serving and health.status == "serving" and health.models == ("fake",)


def test_stream_errors_and_client_side_cancel(client: Client) -> None:
    with pytest.raises(ProtoserveError) as info:
        list(client.stream("bad"))
    assert info.value.reason == "INVALID_PARAMETER"

    with client.stream("endless") as stream:
        first = next(stream)
        assert isinstance(first, StreamDelta)
        stream.cancel()
        assert list(stream) == []  # hanging up ends iteration quietly


def test_wait_until_ready(fake_server: _ServerThread, client: Client) -> None:
    fake_server.service.loading_probes = 2
    health = client.wait_until_ready(timeout=10, interval=0.01)
    assert health.serving and fake_server.service.loading_probes == 0

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    with Client(closed) as nobody, pytest.raises(ProtoserveError) as info:
        nobody.wait_until_ready(timeout=0.5, interval=0.05)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE

    # Errors that waiting cannot fix are raised at once, not retried until the timeout.
    started = time.monotonic()
    with Client(f"127.0.0.1:{fake_server.port}", api_key="revoked") as stranger:
        with pytest.raises(ProtoserveError) as info:
            stranger.wait_until_ready(timeout=30, interval=0.01)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() - started < 5


# --- async client -----------------------------------------------------------


async def test_async_client(fake_target: str) -> None:
    async with AsyncClient(fake_target, api_key="k2", user_id="bob") as client:
        echoed = json.loads((await client.generate("hi")).text)
        assert echoed["authorization"] == "Bearer k2" and echoed["x-user-id"] == "bob"

        stream = client.stream("hi")
        texts = [e.text async for e in stream if isinstance(e, StreamDelta)]
        assert texts == ["a", "b", "c"] and stream.final is not None

        with pytest.raises(ProtoserveError) as info:
            await client.generate("slow", timeout=0.2)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

        with pytest.raises(ProtoserveError) as info:
            async for _ in client.stream("busy"):
                pass
        assert info.value.retry_delay == pytest.approx(1.5)

        async with client.stream("endless") as endless:
            assert isinstance(await endless.__anext__(), StreamDelta)
            endless.cancel()
            assert [e async for e in endless] == []

        assert await client.cancel("known") is True
        results = await client.batch([{"prompt": "q", "max_tokens": 1}])
        assert not isinstance(results[0], ProtoserveError) and results[0].text == "Q"
        assert (await client.tokenize("ab")).token_ids == (97, 98)
        assert await client.detokenize([104, 105]) == "hi"
        (listed,) = await client.list_models()
        assert (listed.max_model_len, listed.kind, listed.aliases) == (99, "chat", ("fake-alias",))
        assert (await client.get_model("fake")).name == "fake"
        assert (await client.health()).serving
        assert (await client.wait_until_ready(timeout=5)).models == ("fake",)


def test_sampling_kwargs_name_every_sampling_field_of_the_proto():
    """A field added to protoserve.v1.SamplingParams is typed in the client too (the builder already sends it)."""
    from protoserve.v1 import inference_pb2 as pb
    from protoserve_client.types import SamplingKwargs

    assert set(SamplingKwargs.__annotations__) == set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
