"""Emits an OpenAPI 3.1 document for the gateway's routes from the same API model.

Schemas follow the JSON the runtime reads and writes: proto field names,
proto3 JSON mapping of scalar and well-known types, and ``null`` for unset
fields with presence. 3.1 is used because its JSON Schema dialect can say
"integer or string" (64-bit ints) and "or null" without extensions. Every
description is the element's proto comment. ``GatewayRule.access`` becomes the
operation's ``security`` (the API key as HTTP bearer auth, ``x-user-id`` as an
optional header key) and ``GatewayRule.example`` its parameter and body examples.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import descriptor

from protoserve.gateway.generator.api import (
    Access,
    Api,
    RouteSpec,
    proto3_optional_fields,
    resolve_field_path,
)
from protoserve.gateway.runtime.route import BodyCodec, ErrorStyle, Framing

FD = descriptor.FieldDescriptor
OPENAI_ERROR_SCHEMA = "OpenAIErrorResponse"
ANTHROPIC_ERROR_SCHEMA = "AnthropicErrorResponse"
_INT32 = {"type": "integer", "format": "int32"}
_UINT32 = {"type": "integer", "format": "uint32", "minimum": 0}
# proto3 JSON prints 64-bit integers as strings and accepts numbers too.
_INT64 = {"type": ["integer", "string"], "format": "int64"}
_UINT64 = {"type": ["integer", "string"], "format": "uint64"}
_SCALARS: dict[int, dict[str, Any]] = {
    FD.TYPE_DOUBLE: {"type": "number", "format": "double"},
    FD.TYPE_FLOAT: {"type": "number", "format": "float"},
    FD.TYPE_INT64: _INT64,
    FD.TYPE_SINT64: _INT64,
    FD.TYPE_SFIXED64: _INT64,
    FD.TYPE_UINT64: _UINT64,
    FD.TYPE_FIXED64: _UINT64,
    FD.TYPE_INT32: _INT32,
    FD.TYPE_SINT32: _INT32,
    FD.TYPE_SFIXED32: _INT32,
    FD.TYPE_UINT32: _UINT32,
    FD.TYPE_FIXED32: _UINT32,
    FD.TYPE_BOOL: {"type": "boolean"},
    FD.TYPE_STRING: {"type": "string"},
    FD.TYPE_BYTES: {"type": "string", "contentEncoding": "base64"},
}
# Well-known types have their own JSON forms (proto3 JSON mapping).
_WELL_KNOWN: dict[str, dict[str, Any]] = {
    "google.protobuf.Value": {"description": "Any JSON value."},
    "google.protobuf.Struct": {"type": "object", "description": "A JSON object."},
    "google.protobuf.ListValue": {"type": "array", "description": "A JSON array."},
    "google.protobuf.NullValue": {"type": "null"},
    "google.protobuf.Empty": {"type": "object"},
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
    "google.protobuf.Duration": {"type": "string", "pattern": r"^-?[0-9]+(\.[0-9]{1,9})?s$"},
    "google.protobuf.FieldMask": {"type": "string"},
    "google.protobuf.Any": {
        "type": "object",
        "properties": {"@type": {"type": "string", "description": "Type URL of the embedded message."}},
        "additionalProperties": True,
    },
    "google.protobuf.DoubleValue": {"type": "number", "format": "double"},
    "google.protobuf.FloatValue": {"type": "number", "format": "float"},
    "google.protobuf.Int64Value": _INT64,
    "google.protobuf.UInt64Value": _UINT64,
    "google.protobuf.Int32Value": _INT32,
    "google.protobuf.UInt32Value": _UINT32,
    "google.protobuf.BoolValue": {"type": "boolean"},
    "google.protobuf.StringValue": {"type": "string"},
    "google.protobuf.BytesValue": {"type": "string", "contentEncoding": "base64"},
}
_OPENAI_ERROR = {
    "type": "object",
    "description": "OpenAI's error body, written by routes with ERROR_STYLE_OPENAI.",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string", "description": "What went wrong."},
                "type": {
                    "type": "string",
                    "description": "Error class, such as invalid_request_error, not_found_error, "
                    "rate_limit_error, authentication_error or server_error.",
                },
                "param": {
                    "type": ["string", "null"],
                    "description": "The request field at fault (first BadRequest field violation).",
                },
                "code": {
                    "type": ["string", "null"],
                    "description": "Machine-readable reason (google.rpc.ErrorInfo reason, lower case).",
                },
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "description": "Anthropic's error body, written by routes with ERROR_STYLE_ANTHROPIC.",
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "properties": {
                "type": {
                    "type": "string",
                    "description": "Error class by Anthropic's status: invalid_request_error (400), "
                    "authentication_error (401), permission_error (403), not_found_error (404), "
                    "request_too_large (413), rate_limit_error (429), api_error (500), "
                    "timeout_error (504), overloaded_error (529).",
                },
                "message": {"type": "string", "description": "What went wrong, naming the bad fields."},
            },
            "required": ["type", "message"],
        },
    },
    "required": ["type", "error"],
}


API_KEY_SCHEME = "ApiKey"
USER_ID_SCHEME = "UserId"
SECURITY_SCHEMES = {
    API_KEY_SCHEME: {
        "type": "http",
        "scheme": "bearer",
        "description": "An API key (`--api-keys-file`, `$PROTOSERVE_API_KEYS`; admin keys too) as "
        "`authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's clients send it). "
        "Needed only when the server runs with keys: without them "
        "every call is accepted and the header is ignored.",
    },
    USER_ID_SCHEME: {
        "type": "apiKey",
        "in": "header",
        "name": "x-user-id",
        "description": "Optional: the end user (at most 256 characters). The key and the user id "
        "together are the caller's identity, which owns its requests, usage, RAG documents and "
        "cached prompts, so a shared key is split by user; without keys the user id alone is.",
    },
}
# The key, with or without a user id: x-user-id is never required.
KEY_SECURITY = ({API_KEY_SCHEME: [], USER_ID_SCHEME: []}, {API_KEY_SCHEME: []})
_ADMIN_NOTE = "Needs an admin key (`--admin-keys-file`) when the server runs with keys: 403 for other keys."
_WATCH_NOTE = (
    "Read it as it arrives with `curl -N`, an SSE client or an OpenAI client's streaming mode; "
    "/docs shows the whole stream once it has ended."
)


def _ref(full_name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{full_name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        return {"anyOf": [schema, {"type": "null"}]}
    if isinstance(schema.get("type"), str):
        return {**schema, "type": [schema["type"], "null"]}
    if isinstance(schema.get("type"), list) and "null" not in schema["type"]:
        return {**schema, "type": [*schema["type"], "null"]}
    return schema


class _SchemaBuilder:
    """Collects component schemas for every message and enum a route reaches."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.components: dict[str, dict[str, Any]] = {}

    def type_ref(self, field: descriptor.FieldDescriptor) -> dict[str, Any]:
        """Schema of one value of the field (an element, for repeated fields)."""
        if field.message_type is not None:
            return self.message_ref(field.message_type)
        if field.enum_type is not None:
            return self.enum_ref(field.enum_type)
        return dict(_SCALARS[field.type])

    def field_schema(
        self, field: descriptor.FieldDescriptor, optional_names: frozenset[str]
    ) -> dict[str, Any]:
        """Schema of the field's JSON value, with its comment as description."""
        message = field.message_type
        if message is not None and message.GetOptions().map_entry:
            schema: dict[str, Any] = {
                "type": "object",
                "additionalProperties": self.type_ref(message.fields_by_name["value"]),
            }
        elif field.is_repeated:
            schema = {"type": "array", "items": self.type_ref(field)}
        else:
            schema = self.type_ref(field)
            in_real_oneof = field.containing_oneof is not None and field.name not in optional_names
            if field.has_presence and not in_real_oneof and not self._is_value(message):
                # The runtime prints unset presence fields as null (see gateway.runtime.json_codec).
                schema = _nullable(schema)
        description = self.api.comments.get(f"{field.containing_type.full_name}.{field.name}")
        oneof = field.containing_oneof
        if oneof is not None and field.name not in optional_names:
            members = ", ".join(f"`{f.name}`" for f in oneof.fields)
            description = f"{description}\n\nAt most one of {members} (oneof `{oneof.name}`).".strip()
        if description:
            schema["description"] = description
        return schema

    @staticmethod
    def _is_value(message: descriptor.Descriptor | None) -> bool:
        # google.protobuf.Value already includes null.
        return message is not None and message.full_name == "google.protobuf.Value"

    def message_ref(self, message: descriptor.Descriptor) -> dict[str, Any]:
        """A $ref to the message's component, building it (and what it reaches) once."""
        name = message.full_name
        if name not in self.components:
            if name in _WELL_KNOWN:
                self.components[name] = dict(_WELL_KNOWN[name])
                return _ref(name)
            schema: dict[str, Any] = {"type": "object"}
            self.components[name] = schema  # placed first: recursive messages refer to it
            description = self.api.comments.get(name)
            if description:
                schema["description"] = description
            optional_names = proto3_optional_fields(message)
            schema["properties"] = {f.name: self.field_schema(f, optional_names) for f in message.fields}
        return _ref(name)

    def enum_ref(self, enum: descriptor.EnumDescriptor) -> dict[str, Any]:
        """A $ref to the enum's component: value names, each explained in the description."""
        name = enum.full_name
        if name not in self.components:
            if name in _WELL_KNOWN:
                self.components[name] = dict(_WELL_KNOWN[name])
                return _ref(name)
            lines = [self.api.comments.get(name)] if self.api.comments.get(name) else []
            values = []
            for value in enum.values:
                values.append(
                    f"- `{value.name}`: {self.api.comments.get(f'{name}.{value.name}')}".rstrip(": ")
                )
            self.components[name] = {
                "type": "string",
                "enum": [value.name for value in enum.values],
                "description": "\n\n".join([*lines, "\n".join(values)]),
            }
        return _ref(name)


