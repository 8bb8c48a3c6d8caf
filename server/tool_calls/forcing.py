"""The grammar that holds a chat output to the model's own call format (llguidance Lark, ``%json``).

``tool_choice`` "required" or a named function: the whole output is calls, in the format the parser
reads, each call's arguments held to its function's JSON Schema, so even a small model returns a
valid call every time. ``auto`` with a ``strict`` tool: the output is either text that never starts
a call, or calls at its start whose strict arguments follow their schema; the model still chooses.

A tool's local references (``#``, ``#/$defs/...``, ``#/definitions/...``, ``#/properties/...``) point
at the root of its own parameters schema, which is no longer the root once it sits inside the call
object. Such a schema is hoisted whole into the root's ``$defs`` under its tool's name and each of its
references re-pointed there (``#/$defs/Item`` becomes ``#/$defs/<tool>/$defs/Item``), so every tool
keeps its own definitions, two tools may use one name for different ones, and recursion (``#``) still
means the tool's arguments.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from typing import Any

from protoserve.server.tool_calls.call import ToolSpec
from protoserve.server.tool_calls.parsers import ToolCallFormat

# The spacing small models were trained on, and no room to pad with whitespace (the engine's JSON
# constraints use the same, engine/sampling/constraints/compiler.py).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def forced_grammar(tools: Sequence[ToolSpec], fmt: ToolCallFormat, *, single: bool) -> str:
    """Lark for output that is only calls of ``tools`` (one call when ``single``)."""
    return "start: " + _calls_rule(fmt, _call_schema(tools, fmt, lambda t: t.parameters), single)


def auto_strict_grammar(tools: Sequence[ToolSpec], fmt: ToolCallFormat, *, single: bool) -> str:
    """Lark for output that is free text without a call, or calls whose strict arguments follow their schema."""
    schema = _call_schema(tools, fmt, lambda t: t.parameters if t.strict else ANY_OBJECT)
    if fmt.open_tag:
        text = f"/(?s:.*)/ & ~/(?s:.*{_regex(fmt.open_tag)}.*)/"
    else:
        # Bare JSON calls (llama3_json) are recognized by the output's start.
        marker = f"|{_regex(fmt.bare_prefix)}" if fmt.bare_prefix else ""
        text = rf"/(?s:.*)/ & ~/\s*(\{{{marker})(?s:.*)/"
    return f"start: TEXT | {_calls_rule(fmt, schema, single)}\nTEXT: {text}"


def _calls_rule(fmt: ToolCallFormat, schema: dict[str, Any], single: bool) -> str:
    if fmt.list_in_tag:
        # The array is spelled out, one call per line, as the format's training examples write it.
        one = _json(schema)
        body = one if single else f"{one} ({_literal(',' + chr(10))} {one})*"
        return f"{_literal(fmt.open_tag + '[' + chr(10))} {body} {_literal(chr(10) + ']' + fmt.close_tag)}"
    if fmt.open_tag:
        one = f"{_literal(fmt.open_tag + chr(10))} {_json(schema)} {_literal(chr(10) + fmt.close_tag)}"
        separator = _literal("\n")
    else:
        one = _json(schema)
        separator = _literal("; ")
    return one if single else f"{one} ({separator} {one})*"


def _call_schema(tools: Sequence[ToolSpec], fmt: ToolCallFormat, arguments_of) -> dict[str, Any]:
    """One call object of any of ``tools``: its name, then its arguments."""
    hoisted: dict[str, Any] = {}
    options = []
    for tool in tools:
        arguments = copy.deepcopy(arguments_of(tool))
        if _has_local_ref(arguments):
            if tool.name in hoisted:
                raise ValueError(f"tools: {tool.name!r} names two tools")
            hoisted[tool.name] = _rebase_refs(arguments, f"#/$defs/{tool.name}")
            arguments = {"$ref": f"#/$defs/{tool.name}"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, fmt.arguments_key: arguments},
                "required": ["name", fmt.arguments_key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if hoisted:
        schema["$defs"] = hoisted
    return schema


# Keywords whose values are data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _is_local_ref(key: str, value: Any) -> bool:
    # "#" and "#/<pointer>" point into the document; "#anchor" and other URIs do not move with it.
    return key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/"))


def _own_resource(node: dict[str, Any]) -> bool:
    # A schema with its own "$id" is the root its "#..." references resolve against, wherever it sits.
    return isinstance(node.get("$id"), str)


def _has_local_ref(node: Any) -> bool:
    """Whether ``node`` has references that resolve against the root it sits under."""
    if isinstance(node, dict):
        if _own_resource(node):
            return False
        return any(
            _is_local_ref(key, value) or (key not in _DATA_KEYWORDS and _has_local_ref(value))
            for key, value in node.items()
        )
    if isinstance(node, list):
        return any(_has_local_ref(item) for item in node)
    return False


def _rebase_refs(node: Any, base: str) -> Any:
    """``node`` with its local references moved under ``base``, the pointer where its root now sits."""
    if isinstance(node, dict):
        if _own_resource(node):
            return node
        out = {}
        for key, value in node.items():
            if _is_local_ref(key, value):
                out[key] = base + value[1:]
            elif key in _DATA_KEYWORDS:
                out[key] = value
            else:
                out[key] = _rebase_refs(value, base)
        return out
    if isinstance(node, list):
        return [_rebase_refs(item, base) for item in node]
    return node


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _regex(text: str) -> str:
    return re.escape(text).replace("/", r"\/")
