"""Issue 21, items 2, 6 and 7, over a raw gRPC channel against the live server.

Undecodable request bytes (garbage, or messages nested past protobuf's depth limit) are
INVALID_ARGUMENT on every method, never UNKNOWN; OpenAI fields the server would ignore
are refused naming the field; list caps hold for gRPC callers as they do behind the
gateway. The server stays healthy and logs no traceback.
"""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2
from grpc_status_helpers import failure_of

from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.openai.v1 import openai_pb2_grpc
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

GARBAGE = b"\xff\xff\xff\xff"
# (method, request streaming, response streaming): services of every kind the server registers.
METHODS = [
    ("/protoserve.v1.InferenceService/Generate", False, False),
    ("/protoserve.v1.InferenceService/GenerateStream", False, True),
    ("/protoserve.v1.InferenceService/Batch", False, False),
    ("/protoserve.v1.InferenceService/Tokenize", False, False),
    ("/protoserve.v1.InferenceService/CheckHealth", False, False),
    ("/protoserve.openai.v1.OpenAIService/CreateCompletion", False, False),
    ("/protoserve.openai.v1.OpenAIService/CreateChatCompletionStream", False, True),
    ("/protoserve.openai.v1.OpenAIService/ListModels", False, False),
    ("/protoserve.v1.MetricsService/GetMetrics", False, False),
    ("/protoserve.v1.MetricsService/WatchMetrics", False, True),
    ("/grpc.health.v1.Health/Check", False, False),
    ("/grpc.health.v1.Health/Watch", False, True),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", True, True),
    ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", True, True),
]


def value(python) -> struct_pb2.Value:
    v = struct_pb2.Value()
    json_format.ParseDict(python, v)
    return v


def nest(target: struct_pb2.Value, depth: int) -> None:
    """Make ``target`` hold ``depth`` arrays, in place.

    Protobuf copies (constructors, CopyFrom) parse what they copy, and would refuse it.
    """
    for _ in range(depth):
        target = target.list_value.values.add()
    target.string_value = "a"


@pytest_asyncio.fixture(loop_scope="function")
async def channel(live_server):
    async with live_server.channel() as ch:
        yield ch


def _raw_call(
    channel: grpc.aio.Channel, method: str, request_streaming: bool, response_streaming: bool, data
):
    """A call with no serializers: the bytes go out exactly as given."""
    if request_streaming:
        return channel.stream_stream(method)(iter([data]), timeout=10)
    if response_streaming:
        return channel.unary_stream(method)(data, timeout=10)
    return channel.unary_unary(method)(data, timeout=10)


@pytest.mark.parametrize(("method", "request_streaming", "response_streaming"), METHODS)
async def test_undecodable_bytes_are_invalid_argument_on_every_method(
    channel, clean_log, method, request_streaming, response_streaming
):
    failure = await failure_of(_raw_call(channel, method, request_streaming, response_streaming, GARBAGE))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT, (method, failure)
    assert failure.message.startswith("request message could not be decoded")
    assert "<class" not in failure.message and failure.reason == "INVALID_PARAMETER"


async def test_values_nested_past_protobufs_limit_are_invalid_argument(channel, live_server, clean_log):
    # 49 levels of arrays decode (the request is 99 messages deep), 50 do not (101).
    decodable = oa.CreateCompletionRequest(max_tokens=1)
    nest(decodable.prompt, 49)
    too_deep = oa.CreateCompletionRequest(max_tokens=1)
    nest(too_deep.prompt, 50)
    method = "/protoserve.openai.v1.OpenAIService/CreateCompletion"
    judged = await failure_of(_raw_call(channel, method, False, False, decodable.SerializeToString()))
    assert judged.code == grpc.StatusCode.INVALID_ARGUMENT and judged.fields == {"prompt"}
    refused = await failure_of(_raw_call(channel, method, False, False, too_deep.SerializeToString()))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be decoded" in refused.message and "100 levels" in refused.message
    chat = oa.CreateChatCompletionStreamRequest()
    nest(chat.request.messages.add(role="user").content, 60)
    stream = openai_pb2_grpc.OpenAIServiceStub(channel).CreateChatCompletionStream(chat)
    assert (await failure_of(stream)).code == grpc.StatusCode.INVALID_ARGUMENT
    assert live_server.health() == health_pb2.HealthCheckResponse.SERVING


# ------------------------------------------------------------------ fields the server would ignore


async def test_stream_settings_on_unary_calls_are_refused_naming_them(channel):
    stub = openai_pb2_grpc.OpenAIServiceStub(channel)
    completion = oa.CreateCompletionRequest(
        prompt=value("hi"), max_tokens=1, stream=True, stream_options=oa.StreamOptions(include_usage=True)
    )
    failure = await failure_of(stub.CreateCompletion(completion))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.fields == {"stream", "stream_options"}
    chat = oa.CreateChatCompletionRequest(
        messages=[oa.ChatCompletionRequestMessage(role="user", content=value("hi"))],
        stream_options=oa.StreamOptions(include_usage=True),
    )
    assert (await failure_of(stub.CreateChatCompletion(chat))).fields == {"stream_options"}
    # The streaming methods honour both.
    chunks = []
    async for chunk in stub.CreateCompletionStream(oa.CreateCompletionStreamRequest(request=completion)):
        chunks.append(chunk)
    assert chunks[-1].usage.completion_tokens == 1


async def test_conflicting_chat_token_limits_are_refused(channel):
    stub = openai_pb2_grpc.OpenAIServiceStub(channel)
    messages = [oa.ChatCompletionRequestMessage(role="user", content=value("hi"))]
    conflict = oa.CreateChatCompletionRequest(messages=messages, max_tokens=3, max_completion_tokens=1)
    assert (await failure_of(stub.CreateChatCompletion(conflict))).fields == {"max_tokens"}
    agreeing = oa.CreateChatCompletionRequest(messages=messages, max_tokens=1, max_completion_tokens=1)
    assert (await stub.CreateChatCompletion(agreeing)).usage.completion_tokens == 1


# ------------------------------------------------------------------ list caps hold for gRPC callers


async def test_list_caps_hold_over_grpc(channel, clean_log):
    openai = openai_pb2_grpc.OpenAIServiceStub(channel)
    inference = inference_pb2_grpc.InferenceServiceStub(channel)
    hello = oa.ChatCompletionRequestMessage(role="user", content=value("hi"))
    cases = [
        (openai.CreateCompletion(oa.CreateCompletionRequest(prompt=value(["hello"] * 5000))), "prompt"),
        (openai.CreateChatCompletion(oa.CreateChatCompletionRequest(messages=[hello] * 2049)), "messages"),
        (
            openai.CreateChatCompletion(
                oa.CreateChatCompletionRequest(
                    messages=[hello], logit_bias={str(i): 1.0 for i in range(1025)}
                )
            ),
            "logit_bias",
        ),
        (
            inference.Generate(
                pb.GenerateRequest(
                    chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")] * 2049)
                )
            ),
            "chat.messages",
        ),
        (
            inference.Generate(
                pb.GenerateRequest(
                    prompt="hi", sampling=pb.SamplingParams(logit_bias={i: 1.0 for i in range(1025)})
                )
            ),
            "sampling.logit_bias",
        ),
    ]
    for call, field in cases:
        failure = await failure_of(call)
        assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and failure.fields == {field}, (
            field,
            failure,
        )
        assert "at most" in failure.message
    # At the caps themselves the requests are served.
    served = await openai.CreateCompletion(
        oa.CreateCompletionRequest(prompt=value([[1]] * 256), max_tokens=1)
    )
    assert len(served.choices) == 256
