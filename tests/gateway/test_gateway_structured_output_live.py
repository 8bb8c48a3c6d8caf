"""Structured output end to end with the real SmolLM2: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and the native ``sampling.constraint`` reach the engine's constrained decoding
through the live gateway and gRPC, and a constraint that does not compile (or two at once, or one over
the server's caps) is a 400 / INVALID_ARGUMENT naming the request's own field.

Outputs are checked for what the constraint promises (``json.loads``, ``jsonschema``, ``re.fullmatch``),
at temperature 0.8 over several seeds, so a constraint that were dropped would show in free text.
"""

from __future__ import annotations

import json
import re

import grpc
import httpx
import jsonschema
import openai
import pydantic
import pytest
from google.protobuf import struct_pb2

from protoserve.server.limits import MAX_CONSTRAINT_CHOICES
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with their name and age."}]
PHONE = r"[0-9]{3}-[0-9]{4}"
COLOURS = ["red", "green", "blue"]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int


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


def test_json_object_parses(client, model):
    # Any object: a 135M model left free at a high temperature nests on past max_tokens, so greedy.
    question = [{"role": "user", "content": 'Answer in JSON like {"answer": 5}. What is 2 + 2?'}]
    response = client.chat.completions.create(
        model=model, messages=question, max_tokens=64, temperature=0, response_format={"type": "json_object"}
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict)


def test_json_schema_validates_at_temperature(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in (1, 2, 3):
        response = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=64, temperature=0.8, seed=seed, response_format=fmt
        )
        assert response.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(response.choices[0].message.content), PERSON)


def test_the_clients_parse_returns_the_model(client, model):
    response = client.chat.completions.parse(
        model=model, messages=ASK, max_tokens=64, temperature=0.8, seed=5, response_format=Person
    )
    assert isinstance(response.choices[0].message.parsed, Person)


def test_a_stream_concatenates_to_valid_json(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=64, temperature=0.8, seed=3, response_format=fmt, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 1  # really streamed, not one piece
    jsonschema.validate(json.loads("".join(pieces)), PERSON)


def test_structured_outputs_on_both_routes(client, model):
    for seed in (1, 2, 3):
        completion = client.completions.create(
            model=model, prompt="Call me at", max_tokens=16, temperature=0.8, seed=seed,
            extra_body={"structured_outputs": {"regex": PHONE}},
        )
        assert re.fullmatch(PHONE, completion.choices[0].text), completion.choices[0].text
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=8,
            temperature=0.8, seed=seed, extra_body={"structured_outputs": {"choice": COLOURS}},
        )
        assert chat.choices[0].message.content in COLOURS
    as_text = client.completions.create(
        model=model, prompt="A person:", max_tokens=64, temperature=0.8, seed=4,
        extra_body={"structured_outputs": {"json": json.dumps(PERSON)}},
    )
    jsonschema.validate(json.loads(as_text.choices[0].text), PERSON)


def test_response_format_on_completions_too(client, model):
    # vLLM takes response_format on /v1/completions as well; so does this server.
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in (1, 2):
        completion = client.completions.create(
            model=model, prompt="A person:", max_tokens=64, temperature=0.8, seed=seed,
            extra_body={"response_format": fmt},
        )
        jsonschema.validate(json.loads(completion.choices[0].text), PERSON)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(
            model=model, prompt="A person:", max_tokens=8,
            extra_body={"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        )
    assert exc.value.param == "structured_outputs.regex"


def test_native_grpc_regex_choice_and_schema(live_server):
    with live_server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)

        def text(constraint: pb.Constraint, seed: int, max_tokens: int = 16) -> str:
            sampling = pb.SamplingParams(
                max_tokens=max_tokens, temperature=0.8, seed=seed, constraint=constraint
            )
            response = stub.Generate(pb.GenerateRequest(prompt="Call me at", sampling=sampling))
            assert response.choices[0].finish_reason == pb.FINISH_REASON_STOP
            return response.choices[0].text

        schema = struct_pb2.Struct()
        schema.update(PERSON)
        for seed in (1, 2, 3):
            assert re.fullmatch(PHONE, text(pb.Constraint(regex=PHONE), seed))
            assert text(pb.Constraint(choice=pb.ConstraintChoices(values=COLOURS)), seed) in COLOURS
            jsonschema.validate(json.loads(text(pb.Constraint(json_schema=schema), seed, 64)), PERSON)
        with pytest.raises(grpc.RpcError) as refused:
            bad = pb.SamplingParams(constraint=pb.Constraint(regex="("))
            stub.Generate(pb.GenerateRequest(prompt="x", sampling=bad))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.constraint.regex" in refused.value.details()


def test_native_json_takes_the_schema_as_an_object(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as http:
        sampling = {"max_tokens": 64, "temperature": 0.8, "seed": 2, "constraint": {"json_schema": PERSON}}
        response = http.post("/v1/generate", json={"prompt": "A person:", "sampling": sampling})
        assert response.status_code == 200, response.text
        jsonschema.validate(json.loads(response.json()["choices"][0]["text"]), PERSON)
        grammar = {"grammar": 'root ::= "yes" | "no"'}
        broken = {"constraint": {"grammar": "root ::= ("}}
        refused = http.post("/v1/generate", json={"prompt": "x", "sampling": broken})
        answered = http.post("/v1/generate", json={"prompt": "Ok?", "sampling": {"constraint": grammar}})
    assert answered.status_code == 200 and answered.json()["choices"][0]["text"] in ("yes", "no")
    assert refused.status_code == 400
    violations = [d for d in refused.json()["details"] if d["@type"].endswith("BadRequest")]
    assert violations[0]["field_violations"][0]["field"] == "sampling.constraint.grammar"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"extra_body": {"structured_outputs": {"regex": "("}}}, "structured_outputs.regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= ("}}}, "structured_outputs.grammar"),
        ({"extra_body": {"structured_outputs": {"choice": ["a"] * (MAX_CONSTRAINT_CHOICES + 1)}}},
         "structured_outputs.choice"),
        ({"extra_body": {"structured_outputs": {}}}, "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs.choice"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
            "structured_outputs.regex",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}},
         "structured_outputs.whitespace_pattern"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **kwargs)
    assert refused.value.param == param, refused.value.body
    assert refused.value.type == "invalid_request_error"
