"""The OpenAI messages' JSON is OpenAI's: documented examples parse, print back, and
validate against the official `openai` client's own response models."""

from __future__ import annotations

import json
import typing

import openai.types as oa
import pytest
from google.protobuf import json_format
from openai.types import completion_create_params
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat import completion_create_params as chat_params

from protoserve.openai.v1 import openai_pb2 as pb

# Examples in the shape of OpenAI's API reference.
CHAT_REQUEST = {
    "model": "smollm2",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hello!"}]},
    ],
    "max_completion_tokens": 32,
    "temperature": 0.7,
    "top_p": 0.9,
    "n": 2,
    "stream": True,
    "stream_options": {"include_usage": True},
    "stop": ["\n\n", "END"],
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "logit_bias": {"50256": -100},
    "logprobs": True,
    "top_logprobs": 3,
    "user": "user-1234",
    "seed": 42,
}
COMPLETION_REQUEST = {
    "model": "smollm2",
    "prompt": ["Say this", "is a test"],
    "max_tokens": 7,
    "temperature": 0,
    "stop": "\n",
    "logprobs": 2,
    "echo": False,
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "ignore_eos": True,
    "min_tokens": 2,
}
CHAT_RESPONSE = {
    "id": "chatcmpl-123",
    "object": "chat.completion",
    "created": 1677652288,
    "model": "smollm2",
    "system_fingerprint": "fp_44709d6fcb",
    "choices": [
        {
            "index": 0,
            # An empty tool_calls list is printed, as vLLM prints it; the official client reads it as no calls.
            "message": {"role": "assistant", "content": "Hello there, how may I assist you today?", "tool_calls": []},
            "logprobs": {
                "content": [
                    {
                        "token": "Hello",
                        "logprob": -0.25,
                        "bytes": [72, 101, 108, 108, 111],
                        "top_logprobs": [{"token": "Hello", "logprob": -0.25, "bytes": [72, 101, 108, 108, 111]}],
                    }
                ]
            },
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21},
}
CHAT_CHUNK = {
    "id": "chatcmpl-123",
    "object": "chat.completion.chunk",
    "created": 1694268190,
    "model": "smollm2",
    "system_fingerprint": "fp_44709d6fcb",
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": "", "tool_calls": []}}],
}
USAGE_CHUNK = {
    "id": "chatcmpl-123",
    "object": "chat.completion.chunk",
    "created": 1694268190,
    "model": "smollm2",
    "system_fingerprint": "fp_44709d6fcb",
    "choices": [],
    "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21},
}
COMPLETION_RESPONSE = {
    "id": "cmpl-uqkvlQyYK7bGYrRHQ0eXlWi7",
    "object": "text_completion",
    "created": 1589478378,
    "model": "smollm2",
    "system_fingerprint": "fp_44709d6fcb",
    "choices": [
        {
            "text": "\n\nThis is indeed a test",
            "index": 0,
            "logprobs": {
                "tokens": ["\n\n", "This"],
                "token_logprobs": [-0.5, -1.25],
                "top_logprobs": [{"\n\n": -0.5, "\n": -2.0}, {"This": -1.25}],
                "text_offset": [0, 2],
            },
            "finish_reason": "length",
        }
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
}
MODELS = {"object": "list", "data": [{"id": "smollm2", "object": "model", "created": 1686935002, "owned_by": "protoserve"}]}


def _print(msg) -> dict:
    return json.loads(
        json_format.MessageToJson(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    )


@pytest.mark.parametrize(
    ("example", "cls"),
    [
        (CHAT_RESPONSE, pb.CreateChatCompletionResponse),
        (CHAT_CHUNK, pb.CreateChatCompletionStreamResponse),
        (USAGE_CHUNK, pb.CreateChatCompletionStreamResponse),
        (COMPLETION_RESPONSE, pb.CreateCompletionResponse),
        (MODELS, pb.ListModelsResponse),
    ],
)
def test_documented_responses_parse_strictly_and_print_back_identically(example: dict, cls) -> None:
    msg = json_format.ParseDict(example, cls())  # strict: an unknown OpenAI field name fails here
    printed = _print(msg)
    if cls is pb.ListModelsResponse:  # protoserve's own fields beside OpenAI's (the gateway omits empty aliases)
        example = {**example, "data": [{**m, "kind": "", "aliases": []} for m in example["data"]]}
    # Numbers stay numbers (no 64-bit ints printed as strings) and names stay snake_case.
    assert printed == example


def test_responses_validate_against_the_official_client_models() -> None:
    chat = ChatCompletion.model_validate(_print(json_format.ParseDict(CHAT_RESPONSE, pb.CreateChatCompletionResponse())))
    assert chat.choices[0].message.content.startswith("Hello") and chat.usage.total_tokens == 21
    assert chat.choices[0].logprobs.content[0].bytes == [72, 101, 108, 108, 111]
    chunk = ChatCompletionChunk.model_validate(_print(json_format.ParseDict(CHAT_CHUNK, pb.CreateChatCompletionStreamResponse())))
    assert chunk.choices[0].delta.role == "assistant" and chunk.choices[0].index == 0
    usage = ChatCompletionChunk.model_validate(_print(json_format.ParseDict(USAGE_CHUNK, pb.CreateChatCompletionStreamResponse())))
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    completion = oa.Completion.model_validate(_print(json_format.ParseDict(COMPLETION_RESPONSE, pb.CreateCompletionResponse())))
    assert completion.choices[0].logprobs.top_logprobs[0] == {"\n\n": -0.5, "\n": -2.0}
    models = [oa.Model.model_validate(m) for m in _print(json_format.ParseDict(MODELS, pb.ListModelsResponse()))["data"]]
    assert models[0].owned_by == "protoserve"


def test_zero_values_openai_clients_read_are_printed() -> None:
    # `index: 0` and `created` must appear even when zero, or clients see missing fields.
    printed = _print(pb.CreateChatCompletionStreamResponse(choices=[pb.ChatCompletionChunkChoice(index=0)]))
    assert printed["choices"][0]["index"] == 0 and printed["created"] == 0 and printed["object"] == ""


@pytest.mark.parametrize(("example", "cls"), [(CHAT_REQUEST, pb.CreateChatCompletionRequest), (COMPLETION_REQUEST, pb.CreateCompletionRequest)])
def test_documented_requests_parse_strictly(example: dict, cls) -> None:
    msg = json_format.ParseDict(example, cls())  # strict: an unknown name fails here
    printed = json_format.MessageToDict(msg, preserving_proto_field_name=True)
    for key, value in example.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        # Numbers arrive as numbers (the int64 seed included) and zero stays distinguishable from unset.
        assert getattr(msg, key) == pytest.approx(value), key
        assert key in printed, f"{key}={value} was lost"


def test_requests_accept_every_parameter_the_official_client_sends_that_we_serve() -> None:
    # The parameters the issue names, checked against the client's own TypedDicts so a rename upstream shows here.
    served_chat = {
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
        "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
        "logit_bias", "user",
    }
    client_chat = set(typing.get_type_hints(chat_params.CompletionCreateParamsStreaming))
    assert served_chat <= client_chat
    assert served_chat <= set(pb.CreateChatCompletionRequest.DESCRIPTOR.fields_by_name)
    served_completion = {
        "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
        "presence_penalty", "frequency_penalty", "logprobs", "logit_bias", "user", "echo",
    }
    assert served_completion <= set(typing.get_type_hints(completion_create_params.CompletionCreateParamsStreaming))
    assert served_completion <= set(pb.CreateCompletionRequest.DESCRIPTOR.fields_by_name)
