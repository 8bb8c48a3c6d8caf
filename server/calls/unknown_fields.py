"""Request fields this server's protos do not define: found, so that they are refused, never ignored.

protobuf keeps the fields of a message it does not know as "unknown fields" and a servicer never
sees them: a client built from newer protos (or one that numbers a field wrongly) would get an
answer that silently ignored what it asked for. The gateway refuses unknown JSON fields; this is
the same rule for binary requests. Each violation names the field by its path and number, the
only name an unknown field has (or by its name, when a known field's value came in the wrong wire
type, which protobuf keeps as unknown too).
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from protoserve.server.errors import echo


def unknown_field_violations(request: Message, data: bytes) -> list[tuple[str, str]]:
    """(field path, problem) for every unknown field in ``request``, decoded from ``data``; their
    values are dropped from ``request`` on the way.

    Cheap when there are none, as for almost every request: dropping unknown fields and re-measuring
    the message runs in protobuf's C code; only a message that shrank (or a client's non-canonical
    encoding, which changes the size too) is decoded again and walked.
    """
    request.DiscardUnknownFields()
    if request.ByteSize() == len(data):
        return []
    return list(_walk(type(request).FromString(data), ""))


def _walk(message: Message, path: str) -> Iterator[tuple[str, str]]:
    descriptor = message.DESCRIPTOR
    for number in sorted({field.field_number for field in UnknownFieldSet(message)}):
        known = descriptor.fields_by_number.get(number)
        if known is not None:  # protobuf keeps a value of the wrong wire type as unknown
            yield _join(path, known.name), f"field number {number} holds a value of the wrong wire type"
            continue
        yield (
            _join(path, str(number)),
            f"unknown field number {number}: {descriptor.full_name} has no such field, so it "
            "cannot be honoured (is the client built from newer protos?)",
        )
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        name = _join(path, field.name)
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].message_type is not None:
                for key in value:
                    yield from _walk(value[key], f"{name}[{echo(key) if isinstance(key, str) else key}]")
        elif field.is_repeated:
            for index, item in enumerate(value):
                yield from _walk(item, f"{name}[{index}]")
        else:
            yield from _walk(value, name)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
