"""``serve --stream-interval N``: after the first token, streams carry N tokens a message, the same tokens."""

from __future__ import annotations

import asyncio

import openai
from grpc_status_helpers import read_all

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

INTERVAL = 4
MAX_TOKENS = 13
PROMPT = "The history of the printing press"
MOST_MESSAGES = 1 + -(-(MAX_TOKENS - 1) // INTERVAL)  # the first token, then the rest INTERVAL at a time


def _request() -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))


def _stream_deltas(server) -> list[pb.GenerateDelta]:
    async def main():
        async with server.channel() as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            return await read_all(stub.GenerateStream(pb.GenerateStreamRequest(request=_request())))

    return [e.delta for e in asyncio.run(main()) if e.HasField("delta")]


def _sizes_fit(sizes: list[int]) -> bool:
    # The first token alone, then INTERVAL at a time (a server loop that fell behind may join more), the
    # rest at the end.
    return sizes[0] == 1 and all(n >= INTERVAL for n in sizes[1:-1]) and len(sizes) <= MOST_MESSAGES


def test_streams_carry_n_tokens_a_message_and_the_same_tokens(spawn_server, live_server):
    server = spawn_server("--stream-interval", str(INTERVAL), "--no-embedding-model")
    every = _stream_deltas(live_server)
    chunked = _stream_deltas(server)
    assert [len(d.token_ids) for d in every] == [1] * MAX_TOKENS
    assert _sizes_fit([len(d.token_ids) for d in chunked]), [len(d.token_ids) for d in chunked]
    assert [t for d in chunked for t in d.token_ids] == [t for d in every for t in d.token_ids]
    assert "".join(d.text for d in chunked) == "".join(d.text for d in every)

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0)
    chunks = client.completions.create(model="", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == "".join(d.text for d in every)
    assert len(texts) <= MOST_MESSAGES, texts