def _query_parameters(
    builder: _SchemaBuilder, message: descriptor.Descriptor, bound: set[str], prefix: str = "", depth: int = 0
) -> list[dict[str, Any]]:
    """Leaf fields not bound by path or body, as dotted query parameters (grpc-gateway's rule)."""
    parameters: list[dict[str, Any]] = []
    for field in message.fields:
        name = prefix + field.name
        if name in bound:
            continue
        sub = field.message_type
        if sub is not None and sub.GetOptions().map_entry:
            continue  # maps cannot be written as query parameters
        if sub is not None and sub.full_name not in _WELL_KNOWN:
            if not field.is_repeated and depth < 4:  # depth bound guards recursive messages
                parameters += _query_parameters(builder, sub, bound, name + ".", depth + 1)
            continue
        schema = builder.type_ref(field)
        if field.is_repeated:
            schema = {"type": "array", "items": schema}
        parameter: dict[str, Any] = {"name": name, "in": "query", "required": False, "schema": schema}
        description = builder.api.comments.get(f"{message.full_name}.{field.name}")
        if description:
            parameter["description"] = description
        if field.is_repeated:
            parameter["explode"] = True
        parameters.append(parameter)
    return parameters


def _stream_note(framing: Framing) -> str:
    """Sentences describing the frames of a stream with this framing."""
    if framing is Framing.NDJSON:
        return (
            'The stream is newline-delimited JSON, one `{"result": <message>}` per line; an error '
            'after the stream started ends it with an `{"error": ...}` line.'
        )
    if framing is Framing.SSE_EVENTS:
        return (
            "The stream is Server-Sent Events, each named by its message's `type` (`event: <type>`) "
            "with the message as JSON in its `data:` field, and no `[DONE]`: the last event says the "
            "stream is complete. An error after the stream started arrives as a last `error` event."
        )
    return (
        "The stream is Server-Sent Events, each `data:` field one message as JSON. It ends with "
        '`data: [DONE]`; an error after the stream started arrives as a last `data: {"error": ...}` '
        "event instead."
    )


