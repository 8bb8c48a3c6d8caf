"""The gateway's compiled JSON writer (gateway/runtime/json_codec.py) against json_format.

The rule the writer implements: json_format.MessageToDict with proto field names and no-presence
fields always printed, then every message's fields in descriptor order with an unset presence field
outside a real oneof written as null, an empty ``omit_empty`` field (GatewayField) left out, well-known
types as json_format writes them, extensions last.
That rule is applied here on top of MessageToDict's own output, and the two are compared as JSON
text (key order and -0.0 included) for randomly filled messages: every message type the server
answers with, and a test file that holds every field kind (64-bit integers, float32, NaN and the
infinities, bytes, open and closed enums, unknown enum numbers, maps with bool/integer/string keys
and message values, oneofs, proto3 optional, proto2 required and extensions, the well-known types).
"""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

import grpc_tools
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from grpc_tools import protoc

from protoserve.gateway.runtime.json_codec import message_to_json
from protoserve.openai.v1 import openai_pb2
from protoserve.options.v1 import gateway_pb2
from protoserve.v1 import adapters_pb2, agent_pb2, embeddings_pb2, inference_pb2, metrics_pb2, rag_pb2

KINDS_PROTO = """
syntax = "proto3";
package codectest;
import "google/protobuf/any.proto";
import "google/protobuf/duration.proto";
import "google/protobuf/empty.proto";
import "google/protobuf/field_mask.proto";
import "google/protobuf/struct.proto";
import "google/protobuf/timestamp.proto";
import "google/protobuf/wrappers.proto";

enum Color { COLOR_UNSPECIFIED = 0; RED = 1; GREEN = 2; }

message Inner {
  int32 a = 1;
  optional string b = 2;
  repeated Inner kids = 3;
  Color c = 4;
}

message Kinds {
  int32 i32 = 1; int64 i64 = 2; uint32 u32 = 3; uint64 u64 = 4; sint32 s32 = 5; sint64 s64 = 6;
  fixed32 f32 = 7; fixed64 f64 = 8; sfixed32 sf32 = 9; sfixed64 sf64 = 10; float fl = 11; double db = 12;
  bool bo = 13; string st = 14; bytes by = 15; Color co = 16;
  optional int64 opt_i64 = 17; optional float opt_fl = 18; optional Color opt_co = 19;
  Inner inner = 20; repeated Inner inners = 21; repeated int64 r_i64 = 22; repeated float r_fl = 23;
  repeated Color r_co = 24; repeated bytes r_by = 25; repeated double r_db = 26; repeated bool r_bo = 27;
  map<string, int64> m_s_i64 = 28; map<bool, Inner> m_b_inner = 29; map<int64, string> m_i64_s = 30;
  map<uint32, Color> m_u32_co = 31; map<sint32, bytes> m_s32_by = 32; map<string, float> m_s_fl = 33;
  oneof choice { string o_st = 34; Inner o_inner = 35; double o_db = 36; Color o_co = 37; }
  google.protobuf.Value v = 38; google.protobuf.Struct sv = 39; google.protobuf.ListValue lv = 40;
  google.protobuf.Timestamp ts = 41; google.protobuf.Duration du = 42; google.protobuf.Int64Value w64 = 43;
  google.protobuf.StringValue wst = 44; google.protobuf.FloatValue wfl = 45; google.protobuf.Any an = 46;
  google.protobuf.Empty em = 47; google.protobuf.FieldMask fm = 48; repeated google.protobuf.Value r_v = 49;
  map<string, google.protobuf.Value> m_v = 50; google.protobuf.NullValue nv = 51;
  repeated google.protobuf.Timestamp r_ts = 52;
}
"""

LEGACY_PROTO = """
syntax = "proto2";
package codectest2;
enum Closed { ONE = 1; TWO = 2; }
message Legacy {
  optional int32 x = 1;
  required string y = 2;
  optional Closed c = 3;
  repeated int32 r = 4;
  optional Legacy child = 5;
  optional double d = 6 [default = 2.5];
  extensions 100 to 200;
}
extend Legacy {
  optional int32 ext_i = 100;
  repeated string ext_s = 101;
  optional Legacy ext_m = 102;
}
"""


def reference_json(message) -> object:
    """json_format's output with the gateway's null and order rule applied on top."""
    value = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _with_nulls(message, value)


