"""The API model the emitters read: services, HTTP bindings and gateway rules from descriptors.

Everything is read from the CodeGeneratorRequest itself: its files are loaded
into a private DescriptorPool, and the ``google.api.http`` and
``protoserve.options.v1.gateway`` method options are decoded through that
pool's own dynamic ``MethodOptions`` class. The plugin therefore needs no
generated code, which matters because it runs while ``gen/`` is being rebuilt.
All inconsistencies between an annotation and the messages it names are
reported here, at generation time, rather than as a failing request later.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Any

from google.protobuf import descriptor, descriptor_pb2, descriptor_pool, message_factory

from protoserve.gateway.generator.http_rules import HttpRulesError, HttpRuleTable
from protoserve.gateway.runtime.json_codec import InvalidJson, parse_message
from protoserve.gateway.runtime.path_template import PathTemplate
from protoserve.gateway.runtime.route import BodyCodec, ErrorStyle, Framing

HTTP_RULE_EXTENSION = "google.api.http"
GATEWAY_RULE_EXTENSION = "protoserve.options.v1.gateway"
_HTTP_VERBS = ("get", "put", "post", "delete", "patch")
_FRAMINGS = {
    "STREAM_FRAMING_UNSPECIFIED": Framing.SSE,
    "STREAM_FRAMING_SSE_OPENAI": Framing.SSE,  # deprecated: every SSE stream ends with [DONE] now
    "STREAM_FRAMING_NDJSON": Framing.NDJSON,
    "STREAM_FRAMING_SSE_EVENTS": Framing.SSE_EVENTS,
}
_ERROR_STYLES = {
    "ERROR_STYLE_UNSPECIFIED": ErrorStyle.GOOGLE_RPC_STATUS,
    "ERROR_STYLE_OPENAI": ErrorStyle.OPENAI,
    "ERROR_STYLE_ANTHROPIC": ErrorStyle.ANTHROPIC,
}


class Access(StrEnum):
    """Who may call a method (GatewayRule.access): what the OpenAPI document's ``security`` says."""

    API_KEY = "api_key"
    PUBLIC = "public"
    ADMIN = "admin"


_ACCESS = {
    "ACCESS_UNSPECIFIED": Access.API_KEY,
    "ACCESS_PUBLIC": Access.PUBLIC,
    "ACCESS_ADMIN": Access.ADMIN,
}
_SCALAR_TYPES = frozenset(
    t
    for t in range(1, 19)
    if t not in (descriptor.FieldDescriptor.TYPE_MESSAGE, descriptor.FieldDescriptor.TYPE_GROUP)
)


class GeneratorError(Exception):
    """An annotation the gateway cannot serve; protoc reports the message and fails."""


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    """The decoded ``protoserve.options.v1.GatewayRule`` of one method (defaults when absent)."""

    stream_method: str = ""
    framing: Framing = Framing.SSE
    error_style: ErrorStyle = ErrorStyle.GOOGLE_RPC_STATUS
    reject_unknown_fields: bool = False
    ignored_fields: tuple[str, ...] = ()
    access: Access = Access.API_KEY
    # GatewayRule.example decoded: the request message as JSON, checked valid; None when absent.
    example: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Binding:
    """One HTTP rule (the primary one or an additional binding) of a method."""

    http_method: str
    path: PathTemplate
    body: str
    response_body: str
    codec: BodyCodec = BodyCodec.PROTO_JSON


@dataclass(frozen=True, slots=True)
class ApiMethod:
    """A service method with its HTTP bindings and gateway options."""

    descriptor: descriptor.MethodDescriptor
    bindings: tuple[Binding, ...]
    options: GatewayOptions

    @property
    def grpc_path(self) -> str:
        """The method's gRPC request path, ``/package.Service/Method``."""
        return f"/{self.descriptor.containing_service.full_name}/{self.descriptor.name}"

    @property
    def full_name(self) -> str:
        """``package.Service.Method``, the form GatewayRule.stream_method uses."""
        return self.descriptor.full_name


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """The streaming method serving a route's ``"stream": true`` bodies."""

    method: ApiMethod
    wrap_field: str
    response_body: str


