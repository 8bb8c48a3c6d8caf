"""Anthropic's Messages API through the official ``anthropic`` client, against the live gateway, the
server and the real SmolLM2.

A streamed reply, assembled by the client's own ``MessageStream``, must equal the unary one; a
tool call forced by ``tool_choice`` "any" must name a tool of the request with an input valid
against its schema, and its result must go back into the conversation; count_tokens must be the
chat template's count (the native Tokenize of the same conversation, and what create reports);
every client mistake must be the exception Anthropic's client raises for Anthropic's own error.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

MAX_TOKENS = 6
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
CALC = {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression",
    "input_schema": {
        "type": "object",
        "properties": {"expression": {"type": "string", "maxLength": 60}},
        "required": ["expression"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, CALC]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
# This client's create() no longer takes temperature, top_p or top_k as arguments (newer Claude
# models fix them); the API still does, so they go in the body.
GREEDY = {"extra_body": {"temperature": 0}}
SYSTEM = "You answer in one short sentence."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def base_url(live_server) -> str:
    assert live_server.http_port, "the server started no REST gateway"
    return f"http://127.0.0.1:{live_server.http_port}"


@pytest.fixture(scope="module")
def client(base_url):
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(base_url) -> str:
    return httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]


def test_a_reply_and_its_stream_agree(client, model, clean_log):
    args = dict(model=model, system=SYSTEM, messages=QUESTION, max_tokens=MAX_TOKENS, **GREEDY)
    reply = client.messages.create(**args)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.model == model and reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.stop_sequence is None
    assert [block.type for block in reply.content] == ["text"] and reply.content[0].text
    assert 0 < reply.usage.output_tokens <= MAX_TOKENS

    with client.messages.stream(**args) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == reply.content[0].text
    assert [(b.type, b.text) for b in final.content] == [("text", reply.content[0].text)]
    assert final.stop_reason == reply.stop_reason
    assert final.usage.input_tokens == reply.usage.input_tokens
    assert final.usage.output_tokens == reply.usage.output_tokens


def test_the_stream_is_named_events_in_anthropics_order(base_url, model):
    body = {"model": model, "messages": QUESTION, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/messages", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [block.split("\n") for block in raw.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    payloads = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert [p["type"] for p in payloads] == names
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = payloads[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert payloads[2] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    end = payloads[-2]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"] == {"input_tokens": start["usage"]["input_tokens"], "output_tokens": 3}
    assert "[DONE]" not in raw


def test_a_stop_sequence_ends_the_reply_and_is_named(client, model):
    reply = client.messages.create(
        model=model, messages=QUESTION, max_tokens=MAX_TOKENS, **GREEDY
    )
    words = reply.content[0].text.split()
    assert len(words) >= 2, reply.content
    stopped = client.messages.create(
        model=model, messages=QUESTION, max_tokens=MAX_TOKENS, stop_sequences=[words[1]], **GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == words[1]
    assert words[1] not in stopped.content[0].text


def test_top_k_is_honoured(client, model):
    poem = [{"role": "user", "content": "Write a short poem about the sea."}]
    greedy = client.messages.create(model=model, messages=poem, max_tokens=24, **GREEDY).content[0].text
    # At temperature 2 the model wanders; top_k 1 leaves it only the greedy token at every step.
    hot = {"model": model, "messages": poem, "max_tokens": 24}
    assert client.messages.create(**hot, extra_body={"temperature": 2, "top_k": 1}).content[0].text == greedy
    assert client.messages.create(**hot, extra_body={"temperature": 2, "top_k": 50}).content[0].text != greedy


def _tool_use(message) -> anthropic.types.ToolUseBlock:
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and message.stop_reason == "tool_use", message
    for call in calls:
        assert call.id.startswith("toolu_") and call.name in SCHEMAS
        jsonschema.validate(call.input, SCHEMAS[call.name])
    return calls[0]


def test_a_forced_tool_call_round_trip(client, model, clean_log):
    args = dict(
        model=model,
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice={"type": "any"},
        max_tokens=160,
        **GREEDY,
    )
    first = client.messages.create(**args)
    call = _tool_use(first)

    with client.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    streamed_call = _tool_use(streamed)
    assert (streamed_call.name, streamed_call.input) == (call.name, call.input)

    answer = client.messages.create(
        model=model,
        messages=[
            *WEATHER_QUESTION,
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "22 degrees and sunny."}],
            },
        ],
        tools=TOOLS,
        tool_choice={"type": "none"},
        max_tokens=MAX_TOKENS,
        **GREEDY,
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in answer.content] == ["text"] and answer.content[0].text


def test_a_named_tool_is_the_one_called(client, model):
    reply = client.messages.create(
        model=model,
        messages=[{"role": "user", "content": "What is 17 times 23?"}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "calculate", "disable_parallel_tool_use": True},
        max_tokens=160,
        **GREEDY,
    )
    assert [block.name for block in reply.content if block.type == "tool_use"] == ["calculate"], reply
    _tool_use(reply)


def test_count_tokens_is_the_chat_templates_count(client, model, base_url):
    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=QUESTION)
    # A caching hint is accepted and changes nothing: prefixes are cached anyway.
    hinted = client.messages.count_tokens(
        model=model, system=SYSTEM, messages=QUESTION, cache_control={"type": "ephemeral"}
    )
    assert hinted.input_tokens == counted.input_tokens
    chat = [{"role": "system", "content": SYSTEM}, *QUESTION]
    native = httpx.post(f"{base_url}/v1/tokenize", json={"model": model, "chat": {"messages": chat}}, timeout=60)
    assert native.status_code == 200, native.text
    assert counted.input_tokens == len(native.json()["token_ids"]) > 0
    reply = client.messages.create(model=model, system=SYSTEM, messages=QUESTION, max_tokens=1, **GREEDY)
    assert reply.usage.input_tokens == counted.input_tokens

    # Tools are rendered into the prompt, so they count; "none" leaves them out, as create does.
    with_tools = client.messages.count_tokens(model=model, system=SYSTEM, messages=QUESTION, tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens
    used = client.messages.create(
        model=model, system=SYSTEM, messages=QUESTION, tools=TOOLS, max_tokens=1, **GREEDY
    )
    assert used.usage.input_tokens == with_tools.input_tokens
    without = client.messages.count_tokens(
        model=model, system=SYSTEM, messages=QUESTION, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert without.input_tokens == counted.input_tokens


def _anthropic_error(response: httpx.Response, status: int, error_type: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == error_type, body
    return body["error"]["message"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}]},
         "messages[0].content[0].extra"),
        ({"messages": [*QUESTION, {"role": "assistant", "content": "Paris"}]}, "messages[1].role"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_bad_requests_are_invalid_request_errors_naming_the_field(base_url, model, change, named, clean_log):
    body = {"model": model, "messages": QUESTION, "max_tokens": MAX_TOKENS, **change}
    body = {key: value for key, value in body.items() if value is not None}
    message = _anthropic_error(httpx.post(f"{base_url}/v1/messages", json=body, timeout=60), 400, "invalid_request_error")
    assert named in message


def test_the_clients_exceptions_for_anthropics_errors(client, model, base_url):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", messages=QUESTION, max_tokens=MAX_TOKENS)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        with client.messages.stream(model="no-such-model", messages=QUESTION, max_tokens=MAX_TOKENS) as stream:
            stream.get_final_message()
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=model, messages=QUESTION, max_tokens=MAX_TOKENS, extra_body={"top_k": -5})
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "top_k" in bad.value.message
    unknown_route = httpx.post(f"{base_url}/v1/messages/batches", json={}, timeout=60)
    _anthropic_error(unknown_route, 404, "not_found_error")


@pytest.fixture(scope="module")
def auth_base_url(live_server_auth) -> str:
    return f"http://127.0.0.1:{live_server_auth.http_port}"


def test_keys_by_x_api_key_or_bearer_and_a_bad_key_is_an_authentication_error(live_server_auth, auth_base_url):
    key = live_server_auth.api_keys[0]
    body = {"model": "", "messages": QUESTION}
    model = httpx.get(f"{auth_base_url}/v1/models", headers={"x-api-key": key}).json()["data"][0]["id"]
    body["model"] = model
    by_header = httpx.post(
        f"{auth_base_url}/v1/messages/count_tokens",
        json=body,
        headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert by_header.status_code == 200 and by_header.json()["input_tokens"] > 0
    with anthropic.Anthropic(base_url=auth_base_url, api_key=key, max_retries=0) as bearer:
        assert bearer.auth_headers == {"Authorization": f"Bearer {key}"}  # what this client sends
        assert bearer.messages.count_tokens(model=model, messages=QUESTION).input_tokens == by_header.json()[
            "input_tokens"
        ]
    with anthropic.Anthropic(
        base_url=auth_base_url, api_key=None, default_headers={"x-api-key": key}, max_retries=0
    ) as by_x_api_key:
        assert by_x_api_key.messages.count_tokens(model=model, messages=QUESTION).input_tokens > 0
    with anthropic.Anthropic(base_url=auth_base_url, api_key="wrong-key", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            wrong.messages.create(model=model, messages=QUESTION, max_tokens=MAX_TOKENS)
    assert refused.value.body["error"]["type"] == "authentication_error"
    missing = httpx.post(f"{auth_base_url}/v1/messages", json={**body, "max_tokens": 2}, timeout=60)
    assert "x-api-key" in _anthropic_error(missing, 401, "authentication_error")
