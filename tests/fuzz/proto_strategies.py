"""Hypothesis strategies for arbitrary protobuf messages, built field by field from their descriptors.

``messages(descriptor)`` draws any message of that type: each field set or not,
every scalar anywhere in its range, unknown enum numbers, repeated and map
fields of bounded length, none, one or all members of a oneof, nested messages
to a bounded depth, and google.protobuf.Value / Struct / ListValue holding any
JSON, at times nested far deeper than a parser recurses.

So that a fair share of what it draws is valid and reaches the engine, numbers
lean towards small and boundary values, and ``hints`` (by field) offer a
likely-valid value half of the time: the served model's name, real chat roles,
a prompt of the shape a Value field takes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, struct_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

MAX_DEPTH = 4  # nested messages below this depth are left unset
MAX_ITEMS = 6  # elements of a repeated or map field
MAX_TEXT = 32  # characters of an ordinary string

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_VALUE = struct_pb2.Value.DESCRIPTOR.full_name
_STRUCT_TYPES = {
    struct_pb2.Value.DESCRIPTOR.full_name,
    struct_pb2.Struct.DESCRIPTOR.full_name,
    struct_pb2.ListValue.DESCRIPTOR.full_name,
}


def integers(low: int, high: int) -> st.SearchStrategy[int]:
    """Mostly small values (counts, token ids, lengths), then the boundaries, then anything."""
    edges = sorted({v for v in (low, high, -1, 0, 1, 2, low + 1, high - 1) if low <= v <= high})
    return st.one_of(st.integers(max(low, 0), min(high, 64)), st.sampled_from(edges), st.integers(low, high))


def floats(width: int) -> st.SearchStrategy[float]:
    """Usual sampling values, the specials, and any float of this width."""
    specials = [math.nan, math.inf, -math.inf, -0.0, 1e-45, 3.4e38, -3.4e38]
    return st.one_of(st.floats(-2.5, 2.5, width=width), st.sampled_from(specials), st.floats(width=width))


def texts(words: Sequence[str]) -> st.SearchStrategy[str]:
    """Short text, words the server knows (a model name, roles), and rarely a 3-6 KB string."""
    return st.one_of(
        st.text(max_size=MAX_TEXT),
        st.sampled_from(list(words) or [""]),
        st.integers(3000, 6000).map(lambda n: "é" * n),
    )


def _nested(depth: int) -> Any:
    value: Any = "x"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def json_values() -> st.SearchStrategy[Any]:
    """Any JSON value, and JSON nested from 10 to 1,200 levels deep."""
    scalars = st.one_of(
        st.none(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=MAX_TEXT)
    )
    shallow = st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=MAX_ITEMS), st.dictionaries(st.text(max_size=8), inner, max_size=MAX_ITEMS)
        ),
        max_leaves=12,
    )
    return st.one_of(shallow, st.integers(10, 1200).map(_nested))


def _struct_value(full_name: str) -> st.SearchStrategy[Message]:
    """Value, Struct or ListValue from a JSON value of the shape each one holds."""

    def build(value: Any) -> Message:
        holder = struct_pb2.Value()
        if full_name == struct_pb2.Struct.DESCRIPTOR.full_name:
            _set_value(holder, value if isinstance(value, dict) else {"v": value})
            return holder.struct_value
        if full_name == struct_pb2.ListValue.DESCRIPTOR.full_name:
            _set_value(holder, value if isinstance(value, list) else [value])
            return holder.list_value
        _set_value(holder, value)
        return holder

    return json_values().map(build)


def _as_value(value: Any) -> struct_pb2.Value:
    message = struct_pb2.Value()
    _set_value(message, value)
    return message


def _set_value(message: struct_pb2.Value, value: Any) -> None:
    # Built by hand: protobuf's own helpers recurse once per level in Python and
    # give up long before the 1,200 levels a client may send.
    stack = [(message, value)]
    while stack:
        target, item = stack.pop()
        if item is None:
            target.null_value = struct_pb2.NULL_VALUE
        elif isinstance(item, bool):
            target.bool_value = item
        elif isinstance(item, float | int):
            target.number_value = float(item)
        elif isinstance(item, str):
            target.string_value = item
        elif isinstance(item, list):
            target.list_value.SetInParent()
            stack.extend((target.list_value.values.add(), x) for x in item)
        else:
            target.struct_value.SetInParent()
            stack.extend((target.struct_value.fields[k], v) for k, v in item.items())


def _scalar(field: FieldDescriptor, words: Sequence[str]) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INT_RANGES:
        return integers(*_INT_RANGES[kind])
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_FLOAT:
        return floats(32)
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return floats(64)
    if kind == FieldDescriptor.TYPE_STRING:
        return texts(words)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=MAX_TEXT)
    if kind == FieldDescriptor.TYPE_ENUM:
        # proto3 enums are open: a number the server has never heard of is a valid message.
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), integers(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for field type {kind} of {field.full_name}")


Hints = Mapping[str, st.SearchStrategy[Any]]


def _is_repeated(field: FieldDescriptor) -> bool:
    # ``label`` is deprecated from protobuf 6.31 on; older releases have nothing else.
    if hasattr(field, "is_repeated"):
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _assign(message: Message, field: FieldDescriptor, value: Any) -> None:
    if _is_map(field):
        target = getattr(message, field.name)
        value_field = field.message_type.fields_by_name["value"]
        for key, item in value:
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif _is_repeated(field):
        target = getattr(message, field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


@dataclass(frozen=True)
class _Plan:
    """How one top-level message is drawn; ``lean`` holds for the whole tree below it."""

    words: tuple[str, ...]
    hints: Hints
    lean: bool  # hinted fields from their hints, unhinted scalars unset, one member per oneof


def _single(field: FieldDescriptor, depth: int, plan: _Plan) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if field.message_type.full_name in _STRUCT_TYPES:
            return _struct_value(field.message_type.full_name)
        return _message(field.message_type, depth + 1, plan)
    return _scalar(field, plan.words)


def _hint(field: FieldDescriptor, plan: _Plan) -> st.SearchStrategy[Any] | None:
    hint = plan.hints.get(field.full_name, plan.hints.get(field.name))
    if hint is not None and field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.full_name == _VALUE:
        return hint.map(_as_value)  # a hint for a Value field is plain JSON
    if hint is not None and field.type == FieldDescriptor.TYPE_MESSAGE:
        # A hint for another message field is its JSON form (Responses' `text`).
        message_class = GetMessageClass(field.message_type)
        return hint.map(lambda value: json_format.ParseDict(value, message_class()))
    return hint


def _field_value(field: FieldDescriptor, depth: int, plan: _Plan) -> st.SearchStrategy[Any]:
    hint = _hint(field, plan)
    if plan.lean and hint is not None:
        return hint
    if _is_map(field):
        entry = field.message_type
        key = _scalar(entry.fields_by_name["key"], plan.words)
        value = _single(entry.fields_by_name["value"], depth, plan)
        anything: st.SearchStrategy[Any] = st.lists(st.tuples(key, value), max_size=MAX_ITEMS)
    elif _is_repeated(field):
        # Leaning valid, a repeated message (chat messages, batch requests) is not empty.
        at_least = 1 if plan.lean and field.type == FieldDescriptor.TYPE_MESSAGE else 0
        anything = st.lists(_single(field, depth, plan), min_size=at_least, max_size=MAX_ITEMS)
    else:
        anything = _single(field, depth, plan)
    return anything if hint is None else st.one_of(hint, anything)


def _wanted(field: FieldDescriptor, plan: _Plan) -> st.SearchStrategy[bool]:
    """Whether to set a field outside real oneofs."""
    if not plan.lean:
        return st.booleans()
    # Leaning valid: hinted fields and nested messages are set, flags vary, and other scalars and
    # maps (ids, enums, token maps) stay unset: random ones are where requests go invalid.
    if _hint(field, plan) is not None or (field.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(field)):
        return st.just(True)
    return st.booleans() if field.type == FieldDescriptor.TYPE_BOOL and not _is_repeated(field) else st.just(False)


def _oneof_members(draw: st.DrawFn, descriptor: Descriptor, lean: bool) -> tuple[set[str], set[str]]:
    """(members of real oneofs, the ones to set): one of each oneof, or (not leaning) none or all."""
    members: set[str] = set()
    chosen: set[str] = set()
    for oneof in descriptor.oneofs:
        names = [f.name for f in oneof.fields]
        if len(names) < 2:  # the synthetic oneof of a proto3 `optional` field
            continue
        members.update(names)
        one = st.sampled_from(names).map(lambda n: [n])
        chosen.update(draw(one if lean else st.one_of(one, st.just([]), st.just(names))))
    return members, chosen


@st.composite
def _message(draw: st.DrawFn, descriptor: Descriptor, depth: int, plan: _Plan) -> Message:
    message = GetMessageClass(descriptor)()
    if depth >= MAX_DEPTH:
        return message
    in_oneof, chosen = _oneof_members(draw, descriptor, plan.lean)
    for field in descriptor.fields:
        wanted = field.name in chosen if field.name in in_oneof else draw(_wanted(field, plan))
        if wanted:
            _assign(message, field, draw(_field_value(field, depth, plan)))
    return message


def messages(descriptor: Descriptor, words: Sequence[str] = (), hints: Hints | None = None) -> st.SearchStrategy[Message]:
    """Any message of this type.

    ``words``: strings the server knows, mixed into every string field. ``hints``: by a field's
    full name or else its name, what the field holds in a valid request (a list for a repeated
    field, (key, value) pairs for a map, plain JSON for a google.protobuf.Value). Half of the
    messages lean valid: hinted fields take their hints, unhinted scalars other than flags stay
    unset, each oneof gets one member; the other half may hold anything.
    """
    if descriptor.full_name in _STRUCT_TYPES:
        return _struct_value(descriptor.full_name)
    return st.booleans().flatmap(lambda lean: _message(descriptor, 0, _Plan(tuple(words), hints or {}, lean)))
