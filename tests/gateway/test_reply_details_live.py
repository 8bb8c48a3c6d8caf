"""Issue 43, item 5: OpenAI reply details and the end of native SSE streams, against the live gateway.

A message or delta without tool calls has no ``tool_calls`` key (OpenAI omits it, and refuses
``"tool_calls": []`` sent back); a reply that only calls tools has ``content`` null in the unary
message and in its stream's first delta, which carries the role with the first call as OpenAI's
streams do; every native SSE stream ends with ``data: [DONE]`` as the OpenAI routes' do. Checked
as raw JSON and through the official ``openai`` client.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base_url(live_server) -> str:
    assert live_server.http_port, "the server started no REST gateway"
    return f"http://127.0.0.1:{live_server.http_port}"


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as sync_client:
        yield sync_client


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def sse_events(reply: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a whole SSE body, in order."""
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/event-stream")
    body = reply.text
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(event.startswith("data: ") for event in events), body
    return [event.removeprefix("data: ") for event in events]


def chat_chunks(reply: httpx.Response) -> list[dict]:
    *chunks, done = sse_events(reply)
    assert done == "[DONE]"
    return [json.loads(chunk) for chunk in chunks]


def test_a_reply_without_calls_has_no_tool_calls_key(http, model):
    body = {"model": model, "messages": ASK, "max_tokens": 4, "temperature": 0}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert "tool_calls" not in message, message
    chunks = chat_chunks(http.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [choice["delta"] for chunk in chunks for choice in chunk["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas and all("tool_calls" not in delta for delta in deltas), deltas
    assert "".join(delta["content"] or "" for delta in deltas) == message["content"]


def test_a_calls_only_reply_has_content_null_unary_and_streamed(http, model):
    body = {"model": model, "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 48,
            "temperature": 0}  # fmt: skip
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    message = choice["message"]
    assert message["content"] is None and choice["finish_reason"] == "tool_calls", choice
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_weather"]
    chunks = chat_chunks(http.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [choice["delta"] for chunk in chunks for choice in chunk["choices"]]
    first = deltas[0]
    # OpenAI's first chunk of such a stream: the role, content null and the call's first piece.
    assert first == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"index": 0, "id": first["tool_calls"][0]["id"], "type": "function",
             "function": {"name": "get_weather", "arguments": ""}},
        ],
    }  # fmt: skip
    assert all(delta["content"] is None for delta in deltas), deltas
    assert "tool_calls" not in deltas[-1] and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    arguments = "".join(
        piece["function"]["arguments"] for delta in deltas for piece in delta.get("tool_calls", [])
    )
    assert arguments == message["tool_calls"][0]["function"]["arguments"]


def test_the_openai_client_sees_no_calls_as_none_and_can_send_a_reply_back(client, model):
    reply = client.chat.completions.create(model=model, messages=ASK, max_tokens=4, temperature=0)
    message = reply.choices[0].message
    assert message.tool_calls is None
    # The message as the client holds it goes back into the conversation unchanged.
    history = [*ASK, message.model_dump(exclude_unset=True), {"role": "user", "content": "Thanks."}]
    assert "tool_calls" not in history[1]
    again = client.chat.completions.create(model=model, messages=history, max_tokens=2, temperature=0)
    assert again.choices[0].message.tool_calls is None
    stream = client.chat.completions.create(model=model, messages=ASK, max_tokens=4, temperature=0, stream=True)
    assert all(chunk.choices[0].delta.tool_calls is None for chunk in stream if chunk.choices)


def test_the_openai_stream_helper_assembles_the_unary_calls_only_message(client, model):
    args = {"model": model, "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 48,
            "temperature": 0}  # fmt: skip
    unary = client.chat.completions.create(**args).choices[0].message
    with client.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion().choices[0].message
    assert unary.content is None and final.content is None
    assert [(c.function.name, c.function.arguments) for c in final.tool_calls] == [
        (c.function.name, c.function.arguments) for c in unary.tool_calls
    ]


# ------------------------------------------------------------------ native SSE streams end with [DONE]


def test_native_streams_end_with_done(http, model):
    generate = sse_events(http.post("/v1/generate:stream", json={"prompt": "Hi", "sampling": {"max_tokens": 2}}))
    assert generate[-1] == "[DONE]" and "final" in json.loads(generate[-2])
    indexed = http.post("/v1/rag/index", json={"documents": [{"document_id": "paris", "text": "Paris is the capital of France."}]})
    assert indexed.status_code == 200, indexed.text
    rag = {"query": "capital of France", "stream": True, "sampling": {"max_tokens": 2}}
    answer = sse_events(http.post("/v1/rag/generate", json=rag))
    assert answer[-1] == "[DONE]" and all(json.loads(event) for event in answer[:-1])
    run = {"messages": [{"role": "user", "content": "Say hi."}], "max_steps": 1, "sampling": {"max_tokens": 4}}
    events = sse_events(http.post("/v1/agent/runs", json=run))
    assert events[-1] == "[DONE]" and "answer" in json.loads(events[-2])


def test_a_native_stream_that_fails_ends_without_done(http):
    # Refused after it began: the error event is the last, and no [DONE] follows it.
    fails_after_a_token = 'root ::= ("b" | "c") rest\nrest ::= "a" rest'
    body = {"prompt": "Answer:", "sampling": {"max_tokens": 32, "constraint": {"grammar": fails_after_a_token}}}
    events = sse_events(http.post("/v1/generate:stream", json=body))
    assert "[DONE]" not in events and "error" in json.loads(events[-1])
