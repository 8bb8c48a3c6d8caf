"""The grammar that holds a chat output to the model's own call format (llguidance Lark, ``%json``).

``tool_choice`` "required" or a named function: the whole output is calls, in the format the parser
reads, each call's arguments held to its function's JSON Schema, so even a small model returns a
valid call every time. ``auto`` with a ``strict`` tool: the output is either text that never starts
a call, or calls at its start whose strict arguments follow their schema; the model still chooses.

A schema's ``$defs`` (or draft-7 ``definitions``) are hoisted to the root of the embedded schema,
where its ``#/$defs/...`` references point once it sits inside the call object; two tools that use
one name for different definitions get theirs renamed.
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
        arguments = _hoist(copy.deepcopy(arguments_of(tool)), hoisted)
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


def _hoist(schema: Any, into: dict[str, Any]) -> Any:
    """Move ``schema``'s definitions into ``into`` (renaming clashes) and point its references there."""
    if not isinstance(schema, dict):
        return schema
    defs = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}
    renames: dict[str, str] = {}
    for name, definition in defs.items():
        new = name
        n = 1
        while new in into and into[new] != definition:
            n += 1
            new = f"{name}_{n}"
        renames[name] = new
    for name, definition in defs.items():
        into[renames[name]] = _rewrite_refs(definition, renames)
    return _rewrite_refs(schema, renames)


def _rewrite_refs(node: Any, renames: dict[str, str]) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                match = re.fullmatch(r"#/(?:\$defs|definitions)/([^/]+)(.*)", value)
                if match:
                    value = f"#/$defs/{renames.get(match.group(1), match.group(1))}{match.group(2)}"
            out[key] = _rewrite_refs(value, renames)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(item, renames) for item in node]
    return node


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _regex(text: str) -> str:
    return re.escape(text).replace("/", r"\/")
