"""OpenAIService over gRPC against the live server: completions and chat, unary and streamed."""

from __future__ import annotations

import time

import grpc
import pytest_asyncio
from google.protobuf import json_format, struct_pb2
from grpc_status_helpers import failure_of, read_all

from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.openai.v1 import openai_pb2_grpc
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc


def value(python) -> struct_pb2.Value:
    v = struct_pb2.Value()
    json_format.ParseDict(python, v)
    return v


def without_stream_options(request):
    """The unary twin of a streamed request: stream_options only applies to streams (and is refused)."""
    unary = type(request)()
    unary.CopyFrom(request)
    unary.ClearField("stream_options")
    return unary


def chat_request(**kw) -> oa.CreateChatCompletionRequest:
    messages = [
        oa.ChatCompletionRequestMessage(role="system", content=value("You are terse.")),
        oa.ChatCompletionRequestMessage(
            role="user", content=value([{"type": "text", "text": "Name a colour."}])
        ),
    ]
    return oa.CreateChatCompletionRequest(messages=messages, **kw)


@pytest_asyncio.fixture(loop_scope="function")
async def stubs(live_server):
    async with live_server.channel() as ch:
        yield openai_pb2_grpc.OpenAIServiceStub(ch), inference_pb2_grpc.InferenceServiceStub(ch)


async def test_completion_unary(stubs):
    openai, _ = stubs
    response = await openai.CreateCompletion(
        oa.CreateCompletionRequest(prompt=value("The sky is"), temperature=0, logprobs=2)
    )
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert abs(response.created - time.time()) < 60 and response.system_fingerprint.startswith("fp_")
    [choice] = response.choices
    # OpenAI's default max_tokens for completions is 16.
    assert response.usage.completion_tokens <= 16 and choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "length":
        assert response.usage.completion_tokens == 16
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset[0] == 0 and list(lp.text_offset) == sorted(lp.text_offset)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


async def test_completion_prompt_forms_and_n(stubs):
    openai, inference = stubs
    ids = list((await inference.Tokenize(pb.TokenizeRequest(text="Once upon"))).token_ids)
    response = await openai.CreateCompletion(
        oa.CreateCompletionRequest(prompt=value([ids, ids]), max_tokens=4, temperature=0, n=2)
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert len({c.text for c in response.choices}) == 1  # greedy: one answer
    by_text = await openai.CreateCompletion(
        oa.CreateCompletionRequest(
            prompt=value(["Once upon", "Twice upon"]), max_tokens=4, temperature=0, echo=True
        )
    )
    assert by_text.choices[0].text == "Once upon" + response.choices[0].text
    assert by_text.choices[1].text.startswith("Twice upon")
    assert by_text.usage.prompt_tokens == 2 * len(ids) or by_text.usage.prompt_tokens > len(ids)


async def test_completion_stream_with_usage(stubs):
    openai, _ = stubs
    request = oa.CreateCompletionRequest(
        prompt=value("Hello"),
        max_tokens=4,
        temperature=0,
        n=2,
        stream_options=oa.StreamOptions(include_usage=True),
    )
    unary = await openai.CreateCompletion(without_stream_options(request))
    chunks = await read_all(openai.CreateCompletionStream(oa.CreateCompletionStreamRequest(request=request)))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    usage_chunk = chunks[-1]
    assert not usage_chunk.choices and usage_chunk.usage == unary.usage
    for index in (0, 1):
        mine = [ch for c in chunks[:-1] for ch in c.choices if ch.index == index]
        assert "".join(ch.text for ch in mine) == unary.choices[index].text
        assert [ch.HasField("finish_reason") for ch in mine][-1] and not any(
            ch.HasField("finish_reason") for ch in mine[:-1]
        )
        assert mine[-1].finish_reason == unary.choices[index].finish_reason
    assert all(not c.HasField("usage") for c in chunks[:-1])


async def test_chat_unary(stubs):
    openai, _ = stubs
    response = await openai.CreateChatCompletion(
        chat_request(max_completion_tokens=4, temperature=0, logprobs=True, top_logprobs=2, seed=1)
    )
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    [choice] = response.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens
    if choice.finish_reason == "length":  # no EOS or stop string left out of the text
        assert bytes(b for c in content for b in c.bytes).decode() == choice.message.content
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


async def test_chat_stream_roles_finish_and_usage(stubs):
    openai, _ = stubs
    request = chat_request(
        max_tokens=4, temperature=0, n=2, stream_options=oa.StreamOptions(include_usage=True)
    )
    unary = await openai.CreateChatCompletion(without_stream_options(request))
    chunks = await read_all(
        openai.CreateChatCompletionStream(oa.CreateChatCompletionStreamRequest(request=request))
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert not chunks[-1].choices and chunks[-1].usage == unary.usage
    for index in (0, 1):
        mine = [ch for c in chunks[:-1] for ch in c.choices if ch.index == index]
        assert mine[0].delta.role == "assistant"
        assert not any(ch.delta.HasField("role") for ch in mine[1:])
        assert "".join(ch.delta.content for ch in mine) == unary.choices[index].message.content
        assert mine[-1].finish_reason == unary.choices[index].finish_reason
        assert not any(ch.HasField("finish_reason") for ch in mine[:-1])


async def test_openai_models_and_errors(stubs):
    openai, _ = stubs
    models = await openai.ListModels(oa.ListModelsRequest())
    assert models.object == "list" and models.data[0].object == "model" and models.data[0].owned_by
    got = await openai.RetrieveModel(oa.RetrieveModelRequest(model=models.data[0].id))
    assert got.model == models.data[0]
    failure = await failure_of(openai.RetrieveModel(oa.RetrieveModelRequest(model="nope")))
    assert failure.code == grpc.StatusCode.NOT_FOUND
    failure = await failure_of(
        openai.CreateChatCompletion(chat_request(temperature=5000, top_logprobs=3, stop=value(["a"] * 5)))
    )
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.fields == {"temperature", "top_logprobs", "stop"}
    failure = await failure_of(openai.CreateCompletion(oa.CreateCompletionRequest(prompt=value([]))))
    assert failure.fields == {"prompt"}
