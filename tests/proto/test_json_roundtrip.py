"""Every message of the contract survives proto -> JSON -> proto with preserved field names."""

from __future__ import annotations

import json

import pytest
from google.protobuf import descriptor, json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool

from protoserve.openai.v1 import openai_pb2
from protoserve.options.v1 import gateway_pb2
from protoserve.v1 import inference_pb2, metrics_pb2

FILES = [inference_pb2, metrics_pb2, openai_pb2, gateway_pb2]
FD = descriptor.FieldDescriptor


def _all_messages() -> list[descriptor.Descriptor]:
    found: list[descriptor.Descriptor] = []

    def walk(d: descriptor.Descriptor) -> None:
        if d.GetOptions().map_entry:
            return
        found.append(d)
        for nested in d.nested_types:
            walk(nested)

    for module in FILES:
        for d in module.DESCRIPTOR.message_types_by_name.values():
            walk(d)
    return found


def _scalar(field: descriptor.FieldDescriptor, salt: int):
    t = field.type
    if t in (FD.TYPE_STRING,):
        return f"{field.name}-{salt} ünïcode ✓"
    if t == FD.TYPE_BYTES:
        return bytes([salt % 256, 0, 255])
    if t == FD.TYPE_BOOL:
        return True
    if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return 0.5 + salt  # exactly representable in float32
    if t == FD.TYPE_ENUM:
        values = field.enum_type.values
        return values[-1].number
    if t in (FD.TYPE_UINT32, FD.TYPE_UINT64, FD.TYPE_FIXED32, FD.TYPE_FIXED64):
        return 7 + salt
    return -(7 + salt) if t in (FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_SINT32, FD.TYPE_SINT64) else 7 + salt


def _fill(msg, depth: int = 0) -> None:
    """Set every field (one branch of each oneof) to a non-default value."""
    d = msg.DESCRIPTOR
    if d.full_name == "google.protobuf.Value":
        msg.string_value = "value"
        return
    if d.full_name == "google.protobuf.Struct":
        msg.update({"a": 1.5, "b": "x"})
        return
    if d.full_name == "google.protobuf.Any":
        return
    seen_oneofs: set[str] = set()
    for i, field in enumerate(d.fields):
        oneof = field.containing_oneof
        if oneof is not None and not oneof.name.startswith("_"):
            if oneof.name in seen_oneofs:
                continue
            seen_oneofs.add(oneof.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_f, val_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            key = _scalar(key_f, i)
            if val_f.message_type is not None:
                if depth < 3:
                    _fill(getattr(msg, field.name)[key], depth + 1)
            else:
                getattr(msg, field.name)[key] = _scalar(val_f, i)
            continue
        if field.message_type is not None:
            if depth >= 3:
                continue
            if field.is_repeated:
                _fill(getattr(msg, field.name).add(), depth + 1)
            else:
                _fill(getattr(msg, field.name), depth + 1)
            continue
        if field.is_repeated:
            getattr(msg, field.name).extend([_scalar(field, i), _scalar(field, i + 1)])
        else:
            setattr(msg, field.name, _scalar(field, i))


MESSAGES = _all_messages()


@pytest.mark.parametrize("desc", MESSAGES, ids=[d.full_name for d in MESSAGES])
def test_message_round_trips_through_json_with_proto_names(desc: descriptor.Descriptor) -> None:
    cls = message_factory.GetMessageClass(desc)
    original = cls()
    _fill(original)
    text = json_format.MessageToJson(original, preserving_proto_field_name=True)
    parsed = json_format.Parse(text, cls())
    assert parsed == original, f"{desc.full_name} changed on a JSON round trip:\n{text}"
    # Preserved names: every top-level key is a proto field name, never the camelCase json_name.
    keys = set(json.loads(text))
    names = {f.name for f in desc.fields}
    assert keys <= names, f"{desc.full_name}: keys {keys - names} are not proto field names"
    if desc.fields:
        assert keys, f"{desc.full_name}: the filled message printed no fields"


def test_the_walk_covers_every_message() -> None:
    # A guard against the walk silently skipping files: the contract's core messages are here.
    names = {d.full_name for d in MESSAGES}
    for required in (
        "protoserve.v1.GenerateRequest",
        "protoserve.v1.GenerateStreamResponse",
        "protoserve.v1.MetricsSnapshot",
        "protoserve.openai.v1.CreateChatCompletionStreamResponse",
        "protoserve.options.v1.GatewayRule",
    ):
        assert required in names
    assert len(MESSAGES) >= 60


def test_every_rpc_has_one_http_route_and_no_route_is_claimed_twice() -> None:
    from google.api import annotations_pb2

    pool: DescriptorPool = inference_pb2.DESCRIPTOR.pool
    routes: dict[tuple[str, str], str] = {}
    for module in (inference_pb2, metrics_pb2, openai_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                rule = method.GetOptions().Extensions[annotations_pb2.http]
                kind = rule.WhichOneof("pattern")
                assert kind is not None, f"{method.full_name} has no google.api.http annotation"
                key = (kind, getattr(rule, kind))
                assert key not in routes, f"{key} claimed by {routes.get(key)} and {method.full_name}"
                routes[key] = method.full_name
    assert pool is not None
    expected = {
        ("post", "/v1/generate"),
        ("post", "/v1/generate:stream"),
        ("post", "/v1/cancel/{request_id}"),
        ("post", "/v1/batch"),
        ("post", "/v1/tokenize"),
        ("post", "/v1/detokenize"),
        ("get", "/v1/metrics"),
        ("get", "/health"),
        ("post", "/v1/completions"),
        ("post", "/v1/chat/completions"),
        ("get", "/v1/models"),
        ("get", "/v1/models/{model}"),
    }
    assert expected <= set(routes), expected - set(routes)


def test_optional_marks_fields_where_unset_differs_from_zero() -> None:
    sp = inference_pb2.SamplingParams()
    for name in ("max_tokens", "temperature", "top_p", "typical_p", "repetition_penalty", "seed", "n"):
        assert not sp.HasField(name)
    sp.temperature = 0.0  # greedy: explicitly zero is not the same as unset (1.0)
    assert sp.HasField("temperature")
    round_trip = json_format.Parse(json_format.MessageToJson(sp, preserving_proto_field_name=True), inference_pb2.SamplingParams())
    assert round_trip.HasField("temperature") and round_trip.temperature == 0.0
