"""Schemas that arrive as ``google.protobuf.Struct`` render the same in every server process.

A Struct is a protobuf map: its iteration order is a hash order that changes from one process to the
next (upb seeds its hash per process). Tool parameters and response_format schemas become prompt text
and grammars, whose objects list their keys in the schema's order, so the same seeded request sampled
differently after a restart (seen as a flaky gateway test: one tool call in one process, two in
another). ``struct_data`` fixes the order: keys sorted, a schema's ``properties`` in its ``required``
order (an array keeps the client's order) and the rest sorted after them.
"""

from __future__ import annotations

import json
import subprocess
import sys

from google.protobuf import json_format, struct_pb2

from protoserve.server.models.sampling_mapping import json_text, struct_data

SCHEMA = {
    "type": "object",
    "title": "Booking",
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "date": {"type": "string"},
        "guests": {"type": "integer", "minimum": 1.0},
        "notes": {"type": "string"},
        "room": {"enum": ["single", "double"]},
        "breakfast": {"type": "boolean"},
    },
    "required": ["name", "date", "guests", "room"],
}

# What the server does with a chat request's tools and response_format, in a fresh process each time.
PROCESS = """
import json, sys
from google.protobuf import json_format
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server.models.sampling_mapping import json_text
from protoserve.server.tool_calls.request import tool_specs
schema = json.loads(sys.argv[1])
req = json_format.ParseDict({"model": "m", "messages": [{"role": "user", "content": "hi"}],
    "tools": [{"type": "function", "function": {"name": "book", "parameters": schema}}]},
    oa.CreateChatCompletionRequest())
violations = []
[spec] = tool_specs(req.tools, violations)
assert not violations, violations
rf = json_format.ParseDict({"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}, oa.ResponseFormat())
print(json.dumps(spec.parameters), json_text(json_format.MessageToDict(rf.json_schema.schema)), sep="\\n")
"""


def test_keys_sorted_and_properties_in_required_order():
    struct = struct_pb2.Struct()
    json_format.ParseDict(SCHEMA, struct)
    data = struct_data(json_format.MessageToDict(struct))
    assert list(data) == sorted(SCHEMA)
    assert list(data["properties"]) == ["name", "date", "guests", "room", "breakfast", "notes"]
    assert list(data["properties"]["name"]) == ["maxLength", "type"]
    assert data["properties"]["guests"]["minimum"] == 1 and isinstance(data["properties"]["guests"]["minimum"], int)
    assert data["required"] == SCHEMA["required"]  # arrays keep their order
    assert json_text({"b": [2.0, 2.5], "a": None}) == '{"a":null,"b":[2,2.5]}'


def test_required_names_that_are_not_properties_or_repeat_change_nothing_else():
    schema = {"properties": {"b": {}, "a": {}, "c": {}}, "required": ["c", "zz", "c", 3]}
    assert list(struct_data(schema)["properties"]) == ["c", "a", "b"]


def test_every_process_renders_the_same_tools_and_schema():
    outputs = {
        subprocess.run([sys.executable, "-c", PROCESS, json.dumps(SCHEMA)], capture_output=True, text=True,
                       check=True).stdout
        for _ in range(4)
    }
    assert len(outputs) == 1, outputs
    parameters, schema = outputs.pop().splitlines()
    assert list(json.loads(parameters)["properties"]) == ["name", "date", "guests", "room", "breakfast", "notes"]
    assert list(json.loads(schema)) == sorted(SCHEMA)
