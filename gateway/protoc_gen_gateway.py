"""protoc plugin: generates the REST/JSON gateway's route table and OpenAPI document.

``gateway/codegen.py`` runs it from protoc (``make proto`` and wheel builds)::

    python -m grpc_tools.protoc ... --plugin=protoc-gen-gateway=<launcher of this module> \\
        --gateway_out=gen/python --gateway_opt=title=protoserve,version=v1 <protos>

It reads a CodeGeneratorRequest on stdin and writes a CodeGeneratorResponse
with two files, relative to the ``--gateway_out`` directory:
``protoserve/generated/routes.py`` (option ``routes``) and
``protoserve/generated/openapi.json`` (option ``openapi``). Problems with the annotations are
reported through the response's ``error`` so protoc prints them and fails.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from google.protobuf.compiler import plugin_pb2

from protoserve.gateway.generator.api import Api, GeneratorError
from protoserve.gateway.generator.http_rules import HttpRulesError, load_http_rules
from protoserve.gateway.generator.openapi import render_openapi
from protoserve.gateway.generator.routes_module import render_routes_module

DEFAULT_PARAMETERS = {
    "routes": "protoserve/generated/routes.py",
    "openapi": "protoserve/generated/openapi.json",
    "title": "protoserve",
    "version": "v1",
    # A google.api.Service YAML of HTTP rules for methods without annotations (vendored protos), and
    # the Python package their modules are generated into ("": none).
    "http_rules": "",
    "vendored_package": "",
}


def parse_parameters(parameter: str) -> dict[str, str]:
    """``key=value,key=value`` plugin options over the defaults; unknown keys are an error."""
    values = dict(DEFAULT_PARAMETERS)
    for item in filter(None, (part.strip() for part in parameter.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULT_PARAMETERS:
            raise GeneratorError(f"unknown plugin option {item!r}; known: {sorted(DEFAULT_PARAMETERS)}")
        values[key] = value
    return values


def generate(request: plugin_pb2.CodeGeneratorRequest) -> plugin_pb2.CodeGeneratorResponse:
    """The response for one request: the generated files, or an error message."""
    response = plugin_pb2.CodeGeneratorResponse(
        supported_features=plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL
    )
    try:
        options = parse_parameters(request.parameter)
        rules = load_http_rules(Path(options["http_rules"])) if options["http_rules"] else None
        api = Api(request.proto_file, request.file_to_generate, rules)
        outputs: Mapping[str, str] = {
            options["routes"]: render_routes_module(api, options["vendored_package"]),
            options["openapi"]: render_openapi(api, options["title"], options["version"]),
        }
    except (GeneratorError, HttpRulesError) as exc:
        response.error = str(exc)
        return response
    for name, content in outputs.items():
        response.file.add(name=name, content=content)
    return response


def main() -> None:
    """Plugin entry point: CodeGeneratorRequest on stdin, CodeGeneratorResponse on stdout."""
    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    sys.stdout.buffer.write(generate(request).SerializeToString())


if __name__ == "__main__":
    main()