@dataclass(frozen=True, slots=True)
class RouteSpec:
    """One servable route: a binding of a method plus the resolved gateway behaviour."""

    method: ApiMethod
    binding: Binding
    binding_index: int
    framing: Framing
    error_style: ErrorStyle
    reject_unknown_fields: bool
    ignored_fields: tuple[str, ...]
    stream: StreamSpec | None
    codec: BodyCodec = BodyCodec.PROTO_JSON

    @property
    def operation_id(self) -> str:
        """``Service_Method`` (with ``_<n>`` for additional bindings), unique per document."""
        method = self.method.descriptor
        suffix = f"_{self.binding_index}" if self.binding_index else ""
        return f"{method.containing_service.name}_{method.name}{suffix}"


class Comments:
    """Leading comments of every named element, keyed by full name.

    Fields are keyed ``<message>.<field>``, enum values ``<enum>.<VALUE>``, and
    methods ``<service>.<method>``, matching descriptor full names except for
    enum values (whose descriptor names skip the enum).
    """

    def __init__(self, files: Iterable[descriptor_pb2.FileDescriptorProto]) -> None:
        self._by_name: dict[str, str] = {}
        for file in files:
            by_path = {
                tuple(location.path): location.leading_comments
                for location in file.source_code_info.location
                if location.leading_comments
            }
            prefix = f"{file.package}." if file.package else ""
            for index, message in enumerate(file.message_type):
                self._message(by_path, (4, index), prefix + message.name, message)
            for index, enum in enumerate(file.enum_type):
                self._enum(by_path, (5, index), prefix + enum.name, enum)
            for index, service in enumerate(file.service):
                name = prefix + service.name
                self._put(by_path, (6, index), name)
                for m_index, method in enumerate(service.method):
                    self._put(by_path, (6, index, 2, m_index), f"{name}.{method.name}")

    def get(self, full_name: str) -> str:
        """The cleaned comment, or "" when the element has none."""
        return self._by_name.get(full_name, "")

    def _put(self, by_path: dict[tuple[int, ...], str], path: tuple[int, ...], name: str) -> None:
        text = by_path.get(path)
        if text:
            self._by_name[name] = clean_comment(text)

    def _message(self, by_path, path, name, message: descriptor_pb2.DescriptorProto) -> None:
        self._put(by_path, path, name)
        for index, field in enumerate(message.field):
            self._put(by_path, (*path, 2, index), f"{name}.{field.name}")
        for index, nested in enumerate(message.nested_type):
            self._message(by_path, (*path, 3, index), f"{name}.{nested.name}", nested)
        for index, enum in enumerate(message.enum_type):
            self._enum(by_path, (*path, 4, index), f"{name}.{enum.name}", enum)

    def _enum(self, by_path, path, name, enum: descriptor_pb2.EnumDescriptorProto) -> None:
        self._put(by_path, path, name)
        for index, value in enumerate(enum.value):
            self._put(by_path, (*path, 2, index), f"{name}.{value.name}")


def clean_comment(text: str) -> str:
    """A proto comment without the one space after ``//`` and without trailing blanks."""
    lines = [line[1:] if line.startswith(" ") else line for line in text.splitlines()]
    return "\n".join(line.rstrip() for line in lines).strip()


def proto3_optional_fields(message: descriptor.Descriptor) -> frozenset[str]:
    """Names of the message's proto3 ``optional`` fields (whose oneof is synthetic)."""
    proto = descriptor_pb2.DescriptorProto()
    message.CopyToProto(proto)
    return frozenset(field.name for field in proto.field if field.proto3_optional)