def _with_nulls(message, value):
    desc = message.DESCRIPTOR
    if desc.full_name.startswith("google.protobuf.") or not isinstance(value, dict):
        return value
    ordered = {}
    for field in desc.fields:
        if field.name not in value:
            if field.has_presence and not _in_real_oneof(field):
                ordered[field.name] = None
            continue
        item, entry = value[field.name], field.message_type
        if item == [] and field.GetOptions().Extensions[gateway_pb2.field].omit_empty:
            continue
        if entry is not None and entry.GetOptions().map_entry:
            if entry.fields_by_name["value"].message_type is not None:
                container = getattr(message, field.name)
                keys = {_key_text(k): k for k in container}
                item = {k: _with_nulls(container[keys[k]], v) for k, v in item.items()}
        elif entry is not None and field.is_repeated:
            item = [_with_nulls(e, v) for e, v in zip(getattr(message, field.name), item, strict=True)]
        elif entry is not None:
            item = _with_nulls(getattr(message, field.name), item)
        ordered[field.name] = item
    for name, item in value.items():  # extensions
        if name not in desc.fields_by_name:
            ordered.setdefault(name, item)
    return ordered


def _in_real_oneof(field) -> bool:
    """In a oneof that is not proto3 ``optional``'s synthetic one."""
    if field.containing_oneof is None:
        return False
    proto = descriptor_pb2.DescriptorProto()
    field.containing_type.CopyToProto(proto)
    return not any(f.name == field.name and f.proto3_optional for f in proto.field)


def _key_text(key) -> str:
    return ("true" if key else "false") if isinstance(key, bool) else str(key)


# ---- random messages ---------------------------------------------------------------------------

_INT_BOUNDS = {
    FD.CPPTYPE_INT32: (-(2**31), 2**31 - 1), FD.CPPTYPE_UINT32: (0, 2**32 - 1),
    FD.CPPTYPE_INT64: (-(2**63), 2**63 - 1), FD.CPPTYPE_UINT64: (0, 2**64 - 1),
}


def _float(rng: random.Random, single: bool) -> float:
    special = [0.0, -0.0, 1.5, math.nan, math.inf, -math.inf, 0.1, 1e-45 if single else 5e-324,
               3.4028234663852886e38 if single else 1.7976931348623157e308]
    value = rng.choice(special) if rng.random() < 0.5 else rng.uniform(-1e6, 1e6)
    return struct.unpack("f", struct.pack("f", value))[0] if single and math.isfinite(value) else value


def _scalar(field, rng: random.Random):
    kind = field.cpp_type
    if kind in _INT_BOUNDS:
        low, high = _INT_BOUNDS[kind]
        return rng.choice([0, 1, low, high, rng.randint(low, high)])
    if kind in (FD.CPPTYPE_FLOAT, FD.CPPTYPE_DOUBLE):
        return _float(rng, kind == FD.CPPTYPE_FLOAT)
    if kind == FD.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if kind == FD.CPPTYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        if not field.enum_type.is_closed and rng.random() < 0.2:
            return 7777  # an open enum keeps a number it has no name for
        return rng.choice(numbers)
    if field.type == FD.TYPE_BYTES:
        return rng.randbytes(rng.randint(0, 9))
    return rng.choice(["", "héllo", 'a "quoted"\nline', "\u2028\U0001f600", "x" * rng.randint(1, 20)])


