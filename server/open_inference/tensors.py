"""Open Inference Protocol tensors: a ModelInferRequest's inputs decoded and checked, outputs encoded.

A tensor's data comes either in its ``contents`` (typed repeated fields) or, for every input at
once, in the request's ``raw_input_contents`` (one little-endian buffer per input, in input order;
what tritonclient always sends). BYTES elements in a raw buffer are each a 4-byte little-endian
length and that many bytes. Every problem is INVALID_ARGUMENT naming the tensor, so a client sees
which of its inputs the server refused and why.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from protoserve.open_inference import grpc_service_pb2 as oip
from protoserve.server import errors

# Datatype -> (the InferTensorContents field holding it, its numpy dtype; None for BYTES).
DATATYPES: dict[str, tuple[str, np.dtype | None]] = {
    "BOOL": ("bool_contents", np.dtype(np.bool_)),
    "UINT8": ("uint_contents", np.dtype("<u1")),
    "UINT16": ("uint_contents", np.dtype("<u2")),
    "UINT32": ("uint_contents", np.dtype("<u4")),
    "UINT64": ("uint64_contents", np.dtype("<u8")),
    "INT8": ("int_contents", np.dtype("<i1")),
    "INT16": ("int_contents", np.dtype("<i2")),
    "INT32": ("int_contents", np.dtype("<i4")),
    "INT64": ("int64_contents", np.dtype("<i8")),
    "FP32": ("fp32_contents", np.dtype("<f4")),
    "FP64": ("fp64_contents", np.dtype("<f8")),
    "BYTES": ("bytes_contents", None),
}
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor a model takes or gives, as ModelMetadata describes it (-1: any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_proto(self) -> oip.ModelMetadataResponse.TensorMetadata:
        return oip.ModelMetadataResponse.TensorMetadata(name=self.name, datatype=self.datatype, shape=self.shape)


@dataclass(frozen=True, slots=True)
class Tensor:
    """A decoded input: its declared datatype and shape and its elements, flat (bytes for BYTES)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    values: list[Any]


def tensor_error(name: str, problem: str) -> errors.ServiceError:
    return errors.invalid_argument([(name, problem)])


def decode_inputs(request: oip.ModelInferRequest) -> dict[str, Tensor]:
    """Every input of ``request`` by name, its data checked against its datatype and shape."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise errors.invalid_argument([(
            "raw_input_contents",
            f"holds {len(raw)} buffers for {len(request.inputs)} inputs; give one per input, in input order",
        )])
    tensors: dict[str, Tensor] = {}
    for index, spec in enumerate(request.inputs):
        name = spec.name or f"inputs[{index}]"
        if not spec.name:
            raise tensor_error(name, "has no name")
        if name in tensors:
            raise tensor_error(name, "is given more than once")
        if spec.parameters:
            raise tensor_error(name, f"input parameters are not supported (got {', '.join(sorted(spec.parameters))})")
        if spec.datatype not in DATATYPES:
            raise tensor_error(name, f"unknown datatype {errors.echo(spec.datatype)}; known: {', '.join(DATATYPES)}")
        shape = tuple(spec.shape)
        if any(dim < 0 for dim in shape):
            raise tensor_error(name, f"shape {list(shape)} has a negative dimension")
        count = math.prod(shape)
        has_contents = spec.HasField("contents")
        if raw and has_contents:
            raise tensor_error(name, "has contents while the request sends raw_input_contents; use one or the other")
        values = _from_raw(name, spec.datatype, raw[index], count) if raw else _from_contents(spec, count)
        tensors[name] = Tensor(name, spec.datatype, shape, values)
    return tensors


def _from_contents(spec: oip.ModelInferRequest.InferInputTensor, count: int) -> list[Any]:
    field, _ = DATATYPES[spec.datatype]
    values = list(getattr(spec.contents, field))
    others = [f.name for f, _ in spec.contents.ListFields() if f.name != field]
    if others:
        raise tensor_error(spec.name, f"datatype {spec.datatype} takes its data in contents.{field}, not {others[0]}")
    if len(values) != count:
        raise tensor_error(spec.name, f"shape {list(spec.shape)} holds {count} elements, contents.{field} {len(values)}")
    return values


def _from_raw(name: str, datatype: str, buffer: bytes, count: int) -> list[Any]:
    _, dtype = DATATYPES[datatype]
    if dtype is None:
        values = split_bytes(name, buffer)
        if len(values) != count:
            raise tensor_error(name, f"shape holds {count} elements, its raw BYTES buffer {len(values)}")
        return values
    if len(buffer) != count * dtype.itemsize:
        raise tensor_error(
            name, f"shape holds {count} {datatype} elements ({count * dtype.itemsize} bytes), its raw buffer {len(buffer)}"
        )
    return np.frombuffer(buffer, dtype=dtype).tolist()


def split_bytes(name: str, buffer: bytes) -> list[bytes]:
    """A raw BYTES buffer's elements (4-byte little-endian length, then the bytes, each)."""
    values, offset = [], 0
    while offset < len(buffer):
        if offset + _LENGTH.size > len(buffer):
            raise tensor_error(name, "raw BYTES buffer ends inside an element's 4-byte length")
        (length,) = _LENGTH.unpack_from(buffer, offset)
        offset += _LENGTH.size
        if offset + length > len(buffer):
            raise tensor_error(name, f"raw BYTES element of {length} bytes runs past the buffer's end")
        values.append(bytes(buffer[offset : offset + length]))
        offset += length
    return values


def join_bytes(values: Sequence[bytes]) -> bytes:
    """The raw buffer of BYTES elements (split_bytes' inverse)."""
    return b"".join(_LENGTH.pack(len(v)) + v for v in values)


def check_tensor(tensor: Tensor, spec: TensorSpec) -> None:
    """INVALID_ARGUMENT naming the tensor when its datatype or shape is not the model's."""
    if tensor.datatype != spec.datatype:
        raise tensor_error(tensor.name, f"datatype must be {spec.datatype}, got {tensor.datatype}")
    fits = len(tensor.shape) == len(spec.shape) and all(
        want in (-1, got) for want, got in zip(spec.shape, tensor.shape, strict=True)
    )
    if not fits:
        raise tensor_error(tensor.name, f"shape must be {list(spec.shape)}, got {list(tensor.shape)}")


def text_of(tensor: Tensor) -> list[str]:
    """A BYTES tensor's elements as UTF-8 text."""
    try:
        return [value.decode("utf-8") for value in tensor.values]
    except UnicodeDecodeError:
        raise tensor_error(tensor.name, "elements must be UTF-8 text") from None


def bytes_output(name: str, texts: Sequence[str]) -> tuple[oip.ModelInferResponse.InferOutputTensor, bytes]:
    """A BYTES output of ``texts`` (shape [len]) and its raw buffer, as Triton answers."""
    tensor = oip.ModelInferResponse.InferOutputTensor(name=name, datatype="BYTES", shape=[len(texts)])
    return tensor, join_bytes([t.encode("utf-8") for t in texts])


def fp32_output(name: str, array: np.ndarray) -> tuple[oip.ModelInferResponse.InferOutputTensor, bytes]:
    """An FP32 output of ``array`` and its raw little-endian buffer."""
    data = np.ascontiguousarray(array, dtype="<f4")
    tensor = oip.ModelInferResponse.InferOutputTensor(name=name, datatype="FP32", shape=list(data.shape))
    return tensor, data.tobytes()
