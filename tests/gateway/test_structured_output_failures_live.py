"""Constraints the grammar engine cannot follow, against the live server (issue 43's inputs).

Refused before generating (400 / INVALID_ARGUMENT on the request's own field, with no ERROR in the
log) when no text satisfies them or their forced start is past llguidance's limits; failing mid-output
(a limit hit on the path the model took) as INVALID_ARGUMENT after the tokens a stream already sent,
whose text equals their token ids, on the native routes, gRPC and the official ``openai`` client.
Never a 200 with finish reason ``stop``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from google.protobuf import struct_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

REF_ROOT = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
MUTUAL_REF = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
# (constraint as the native API takes it, what the refusal says)
REFUSED = {
    "endless forced grammar": ({"grammar": 'root ::= "a" root'}, "beyond the grammar engine's limits"),
    "required $ref to the root": ({"json_schema": REF_ROOT}, "beyond the grammar engine's limits"),
    "regex of a million a": ({"regex": "(a{1000}){1000}"}, "beyond the grammar engine's limits"),
    "regex matching no character": ({"regex": r"[^\x00-\x{10FFFF}]"}, "no output can satisfy it"),
    "rule made of itself": ({"grammar": "root ::= x\nx ::= x"}, "no output can satisfy it"),
    "mutual $ref": ({"json_schema": MUTUAL_REF}, "no output can satisfy it"),
}
# Compiles; the endless forced "aaa..." after the model's first token ("b" or "c") is past the limits.
FAILS_MID_OUTPUT = 'root ::= ("b" | "c") rest\nrest ::= "a" rest'
FIRST_TOKENS = ("b", "c", "ba", "ca")
MID_OUTPUT = "the grammar engine hit one of its limits after 1 output token"


@pytest.fixture(scope="module")
def base_url(live_server) -> str:
    assert live_server.http_port, "the server started no REST gateway"
    return f"http://127.0.0.1:{live_server.http_port}"


@pytest.fixture(scope="module")
def http(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(base_url) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def stub(live_server) -> Iterator[inference_pb2_grpc.InferenceServiceStub]:
    with live_server.sync_channel() as channel:
        yield inference_pb2_grpc.InferenceServiceStub(channel)


@pytest.fixture
def no_error_logged(live_server, clean_log) -> Iterator[None]:
    """The server logs no ERROR line (clean_log: and no traceback) while the test runs."""
    start = live_server.log_path.stat().st_size
    yield
    written = live_server.log_path.read_bytes()[start:].decode(errors="replace")
    assert " ERROR " not in written, written[-3000:]


def native_body(constraint: dict, **sampling) -> dict:
    return {"prompt": "Answer:", "sampling": {"max_tokens": 32, "constraint": constraint, **sampling}}


def field_violations(body: dict) -> list[dict]:
    [bad] = [d for d in body["details"] if d["@type"].endswith("google.rpc.BadRequest")]
    return bad["field_violations"]


def bad_request_fields(error: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(error)
    assert status is not None, error
    found = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            found += [v.field for v in bad.field_violations]
    return found


def proto_constraint(constraint: dict) -> pb.Constraint:
    [(kind, value)] = constraint.items()
    if isinstance(value, dict):
        schema = struct_pb2.Struct()
        schema.update(value)
        value = schema
    return pb.Constraint(**{kind: value})


@pytest.mark.parametrize("name", REFUSED)
def test_native_route_refuses_before_generating(http, no_error_logged, name):
    constraint, problem = REFUSED[name]
    for _ in range(2):  # again from the compile cache: the issue's rerun answered EOS as stop
        response = http.post("/v1/generate", json=native_body(constraint))
        assert response.status_code == 400, response.text
        [violation] = field_violations(response.json())
        assert violation["field"] == f"sampling.constraint.{next(iter(constraint))}"
        assert problem in violation["description"]


@pytest.mark.parametrize("name", ["required $ref to the root", "rule made of itself"])
def test_grpc_refuses_before_any_stream_message(stub, no_error_logged, name):
    constraint, problem = REFUSED[name]
    request = pb.GenerateRequest(prompt="Answer:", sampling=pb.SamplingParams(
        max_tokens=32, constraint=proto_constraint(constraint)))
    with pytest.raises(grpc.RpcError) as unary:
        stub.Generate(request)
    stream = stub.GenerateStream(pb.GenerateStreamRequest(request=request))
    with pytest.raises(grpc.RpcError) as streamed:
        next(stream)
    for refused in (unary.value, streamed.value):
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in refused.details()
        assert bad_request_fields(refused) == [f"sampling.constraint.{next(iter(constraint))}"]


@pytest.mark.parametrize(
    ("kwargs", "param", "problem"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": REF_ROOT}}},
         "response_format.json_schema.schema", "beyond the grammar engine's limits"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": MUTUAL_REF}}},
         "response_format.json_schema.schema", "no output can satisfy it"),
        ({"extra_body": {"structured_outputs": {"regex": "(a{1000}){1000}"}}},
         "structured_outputs.regex", "beyond the grammar engine's limits"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= x\nx ::= x"}}},
         "structured_outputs.grammar", "no output can satisfy it"),
    ],
)
def test_openai_routes_refuse_naming_the_field(client, model, no_error_logged, kwargs, param, problem):
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=32, **kwargs)
    # The client's completions take no response_format argument: the server does, from the body.
    body = kwargs.get("extra_body") or {"response_format": kwargs["response_format"]}
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=model, prompt="Answer:", max_tokens=32, extra_body=body)
    for refused in (chat.value, completion.value):
        assert refused.param == param and refused.code == "invalid_parameter", refused.body
        assert problem in refused.message


def test_native_mid_output_failure_is_400_not_stop(http, no_error_logged):
    for _ in range(2):  # the second run recompiles; it fails as the first did, not at once with EOS
        response = http.post("/v1/generate", json=native_body({"grammar": FAILS_MID_OUTPUT}))
        assert response.status_code == 400, response.text
        [violation] = field_violations(response.json())
        assert violation["field"] == "sampling.constraint.grammar"
        assert MID_OUTPUT in violation["description"]
    cached_regex = {"regex": "[bc](a{1000}){1000}"}
    for _ in range(2):
        response = http.post("/v1/generate", json=native_body(cached_regex))
        assert response.status_code == 400 and MID_OUTPUT in response.text, response.text


def test_native_stream_sends_the_tokens_then_the_error(http, no_error_logged):
    body = native_body({"grammar": FAILS_MID_OUTPUT}, n=3, temperature=1.0, seed=4)
    with http.stream("POST", "/v1/generate:stream", json=body) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    *deltas, last = [json.loads(e) for e in events]
    assert sorted(d["delta"]["index"] for d in deltas) == [0, 1, 2]
    for event in deltas:
        delta = event["delta"]
        assert delta["text"] in FIRST_TOKENS
        detok = http.post("/v1/detokenize", json={"token_ids": delta["token_ids"]})
        assert detok.json()["text"] == delta["text"]
    assert last["error"]["code"] == 3 and MID_OUTPUT in last["error"]["message"]
    assert "final" not in json.dumps(events)


def test_grpc_generate_and_stream_end_in_invalid_argument(stub, no_error_logged):
    sampling = pb.SamplingParams(max_tokens=32, constraint=pb.Constraint(grammar=FAILS_MID_OUTPUT))
    request = pb.GenerateRequest(prompt="Answer:", sampling=sampling)
    with pytest.raises(grpc.RpcError) as unary:
        stub.Generate(request)
    received = []
    with pytest.raises(grpc.RpcError) as streamed:
        for message in stub.GenerateStream(pb.GenerateStreamRequest(request=request)):
            received.append(message)
    for failed in (unary.value, streamed.value):
        assert failed.code() == grpc.StatusCode.INVALID_ARGUMENT and MID_OUTPUT in failed.details()
        assert bad_request_fields(failed) == ["sampling.constraint.grammar"]
    [message] = received
    assert message.WhichOneof("event") == "delta" and message.delta.text in FIRST_TOKENS
    detok = stub.Detokenize(pb.DetokenizeRequest(token_ids=message.delta.token_ids))
    assert detok.text == message.delta.text


def test_openai_unary_and_stream_fail_after_the_text_sent(client, model, no_error_logged):
    extra = {"structured_outputs": {"grammar": FAILS_MID_OUTPUT}}
    with pytest.raises(openai.BadRequestError) as unary:
        client.completions.create(model=model, prompt="Answer:", max_tokens=32, extra_body=extra)
    assert unary.value.param == "structured_outputs.grammar" and MID_OUTPUT in unary.value.message
    texts, reasons = [], []
    with pytest.raises(openai.APIError) as streamed:
        for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=32, stream=True, extra_body=extra):
            texts += [c.delta.content or "" for c in chunk.choices]
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert MID_OUTPUT in streamed.value.message
    assert "".join(texts) in FIRST_TOKENS and reasons == []


def test_batch_fails_only_the_item_whose_grammar_failed(stub, no_error_logged):
    failing = pb.SamplingParams(max_tokens=32, constraint=pb.Constraint(grammar=FAILS_MID_OUTPUT))
    fine = pb.SamplingParams(max_tokens=8, constraint=pb.Constraint(regex="[0-9]{3}"))
    reply = stub.Batch(pb.BatchRequest(requests=[pb.GenerateRequest(prompt="Answer:", sampling=fine),
                                                 pb.GenerateRequest(prompt="Answer:", sampling=failing)]))
    answered, failed = reply.results
    assert answered.response.choices[0].finish_reason == pb.FINISH_REASON_STOP
    assert failed.WhichOneof("result") == "error" and failed.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert MID_OUTPUT in failed.error.message and "requests[1].sampling.constraint.grammar" in failed.error.message
