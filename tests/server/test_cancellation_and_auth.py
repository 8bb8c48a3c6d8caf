"""Cancellation (Cancel RPC, client gone, deadline), load shedding and auth, against the in-process server.

The in-process server runs the real engine with the real model in this
process, so each test can check that the engine's KV cache is fully free
again (``inproc_server.wait_kv_free``) without an admin API.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest_asyncio
from grpc_status_helpers import failure_of, read_all

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

# Long enough that the request is still running when the test cancels it.
LONG = pb.SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0)
# Cancellation must free KV within one engine step; this bound leaves room for a slow CI machine.
FREE_WITHIN_S = 2.0


def long_request(request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, prompt="Count from one to a thousand:", sampling=LONG)


@pytest_asyncio.fixture(loop_scope="function")
async def stub(inproc_server):
    async with grpc.aio.insecure_channel(inproc_server.grpc_target) as ch:
        yield inference_pb2_grpc.InferenceServiceStub(ch)


@pytest_asyncio.fixture(loop_scope="function")
async def auth_stub(inproc_server):
    async with grpc.aio.insecure_channel(inproc_server.auth_target) as ch:
        yield inference_pb2_grpc.InferenceServiceStub(ch)


async def test_cancel_rpc_frees_kv(stub, inproc_server):
    stream = stub.GenerateStream(pb.GenerateStreamRequest(request=long_request("to-cancel")))
    first = await stream.read()
    assert first.HasField("delta")
    assert not inproc_server.kv_all_free()
    reply = await stub.Cancel(pb.CancelRequest(request_id="to-cancel"))
    assert reply.cancelled
    rest = await read_all(stream)
    assert rest[-1].final.choices[0].finish_reason == pb.FINISH_REASON_CANCELLED
    assert inproc_server.wait_kv_free(FREE_WITHIN_S) < FREE_WITHIN_S
    # The request is over: cancelling again says so instead of failing.
    assert not (await stub.Cancel(pb.CancelRequest(request_id="to-cancel"))).cancelled


async def test_client_going_away_frees_kv(stub, inproc_server):
    stream = stub.GenerateStream(pb.GenerateStreamRequest(request=long_request()))
    await stream.read()
    assert not inproc_server.kv_all_free()
    stream.cancel()
    inproc_server.wait_kv_free(FREE_WITHIN_S)


async def test_deadline_frees_kv(stub, inproc_server):
    failure = await failure_of(stub.Generate(long_request(), timeout=1.0))
    assert failure.code == grpc.StatusCode.DEADLINE_EXCEEDED
    inproc_server.wait_kv_free(FREE_WITHIN_S)
    stream = stub.GenerateStream(pb.GenerateStreamRequest(request=long_request()), timeout=1.0)
    failure = await failure_of(stream)
    assert failure.code == grpc.StatusCode.DEADLINE_EXCEEDED
    inproc_server.wait_kv_free(FREE_WITHIN_S)


async def test_queue_full_sheds_load_with_retry_info(stub, inproc_server):
    # The in-process engine runs 2 sequences and queues 2 more; the rest are shed.
    request = pb.GenerateRequest(
        prompt="Tell me a story.", sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True)
    )
    calls = [stub.Generate(request) for _ in range(8)]
    outcomes = await asyncio.gather(*(failure_or_response(c) for c in calls))
    shed = [o for o in outcomes if not isinstance(o, pb.GenerateResponse)]
    served = [o for o in outcomes if isinstance(o, pb.GenerateResponse)]
    assert shed and served
    for failure in shed:
        assert failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED and failure.reason == "QUEUE_FULL"
        assert failure.details["RetryInfo"].retry_delay.ToTimedelta().total_seconds() > 0
    assert all(len(r.choices[0].token_ids) == 6 for r in served)
    inproc_server.wait_kv_free(FREE_WITHIN_S)


async def failure_or_response(call):
    try:
        return await call
    except grpc.aio.AioRpcError:
        return await failure_of(call)


async def test_auth_rejects_missing_and_wrong_keys(auth_stub, inproc_server):
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "Basic abc"),)):
        failure = await failure_of(auth_stub.Generate(request, metadata=metadata))
        assert failure.code == grpc.StatusCode.UNAUTHENTICATED and failure.reason == "UNAUTHENTICATED"
    failure = await failure_of(auth_stub.ListModels(pb.ListModelsRequest()))
    assert failure.code == grpc.StatusCode.UNAUTHENTICATED
    good = (("authorization", f"Bearer {inproc_server.api_keys[1]}"),)
    assert (await auth_stub.Generate(request, metadata=good)).choices[0].token_ids
    # Health is a probe: no key needed.
    assert (await auth_stub.CheckHealth(pb.CheckHealthRequest())).status == pb.SERVING_STATUS_SERVING


async def test_only_the_owner_may_cancel(auth_stub, inproc_server):
    key_a, key_b = inproc_server.api_keys
    alice = (("authorization", f"Bearer {key_a}"), ("x-user-id", "alice"))
    bob_same_key = (("authorization", f"Bearer {key_a}"), ("x-user-id", "bob"))
    alice_other_key = (("authorization", f"Bearer {key_b}"), ("x-user-id", "alice"))
    stream = auth_stub.GenerateStream(
        pb.GenerateStreamRequest(request=long_request("shared-id")), metadata=alice
    )
    await stream.read()
    for stranger in (bob_same_key, alice_other_key):
        failure = await failure_of(
            auth_stub.Cancel(pb.CancelRequest(request_id="shared-id"), metadata=stranger)
        )
        assert failure.code == grpc.StatusCode.NOT_FOUND and failure.reason == "REQUEST_NOT_FOUND"
    assert (await auth_stub.Cancel(pb.CancelRequest(request_id="shared-id"), metadata=alice)).cancelled
    rest = await read_all(stream)
    assert rest[-1].final.choices[0].finish_reason == pb.FINISH_REASON_CANCELLED
    inproc_server.wait_kv_free(FREE_WITHIN_S)


async def test_auth_off_user_ids_are_separate_identities(stub, inproc_server):
    carol, dave = (("x-user-id", "carol"),), (("x-user-id", "dave"),)
    stream = stub.GenerateStream(pb.GenerateStreamRequest(request=long_request("same-id")), metadata=carol)
    await stream.read()
    failure = await failure_of(stub.Cancel(pb.CancelRequest(request_id="same-id"), metadata=dave))
    assert failure.code == grpc.StatusCode.NOT_FOUND
    assert (await stub.Cancel(pb.CancelRequest(request_id="same-id"), metadata=carol)).cancelled
    await read_all(stream)
    inproc_server.wait_kv_free(FREE_WITHIN_S)


async def test_prefix_cache_is_salted_by_identity(stub):
    # Long enough to fill several KV blocks, so a cache hit shows up in usage.
    prompt = "Here is a long shared system preamble about gardening. " * 4
    request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=1, temperature=0))
    erin, frank = (("x-user-id", "erin"),), (("x-user-id", "frank"),)
    first = await stub.Generate(request, metadata=erin)
    again = await stub.Generate(request, metadata=erin)
    other = await stub.Generate(request, metadata=frank)
    assert first.usage.cached_prompt_tokens == 0
    assert again.usage.cached_prompt_tokens > 0
    assert other.usage.cached_prompt_tokens == 0
