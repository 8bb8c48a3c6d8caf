"""Server reflection answers a client that speaks only grpc.reflection.v1, not just v1alpha.

The client's messages are compiled here from the v1 spec's field numbers (the parts it uses),
into a private descriptor pool, independent of how the server builds its v1 service.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_tools import protoc

V1_CLIENT_PROTO = """
syntax = "proto3";
package grpc.reflection.v1;

message ServerReflectionRequest {
  string host = 1;
  oneof message_request {
    string file_by_filename = 3;
    string file_containing_symbol = 4;
    string list_services = 7;
  }
}
message FileDescriptorResponse { repeated bytes file_descriptor_proto = 1; }
message ServiceResponse { string name = 1; }
message ListServiceResponse { repeated ServiceResponse service = 1; }
message ErrorResponse { int32 error_code = 1; string error_message = 2; }
message ServerReflectionResponse {
  string valid_host = 1;
  ServerReflectionRequest original_request = 2;
  oneof message_response {
    FileDescriptorResponse file_descriptor_response = 4;
    ListServiceResponse list_services_response = 6;
    ErrorResponse error_response = 7;
  }
}
"""
METHOD = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"


@pytest.fixture(scope="module")
def v1(tmp_path_factory: pytest.TempPathFactory):
    """(request class, response class) of grpc.reflection.v1, compiled by protoc."""
    root = tmp_path_factory.mktemp("reflection-v1")
    (root / "v1_client.proto").write_text(V1_CLIENT_PROTO)
    out = root / "v1_client.binpb"
    assert protoc.main(["protoc", f"-I{root}", f"--descriptor_set_out={out}", "v1_client.proto"]) == 0
    pool = descriptor_pool.DescriptorPool()
    for file in descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file:
        pool.Add(file)
    return tuple(
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.reflection.v1.{name}"))
        for name in ("ServerReflectionRequest", "ServerReflectionResponse")
    )


def ask(live_server, v1, **request):
    request_cls, response_cls = v1
    with live_server.sync_channel() as channel:
        call = channel.stream_stream(
            METHOD, request_serializer=request_cls.SerializeToString, response_deserializer=response_cls.FromString
        )
        [reply] = list(call(iter([request_cls(**request)]), timeout=30))
    return reply


def test_v1_lists_every_service(live_server, v1):
    reply = ask(live_server, v1, list_services="")
    assert reply.WhichOneof("message_response") == "list_services_response"
    names = {s.name for s in reply.list_services_response.service}
    assert {
        "protoserve.v1.InferenceService",
        "protoserve.openai.v1.OpenAIService",
        "protoserve.v1.MetricsService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    assert reply.original_request.list_services == ""


@pytest.mark.parametrize(
    ("symbol", "package"),
    [
        ("protoserve.v1.InferenceService", "protoserve.v1"),
        ("protoserve.openai.v1.OpenAIService", "protoserve.openai.v1"),
        ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1"),  # it describes itself
    ],
)
def test_v1_describes_a_service_with_its_methods(live_server, v1, symbol: str, package: str):
    reply = ask(live_server, v1, file_containing_symbol=symbol)
    assert reply.WhichOneof("message_response") == "file_descriptor_response"
    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in reply.file_descriptor_response.file_descriptor_proto]
    [owner] = [f for f in files if any(f"{f.package}.{s.name}" == symbol for s in f.service)]
    assert owner.package == package
    [service] = [s for s in owner.service if f"{package}.{s.name}" == symbol]
    assert service.method


def test_v1_reports_an_unknown_symbol_as_not_found(live_server, v1):
    reply = ask(live_server, v1, file_containing_symbol="no.such.Service")
    assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_v1_reflection_of_the_v1_service_matches_v1alpha_field_by_field(live_server, v1):
    """Served v1 messages carry v1alpha's field numbers and types: the two are one wire format."""
    reply = ask(live_server, v1, file_containing_symbol="grpc.reflection.v1.ServerReflectionRequest")
    [served] = [
        f
        for f in map(descriptor_pb2.FileDescriptorProto.FromString, reply.file_descriptor_response.file_descriptor_proto)
        if f.package == "grpc.reflection.v1"
    ]
    from grpc_reflection.v1alpha import reflection_pb2

    alpha = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(alpha)

    def shape(file: descriptor_pb2.FileDescriptorProto) -> dict[str, list[tuple[str, int, int]]]:
        return {m.name: [(f.name, f.number, f.type) for f in m.field] for m in file.message_type}

    assert shape(served) == shape(alpha)
    assert Path(served.name) == Path("grpc/reflection/v1/reflection.proto")
