"""A Responses request's ``input`` read into items, and items into the served model's chat turns.

``input`` is a string (one user message) or a list of items: messages whose content is a string or
``input_text`` / ``output_text`` parts, ``function_call`` items (a call the model made earlier) and
``function_call_output`` items (its result). Each is checked key by key, so a field this server
would not honour (an image part, a reasoning item, an unknown key) is refused naming its path, and
normalized into a ``ResponseItem`` with an id: what is stored and listed by ``input_items``.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from google.protobuf import struct_pb2

from protoserve.openai.v1 import responses_pb2 as rs
from protoserve.server.limits import MAX_CHAT_MESSAGES
from protoserve.server.models.chat_turn import ChatTurn
from protoserve.server.tool_calls.call import ToolCall

Violations = list[tuple[str, str]]

MESSAGE_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_MESSAGE_KEYS = {"type", "role", "content", "id", "status"}
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
_PART_KEYS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs"}}
_STATUSES = ("in_progress", "completed", "incomplete")


def new_id(prefix: str) -> str:
    """A fresh item or response id, ``{prefix}_`` and 32 hex digits, as OpenAI's look."""
    return f"{prefix}_{secrets.token_hex(16)}"


def text_parts(kind: str, text: str) -> struct_pb2.ListValue:
    """A message's content: one part of ``kind`` (``output_text`` parts carry empty annotations)."""
    part: dict[str, Any] = {"type": kind, "text": text}
    if kind == "output_text":
        part["annotations"] = []
    content = struct_pb2.ListValue()
    content.append(part)
    return content


def message_item(role: str, text: str, *, status: str = "completed", item_id: str = "") -> rs.ResponseItem:
    """A message item with one text part (``output_text`` for the assistant, ``input_text`` else)."""
    kind = "output_text" if role == "assistant" else "input_text"
    return rs.ResponseItem(
        type="message", id=item_id or new_id("msg"), role=role, status=status, content=text_parts(kind, text)
    )


def read_input(value: Any, violations: Violations) -> list[rs.ResponseItem]:
    """``input`` (a string, or a list of item objects) as items; each problem named by its path."""
    if isinstance(value, str):
        return [message_item("user", value)]
    if not isinstance(value, list) or not value:
        violations.append(("input", "must be a string or a non-empty list of items"))
        return []
    if len(value) > MAX_CHAT_MESSAGES:
        violations.append(("input", f"at most {MAX_CHAT_MESSAGES} items"))
        return []
    items = []
    for i, raw in enumerate(value):
        item = _item(raw, f"input[{i}]", violations)
        if item is not None:
            items.append(item)
    return items


def _item(raw: Any, path: str, violations: Violations) -> rs.ResponseItem | None:
    if not isinstance(raw, dict):
        violations.append((path, "must be an object"))
        return None
    kind = raw.get("type", "message")  # a message may leave its type out (EasyInputMessage)
    readers = {"message": _message, "function_call": _function_call, "function_call_output": _call_output}
    reader = readers.get(kind)
    if reader is None:
        violations.append((f"{path}.type", "must be message, function_call or function_call_output"))
        return None
    known = len(violations)
    item = reader(raw, path, violations)
    return item if len(violations) == known else None


def _unknown_keys(raw: dict[str, Any], allowed: set[str], path: str, violations: Violations) -> None:
    for key in sorted(set(raw) - allowed):
        if raw[key] is not None:  # a field sent as null asks for nothing
            violations.append((f"{path}.{key}", "is not a field this server takes here"))


def _string(raw: dict[str, Any], key: str, path: str, violations: Violations, *, required: bool = True) -> str:
    value = raw.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value and key != "arguments"):
        violations.append((f"{path}.{key}", "must be a non-empty string" if required else "must be a string"))
        return ""
    return value


