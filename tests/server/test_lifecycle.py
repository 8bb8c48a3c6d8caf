"""A real `protoserve serve` process: health while loading, then SIGTERM with a stream in flight."""

from __future__ import annotations

import asyncio
import signal

import grpc
from grpc_health.v1 import health_pb2
from grpc_status_helpers import failure_of, read_all

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


async def test_health_through_load_and_graceful_drain(spawn_server):
    server = spawn_server("--grace-period", "120", wait_ready=False)
    # The listen line comes before the model is loaded: health answers, and says NOT_SERVING.
    # (Answers can lag while the loading thread imports torch, so allow a few tries.)
    first = None
    for _ in range(50):
        if (first := server.health()) is not None:
            break
    assert first == NOT_SERVING
    assert server.health("protoserve.v1.InferenceService") in (NOT_SERVING, None)
    async with server.channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        failure = await failure_of(stub.CheckHealth(pb.CheckHealthRequest()))
        if failure.code == grpc.StatusCode.UNAVAILABLE:  # still loading (it almost always is)
            assert failure.reason == "NOT_READY"
        await asyncio.to_thread(server.wait_serving)
        assert (await stub.CheckHealth(pb.CheckHealthRequest())).status == pb.SERVING_STATUS_SERVING

        request = pb.GenerateRequest(
            prompt="Once upon a time",
            sampling=pb.SamplingParams(max_tokens=32, ignore_eos=True, temperature=0),
        )
        stream = stub.GenerateStream(pb.GenerateStreamRequest(request=request))
        assert (await stream.read()).HasField("delta")

        server.process.send_signal(signal.SIGTERM)
        for _ in range(200):
            if server.health() == NOT_SERVING:
                break
            await asyncio.sleep(0.02)
        assert server.health() == NOT_SERVING
        failure = await failure_of(stub.Generate(request))
        assert failure.code == grpc.StatusCode.UNAVAILABLE and failure.reason == "SERVER_DRAINING"

        # The in-flight stream still runs to its natural end.
        rest = await read_all(stream)
        final = rest[-1].final
        assert final.choices[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 32

    assert await asyncio.to_thread(server.process.wait, 30) == 0