class Api:
    """Services and routes of the files protoc asked the plugin to generate."""

    def __init__(
        self,
        request_files: Sequence[descriptor_pb2.FileDescriptorProto],
        generate: Sequence[str],
        http_rules: HttpRuleTable | None = None,
    ):
        """``http_rules``: rules for methods without annotations (vendored protos; see generator.http_rules)."""
        self.http_rules = http_rules
        self.pool = descriptor_pool.DescriptorPool()
        for file in request_files:  # protoc sends dependencies before their dependents
            self.pool.Add(file)
        by_name = {file.name: file for file in request_files}
        missing = [name for name in generate if name not in by_name]
        if missing:
            raise GeneratorError(f"files to generate are not in the request: {missing}")
        self.file_protos = [by_name[name] for name in generate]
        self.files = [self.pool.FindFileByName(name) for name in generate]
        self.comments = Comments(self.file_protos)
        self._options_class = message_factory.GetMessageClass(
            self.pool.FindMessageTypeByName("google.protobuf.MethodOptions")
        )
        self._http_ext = self._extension(HTTP_RULE_EXTENSION)
        self._gateway_ext = self._extension(GATEWAY_RULE_EXTENSION)
        self._methods: dict[str, ApiMethod] = {}

    @cached_property
    def services(self) -> list[descriptor.ServiceDescriptor]:
        """Services of the generated files, in file then declaration order."""
        return [service for file in self.files for service in file.services_by_name.values()]

    @cached_property
    def routes(self) -> list[RouteSpec]:
        """Every binding of every annotated method, validated, in declaration order."""
        routes: list[RouteSpec] = []
        seen: dict[tuple[str, str], str] = {}
        for service in self.services:
            for method_descriptor in service.methods:
                method = self.method(method_descriptor.full_name)
                for index, binding in enumerate(method.bindings):
                    key = (binding.http_method, binding.path.openapi_path())
                    if key in seen:
                        raise GeneratorError(
                            f"{method.full_name}: {binding.http_method} {binding.path.template} "
                            f"is already bound by {seen[key]}"
                        )
                    seen[key] = method.full_name
                    routes.append(self._route(method, binding, index))
        return routes

    def method(self, full_name: str) -> ApiMethod:
        """The method named ``package.Service.Method`` with its decoded options."""
        if full_name not in self._methods:
            service_name, _, method_name = full_name.rpartition(".")
            try:
                service = self.pool.FindServiceByName(service_name)
            except KeyError:
                raise GeneratorError(f"no service {service_name!r} (from {full_name!r})") from None
            method_descriptor = service.methods_by_name.get(method_name)
            if method_descriptor is None:
                raise GeneratorError(f"service {service_name} has no method {method_name!r}")
            self._methods[full_name] = self._read_method(method_descriptor)
        return self._methods[full_name]

    def _extension(self, name: str) -> descriptor.FieldDescriptor | None:
        try:
            return self.pool.FindExtensionByName(name)
        except KeyError:
            # A file set that never imports the option simply has no such annotations.
            return None

    def _read_method(self, method: descriptor.MethodDescriptor) -> ApiMethod:
        proto = descriptor_pb2.MethodDescriptorProto()
        method.CopyToProto(proto)
        options = self._options_class.FromString(proto.options.SerializeToString())
        bindings: list[Binding] = []
        rule, table = None, None
        if self._http_ext is not None and options.HasExtension(self._http_ext):
            rule = options.Extensions[self._http_ext]
        elif self.http_rules is not None and method.full_name in self.http_rules.rules:
            rule, table = self.http_rules.rules[method.full_name], self.http_rules
        if rule is not None:
            bindings.append(self._binding(method, rule, table))
            for extra in rule.additional_bindings:
                if extra.additional_bindings:
                    raise GeneratorError(f"{method.full_name}: additional bindings cannot nest")
                bindings.append(self._binding(method, extra, table))
        gateway = GatewayOptions()
        if self._gateway_ext is not None and options.HasExtension(self._gateway_ext):
            rule = options.Extensions[self._gateway_ext]
            framing, style = _enum_name(rule, "framing"), _enum_name(rule, "error_style")
            access = _enum_name(rule, "access")
            for name, value, known in (
                ("framing", framing, _FRAMINGS),
                ("error_style", style, _ERROR_STYLES),
                ("access", access, _ACCESS),
            ):
                if value not in known:
                    # A newer options proto than this generator: refuse rather than guess.
                    raise GeneratorError(f"{method.full_name}: unknown gateway option value in {name}")
            gateway = GatewayOptions(
                stream_method=rule.stream_method,
                framing=_FRAMINGS[framing],
                error_style=_ERROR_STYLES[style],
                reject_unknown_fields=rule.reject_unknown_fields,
                ignored_fields=tuple(rule.ignored_fields),
                access=_ACCESS[access],
                example=_decode_example(method, rule.example) if rule.example else None,
            )
        return ApiMethod(method, tuple(bindings), gateway)

    def _binding(self, method: descriptor.MethodDescriptor, rule, table: HttpRuleTable | None = None) -> Binding:
        where = method.full_name
        pattern = rule.WhichOneof("pattern")
        if pattern is None:
            raise GeneratorError(f"{where}: google.api.http rule has no pattern")
        if pattern == "custom":
            http_method, template = rule.custom.kind.upper(), rule.custom.path
        else:
            http_method, template = pattern.upper(), getattr(rule, pattern)
        try:
            path = PathTemplate.parse(template)
        except ValueError as exc:
            raise GeneratorError(f"{where}: {exc}") from None
        codec = BodyCodec.PROTO_JSON
        if table is not None:
            try:
                codec = table.codec(template)
            except HttpRulesError as exc:
                raise GeneratorError(f"{where}: {exc}") from None
        if method.client_streaming and codec is not BodyCodec.OIP_GENERATE:
            # The generate extension sends its one request on the stream; nothing else can.
            raise GeneratorError(f"{where}: client-streaming methods cannot be served over HTTP/JSON")
        request = method.input_type
        for variable in path.variables:
            field = resolve_field_path(request, variable.field_path, where)
            if field.is_repeated or field.type not in _SCALAR_TYPES:
                raise GeneratorError(
                    f"{where}: path variable {variable.field_path} must be a singular scalar"
                )
        if rule.body and http_method in ("GET", "DELETE"):
            raise GeneratorError(f"{where}: {http_method} routes cannot have a body")
        if rule.body not in ("", "*"):
            field = request.fields_by_name.get(rule.body)
            if field is None:
                raise GeneratorError(f"{where}: body field {rule.body!r} is not in {request.full_name}")
        if rule.response_body and rule.response_body not in method.output_type.fields_by_name:
            raise GeneratorError(
                f"{where}: response_body {rule.response_body!r} is not in {method.output_type.full_name}"
            )
        return Binding(http_method, path, rule.body, rule.response_body, codec)

    def _route(self, method: ApiMethod, binding: Binding, index: int) -> RouteSpec:
        stream = None
        if method.options.stream_method:
            stream = self._stream_spec(method, binding)
        self._check_ignored_fields(method, binding)
        kserve = binding.codec is not BodyCodec.PROTO_JSON
        return RouteSpec(
            method=method,
            binding=binding,
            binding_index=index,
            framing=method.options.framing,
            error_style=ErrorStyle.KSERVE if kserve else method.options.error_style,
            reject_unknown_fields=method.options.reject_unknown_fields,
            ignored_fields=method.options.ignored_fields,
            stream=stream,
            codec=binding.codec,
        )

    @staticmethod
    def _check_ignored_fields(method: ApiMethod, binding: Binding) -> None:
        where = method.full_name
        ignored = method.options.ignored_fields
        if not ignored:
            return
        if not method.options.reject_unknown_fields:
            raise GeneratorError(f"{where}: ignored_fields only means something with reject_unknown_fields")
        if len(set(ignored)) != len(ignored) or "" in ignored:
            raise GeneratorError(f"{where}: ignored_fields must be distinct, non-empty names")
        body = method.descriptor.input_type
        if binding.body not in ("", "*"):
            body = body.fields_by_name[binding.body].message_type
            if body is None:
                raise GeneratorError(
                    f"{where}: ignored_fields needs a message body; {binding.body!r} is not one"
                )
        elif not binding.body:
            raise GeneratorError(f"{where}: ignored_fields names body fields; this route has no body")
        for name in ignored:
            if name in body.fields_by_name or any(f.json_name == name for f in body.fields):
                raise GeneratorError(
                    f"{where}: ignored field {name!r} is a field of {body.full_name}; only unknown fields are ignored"
                )

    def _stream_spec(self, method: ApiMethod, binding: Binding) -> StreamSpec:
        where = method.full_name
        target = self.method(method.options.stream_method)
        if method.descriptor.server_streaming:
            raise GeneratorError(f"{where}: stream_method is for unary methods; this one already streams")
        if not target.descriptor.server_streaming:
            raise GeneratorError(f"{where}: stream_method {target.full_name} is not server-streaming")
        if binding.body != "*":
            raise GeneratorError(f'{where}: stream_method needs body "*" so the body can say "stream": true')
        flag = method.descriptor.input_type.fields_by_name.get("stream")
        if flag is None or flag.type != flag.TYPE_BOOL or flag.is_repeated:
            raise GeneratorError(f"{where}: stream_method needs a bool field 'stream' in the request")
        wrap_fields = {b.body for b in target.bindings} - {"", "*"}
        if len(wrap_fields) != 1:
            raise GeneratorError(
                f"{where}: stream_method {target.full_name} must have one HTTP body field wrapping the request"
            )
        wrap_field = wrap_fields.pop()
        field = target.descriptor.input_type.fields_by_name[wrap_field]
        if (
            field.message_type is None
            or field.message_type.full_name != method.descriptor.input_type.full_name
        ):
            raise GeneratorError(
                f"{where}: {target.full_name}'s body field {wrap_field!r} is not a "
                f"{method.descriptor.input_type.full_name}"
            )
        response_bodies = {b.response_body for b in target.bindings}
        return StreamSpec(target, wrap_field, response_bodies.pop() if len(response_bodies) == 1 else "")