def _common(raw: dict[str, Any], prefix: str, path: str, violations: Violations) -> tuple[str, str]:
    """An item's own id (a fresh one when it has none) and its status."""
    item_id = _string(raw, "id", path, violations, required=False) or new_id(prefix)
    status = _string(raw, "status", path, violations, required=False) or "completed"
    if status not in _STATUSES:
        violations.append((f"{path}.status", f"must be one of {', '.join(_STATUSES)}"))
    return item_id, status


def _message(raw: dict[str, Any], path: str, violations: Violations) -> rs.ResponseItem | None:
    _unknown_keys(raw, _MESSAGE_KEYS, path, violations)
    role = raw.get("role")
    if role not in MESSAGE_ROLES:
        violations.append((f"{path}.role", f"must be one of {', '.join(MESSAGE_ROLES)}"))
        return None
    item_id, status = _common(raw, "msg", path, violations)
    content = raw.get("content")
    if isinstance(content, str):
        return message_item(role, content, status=status, item_id=item_id)
    if not isinstance(content, list):
        violations.append((f"{path}.content", "must be a string or a list of text parts"))
        return None
    parts = struct_pb2.ListValue()
    for j, part in enumerate(content):
        where = f"{path}.content[{j}]"
        part_kind = part.get("type") if isinstance(part, dict) else None
        if part_kind not in _PART_KEYS:
            violations.append((f"{where}.type", "must be input_text or output_text: this server reads text only"))
            continue
        _unknown_keys(part, _PART_KEYS[part_kind], where, violations)
        text = _string(part, "text", where, violations, required=False)
        extra = {"annotations": []} if part_kind == "output_text" else {}
        parts.append({"type": part_kind, "text": text, **extra})
    return rs.ResponseItem(type="message", id=item_id, role=role, status=status, content=parts)


def _function_call(raw: dict[str, Any], path: str, violations: Violations) -> rs.ResponseItem | None:
    _unknown_keys(raw, _CALL_KEYS, path, violations)
    item_id, status = _common(raw, "fc", path, violations)
    return rs.ResponseItem(
        type="function_call",
        id=item_id,
        status=status,
        call_id=_string(raw, "call_id", path, violations),
        name=_string(raw, "name", path, violations),
        arguments=_string(raw, "arguments", path, violations),
    )


def _call_output(raw: dict[str, Any], path: str, violations: Violations) -> rs.ResponseItem | None:
    _unknown_keys(raw, _OUTPUT_KEYS, path, violations)
    item_id, status = _common(raw, "fco", path, violations)
    output = raw.get("output")
    if isinstance(output, list):  # a list of text parts, as the newer SDKs may send it
        texts = [p.get("text") for p in output if isinstance(p, dict) and p.get("type") in _PART_KEYS]
        if len(texts) != len(output) or not all(isinstance(t, str) for t in texts):
            violations.append((f"{path}.output", "must be a string or a list of text parts"))
            return None
        output = "".join(texts)
    if not isinstance(output, str):
        violations.append((f"{path}.output", "must be a string"))
        return None
    return rs.ResponseItem(
        type="function_call_output",
        id=item_id,
        status=status,
        call_id=_string(raw, "call_id", path, violations),
        output=output,
    )


def item_text(item: rs.ResponseItem) -> str:
    """The text of a message item's parts, joined."""
    return "".join(part.struct_value.fields["text"].string_value for part in item.content.values)


def chat_turns(items: list[rs.ResponseItem]) -> list[ChatTurn]:
    """Items as chat turns: a function call joins the assistant turn before it (or opens one), and its
    output is a tool turn answering its call id."""
    turns: list[ChatTurn] = []
    for item in items:
        if item.type == "message":
            turns.append(ChatTurn(MESSAGE_ROLES[item.role], item_text(item)))
        elif item.type == "function_call":
            call = ToolCall(item.call_id, item.name, item.arguments)
            if turns and turns[-1].role == "assistant":
                turns[-1] = dataclasses.replace(turns[-1], tool_calls=(*turns[-1].tool_calls, call))
            else:
                turns.append(ChatTurn("assistant", "", tool_calls=(call,)))
        else:
            turns.append(ChatTurn("tool", item.output, tool_call_id=item.call_id))
    return turns
