"""A tenant's short requests, from a process of its own: ``python -m bench.short_requests TARGET KEY SECONDS``.

Connects with API key KEY, prints ``ready``, waits for a line on stdin, then sends a 12-token prompt
for 4 new tokens (greedy, EOS ignored) every second for SECONDS seconds, each on its own, and prints
one JSON line: for every request, ``[sent, ttft]``: when it was sent (seconds after the first) and its
time to first token in seconds (null for one that failed or got no token). Its own process, as another tenant's client would be: the measuring process's event loop,
busy with the other tenant's streams, adds nothing to these figures.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence

PROMPT_LEN = 12
MAX_TOKENS = 4
PERIOD_S = 1.0
CALL_TIMEOUT_S = 120.0
TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary ids of the default model


async def run(target: str, key: str, seconds: float) -> list[tuple[float, float | None]]:
    import grpc

    from protoserve.v1 import inference_pb2 as pb
    from protoserve.v1 import inference_pb2_grpc

    rng = random.Random()  # every prompt new: no request finds another's prefix in the cache
    metadata = (("authorization", f"Bearer {key}"),)
    async with grpc.aio.insecure_channel(target) as channel:
        await channel.channel_ready()
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

        async def one(offset: float) -> tuple[float, float | None]:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[rng.randrange(*TOKEN_RANGE) for _ in range(PROMPT_LEN)]),
                sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            )
            sent = time.perf_counter()
            first = None
            try:
                call = stub.GenerateStream(pb.GenerateStreamRequest(request=request), metadata=metadata,
                                           timeout=CALL_TIMEOUT_S)
                async for message in call:
                    if first is None and message.HasField("delta") and message.delta.token_ids:
                        first = time.perf_counter() - sent
            except grpc.RpcError:
                return offset, None
            return offset, first

        tasks = []
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            tasks.append(asyncio.create_task(one(time.perf_counter() - start)))
            await asyncio.sleep(PERIOD_S)
        return list(await asyncio.gather(*tasks))


def main(argv: Sequence[str] | None = None) -> int:
    target, key, seconds = (argv if argv is not None else sys.argv[1:])[:3]
    print(json.dumps(asyncio.run(run(target, key, float(seconds)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