def _decode_example(method: descriptor.MethodDescriptor, text: str) -> dict[str, Any]:
    """GatewayRule.example as JSON, refused unless it is a request the gateway would accept."""
    where = method.full_name
    try:
        example = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GeneratorError(f"{where}: example is not JSON: {exc}") from None
    if not isinstance(example, dict):
        raise GeneratorError(f"{where}: example must be a JSON object (the request message)")
    request_class = message_factory.GetMessageClass(method.input_type)
    try:
        # Unknown fields refused whatever the route says: an example shows only real fields.
        parse_message(example, request_class, reject_unknown_fields=True)
    except InvalidJson as exc:
        raise GeneratorError(
            f"{where}: example is not a valid {method.input_type.full_name}: {exc}"
        ) from None
    return example


def _enum_name(message, field_name: str) -> str:
    """The enum value name of ``message.<field_name>``, or "" for a number the enum does not define."""
    values = message.DESCRIPTOR.fields_by_name[field_name].enum_type.values_by_number
    value = values.get(getattr(message, field_name))
    return value.name if value is not None else ""


def resolve_field_path(
    message: descriptor.Descriptor, field_path: str, where: str
) -> descriptor.FieldDescriptor:
    """The field a dotted path names, through singular message fields."""
    current = message
    field = None
    for name in field_path.split("."):
        if current is None:
            raise GeneratorError(f"{where}: {field_path!r} goes through a non-message field")
        field = current.fields_by_name.get(name)
        if field is None:
            raise GeneratorError(f"{where}: {current.full_name} has no field {name!r} (in {field_path!r})")
        if field.is_repeated and field.message_type is not None:
            raise GeneratorError(f"{where}: {field_path!r} goes through a repeated field")
        current = field.message_type
    assert field is not None
    return field
