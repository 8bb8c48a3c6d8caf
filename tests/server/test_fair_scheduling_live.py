"""Fair scheduling on a live server: one API key holding every engine slot does not keep another waiting.

The in-process server runs two sequences at a time (``max_num_seqs=2``). Alice's key fills both with
long generations; Bob's key then asks for four tokens. First come first served would run Bob once one of
Alice's requests ends; the fair scheduler preempts Alice's newest sequence (she has been served far
more) and Bob finishes while both of hers are still generating. Hers then resume with the same tokens.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest_asyncio

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

LONG_TOKENS = 400


def long_request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt="Write a long story about a lighthouse keeper.",
        sampling=pb.SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True, temperature=0),
    )


@pytest_asyncio.fixture(loop_scope="function")
async def stub(inproc_server):
    async with grpc.aio.insecure_channel(inproc_server.auth_target) as channel:
        yield inference_pb2_grpc.InferenceServiceStub(channel)


async def test_a_key_holding_every_slot_does_not_starve_another(stub, inproc_server):
    alice = (("authorization", f"Bearer {inproc_server.api_keys[0]}"),)
    bob = (("authorization", f"Bearer {inproc_server.api_keys[1]}"),)
    streams = [
        stub.GenerateStream(pb.GenerateStreamRequest(request=long_request(f"alice-{i}")), metadata=alice)
        for i in range(2)
    ]
    tokens = [0, 0]
    finished = [False, False]

    async def drain(i: int) -> None:
        async for event in streams[i]:
            if event.HasField("delta"):
                tokens[i] += len(event.delta.token_ids)
            if event.HasField("final"):
                finished[i] = True

    readers = [asyncio.create_task(drain(i)) for i in range(2)]
    try:
        while min(tokens) < 8:  # both of Alice's requests hold a slot and are generating
            for reader in readers:
                if reader.done():
                    reader.result()  # a failed stream: its error, not a hang
            await asyncio.sleep(0.02)
        answer = await stub.Generate(
            pb.GenerateRequest(prompt="Say hi.", sampling=pb.SamplingParams(max_tokens=4, temperature=0)),
            metadata=bob,
            timeout=60,
        )
        assert len(answer.choices[0].token_ids) == 4
        assert not any(finished), "Bob finished only after one of Alice's requests ended"
        assert min(tokens) < LONG_TOKENS
        stats = inproc_server.call(inproc_server.engine.engine.stats)
        assert stats.fair_preemptions_total >= 1
    finally:
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    inproc_server.wait_kv_free(timeout=10)


async def test_preempted_requests_resume_with_the_same_tokens(stub, inproc_server):
    alice = (("authorization", f"Bearer {inproc_server.api_keys[0]}"),)
    bob = (("authorization", f"Bearer {inproc_server.api_keys[1]}"),)
    short = pb.SamplingParams(max_tokens=48, ignore_eos=True, temperature=0)
    request = pb.GenerateRequest(prompt="Count sheep:", sampling=short)
    solo = await stub.Generate(request, metadata=alice)
    before = inproc_server.call(inproc_server.engine.engine.stats).fair_preemptions_total

    async def alice_pair() -> list[pb.GenerateResponse]:
        return await asyncio.gather(*(stub.Generate(request, metadata=alice) for _ in range(2)))

    pair = asyncio.create_task(alice_pair())
    await asyncio.sleep(0.3)
    await stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=2)), metadata=bob)
    for response in await pair:
        assert list(response.choices[0].token_ids) == list(solo.choices[0].token_ids)
    assert inproc_server.call(inproc_server.engine.engine.stats).fair_preemptions_total > before
