"""A real `protoserve serve` process: health while loading, then SIGTERM with a stream in flight."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
from grpc_health.v1 import health_pb2
from grpc_status_helpers import failure_of, read_all

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
LOAD_TIMEOUT_S = 180


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


def test_ready_line_comes_once_health_is_serving(spawn_server):
    """'listening' comes while the model loads; 'ready' only once health says SERVING."""
    server = spawn_server(wait_ready=False)
    ready = None
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while ready is None:
        assert time.monotonic() < deadline and server.process.poll() is None, server.log()
        printed = list(server.stdout_lines)  # before asking: a ready line here was printed before the answer
        status = server.health()
        ready = next((line for line in printed if line.startswith("protoserve ready:")), None)
        if ready is None:
            time.sleep(0.02)
        else:
            assert status == SERVING, (status, printed)
    assert printed[0].startswith("protoserve listening on ") and printed.index(ready) > 0
    assert ready.strip() == f"protoserve ready: serving SmolLM2-135M-Instruct, all-MiniLM-L6-v2 on {server.grpc_target} (grpc), " \
        f"http on 127.0.0.1:{server.http_port}"
    server.stop()
    assert len([line for line in server.stdout_lines if line.startswith("protoserve ready:")]) == 1
