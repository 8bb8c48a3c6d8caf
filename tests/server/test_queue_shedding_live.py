"""A full waiting queue on a live server: one key that fills it does not shut another key out.

One engine slot and three places in the waiting queue. Alice's key holds the slot with a long generation
and fills the queue with three more; Bob's key then asks for four tokens. Refusing whoever arrives at a
full queue would refuse Bob for as long as Alice keeps her queue full; instead Bob's request takes the
place of Alice's newest waiting one (the last of hers to reach the engine), which is refused with RESOURCE_EXHAUSTED as if it had come last.
Alice asking again at the full queue is refused herself; her other requests all finish.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc, metrics_pb2, metrics_pb2_grpc

KEYS = ("queue-key-alice", "queue-key-bob")


@pytest.fixture(scope="module")
def server(spawn_server):
    return spawn_server("--max-num-seqs", "1", "--max-queue", "3", env={"PROTOSERVE_API_KEYS": ",".join(KEYS)})


def request(request_id: str, tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id, prompt="Tell me about lighthouses.",
        sampling=pb.SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0),
    )


async def waiting(channel: grpc.aio.Channel, key: str) -> int:
    reply = await metrics_pb2_grpc.MetricsServiceStub(channel).GetMetrics(
        metrics_pb2.GetMetricsRequest(), metadata=(("authorization", f"Bearer {key}"),)
    )
    return reply.snapshot.num_requests_waiting


async def test_a_newcomer_at_a_full_queue_displaces_the_tenant_that_filled_it(server) -> None:
    alice, bob = ((("authorization", f"Bearer {key}"),) for key in KEYS)
    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        running = stub.GenerateStream(pb.GenerateStreamRequest(request=request("alice-0", 400)), metadata=alice,
                                      timeout=300)
        first = await running.read()  # the slot is hers before the queue fills
        assert first.HasField("delta") or first.HasField("final"), first
        tasks = [asyncio.ensure_future(stub.Generate(request(f"alice-{i}", 8), metadata=alice, timeout=300))
                 for i in range(1, 4)]
        deadline = time.monotonic() + 60
        while await waiting(channel, KEYS[0]) < 3:
            assert time.monotonic() < deadline, "Alice's requests never filled the queue"
            assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
            await asyncio.sleep(0.02)

        with pytest.raises(grpc.aio.AioRpcError) as again:  # Alice holds the queue: she is refused herself
            await stub.Generate(request("alice-again", 8), metadata=alice, timeout=300)
        assert again.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        answer = await stub.Generate(request("bob", 4), metadata=bob, timeout=300)
        assert len(answer.choices[0].token_ids) == 4

        results = await asyncio.gather(*tasks, return_exceptions=True)
        while (event := await running.read()) is not grpc.aio.EOF:
            last = event
        assert last.HasField("final"), last  # the running one is never shed
    # One of Alice's waiting requests (the newest to reach the engine; they were sent at once) made room.
    shed = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(shed) == 1 and shed[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED, results
    assert "queue is full" in shed[0].details()
    assert sum(isinstance(r, pb.GenerateResponse) for r in results) == 2
    assert "Traceback" not in server.log()
