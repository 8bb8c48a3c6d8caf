"""Tool calling end to end with the real SmolLM2, through the official ``openai`` client, the live
gateway and gRPC.

``tool_choice`` "required" and a named function are enforced by the grammar, so at temperature 0.8
over several seeds every call must name a tool of the request and carry arguments that validate
against that tool's schema; a streamed call, reassembled by the client's own accumulator, must equal
the unary one; a tool result goes back into the conversation; and every malformed tools request is
a 400 naming its field.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
FLIGHTS = {
    "type": "function",
    "function": {
        "name": "search_flights",
        "description": "Find flights between two airports",
        "parameters": {
            "type": "object",
            "properties": {
                "route": {
                    "type": "object",
                    "properties": {
                        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    },
                    "required": ["origin", "destination"],
                    "additionalProperties": False,
                },
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "dates": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 10},
                    "minItems": 1,
                    "maxItems": 2,
                },
            },
            "required": ["route", "passengers", "dates"],
            "additionalProperties": False,
        },
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 60}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, FLIGHTS, CALC]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = [
    "What is the weather in Paris right now?",
    "Find me a flight from JFK to LHR for two people on 2026-12-01.",
    "What is 17 times 23?",
    "Is it raining in Tokyo, and what is 2 plus 2?",
]


@pytest.fixture(scope="module")
def base_url(live_server) -> str:
    assert live_server.http_port, "the server started no REST gateway"
    return f"http://127.0.0.1:{live_server.http_port}"


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def assert_valid_calls(message, names: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_validate_against_their_schemas_at_temperature(client, model, clean_log):
    checked = 0
    for question in QUESTIONS:
        for seed in (1, 2, 3):
            response = client.chat.completions.create(
                model=model,
                messages=ask(question),
                tools=TOOLS,
                tool_choice="required",
                temperature=0.8,
                seed=seed,
                n=2,
                max_tokens=600,
            )
            for choice in response.choices:
                assert choice.finish_reason == "tool_calls", choice
                assert choice.message.content is None
                assert_valid_calls(choice.message, set(SCHEMAS))
                checked += 1
    assert checked == len(QUESTIONS) * 3 * 2


def test_a_named_function_is_the_one_called(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=ask(QUESTIONS[0]),
        tools=TOOLS,
        temperature=0.8,
        seed=7,
        max_tokens=160,
        tool_choice={"type": "function", "function": {"name": "search_flights"}},
    )
    choice = response.choices[0]
    # As OpenAI answers a named tool_choice (vLLM measured it): the calls, with finish_reason "stop".
    assert choice.finish_reason == "stop"
    assert [c.function.name for c in choice.message.tool_calls] == ["search_flights"]
    assert_valid_calls(choice.message, {"search_flights"})


def test_a_streamed_call_reassembles_to_the_unary_one(client, model, clean_log):
    kwargs = dict(
        model=model,
        messages=ask(QUESTIONS[3]),
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=160,
    )
    unary = client.chat.completions.create(**kwargs).choices[0]
    pieces = 0
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices and event.chunk.choices[0].delta.tool_calls:
                delta_calls = event.chunk.choices[0].delta.tool_calls
                # The id, type and name come once, in a call's first piece; later pieces are arguments.
                for piece in delta_calls:
                    if piece.id is None:
                        assert piece.type is None and piece.function.name is None
                pieces += len(delta_calls)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == unary.finish_reason == "tool_calls"
    streamed = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert streamed == [(c.function.name, c.function.arguments) for c in unary.message.tool_calls]
    assert pieces > len(streamed), "arguments should arrive in several pieces"


def test_parallel_tool_calls_false_returns_one_call(client, model):
    for seed in (1, 2, 3, 4):
        response = client.chat.completions.create(
            model=model,
            messages=ask(QUESTIONS[3]),
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=160,
        )
        assert len(response.choices[0].message.tool_calls) == 1


def test_a_tool_result_goes_back_into_the_conversation(client, model, clean_log):
    first = (
        client.chat.completions.create(
            model=model,
            messages=ask(QUESTIONS[0]),
            tools=TOOLS,
            tool_choice="required",
            temperature=0,
            max_tokens=160,
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    messages = ask(QUESTIONS[0]) + [
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "It is 22 degrees and sunny."},
    ]
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=30
    ).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert not answer.message.tool_calls


def test_auto_lets_the_model_answer_in_text(client, model):
    choice = client.chat.completions.create(
        model=model, messages=ask("Say hello."), tools=TOOLS, temperature=0, max_tokens=20
    ).choices[0]
    # SmolLM2-135M answers this in text; what it wrote is content, not a call.
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=40)
    unit: str


def test_the_clients_strict_pydantic_tool_parses(client, model):
    # parse() sends strict tools; under "required" the arguments are grammar-held to the strict schema.
    completion = client.chat.completions.parse(
        model=model,
        messages=ask(QUESTIONS[0]),
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required",
        temperature=0.8,
        seed=5,
        max_tokens=120,
    )
    [call] = completion.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Weather)


def test_auto_with_a_strict_tool_gives_text_or_a_valid_call(client, model):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    for seed in (1, 2, 3):
        choice = client.chat.completions.create(
            model=model, messages=ask(QUESTIONS[0]), tools=[strict], temperature=1.0, seed=seed, max_tokens=80
        ).choices[0]
        if choice.message.tool_calls:
            assert_valid_calls(choice.message, {"get_weather"})
        else:
            assert "<tool_call>" not in (choice.message.content or "")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "hi",
                        "tool_calls": [
                            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(base_url, model, body, param, clean_log):
    payload = {"model": model, "messages": ask("hi"), "max_tokens": 4, **body}
    for stream in (False, True):
        response = httpx.post(
            f"{base_url}/v1/chat/completions", json={**payload, "stream": stream}, timeout=60
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