def _json_value(rng: random.Random, depth: int):
    choices = [None, True, 1.5, -3.0, "s", "ü"]
    if depth < 2:
        choices += [[_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
                    {f"k{i}": _json_value(rng, depth + 1) for i in range(rng.randint(0, 3))}]
    return rng.choice(choices)


def _fill_well_known(message, rng: random.Random) -> bool:
    name = message.DESCRIPTOR.full_name
    if name == "google.protobuf.Value":
        json_format.ParseDict(_json_value(rng, 0), message)
    elif name == "google.protobuf.Struct":
        json_format.ParseDict({f"f{i}": _json_value(rng, 1) for i in range(rng.randint(0, 3))}, message)
    elif name == "google.protobuf.ListValue":
        json_format.ParseDict([_json_value(rng, 1) for _ in range(rng.randint(0, 3))], message)
    elif name == "google.protobuf.Timestamp":
        message.seconds, message.nanos = rng.randint(0, 4_000_000_000), rng.choice([0, 5_000_000, 123_456_789])
    elif name == "google.protobuf.Duration":
        message.seconds, message.nanos = rng.randint(0, 10**6), rng.choice([0, 500_000_000])
    elif name == "google.protobuf.Any":
        inner = inference_pb2.SamplingParams(max_tokens=rng.randint(1, 9), temperature=0.5)
        message.Pack(inner)
    elif name == "google.protobuf.FieldMask":
        message.paths.extend(rng.sample(["a", "b_c", "d.e"], rng.randint(0, 3)))
    elif message.DESCRIPTOR.file.name == "google/protobuf/wrappers.proto":
        message.value = _scalar(message.DESCRIPTOR.fields_by_name["value"], rng)
    elif name.startswith("google.protobuf."):
        message.SetInParent()
    else:
        return False
    return True


def fill(message, rng: random.Random, depth: int = 0) -> None:
    """Set a random subset of the message's fields to random values, nested messages to depth 3."""
    if _fill_well_known(message, rng):
        return
    for field in message.DESCRIPTOR.fields:
        if field.is_required:
            setattr(message, field.name, _scalar(field, rng))
            continue
        if rng.random() < 0.35:
            continue
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
            container = getattr(message, field.name)
            for _ in range(rng.randint(0, 3)):
                key = _scalar(key_field, rng)
                if value_field.message_type is not None:
                    if depth < 3:
                        fill(container[key], rng, depth + 1)
                else:
                    container[key] = _scalar(value_field, rng)
        elif field.is_repeated:
            container = getattr(message, field.name)
            for _ in range(rng.randint(0, 3)):
                if entry is not None:
                    if depth < 3:
                        fill(container.add(), rng, depth + 1)
                else:
                    container.append(_scalar(field, rng))
        elif entry is not None:
            if depth < 3:
                child = getattr(message, field.name)
                child.SetInParent()
                fill(child, rng, depth + 1)
        else:
            setattr(message, field.name, _scalar(field, rng))


def _served_message_types() -> list[type]:
    types = []
    for module in (inference_pb2, openai_pb2, embeddings_pb2, rag_pb2, agent_pb2, adapters_pb2, metrics_pb2):
        for desc in module.DESCRIPTOR.message_types_by_name.values():
            types.append(message_factory.GetMessageClass(desc))
    return types


@pytest.fixture(scope="module")
def test_files(tmp_path_factory) -> descriptor_pool.DescriptorPool:
    """The two test files compiled by protoc into their own pool."""
    root = tmp_path_factory.mktemp("codec_protos")
    (root / "kinds.proto").write_text(KINDS_PROTO)
    (root / "legacy.proto").write_text(LEGACY_PROTO)
    out = root / "set.binpb"
    include = Path(grpc_tools.__file__).parent / "_proto"
    status = protoc.main(["protoc", f"-I{root}", f"-I{include}", "--include_imports",
                          f"--descriptor_set_out={out}", "kinds.proto", "legacy.proto"])
    assert status == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    return pool


def _same(message) -> None:
    expected = json.dumps(reference_json(message))
    assert json.dumps(message_to_json(message)) == expected, message


def _same_when_filled(message_type, fillings: int) -> None:
    """The empty message, then ``fillings`` random ones (seeds 0, 1, ...)."""
    _same(message_type())
    for seed in range(fillings):
        message = message_type()
        fill(message, random.Random(seed))
        _same(message)


@pytest.mark.parametrize("message_type", _served_message_types(), ids=lambda t: t.DESCRIPTOR.full_name)
def test_served_messages_are_written_as_json_format_writes_them(message_type):
    _same_when_filled(message_type, 12)


def test_every_field_kind_is_written_as_json_format_writes_it(test_files):
    _same_when_filled(message_factory.GetMessageClass(test_files.FindMessageTypeByName("codectest.Kinds")), 300)


def test_proto2_fields_and_extensions_are_written_as_json_format_writes_them(test_files):
    legacy = message_factory.GetMessageClass(test_files.FindMessageTypeByName("codectest2.Legacy"))
    ext_i = test_files.FindExtensionByName("codectest2.ext_i")
    ext_s = test_files.FindExtensionByName("codectest2.ext_s")
    ext_m = test_files.FindExtensionByName("codectest2.ext_m")
    for seed in range(60):
        rng = random.Random(seed)
        message = legacy()
        fill(message, rng)
        if rng.random() < 0.5:
            message.Extensions[ext_i] = rng.randint(-5, 5)
        if rng.random() < 0.5:
            message.Extensions[ext_s].extend(["a", "b"][: rng.randint(0, 2)])
        if rng.random() < 0.5:
            message.Extensions[ext_m].y = "inner"
        _same(message)


def test_the_chat_chunk_shape():
    """What each streamed chat token becomes, spelled out (the rule above, on the hot path)."""
    chunk = openai_pb2.CreateChatCompletionStreamResponse(
        id="chatcmpl-1", object="chat.completion.chunk", created=7, model="m",
        choices=[openai_pb2.ChatCompletionChunkChoice(index=0, delta=openai_pb2.ChatCompletionDelta(content="hi"))],
    )
    written = message_to_json(chunk)
    assert list(written) == ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]
    assert written["choices"] == [
        {"index": 0, "delta": {"role": None, "content": "hi"}, "logprobs": None, "finish_reason": None}
    ]  # no "tool_calls": [] (omit_empty), as OpenAI writes a delta without calls
    call = openai_pb2.ChoiceDeltaToolCall(index=0, function=openai_pb2.ChoiceDeltaFunctionCall(arguments="{"))
    with_call = message_to_json(openai_pb2.ChatCompletionDelta(tool_calls=[call]))
    assert with_call == {"role": None, "content": None, "tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    assert written["usage"] is None and written["system_fingerprint"] == ""