def _stream_content(schema: dict[str, Any], framing: Framing) -> tuple[dict[str, Any], str]:
    """The media type of a stream with this framing, and a sentence describing its frames."""
    if framing is Framing.NDJSON:
        media = {"application/x-ndjson": {"schema": {"type": "object", "properties": {"result": schema}}}}
    else:
        media = {"text/event-stream": {"schema": schema}}
    return media, _stream_note(framing)


def _value_at(example: dict[str, Any], field_path: str) -> tuple[bool, Any]:
    """Whether the example sets the dotted field path, and its value there."""
    value: Any = example
    for name in field_path.split("."):
        if not isinstance(value, dict) or name not in value:
            return False, None
        value = value[name]
    return True, value


def _body_examples(route: RouteSpec, example: dict[str, Any], path_bound: set[str]) -> dict[str, Any]:
    """The body part of the method's example request, and with a stream method the same streamed."""
    body = route.binding.body
    if body == "*":
        value: Any = {key: item for key, item in example.items() if key not in path_bound}
    elif body in example:
        value = example[body]
    else:
        return {}
    examples = {"request": {"summary": "A request", "value": value}}
    if route.stream is not None and isinstance(value, dict):
        examples["stream"] = {
            "summary": 'The same request, streamed ("stream": true)',
            "value": {**value, "stream": True},
        }
    return examples


