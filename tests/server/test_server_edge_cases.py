"""Server plumbing against an engine double: faults the real model cannot produce on demand.

Each test runs a real grpc.aio server in the test's event loop over a real
channel; only the engine is the in-memory double from server_engine_double.py.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status_helpers import failure_of, read_all
from server_engine_double import EngineDouble

from protoserve.server.app import ServerApp, ServerConfig
from protoserve.server.models.served_model import ModelCard
from protoserve.server.security.auth import Authenticator
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc


@contextlib.asynccontextmanager
async def double_server(engine: EngineDouble | None = None, api_keys: list[str] | None = None):
    engine = engine or EngineDouble()
    app = ServerApp(ServerConfig(port=0, http_port=None, grace_period_s=2.0), auth=Authenticator(api_keys))
    await app.start()
    await app.attach_engine(engine, ModelCard("float32", "none", "double"))
    channel = grpc.aio.insecure_channel(app.grpc_target)
    try:
        yield app, engine, inference_pb2_grpc.InferenceServiceStub(channel)
    finally:
        await channel.close()
        await app.stop()


async def status_of(call) -> tuple[grpc.StatusCode, str, dict[str, object]]:
    failure = await failure_of(call)
    return failure.code, failure.message, failure.details


def prompt(text: str = "hello world", max_tokens: int = 4, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=text, sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def test_unexpected_engine_error_is_internal_without_traceback(caplog):
    async with double_server() as (_, engine, stub):
        engine.fail_with = RuntimeError("secret internal detail /path/to/file.py line 3")
        call = stub.Generate(prompt())
        code, message, details = await status_of(call)
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in message and "Traceback" not in message
    assert details["ErrorInfo"].reason == "INTERNAL" and details["ErrorInfo"].domain == "protoserve"
    # The server log has the whole story under the same reference.
    ref = details["ErrorInfo"].metadata["ref"]
    assert any(ref in r.getMessage() and r.exc_info for r in caplog.records)


async def test_generate_and_stream_through_double():
    async with double_server() as (app, engine, stub):
        response = await stub.Generate(prompt("abc", max_tokens=5))
        assert response.choices[0].text == "abcab"
        assert response.choices[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert response.usage.prompt_tokens == 3 and response.usage.completion_tokens == 5
        events = [
            e async for e in stub.GenerateStream(pb.GenerateStreamRequest(request=prompt("xy", max_tokens=3)))
        ]
        assert "".join(e.delta.text for e in events if e.HasField("delta")) == "xyx"
        assert events[-1].final.choices[0].finish_reason == pb.FINISH_REASON_LENGTH
        # The identity salts the prefix cache: with auth off, the keyed hash of ("", ""), not sha256("").
        assert engine.submitted[0].cache_salt == app.auth.identity_for("", "").cache_salt
        assert engine.submitted[0].cache_salt.hex() != (
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        )


async def test_queue_full_carries_retry_info():
    engine = EngineDouble(step_s=0.05, max_running=1, max_queue=1)
    async with double_server(engine) as (_, engine, stub):
        first = asyncio.ensure_future(stub.Generate(prompt(max_tokens=20)))
        second = asyncio.ensure_future(stub.Generate(prompt(max_tokens=20)))
        await wait_for(lambda: engine.stats().running == 1 and engine.stats().waiting == 1)
        code, message, details = await status_of(stub.Generate(prompt()))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details["ErrorInfo"].reason == "QUEUE_FULL"
        assert details["RetryInfo"].retry_delay.ToTimedelta().total_seconds() == 0.5
        await asyncio.gather(first, second)


async def test_cancel_only_by_owner_and_late_cancel():
    engine = EngineDouble(step_s=0.05)
    async with double_server(engine, api_keys=["k1", "k2"]) as (_, engine, stub):
        owner = (("authorization", "Bearer k1"), ("x-user-id", "alice"))
        other = (("authorization", "Bearer k1"), ("x-user-id", "bob"))
        request = prompt(max_tokens=200)
        request.request_id = "mine"
        call = stub.Generate(request, metadata=owner)
        await wait_for(lambda: engine.stats().running == 1)
        code, _, details = await status_of(stub.Cancel(pb.CancelRequest(request_id="mine"), metadata=other))
        assert code == grpc.StatusCode.NOT_FOUND and details["ErrorInfo"].reason == "REQUEST_NOT_FOUND"
        assert (await stub.Cancel(pb.CancelRequest(request_id="mine"), metadata=owner)).cancelled
        response = await call
        assert response.choices[0].finish_reason == pb.FINISH_REASON_CANCELLED
        assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total
        # Finished requests answer cancelled=false for their owner, NOT_FOUND for anyone else.
        assert not (await stub.Cancel(pb.CancelRequest(request_id="mine"), metadata=owner)).cancelled


async def test_duplicate_running_request_id_is_invalid():
    engine = EngineDouble(step_s=0.05)
    async with double_server(engine) as (_, engine, stub):
        request = prompt(max_tokens=50)
        request.request_id = "dup"
        call = stub.Generate(request)
        await wait_for(lambda: engine.stats().running == 1)
        code, _, details = await status_of(stub.Generate(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details["BadRequest"].field_violations[0].field == "request_id"
        await stub.Cancel(pb.CancelRequest(request_id="dup"))
        await call


async def test_drain_refuses_new_calls_and_lets_streams_finish():
    engine = EngineDouble(step_s=0.02)
    async with double_server(engine) as (app, engine, stub):
        health = health_pb2_grpc.HealthStub(grpc.aio.insecure_channel(app.grpc_target))
        stream = stub.GenerateStream(pb.GenerateStreamRequest(request=prompt(max_tokens=30)))
        first = await stream.read()
        assert first.HasField("delta")
        drain = asyncio.ensure_future(app.drain(grace_period_s=5.0))
        await wait_for(lambda: not app.readiness.serving)
        status = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        code, _, details = await status_of(stub.Generate(prompt()))
        assert code == grpc.StatusCode.UNAVAILABLE and details["ErrorInfo"].reason == "SERVER_DRAINING"
        rest = await read_all(stream)
        assert rest[-1].final.choices[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert await drain is True


async def test_grace_period_over_aborts_streams():
    engine = EngineDouble(step_s=0.02)
    async with double_server(engine) as (app, engine, stub):
        stream = stub.GenerateStream(pb.GenerateStreamRequest(request=prompt(max_tokens=10_000)))
        await stream.read()
        assert await app.drain(grace_period_s=0.2) is False
        assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


async def test_deadline_and_disconnect_abort_in_engine():
    engine = EngineDouble(step_s=0.02)
    async with double_server(engine) as (_, engine, stub):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(prompt(max_tokens=10_000), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_for(lambda: engine.stats().running == 0, timeout=1.0)
        stream = stub.GenerateStream(pb.GenerateStreamRequest(request=prompt(max_tokens=10_000)))
        await stream.read()
        assert engine.stats().running == 1
        stream.cancel()
        await wait_for(lambda: engine.stats().running == 0, timeout=1.0)
        assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


async def test_openai_multi_prompt_stream_disconnect_aborts_every_prompt():
    from google.protobuf import struct_pb2

    from protoserve.openai.v1 import openai_pb2 as oa
    from protoserve.openai.v1 import openai_pb2_grpc

    engine = EngineDouble(step_s=0.02, max_running=4)
    async with double_server(engine) as (app, engine, _):
        async with grpc.aio.insecure_channel(app.grpc_target) as channel:
            openai = openai_pb2_grpc.OpenAIServiceStub(channel)
            prompts = struct_pb2.Value()
            prompts.list_value.values.add().string_value = "abc"
            prompts.list_value.values.add().string_value = "xyz"
            request = oa.CreateCompletionRequest(prompt=prompts, max_tokens=1000, n=2)
            stream = openai.CreateCompletionStream(oa.CreateCompletionStreamRequest(request=request))
            seen = set()
            while len(seen) < 4:
                chunk = await stream.read()
                seen.update(c.index for c in chunk.choices)
            assert engine.stats().running == 2
            stream.cancel()
            await wait_for(lambda: engine.stats().running == 0, timeout=1.0)
            # Unary, with the finish of each choice.
            request.max_tokens = 3
            response = await openai.CreateCompletion(request)
            assert [c.text for c in response.choices] == ["abc", "abc", "xyz", "xyz"]
            assert {c.finish_reason for c in response.choices} == {"length"}
            assert response.usage.prompt_tokens == 6 and response.usage.completion_tokens == 12


async def test_the_servers_own_deadline_fails_the_request_instead_of_answering_with_partial_output():
    """When the server's deadline timer stops a request, the call fails with DEADLINE_EXCEEDED. Returning the
    cut-short output as OK would reach a client whose own deadline timer runs late as a successful answer
    (seen in the suite: a 512-token Generate with a 0.3 s deadline "succeeded")."""
    from protoserve.engine.request import FinishReason, TokenizedRequest
    from protoserve.engine.sampling.sampling_params import SamplingParams
    from protoserve.server import errors
    from protoserve.server.calls.inflight import InflightRequests
    from protoserve.server.observability.usage import UsageLedger
    from protoserve.server.security.auth import Authenticator

    engine = EngineDouble(step_s=0.02, max_model_len=4096)
    inflight = InflightRequests(UsageLedger())
    caller = Authenticator().identity_for("", "")
    request = TokenizedRequest("e1", list(b"tell me everything"), SamplingParams(max_tokens=1000, ignore_eos=True))
    deadline = asyncio.get_running_loop().time() + 0.15
    outputs = []
    with pytest.raises(errors.ServiceError) as info:
        async with inflight.call(caller, "r1", deadline) as call:
            async for output in inflight.generate(call, engine, request):
                outputs.append(output)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert info.value.reason == pb.ERROR_REASON_DEADLINE_EXCEEDED
    assert outputs and not any(o.finished for o in outputs)  # tokens before the deadline, no cancelled final
    await wait_for(lambda: engine.stats().running == 0, timeout=1.0)
    # A request that finishes before its deadline still answers normally.
    request = TokenizedRequest("e2", list(b"hi"), SamplingParams(max_tokens=2, ignore_eos=True))
    deadline = asyncio.get_running_loop().time() + 5.0
    async with inflight.call(caller, "r2", deadline) as call:
        last = [o async for o in inflight.generate(call, engine, request)][-1]
    assert last.finished and last.deltas[-1].finish_reason == FinishReason.LENGTH
