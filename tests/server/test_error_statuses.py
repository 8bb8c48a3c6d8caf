"""Every error status of InferenceService against the live server, with details parsed from trailers."""

from __future__ import annotations

import grpc
import pytest_asyncio
from grpc_status_helpers import failure_of

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc


@pytest_asyncio.fixture(loop_scope="function")
async def stub(live_server):
    async with live_server.channel() as ch:
        yield inference_pb2_grpc.InferenceServiceStub(ch)


async def test_invalid_parameters_name_every_field(stub):
    request = pb.GenerateRequest(
        prompt="hi",
        sampling=pb.SamplingParams(max_tokens=0, temperature=-1, top_p=0, n=99, top_logprobs=3),
        context_policy=42,
    )
    failure = await failure_of(stub.Generate(request))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.reason == "INVALID_PARAMETER"
    assert failure.details["ErrorInfo"].domain == "protoserve"
    assert failure.fields == {
        "sampling.max_tokens",
        "sampling.temperature",
        "sampling.top_p",
        "sampling.n",
        "sampling.top_logprobs",
        "context_policy",
    }


async def test_missing_prompt_and_bad_token_ids(stub):
    failure = await failure_of(stub.Generate(pb.GenerateRequest()))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and failure.fields == {"input"}
    failure = await failure_of(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**8]))))
    assert failure.fields == {"token_ids.ids"}
    failure = await failure_of(
        stub.Generate(
            pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="robot", content="x")]))
        )
    )
    assert failure.fields == {"chat.messages[0].role"}


async def test_stream_errors_are_statuses_too(stub):
    request = pb.GenerateStreamRequest(
        request=pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_k=-3))
    )
    failure = await failure_of(stub.GenerateStream(request))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and failure.fields == {"sampling.top_k"}


async def test_unknown_model_is_not_found(stub):
    failure = await failure_of(stub.Generate(pb.GenerateRequest(model="gpt-17", prompt="hi")))
    assert failure.code == grpc.StatusCode.NOT_FOUND and failure.reason == "MODEL_NOT_FOUND"
    failure = await failure_of(stub.GetModel(pb.GetModelRequest(name="gpt-17")))
    assert failure.code == grpc.StatusCode.NOT_FOUND


async def test_context_overflow_under_reject_is_out_of_range(stub):
    tokens = await stub.Tokenize(pb.TokenizeRequest(text="Hello there"))
    limit = tokens.max_model_len
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=tokens.token_ids),
        sampling=pb.SamplingParams(max_tokens=limit),
        context_policy=pb.CONTEXT_POLICY_REJECT,
    )
    failure = await failure_of(stub.Generate(request))
    assert failure.code == grpc.StatusCode.OUT_OF_RANGE
    assert failure.reason == "CONTEXT_LENGTH_EXCEEDED"
    assert str(limit) in failure.message
    # A prompt that alone exceeds the context is rejected under the default policy too.
    too_long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[tokens.token_ids[0]] * (limit + 1)))
    failure = await failure_of(stub.Generate(too_long))
    assert failure.code == grpc.StatusCode.OUT_OF_RANGE and str(limit) in failure.message


async def test_cancel_of_unknown_request_is_not_found(stub):
    failure = await failure_of(stub.Cancel(pb.CancelRequest(request_id="never-started")))
    assert failure.code == grpc.StatusCode.NOT_FOUND and failure.reason == "REQUEST_NOT_FOUND"


async def test_oversized_message_is_refused(live_server):
    # Above the server's 64 MiB receive limit: refused by gRPC before any handler runs.
    async with grpc.aio.insecure_channel(
        live_server.grpc_target, options=[("grpc.max_send_message_length", 80 * 2**20)]
    ) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        failure = await failure_of(stub.Tokenize(pb.TokenizeRequest(text="x" * (65 * 2**20))))
    assert failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED
