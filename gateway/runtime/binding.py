"""Builds the gRPC request of a matched route from path variables, query string and body.

The google.api.http rules: with ``body: "*"`` the JSON body is the whole
request and the query string is ignored; with ``body: "<field>"`` the body is
that field and other fields may come from the query; with no body every
field not bound by the path comes from the query, as dotted paths
(``?sampling.top_k=5``, repeated fields by repeating the key). Path
variables always win. A route with a ``stream`` target switches to it when
the body says ``"stream": true``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor, message_factory
from google.protobuf.message import Message
from google.rpc import code_pb2

from protoserve.gateway.runtime.errors import HttpError, gateway_error
from protoserve.gateway.runtime.json_codec import InvalidJson, loads, parse_message
from protoserve.gateway.runtime.route import Route

FD = descriptor.FieldDescriptor
_TRUE, _FALSE = ("true", "t", "1"), ("false", "f", "0")


@dataclass(frozen=True, slots=True)
class Call:
    """What to send to the gRPC server for one HTTP request."""

    grpc_method: str
    request: Message
    response_type: type[Message]
    server_streaming: bool
    response_body: str


def bind_request(
    route: Route, path_values: dict[str, str], query: Iterable[tuple[str, str]], body: bytes
) -> Call:
    """The Call for a request, or raise HttpError (400) naming every bad field."""
    document: Any = None
    if route.body:
        try:
            document = loads(body) if body.strip() else ({} if route.body == "*" else None)
        except InvalidJson as exc:
            raise invalid_request(exc) from None
    return bind_document(route, path_values, query, document)


def bind_document(
    route: Route, path_values: dict[str, str], query: Iterable[tuple[str, str]], document: Any
) -> Call:
    """bind_request for a body already decoded (None: no body), e.g. one inside a WebSocket message."""
    try:
        return _bind(route, path_values, list(query), document)
    except InvalidJson as exc:
        raise invalid_request(exc) from None


def invalid_request(exc: InvalidJson) -> HttpError:
    """INVALID_ARGUMENT with a BadRequest detail per violation."""
    return gateway_error(code_pb2.INVALID_ARGUMENT, f"invalid request: {exc}", violations=exc.violations)


def _bind(route: Route, path_values: dict[str, str], query: list[tuple[str, str]], document: Any) -> Call:
    request_type = route.request_type
    reject, ignored = route.reject_unknown_fields, route.ignored_fields
    stream = route.stream
    streaming = stream is not None and isinstance(document, dict) and document.get("stream") is True
    # A streamed request travels wrapped in the streaming method's request: one level deeper.
    depth = 1 if streaming else 0
    if route.body == "*":
        data = document
        if isinstance(data, dict):
            _put_path_values(data, request_type.DESCRIPTOR, path_values)
        request = parse_message(
            data, request_type, reject_unknown_fields=reject, ignored_fields=ignored, depth=depth
        )
    else:
        data = _query_document(request_type.DESCRIPTOR, query, set(path_values) | {route.body}, reject)
        request = parse_message(data, request_type, reject_unknown_fields=reject, depth=depth)
        if route.body and document is not None:
            _set_body_field(request, route.body, document, reject, ignored, depth)
        if path_values:
            # Applied last: a path variable inside the body field ({book.name}) wins over the body.
            path_data: dict[str, Any] = {}
            _put_path_values(path_data, request_type.DESCRIPTOR, path_values)
            _copy_fields(
                parse_message(path_data, request_type, reject_unknown_fields=True), request, path_values
            )
    if streaming:
        wrapper = stream.request_type()
        getattr(wrapper, stream.wrap_field).CopyFrom(request)
        return Call(stream.grpc_method, wrapper, stream.response_type, True, stream.response_body)
    return Call(route.grpc_method, request, route.response_type, route.server_streaming, route.response_body)


def _set_body_field(
    request: Message, name: str, document: Any, reject: bool, ignored: Collection[str], depth: int
) -> None:
    field = request.DESCRIPTOR.fields_by_name[name]
    if field.message_type is not None and not field.is_repeated:
        # Parsed on its own so that error paths read as the client wrote the body.
        part_type = message_factory.GetMessageClass(field.message_type)
        part = parse_message(
            document, part_type, reject_unknown_fields=reject, ignored_fields=ignored, depth=depth + 1
        )
        getattr(request, name).CopyFrom(part)
    else:
        part = parse_message({name: document}, type(request), reject_unknown_fields=reject, depth=depth)
        request.MergeFrom(part)


def _copy_fields(source: Message, target: Message, field_paths: Iterable[str]) -> None:
    for field_path in field_paths:
        *parents, leaf = field_path.split(".")
        src, dst = source, target
        for name in parents:
            src, dst = getattr(src, name), getattr(dst, name)
        setattr(dst, leaf, getattr(src, leaf))


def _field(message: descriptor.Descriptor, name: str) -> descriptor.FieldDescriptor | None:
    found = message.fields_by_name.get(name)
    if found is None:
        found = next((f for f in message.fields if f.json_name == name), None)
    return found


def _put_path_values(data: dict[str, Any], message: descriptor.Descriptor, values: dict[str, str]) -> None:
    for field_path, raw in values.items():
        target, current = data, message
        names = field_path.split(".")
        for name in names[:-1]:
            field = current.fields_by_name[name]
            target.pop(field.json_name, None)
            nested = target.get(name)
            if not isinstance(nested, dict):
                nested = target[name] = {}
            target, current = nested, field.message_type
        leaf = current.fields_by_name[names[-1]]
        target.pop(leaf.json_name, None)  # the path wins over a body that spells the field in camelCase
        target[leaf.name] = _scalar(raw, leaf, field_path)


def _scalar(raw: str, field: descriptor.FieldDescriptor, where: str) -> Any:
    """A path or query string as the JSON value json_format expects for the field."""
    if field.type == FD.TYPE_BOOL:
        lowered = raw.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise InvalidJson([(where, f"expected true or false, got {raw!r}")])
    # Integers, floats and enums are accepted as strings by proto3 JSON.
    return raw


def _query_document(
    message: descriptor.Descriptor, query: list[tuple[str, str]], bound: set[str], reject: bool
) -> dict[str, Any]:
    document: dict[str, Any] = {}
    violations: list[tuple[str, str]] = []
    for key, raw in query:
        if key in bound or key.split(".")[0] in bound:
            continue  # grpc-gateway ignores query values for fields the path or body sets
        target, current, field = document, message, None
        names = key.split(".")
        for depth, name in enumerate(names):
            field = _field(current, name) if current is not None else None
            if field is None:
                break
            if depth < len(names) - 1:
                if field.message_type is None or field.is_repeated:
                    field = None
                    break
                target = target.setdefault(field.name, {})
                current = field.message_type
        if field is None:
            if reject:
                violations.append((key, "unknown query parameter"))
            continue
        entry = field.message_type
        if entry is not None and (
            entry.GetOptions().map_entry or not entry.full_name.startswith("google.protobuf.")
        ):
            violations.append((key, "this field cannot be set from the query string"))
            continue
        try:
            value = _scalar(raw, field, key)
        except InvalidJson as exc:
            violations += exc.violations
            continue
        if field.is_repeated:
            target.setdefault(field.name, []).append(value)
        elif field.name in target:
            violations.append((key, "given more than once"))
        else:
            target[field.name] = value
    if violations:
        raise InvalidJson(violations)
    return document
