"""The one request -> engine SamplingParams mapping: which fields map by name, defaults, and violation paths."""

from __future__ import annotations

import dataclasses
import json

import pytest
from google.protobuf import struct_pb2

from protoserve.engine.sampling.constraints.constraint import Constraint
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server.errors import ServiceError
from protoserve.server.limits import MAX_CONSTRAINT_CHARS, MAX_CONSTRAINT_CHOICES
from protoserve.server.models.sampling_mapping import (
    DEFAULTABLE,
    ENGINE_FIELDS,
    SamplingMapping,
    shared_fields,
)
from protoserve.v1 import inference_pb2 as pb

REQUEST_TYPES = (pb.SamplingParams, oa.CreateCompletionRequest, oa.CreateChatCompletionRequest)
BUILTIN = SamplingParams()
# Fields whose form differs in the OpenAI requests; their service converts them.
OPENAI_CONVERTED = {"stop", "logit_bias"}


@pytest.mark.parametrize("message_type", REQUEST_TYPES, ids=lambda t: t.DESCRIPTOR.full_name)
def test_a_field_without_presence_defaults_to_zero_in_the_engine_too(message_type):
    """Unset is zero for such a field, so an engine default other than zero could never be asked for."""
    for fd in shared_fields(message_type.DESCRIPTOR):
        if fd.has_presence or fd.is_repeated:
            continue
        assert getattr(BUILTIN, fd.name) == fd.default_value, fd.full_name


@pytest.mark.parametrize("message_type", REQUEST_TYPES, ids=lambda t: t.DESCRIPTOR.full_name)
def test_every_field_a_model_may_default_has_presence(message_type):
    """A request must be able to set top_k=0 (or temperature=0) over a model's default."""
    fields = message_type.DESCRIPTOR.fields_by_name
    for name in DEFAULTABLE:
        assert fields[name].has_presence, f"{message_type.DESCRIPTOR.full_name}.{name} needs `optional`"
    assert set(DEFAULTABLE) <= ENGINE_FIELDS


def test_the_native_message_maps_every_field_by_name():
    """All but the constraint message, which params() converts (constraint_from_proto)."""
    native = {fd.name for fd in shared_fields(pb.SamplingParams.DESCRIPTOR)}
    assert native == set(pb.SamplingParams.DESCRIPTOR.fields_by_name) - {"constraint"}


def test_openai_requests_share_the_native_names():
    """The OpenAI requests carry the native names, so a parameter added to both maps without code."""
    native = set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    for message_type in REQUEST_TYPES[1:]:
        shared = {fd.name for fd in shared_fields(message_type.DESCRIPTOR)}
        assert shared <= native
        # Only the OpenAI-shaped fields (and the completions API's integer logprobs) are converted.
        assert native - shared - OPENAI_CONVERTED <= {"stop_token_ids", "skip_special_tokens", "logprobs",
                                                      "top_logprobs", "constraint"}


def test_unset_fields_get_the_model_default_then_the_api_default_then_the_engine_default():
    mapping = SamplingMapping(vocab_size=100, defaults={"temperature": 0.5, "top_k": 20})
    params = mapping.params(pb.SamplingParams(), api_defaults={"max_tokens": None})
    assert params == SamplingParams(max_tokens=None, temperature=0.5, top_k=20)
    chosen = mapping.params(pb.SamplingParams(temperature=0.0, top_k=0, max_tokens=3, stop=["x"], logit_bias={1: 2}))
    assert chosen == SamplingParams(max_tokens=3, temperature=0.0, top_k=0, stop=["x"], logit_bias={1: 2.0})
    assert mapping.effective_defaults() == {
        "temperature": 0.5, "top_p": 1.0, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0,
    }
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingMapping(vocab_size=100, defaults={"max_tokens": 4})


def test_converted_fields_win_and_are_not_copied():
    mapping = SamplingMapping(vocab_size=100, defaults={"top_k": 20})
    request = oa.CreateCompletionRequest(logprobs=3, top_k=-1, logit_bias={"5": 1.0})
    params = mapping.params(request, logprobs=True, top_logprobs=3, top_k=0, logit_bias={5: 1.0}, stop=[])
    assert params == dataclasses.replace(BUILTIN, logprobs=True, top_logprobs=3, top_k=0, logit_bias={5: 1.0})


def test_violations_name_the_request_paths():
    mapping = SamplingMapping(vocab_size=100)
    params = SamplingParams(temperature=-1, logit_bias={500: 1.0})
    with pytest.raises(ServiceError) as caught:
        mapping.check(params, lambda name: "sampling." + name, [("request_id", "too long")])
    assert [f for f, _ in caught.value.violations] == ["request_id", "sampling.temperature", "sampling.logit_bias"]
    with pytest.raises(ServiceError) as caught:
        mapping.check(SamplingParams(top_logprobs=50), {"top_logprobs": "logprobs"})
    assert [f for f, _ in caught.value.violations] == ["logprobs"]


def test_max_tokens_below_one_is_one_violation_not_two():
    """min_tokens (unset, 0) is not compared with a max_tokens that is itself refused."""
    for max_tokens in (0, -1):
        assert SamplingParams(max_tokens=max_tokens).validate() == [("max_tokens", "must be at least 1")]
    assert SamplingParams(max_tokens=2, min_tokens=3).validate() == [("min_tokens", "must not exceed max_tokens")]


def test_the_native_constraint_becomes_the_engines():
    mapping = SamplingMapping(vocab_size=100)
    schema = struct_pb2.Struct()
    schema.update({"type": "object", "properties": {"xs": {"type": "array", "minItems": 1}}})
    cases = [
        (pb.Constraint(regex="a+"), Constraint.regex("a+")),
        (pb.Constraint(grammar='root ::= "a"'), Constraint.grammar('root ::= "a"')),
        (pb.Constraint(json_object=True), Constraint.json_object()),
        (pb.Constraint(choice=pb.ConstraintChoices(values=["x", "y"])), Constraint.choice(["x", "y"])),
    ]
    for message, constraint in cases:
        assert mapping.params(pb.SamplingParams(constraint=message)).constraint == constraint
    converted = mapping.params(pb.SamplingParams(constraint=pb.Constraint(json_schema=schema))).constraint
    # A Struct holds numbers as doubles: minItems must come back an integer.
    assert json.loads(converted.text)["properties"]["xs"] == {"type": "array", "minItems": 1}
    assert "1.0" not in converted.text
    assert mapping.params(pb.SamplingParams()).constraint is None


def test_constraint_caps_and_shape_name_the_request_path():
    mapping = SamplingMapping(vocab_size=100)
    too_many = SamplingParams(constraint=Constraint.choice([str(i) for i in range(MAX_CONSTRAINT_CHOICES + 1)]))
    too_long = SamplingParams(constraint=Constraint.regex("a" * (MAX_CONSTRAINT_CHARS + 1)))
    not_json = SamplingParams(constraint=Constraint.json_schema("{nope"))
    for params, field in ((too_many, "choice"), (too_long, "regex"), (not_json, "json_schema")):
        with pytest.raises(ServiceError) as caught:
            mapping.check(params, lambda name: "sampling." + name)
        assert [f for f, _ in caught.value.violations] == [f"sampling.constraint.{field}"]
    with pytest.raises(ServiceError) as caught:
        mapping.check(not_json, {"constraint.json_schema": "response_format.json_schema.schema"})
    assert [f for f, _ in caught.value.violations] == ["response_format.json_schema.schema"]
