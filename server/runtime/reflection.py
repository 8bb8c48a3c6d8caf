"""gRPC server reflection under both names tools ask for: grpc.reflection.v1 and v1alpha.

grpcio-reflection (through 1.85) implements only ``grpc.reflection.v1alpha``, so a tool that
speaks only ``grpc.reflection.v1`` would get UNIMPLEMENTED. The v1 proto is the v1alpha proto
under another package: the same messages with the same field numbers. So one servicer, over
the same descriptor pool, answers both; v1's own descriptor (v1alpha's, renamed) joins the pool
so reflection also describes the v1 service it is reached through.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import grpc
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_PACKAGE = reflection_pb2.DESCRIPTOR.package  # grpc.reflection.v1alpha
V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
SERVICE_NAMES = (V1_SERVICE_NAME, reflection.SERVICE_NAME)


def _renamed(type_name: str) -> str:
    old = f".{V1ALPHA_PACKAGE}."
    return f".{V1_PACKAGE}." + type_name[len(old) :] if type_name.startswith(old) else type_name


@functools.cache
def v1_file_descriptor() -> descriptor.FileDescriptor:
    """The grpc.reflection.v1 file in the default pool: v1alpha's messages under v1's package."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)  # already there, e.g. from a library that ships it
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")  # v1alpha's java/go package names are not v1's
    for message in proto.message_type:
        for f in message.field:
            if f.HasField("type_name"):  # descriptor.proto is proto2: assigning "" would set it
                f.type_name = _renamed(f.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type, method.output_type = _renamed(method.input_type), _renamed(method.output_type)
    return pool.AddSerializedFile(proto.SerializeToString())


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection of ``service_names`` (and of itself) as v1 and as v1alpha on ``server``."""
    v1_file_descriptor()
    servicer = reflection.aio.ReflectionServicer((*service_names, *SERVICE_NAMES))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    # v1's messages are v1alpha's byte for byte, so v1alpha's (de)serializers carry them.
    v1 = grpc.method_handlers_generic_handler(
        V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))
