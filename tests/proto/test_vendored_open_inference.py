"""The vendored Open Inference Protocol protos stay upstream's, and load beside tritonclient's copy."""

from __future__ import annotations

import hashlib
from pathlib import Path

from protoserve.open_inference import grpc_service_pb2, model_config_pb2

VENDORED = Path(__file__).resolve().parents[2] / "proto" / "vendor" / "triton"
# triton-inference-server/common protobuf/ at 83adf7cf88a2f343005974dff3728be746de2d66 (README there).
UPSTREAM_SHA256 = {
    "grpc_service.proto": "a2cca0548e8b647f35c2d7d4aaee24d711fa786150dd5e2437c6830843301462",
    "model_config.proto": "eb72c7ee93dc0eb6aa4393ff186ca0dd0898f0e138b0cd04eb0624a1a592f5f1",
}


def test_vendored_files_are_upstreams_unmodified():
    found = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in VENDORED.glob("*.proto")}
    assert found == UPSTREAM_SHA256


def test_descriptors_are_the_ones_tritonclient_ships():
    # Importing both defines each file twice in the default pool: protobuf takes that only when they are
    # the same file byte for byte, and then both modules share one descriptor.
    from tritonclient.grpc import model_config_pb2 as their_config
    from tritonclient.grpc import service_pb2 as their_service

    assert grpc_service_pb2.DESCRIPTOR.serialized_pb == their_service.DESCRIPTOR.serialized_pb
    assert model_config_pb2.DESCRIPTOR.serialized_pb == their_config.DESCRIPTOR.serialized_pb
    assert grpc_service_pb2.DESCRIPTOR.name == "grpc_service.proto"
    assert "ModelStreamInfer" in grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name