def _response_schema(builder: _SchemaBuilder, message: descriptor.Descriptor, response_body: str) -> dict:
    if response_body:
        field = message.fields_by_name[response_body]
        return builder.field_schema(field, proto3_optional_fields(message))
    return builder.message_ref(message)


def _operation(builder: _SchemaBuilder, route: RouteSpec) -> dict[str, Any]:
    method = route.method.descriptor
    binding = route.binding
    request = method.input_type
    description = builder.api.comments.get(method.full_name)
    operation: dict[str, Any] = {
        "operationId": route.operation_id,
        "tags": [method.containing_service.name],
        "summary": f"{method.containing_service.name}.{method.name}",
    }
    notes = [description] if description else []
    if route.reject_unknown_fields and binding.body:
        note = "Body fields the request message does not define are refused (400)"
        if route.ignored_fields:
            names = ", ".join(f"`{name}`" for name in route.ignored_fields)
            note += f", except {names}, which change nothing here and are accepted and ignored"
        notes.append(note + ".")
    if route.method.options.access is Access.ADMIN:
        notes.append(_ADMIN_NOTE)
    if method.server_streaming:
        notes.append(f"**Streaming.** {_stream_note(route.framing)} {_WATCH_NOTE}")
    elif route.stream is not None:
        notes.append(
            f'**Streaming.** With `"stream": true` in the body the answer streams. '
            f"{_stream_note(route.framing)} {_WATCH_NOTE}"
        )
    if notes:
        operation["description"] = "\n\n".join(notes)
    if route.method.options.access is Access.PUBLIC:
        operation["security"] = []
    else:
        operation["security"] = [dict(requirement) for requirement in KEY_SECURITY]
    example = route.method.options.example
    parameters = []
    bound = set()
    for variable in binding.path.variables:
        field = resolve_field_path(request, variable.field_path, method.full_name)
        bound.add(variable.field_path)
        parameter = {
            "name": variable.field_path,
            "in": "path",
            "required": True,
            "schema": builder.type_ref(field),
        }
        comment = builder.api.comments.get(f"{field.containing_type.full_name}.{field.name}")
        if comment:
            parameter["description"] = comment
        parameters.append(parameter)
    if binding.body != "*":
        if binding.body:
            bound.add(binding.body)
        parameters += _query_parameters(builder, request, bound)
    if example is not None:
        for parameter in parameters:
            found, value = _value_at(example, parameter["name"])
            if found:
                parameter["example"] = value
    if parameters:
        operation["parameters"] = parameters

    if binding.body:
        if binding.body == "*":
            top_bound = {path.split(".")[0] for path in bound}
            if top_bound:
                # Path-bound fields are not part of the body.
                builder.message_ref(request)
                optional_names = proto3_optional_fields(request)
                body_schema: dict[str, Any] = {
                    "type": "object",
                    "properties": {
                        f.name: builder.field_schema(f, optional_names)
                        for f in request.fields
                        if f.name not in top_bound
                    },
                }
            else:
                body_schema = builder.message_ref(request)
        else:
            body_schema = builder.field_schema(request.fields_by_name[binding.body], frozenset())
        media: dict[str, Any] = {"schema": body_schema}
        if example is not None:
            examples = _body_examples(route, example, {path.split(".")[0] for path in bound})
            if examples:
                media["examples"] = examples
        operation["requestBody"] = {"required": True, "content": {"application/json": media}}

    response_schema = _response_schema(builder, method.output_type, binding.response_body)
    ok_description = builder.api.comments.get(method.output_type.full_name) or "OK"
    if method.server_streaming:
        content, note = _stream_content(response_schema, route.framing)
        ok_description += "\n\n" + note
    else:
        content = {"application/json": {"schema": response_schema}}
    if route.stream is not None:
        target = route.stream.method.descriptor
        stream_schema = _response_schema(builder, target.output_type, route.stream.response_body)
        stream_content, note = _stream_content(stream_schema, route.framing)
        content.update(stream_content)
        ok_description += (
            f'\n\nWith `"stream": true` in the body the route is served by {target.full_name}. ' + note
        )
    if route.error_style is ErrorStyle.OPENAI:
        error_schema = {"$ref": f"#/components/schemas/{OPENAI_ERROR_SCHEMA}"}
        builder.components[OPENAI_ERROR_SCHEMA] = _OPENAI_ERROR
        error_description = "An error, as OpenAI writes it."
    elif route.error_style is ErrorStyle.ANTHROPIC:
        error_schema = {"$ref": f"#/components/schemas/{ANTHROPIC_ERROR_SCHEMA}"}
        builder.components[ANTHROPIC_ERROR_SCHEMA] = _ANTHROPIC_ERROR
        error_description = "An error, as Anthropic writes it."
    else:
        error_schema = _status_ref(builder)
        error_description = "An error, as a google.rpc.Status with typed details."
    operation["responses"] = {
        "200": {"description": ok_description, "content": content},
        "default": {
            "description": error_description,
            "content": {"application/json": {"schema": error_schema}},
        },
    }
    return operation


