"""32 concurrent streams on the live server, each equal to the same request run alone (greedy)."""

from __future__ import annotations

import asyncio

from grpc_status_helpers import read_all

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

PROMPTS = [
    "The quick brown fox",
    "In a galaxy far away,",
    "def fibonacci(n):",
    "My favourite recipe for soup is",
]
STREAMS = 32
MAX_TOKENS = 6


def request(prompt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))


async def test_32_concurrent_streams_equal_solo(live_server):
    async with live_server.channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        solo = {}
        for prompt in PROMPTS:
            response = await stub.Generate(request(prompt))
            solo[prompt] = (list(response.choices[0].token_ids), response.choices[0].text)

        async def one(i: int):
            prompt = PROMPTS[i % len(PROMPTS)]
            events = await read_all(stub.GenerateStream(pb.GenerateStreamRequest(request=request(prompt))))
            deltas = [e.delta for e in events if e.HasField("delta")]
            return (
                prompt,
                [t for d in deltas for t in d.token_ids],
                "".join(d.text for d in deltas),
                events[-1],
            )

        results = await asyncio.gather(*(one(i) for i in range(STREAMS)))
    for prompt, token_ids, text, last in results:
        assert (token_ids, text) == solo[prompt], prompt
        assert last.HasField("final") and last.final.usage.completion_tokens == len(token_ids)
