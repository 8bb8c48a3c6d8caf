"""Open Inference Protocol tensor decoding: every malformed input is INVALID_ARGUMENT naming the tensor."""

from __future__ import annotations

import struct

import grpc
import pytest

from protoserve.open_inference import grpc_service_pb2 as oip
from protoserve.server import errors
from protoserve.server.open_inference.llm_tensors import read_llm_call
from protoserve.server.open_inference.tensors import decode_inputs, join_bytes, split_bytes


def request(*inputs: oip.ModelInferRequest.InferInputTensor, raw: list[bytes] | None = None) -> oip.ModelInferRequest:
    return oip.ModelInferRequest(model_name="m", inputs=inputs, raw_input_contents=raw or [])


def tensor(name: str, datatype: str, shape: list[int], **contents) -> oip.ModelInferRequest.InferInputTensor:
    spec = oip.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape)
    if contents:
        spec.contents.CopyFrom(oip.InferTensorContents(**contents))
    return spec


def refused(message: oip.ModelInferRequest) -> str:
    with pytest.raises(errors.ServiceError) as caught:
        read_llm_call("m", message, decode_inputs(message), streaming_rpc=False)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value.message


def test_bytes_round_trip():
    values = [b"", b"hello", "é".encode()]
    assert split_bytes("t", join_bytes(values)) == values


@pytest.mark.parametrize(
    ("message", "named"),
    [
        (request(tensor("text_input", "BYTES", [1]), raw=[struct.pack("<I", 9) + b"abc"]), "runs past"),
        (request(tensor("text_input", "BYTES", [1]), raw=[b"\x01\x00"]), "4-byte length"),
        (request(tensor("text_input", "BYTES", [1]), raw=[join_bytes([b"a", b"b"])]), "holds 1 elements"),
        (request(tensor("text_input", "BYTES", [1]), raw=[b"", b""]), "raw_input_contents"),
        (request(tensor("text_input", "BYTES", [1], bytes_contents=[b"a", b"b"])), "holds 1 elements"),
        (request(tensor("text_input", "BYTES", [1], fp32_contents=[1.0])), "contents.bytes_contents"),
        (request(tensor("text_input", "BYTES", [1], bytes_contents=[b"\xff"])), "UTF-8"),
        (request(tensor("text_input", "STRING", [1])), "unknown datatype"),
        (request(tensor("text_input", "BYTES", [-1])), "negative"),
        (request(tensor("stream", "BOOL", [1], bool_contents=[True])), "text_input: is required"),
        (request(tensor("text_input", "BYTES", [1], bytes_contents=[b"a"]),
                 tensor("text_input", "BYTES", [1], bytes_contents=[b"a"])), "more than once"),
        (request(tensor("stream", "BOOL", [1]), tensor("text_input", "BYTES", [1]),
                 raw=[b"\x01\x00", join_bytes([b"a"])]), "stream: shape holds 1 BOOL elements"),
    ],
)
def test_malformed_inputs_name_the_tensor(message, named):
    assert named in refused(message)


def test_sampling_json_must_be_an_object():
    message = request(tensor("text_input", "BYTES", [1], bytes_contents=[b"hi"]),
                      tensor("sampling_parameters", "BYTES", [1], bytes_contents=[b"[1]"]))
    assert "sampling_parameters: must be a JSON object" in refused(message)


def test_reserved_parameters_are_refused_by_name():
    message = request(tensor("text_input", "BYTES", [1], bytes_contents=[b"hi"]))
    message.parameters["sequence_id"].int64_param = 3
    assert "parameters.sequence_id" in refused(message)


def test_numbers_as_strings_and_one_stop_string_are_read_as_the_vllm_backend_does():
    message = request(tensor("text_input", "BYTES", [1], bytes_contents=[b"hi"]),
                      tensor("sampling_parameters", "BYTES", [1],
                             bytes_contents=[b'{"temperature": "0.5", "max_tokens": "4", "stop": "."}']))
    call = read_llm_call("m", message, decode_inputs(message), streaming_rpc=False)
    sampling = call.request.sampling
    assert (sampling.temperature, sampling.max_tokens, list(sampling.stop)) == (0.5, 4, ["."])
    assert call.prompt == "hi" and not call.exclude_input and not call.stream
