"""OpenAI's Responses API end to end with the real SmolLM2, through the official ``openai`` client and
the ``openai-agents`` SDK's default Responses model, the live gateway and gRPC.

A unary response and a stream of the same greedy request give the same output, the stream's events
in OpenAI's order with consecutive sequence numbers; ``text.format`` json_schema holds over seeds
and json_object gives one JSON object;
a forced function call goes round with its ``function_call_output``; ``previous_response_id``
carries a conversation over three turns; stored responses are read, listed and deleted by their
owner only; fields the server cannot honour are 400s naming them; and the agents SDK's default
provider, given only a model name, runs a one-tool agent through /v1/responses.
"""

from __future__ import annotations

import asyncio
import json

import agents
import httpx
import jsonschema
import openai
import pytest

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def base_url(live_server) -> str:
    return f"http://127.0.0.1:{live_server.http_port}"


def _client(base_url: str, user: str | None = None) -> openai.OpenAI:
    headers = {"x-user-id": user} if user else None
    return openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120, default_headers=headers
    )


@pytest.fixture(scope="module")
def client(base_url):
    with _client(base_url, "responses-owner") as c:
        yield c


def test_unary_response_has_openai_shape(client, clean_log):
    response = client.responses.create(
        model="SmolLM2-135M-Instruct",
        input="What is the capital of France?",
        instructions="Answer in one short sentence.",
        max_output_tokens=24,
        temperature=0,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output_text.strip()
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text"
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.instructions == "Answer in one short sentence." and response.max_output_tokens == 24


def test_stream_events_add_up_to_the_unary_response(client, clean_log):
    kwargs = {"model": "SmolLM2-135M-Instruct", "input": "Name three colours.", "max_output_tokens": 20,
              "temperature": 0, "store": False}
    unary = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]
    closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-4:-1] == closing and kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == unary.output_text
    assert final.usage.output_tokens == unary.usage.output_tokens


def test_top_p_is_honoured(client, clean_log):
    kwargs = {"model": "SmolLM2-135M-Instruct", "input": "Write a short poem about the sea.",
              "max_output_tokens": 24, "store": False}
    greedy = client.responses.create(temperature=0, **kwargs).output_text
    # At temperature 2 the model wanders; a top_p below 1/vocabulary leaves it only the likeliest token
    # at every step (that token's probability is never below 1/vocabulary).
    assert client.responses.create(temperature=2, top_p=1e-6, **kwargs).output_text == greedy
    assert client.responses.create(temperature=2, top_p=1, **kwargs).output_text != greedy


def test_sdk_stream_helper_accumulates_a_completed_response(client, clean_log):
    kwargs = {"model": "SmolLM2-135M-Instruct", "input": "Reply with the single word: yes",
              "max_output_tokens": 48, "temperature": 0, "store": False}
    unary = client.responses.create(**kwargs)
    assert unary.status == "completed"
    # The SDK's own accumulator reads the events into the same response.
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.output_text == unary.output_text and final.id != unary.id


def test_raw_stream_names_each_event_and_sends_no_done(base_url, clean_log):
    body = {"input": "Hi", "max_output_tokens": 4, "temperature": 0, "stream": True, "store": False}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        text = reply.read().decode()
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("event: ") for f in frames) and "[DONE]" not in text
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert json.loads(data_line.removeprefix("data: "))["type"] == event_line.removeprefix("event: ")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_format_holds_over_seeds(client, seed, clean_log):
    response = client.responses.create(
        model="SmolLM2-135M-Instruct",
        input="Invent a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        temperature=1.0,
        max_output_tokens=64,
        extra_body={"seed": seed},
        store=False,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)


def test_json_object_format_is_one_json_object(client, clean_log):
    kwargs = {"model": "SmolLM2-135M-Instruct", "input": "Give a JSON object with a cat's name and age.",
              "temperature": 0, "max_output_tokens": 64, "store": False}
    plain = client.responses.create(**kwargs)
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.output_text)  # unconstrained, the model wraps it in a markdown fence
    response = client.responses.create(text={"format": {"type": "json_object"}}, **kwargs)
    assert response.status == "completed" and response.text.format.type == "json_object"
    assert isinstance(json.loads(response.output_text), dict)