def _status_ref(builder: _SchemaBuilder) -> dict[str, Any]:
    try:
        status = builder.api.pool.FindMessageTypeByName("google.rpc.Status")
    except KeyError:
        # Files that never import google/rpc/status.proto: describe its JSON form inline.
        return {
            "type": "object",
            "properties": {
                "code": _INT32,
                "message": {"type": "string"},
                "details": {"type": "array", "items": _WELL_KNOWN["google.protobuf.Any"]},
            },
        }
    return builder.message_ref(status)


def build_openapi(api: Api, title: str, version: str) -> dict[str, Any]:
    """The OpenAPI document of every route of ``api``."""
    builder = _SchemaBuilder(api)
    paths: dict[str, dict[str, Any]] = {}
    documented = set()
    for route in api.routes:
        if route.codec is not BodyCodec.PROTO_JSON:
            continue  # its body is not its messages' JSON (the Open Inference Protocol's REST forms)
        path = paths.setdefault(route.binding.path.openapi_path(), {})
        path[route.binding.http_method.lower()] = _operation(builder, route)
        documented.add(route.method.descriptor.containing_service.full_name)
    tags = []
    for service in api.services:
        if service.full_name not in documented:
            continue
        tag = {"name": service.name}
        if api.comments.get(service.full_name):
            tag["description"] = api.comments.get(service.full_name)
        tags.append(tag)
    sources = ", ".join(f"`{file.name}`" for file in api.files if file.services_by_name)
    description = (
        f"REST/JSON routes generated from the google.api.http annotations of {sources}.\n\n"
        f"**Auth.** When the server runs with API keys, every operation with a lock needs "
        f"`authorization: Bearer <key>` (`{API_KEY_SCHEME}`) and may name the end user with "
        f"`x-user-id` (`{USER_ID_SCHEME}`); the others, such as `/health`, need nothing. "
        f"A missing or unknown key is 401.\n\n"
        f"**Streaming.** Operations that stream say so in their description: Server-Sent Events, "
        f"each `data:` field one JSON message, ending with `data: [DONE]`."
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "tags": tags,
        "paths": paths,
        "components": {
            "schemas": dict(sorted(builder.components.items())),
            "securitySchemes": SECURITY_SCHEMES,
        },
    }


def render_openapi(api: Api, title: str, version: str) -> str:
    """The document as stable, human-diffable JSON text."""
    return json.dumps(build_openapi(api, title, version), indent=2, ensure_ascii=False) + "\n"
