"""JSON ↔ protobuf for the gateway, on top of ``google.protobuf.json_format``.

Reading: the decoded JSON is first checked against the message descriptor so
that a bad request gets a clear 400 naming every bad field (``json_format``
stops at the first problem and words it for protobuf developers), then
``json_format.ParseDict`` builds the message. Nothing reaches the server
unless both pass.

Writing follows grpc-gateway's default marshaler (protojson with
EmitUnpopulated) with proto field names: fields without presence are always
printed, zero values included (OpenAI clients need ``"index": 0``), and unset
fields with presence (proto3 ``optional`` scalars, singular messages outside
a real oneof) are printed as ``null``; unset oneof members are left out, and so
are empty fields marked ``omit_empty`` (``GatewayField``: OpenAI's ``tool_calls``).
64-bit integers stay strings, as proto3 JSON prints them. Each value is what
``json_format.MessageToDict`` gives it (well-known types are its own output),
in the descriptor's field order, from a writer compiled once per message type:
every streamed chunk goes through it, and json_format's reflection cost three
times as much per chunk as the rest of the writing.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
import re
from collections.abc import Callable, Collection
from itertools import accumulate
from typing import Any

from google.protobuf import descriptor, descriptor_pb2, json_format, message_factory
from google.protobuf.internal import type_checkers
from google.protobuf.message import Message

from protoserve.options.v1 import gateway_pb2

FD = descriptor.FieldDescriptor
_INT_RANGES = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOAT_MAX = 3.4028234663852886e38
_FLOAT_WORDS = ("NaN", "Infinity", "-Infinity")
_WKT_PREFIX = "google.protobuf."
# protobuf's decoder (upb, which the server runs) refuses a message whose messages nest more
# than this many levels below the top-level one. The gateway refuses such a request itself,
# naming the field, instead of sending what the server cannot read.
MAX_MESSAGE_DEPTH = 100
# JSON nesting the gateway reads at all: every request within MAX_MESSAGE_DEPTH fits (a level
# of messages is at most an array and an object), and checking it before decoding keeps both
# json and the checks below far from Python's recursion limit.
MAX_JSON_DEPTH = 2 * MAX_MESSAGE_DEPTH + 1
# A JSON string. The closing quote is optional so that a match, once started, never fails:
# an unterminated string must not make the search retry from each quote inside it (quadratic).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes
# Well-known types whose JSON form is free-form; any JSON value (or shape) is valid.
_FREE_FORM = {
    "google.protobuf.Value": None,
    "google.protobuf.Struct": dict,
    "google.protobuf.ListValue": list,
}


class InvalidJson(Exception):
    """The JSON does not fit the message: ``violations`` are (field path, problem) pairs."""

    def __init__(self, violations: list[tuple[str, str]]) -> None:
        self.violations = violations
        super().__init__(
            "; ".join(f"{field}: {problem}" if field else problem for field, problem in violations)
        )


def loads(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode a request body; raises InvalidJson for bytes that are not one JSON document.

    Documents nested deeper than ``max_depth`` are refused before decoding (a
    WebSocket message wraps a body in one more level, so it allows one more).
    """
    too_deep = InvalidJson([("", f"the JSON document nests deeper than {max_depth} levels")])
    if json_depth(data) > max_depth:
        raise too_deep
    try:
        return json.loads(data)
    except UnicodeDecodeError:
        raise InvalidJson([("", "the request body is not UTF-8")]) from None
    except json.JSONDecodeError as exc:
        raise InvalidJson(
            [("", f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")]
        ) from None
    except RecursionError:
        # The check above bounds the depth; this is the backstop should the two ever disagree.
        raise too_deep from None


def json_depth(data: bytes) -> int:
    """How deep arrays and objects nest in a JSON text (brackets inside strings do not count).

    Cheap: a body with few brackets cannot nest deeply and is not scanned; otherwise the
    scan runs in C (strings cut out by a regex, a running sum over the remaining brackets).
    Malformed text gets some number; json.loads reports what is wrong with it.
    """
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return 0
    steps = _JSON_STRING.sub(b"", data).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    return max(accumulate(memoryview(steps).cast("b")), default=0)


# One encoder for every message: json.dumps with options builds a new one per call, a third of
# the time of a stream's small per-token chunks.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def dumps(value: Any) -> bytes:
    """Compact single-line JSON (safe inside one SSE ``data:`` field)."""
    return _ENCODER.encode(value).encode()


def parse_message(
    value: Any,
    message_type: type[Message],
    *,
    reject_unknown_fields: bool,
    ignored_fields: Collection[str] = (),
    path: str = "",
    depth: int = 0,
) -> Message:
    """Build ``message_type`` from decoded JSON, or raise InvalidJson naming every bad field.

    ``ignored_fields`` are unknown top-level keys dropped even when unknown fields are
    rejected. ``depth`` is how many messages enclose this one in the request sent (1 when
    it is wrapped in another), so that nesting is checked against what the server can decode.
    """
    if ignored_fields and isinstance(value, dict):
        value = {key: item for key, item in value.items() if key not in ignored_fields}
    violations: list[tuple[str, str]] = []
    _check_message(value, message_type.DESCRIPTOR, path, reject_unknown_fields, violations, depth)
    if violations:
        raise InvalidJson(violations)
    message = message_type()
    try:
        json_format.ParseDict(value, message, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        # The checks above mirror json_format's rules; this is the backstop if they ever drift.
        raise InvalidJson([(path, str(exc))]) from None
    except RecursionError:
        raise InvalidJson([(path, "nested too deeply")]) from None
    return message


def message_to_json(message: Message) -> Any:
    """The message as a JSON-ready value (see the module docstring for the rules)."""
    return _writer(message.DESCRIPTOR)(message)


# ---------------------------------------------------------------------------- reading


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {json.dumps(shown)}"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@functools.cache
def _optional_fields(message: descriptor.Descriptor) -> frozenset[str]:
    # Proto3 `optional` fields live in synthetic oneofs, which are not real choices.
    proto = descriptor_pb2.DescriptorProto()
    message.CopyToProto(proto)
    return frozenset(field.name for field in proto.field if field.proto3_optional)


def _real_oneof(field: descriptor.FieldDescriptor) -> descriptor.OneofDescriptor | None:
    oneof = field.containing_oneof
    if oneof is None or field.name in _optional_fields(field.containing_type):
        return None
    return oneof


@functools.cache
def _fields_by_json_key(message: descriptor.Descriptor) -> dict[str, descriptor.FieldDescriptor]:
    # json_format accepts both the proto name and the lowerCamelCase JSON name.
    keys = {}
    for field in message.fields:
        keys[field.json_name] = field
        keys[field.name] = field
    return keys


def _check_message(value, message, path, reject_unknown, out, depth) -> None:
    """Check ``value`` as ``message``, which sits ``depth`` messages below the request's top."""
    if depth > MAX_MESSAGE_DEPTH:
        out.append((path, f"nested too deeply: messages may nest at most {MAX_MESSAGE_DEPTH} levels"))
        return
    name = message.full_name
    if name in _FREE_FORM:
        expected = _FREE_FORM[name]
        if expected is not None and not isinstance(value, expected):
            out.append(
                (path, f"expected {'an object' if expected is dict else 'an array'}, got {_kind(value)}")
            )
            return
        # A Value holds the JSON value itself; a Struct or ListValue sits where its Value would.
        base = depth if expected is None else depth - 1
        if base + _free_form_depth(value, MAX_MESSAGE_DEPTH - base) > MAX_MESSAGE_DEPTH:
            out.append((path, _too_deep_free_form(base)))
        return
    if name.startswith(_WKT_PREFIX):
        _check_with_json_format(value, message, path, out)
        return
    if not isinstance(value, dict):
        out.append((path, f"expected an object, got {_kind(value)}"))
        return
    fields = _fields_by_json_key(message)
    oneofs_seen: dict[str, str] = {}
    for key, item in value.items():
        field = fields.get(key)
        field_path = _join(path, key)
        if field is None:
            # null asks for nothing, as it does for a known field.
            if reject_unknown and item is not None:
                out.append(
                    (
                        field_path,
                        f"unknown field; {message.name} has no field {key!r}, so it cannot be honoured",
                    )
                )
            continue
        is_value = field.message_type is not None and field.message_type.full_name == "google.protobuf.Value"
        if item is None and not is_value:
            continue  # null means "default" in proto3 JSON
        oneof = _real_oneof(field)
        if oneof is not None:
            if oneof.name in oneofs_seen:
                members = ", ".join(f.name for f in oneof.fields)
                out.append(
                    (field_path, f"only one of {members} may be set; {oneofs_seen[oneof.name]} is too")
                )
                continue
            oneofs_seen[oneof.name] = field.name
        _check_field(item, field, field_path, reject_unknown, out, depth)


def _free_form_depth(value: Any, limit: int) -> int:
    """Messages nested below a google.protobuf.Value holding ``value`` (0 for a scalar).

    An array is a ListValue holding a Value per element (2 levels); an object is a Struct
    holding a map entry per key, each holding a Value (3 levels). Iterative, and it stops
    once past ``limit``: the JSON may be as deep as MAX_JSON_DEPTH.
    """
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, below = stack.pop()
        if isinstance(item, list):
            children: Any = item
            step = 2
        elif isinstance(item, dict):
            children = item.values()
            step = 3
        else:
            continue
        if not children:
            deepest = max(deepest, below + 1)  # just the empty ListValue or Struct
            continue
        below += step
        deepest = max(deepest, below)
        if deepest > limit:
            return deepest
        kinds = set(map(type, children))  # in C: long lists of scalars (token ids) cost little
        if list in kinds or dict in kinds:
            stack.extend((child, below) for child in children if isinstance(child, list | dict))
    return deepest


def _too_deep_free_form(depth: int) -> str:
    arrays = (MAX_MESSAGE_DEPTH - depth) // 2
    return (
        f"nested too deeply: the server decodes at most {MAX_MESSAGE_DEPTH} levels of nested messages, "
        f"which leaves room here for {arrays} levels of arrays (an array takes 2 levels, an object 3)"
    )


def _check_field(value, field, path, reject_unknown, out, depth) -> None:
    """Check a field of a message at ``depth``; its message values sit one level deeper."""
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        if not isinstance(value, dict):
            out.append((path, f"expected an object (a map), got {_kind(value)}"))
            return
        key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
        if value and depth + 1 > MAX_MESSAGE_DEPTH:  # each map entry is a message of its own
            out.append((path, f"nested too deeply: messages may nest at most {MAX_MESSAGE_DEPTH} levels"))
            return
        for key, item in value.items():
            _check_map_key(key, key_field, f"{path}[{json.dumps(key)}]", out)
            _check_single(item, value_field, f"{path}[{json.dumps(key)}]", reject_unknown, out, depth + 2)
        return
    if field.is_repeated:
        if not isinstance(value, list):
            out.append((path, f"expected an array, got {_kind(value)}"))
            return
        for index, item in enumerate(value):
            _check_single(item, field, f"{path}[{index}]", reject_unknown, out, depth + 1)
        return
    _check_single(value, field, path, reject_unknown, out, depth + 1)


def _check_map_key(key: str, field, path, out) -> None:
    if field.type == FD.TYPE_BOOL:
        if key not in ("true", "false"):
            out.append((path, "map key must be true or false"))
    elif field.type in _INT_RANGES:
        try:
            number = int(key)
        except ValueError:
            out.append((path, f"map key must be an integer, got {json.dumps(key)}"))
            return
        low, high = _INT_RANGES[field.type]
        if not low <= number <= high:
            out.append((path, f"map key {number} is out of range [{low}, {high}]"))


def _check_single(value, field, path, reject_unknown, out, depth) -> None:
    """Check one value of ``field``; a message value sits at ``depth``."""
    kind = field.type
    if field.message_type is not None:
        if value is None and field.message_type.full_name != "google.protobuf.Value":
            out.append((path, "null is not allowed here"))
            return
        _check_message(value, field.message_type, path, reject_unknown, out, depth)
    elif value is None:
        out.append((path, "null is not allowed here"))
    elif kind in _INT_RANGES:
        _check_integer(value, kind, path, out)
    elif kind in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        _check_float(value, kind, path, out)
    elif kind == FD.TYPE_BOOL:
        if not isinstance(value, bool):
            out.append((path, f"expected true or false, got {_kind(value)}"))
    elif kind == FD.TYPE_STRING:
        if not isinstance(value, str):
            out.append((path, f"expected a string, got {_kind(value)}"))
    elif kind == FD.TYPE_BYTES:
        _check_bytes(value, path, out)
    elif kind == FD.TYPE_ENUM:
        _check_enum(value, field.enum_type, path, out)


def _check_integer(value, kind, path, out) -> None:
    number: int | None = None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            number = None
    if number is None:
        out.append((path, f"expected an integer, got {_kind(value)}"))
        return
    low, high = _INT_RANGES[kind]
    if not low <= number <= high:
        out.append((path, f"{number} is out of range [{low}, {high}]"))


def _check_float(value, kind, path, out) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        out.append((path, f"expected a number, got {_kind(value)}"))
        return
    if isinstance(value, str):
        if value in _FLOAT_WORDS:
            return
        try:
            value = float(value)
        except ValueError:
            out.append((path, f"expected a number, got {_kind(value)}"))
            return
        if not math.isfinite(value):
            out.append((path, 'non-finite numbers must be written "NaN", "Infinity" or "-Infinity"'))
            return
    if kind == FD.TYPE_FLOAT and math.isfinite(value) and abs(value) > _FLOAT_MAX:
        out.append((path, f"{value!r} is too large for a 32-bit float"))


def _check_bytes(value, path, out) -> None:
    if not isinstance(value, str):
        out.append((path, f"expected a base64 string, got {_kind(value)}"))
        return
    text = value.replace("-", "+").replace("_", "/")
    try:
        base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        out.append((path, "expected base64-encoded bytes"))


def _check_enum(value, enum, path, out) -> None:
    if isinstance(value, str):
        if value not in enum.values_by_name:
            names = ", ".join(enum.values_by_name)
            out.append((path, f"unknown value {json.dumps(value)}; expected one of {names}"))
    elif isinstance(value, bool) or not isinstance(value, int):
        out.append((path, f"expected an enum value name, got {_kind(value)}"))
    elif not -(2**31) <= value < 2**31:
        out.append((path, f"enum number {value} is out of range"))


def _check_with_json_format(value, message, path, out) -> None:
    # Timestamps, durations, wrappers, Any...: json_format knows their string forms best.
    try:
        json_format.ParseDict(value, message_factory.GetMessageClass(message)())
    except json_format.ParseError as exc:
        out.append((path, f"not a valid {message.name}: {exc}"))


# ---------------------------------------------------------------------------- writing


_UNSET = object()  # a oneof member's place in a written message until the message says it is set


@functools.cache
def _writer(message_type: descriptor.Descriptor) -> Callable[[Message], Any]:
    """The JSON writer of one message type. Unset fields keep their places from a template in field
    order (the no-presence ones their JSON default, presence ones null, oneof members and
    ``omit_empty`` fields a mark taken out again); the fields the message reports set (ListFields)
    overwrite theirs."""
    if message_type.full_name.startswith(_WKT_PREFIX):  # their own JSON forms, json_format's
        return functools.partial(
            json_format.MessageToDict, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    template: dict[str, Any] = {}
    fresh: list[tuple[str, type]] = []  # empty repeated and map fields: a new container per message
    by_number: dict[int, tuple[str, Callable[[Any], Any]]] = {}
    omissible = False  # some field may be left out: an unset oneof member or an empty omit_empty field
    for field in message_type.fields:
        convert = _field_writer(field)
        by_number[field.number] = (field.name, convert)
        if field.has_presence:
            in_oneof = _real_oneof(field) is not None
            omissible |= in_oneof
            template[field.name] = _UNSET if in_oneof else None
        elif field.is_repeated and _omit_empty(field):
            omissible = True
            template[field.name] = _UNSET
        elif field.is_repeated:
            template[field.name] = None
            fresh.append((field.name, dict if _is_map(field) else list))
        else:
            template[field.name] = convert(field.default_value)
    extensions = bool(message_type.extension_ranges)

    def write(message: Message) -> Any:
        out = template.copy()
        for name, container in fresh:
            out[name] = container()
        whole = None
        for field, value in message.ListFields():
            if extensions and field.is_extension:  # after the fields, as json_format writes them
                if whole is None:
                    whole = json_format.MessageToDict(
                        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
                    )
                key = f"[{field.full_name}]"
                out[key] = whole[key]
            else:
                name, convert = by_number[field.number]
                out[name] = convert(value)
        if omissible:
            out = {name: value for name, value in out.items() if value is not _UNSET}
        return out

    return write


def _omit_empty(field: descriptor.FieldDescriptor) -> bool:
    return field.GetOptions().Extensions[gateway_pb2.field].omit_empty


def _is_map(field: descriptor.FieldDescriptor) -> bool:
    entry = field.message_type
    return entry is not None and entry.GetOptions().map_entry


@functools.cache
def _field_writer(field: descriptor.FieldDescriptor) -> Callable[[Any], Any]:
    """JSON of a field's whole value (a map, a list or one value), as json_format writes it."""
    if _is_map(field):
        value_of = _value_writer(field.message_type.fields_by_name["value"])
        return lambda entries: {_map_key_text(key): value_of(entries[key]) for key in entries}
    value_of = _value_writer(field)
    if field.is_repeated:
        return lambda items: [value_of(item) for item in items]
    return value_of


def _map_key_text(key: Any) -> str:
    if isinstance(key, bool):
        return "true" if key else "false"
    return str(key)


def _value_writer(field: descriptor.FieldDescriptor) -> Callable[[Any], Any]:
    """JSON of one value of the field (json_format's _FieldToJsonObject, with proto field names)."""
    kind = field.cpp_type
    if kind == FD.CPPTYPE_MESSAGE:
        return message_to_json
    if kind == FD.CPPTYPE_ENUM:
        return _enum_writer(field.enum_type)
    if field.type == FD.TYPE_BYTES:
        return lambda value: base64.b64encode(value).decode("utf-8")
    if kind == FD.CPPTYPE_STRING:
        return str
    if kind == FD.CPPTYPE_BOOL:
        return bool
    if kind in (FD.CPPTYPE_INT64, FD.CPPTYPE_UINT64):
        return str
    if kind == FD.CPPTYPE_FLOAT:  # a float32 as the shortest decimal that reads back as itself
        return lambda value: type_checkers.ToShortestFloat(value) if math.isfinite(value) else _float_word(value)
    if kind == FD.CPPTYPE_DOUBLE:
        return lambda value: value if math.isfinite(value) else _float_word(value)
    return _identity


def _identity(value: Any) -> Any:
    return value


def _float_word(value: float) -> str:
    """NaN and the infinities, which JSON has no numbers for, as proto3 JSON writes them."""
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _enum_writer(enum: descriptor.EnumDescriptor) -> Callable[[int], Any]:
    if enum.full_name == "google.protobuf.NullValue":
        return lambda value: None
    names = {number: value.name for number, value in enum.values_by_number.items()}
    closed = enum.is_closed

    def write(value: int) -> Any:
        name = names.get(value)
        if name is not None:
            return name
        if closed:  # json_format's own refusal
            raise json_format.SerializeToJsonError(
                "Enum field contains an integer value which can not mapped to an enum value."
            )
        return value  # an open enum's unknown number stays a number

    return write