def test_function_call_round_trip(client, clean_log):
    first = client.responses.create(
        model="SmolLM2-135M-Instruct",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=64,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The caller runs the tool and sends its output back, with the call, as input items.
    second = client.responses.create(
        model="SmolLM2-135M-Instruct",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'},
        ],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_output_tokens=32,
    )
    assert second.output_text.strip() and not [i for i in second.output if i.type == "function_call"]
    items = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message", "function_call", "function_call_output"]


def test_streamed_function_call_events(client, clean_log):
    events = list(client.responses.create(
        model="SmolLM2-135M-Instruct", input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
        temperature=0, max_output_tokens=64, stream=True, store=False,
    ))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done.arguments == pieces and done.name == "get_weather"
    [call] = [i for i in events[-1].response.output if i.type == "function_call"]
    assert call.arguments == done.arguments


def test_previous_response_id_over_three_turns(client, clean_log):
    kwargs = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_output_tokens": 16}
    one = client.responses.create(input="My name is Ada. Say hello.", **kwargs)
    two = client.responses.create(input="What is 2 + 2?", previous_response_id=one.id, **kwargs)
    three = client.responses.create(input="What is my name?", previous_response_id=two.id, **kwargs)
    assert three.previous_response_id == two.id
    # The third turn's prompt holds the first two turns: its input is the longest by their tokens.
    assert three.usage.input_tokens > two.usage.input_tokens > one.usage.input_tokens
    alone = client.responses.create(input="What is my name?", store=False, **kwargs)
    assert three.usage.input_tokens > alone.usage.input_tokens + one.usage.output_tokens


def test_retrieve_list_and_delete(client, clean_log):
    created = client.responses.create(
        model="SmolLM2-135M-Instruct",
        input=[{"role": "user", "content": "One"}, {"role": "user", "content": [{"type": "input_text", "text": "Two"}]}],
        max_output_tokens=4, temperature=0, metadata={"topic": "count"},
    )
    fetched = client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    assert fetched.metadata == {"topic": "count"}
    items = client.responses.input_items.list(created.id)  # newest first by default
    assert [i.content[0].text for i in items.data] == ["Two", "One"] and not items.has_more
    page = client.responses.input_items.list(created.id, order="asc", limit=1)
    assert [i.content[0].text for i in page.data] == ["One"] and page.has_more
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_another_identity_gets_404_for_every_route(base_url, client, clean_log):
    mine = client.responses.create(model="SmolLM2-135M-Instruct", input="Secret", max_output_tokens=4, temperature=0)
    with _client(base_url, "someone-else") as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.input_items.list(mine.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(mine.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(
                model="SmolLM2-135M-Instruct", input="Go on", previous_response_id=mine.id, max_output_tokens=4
            )
    assert client.responses.retrieve(mine.id).id == mine.id  # still the owner's


def test_store_false_keeps_nothing(client, clean_log):
    unstored = client.responses.create(
        model="SmolLM2-135M-Instruct", input="Hi", max_output_tokens=4, temperature=0, store=False
    )
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_unsupported_fields_are_400_naming_them(base_url, extra, param, clean_log):
    body = {"input": "Hi", "max_output_tokens": 4, **extra}
    for stream in (False, True):
        reply = httpx.post(f"{base_url}/v1/responses", json={**body, "stream": stream}, timeout=60)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param


def test_agents_sdk_runs_a_one_tool_agent_on_its_default_model(base_url, clean_log):
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    # The SDK's default provider with its default API: a model named by a string is its Responses model.
    provider = agents.MultiProvider(openai_client=client)
    assert isinstance(provider.get_model("SmolLM2-135M-Instruct"), agents.OpenAIResponsesModel)
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather using the get_weather tool.",
        tools=[get_weather],
        model="SmolLM2-135M-Instruct",
        # Forced on the first turn, then free to answer: the run must call the tool and end.
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
        reset_tool_choice=True,
    )
    run_config = agents.RunConfig(model_provider=provider, tracing_disabled=True)
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4, run_config=run_config))
    assert calls and isinstance(result.final_output, str) and result.final_output.strip()
    # Every turn went through /v1/responses (the chat-completions model reports no response id).
    assert len(result.raw_responses) >= 2
    assert all((r.response_id or "").startswith("resp_") for r in result.raw_responses)
