"""KServe v2 REST bodies <-> ModelInferRequest / ModelInferResponse, with Triton's binary tensor data.

A request body is JSON, optionally followed by raw tensor bytes: ``Inference-Header-Content-Length``
says how long the JSON is, and each input sent that way says its byte count in
``parameters.binary_data_size`` (tritonclient.http sends every input so by default). Inputs go to
gRPC as ``raw_input_contents`` (JSON ``data`` is packed the same way), so the server reads one
form. Outputs come back as JSON ``data``, or as raw bytes after the JSON when the request asks
(``binary_data_output`` for all, ``binary_data`` per output).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from protoserve.gateway.runtime.json_codec import InvalidJson, loads
from protoserve.open_inference import grpc_service_pb2 as oip

_DTYPES = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"), "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
HEADER_LENGTH = "inference-header-content-length"
_DIGITS = re.compile(r"[0-9]{1,18}")  # ASCII digits only: str.isdigit() also takes "²"
_INT64 = (-(2**63), 2**63)
_INTEGER_TYPES = frozenset(("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"))


class TensorBodyError(ValueError):
    """A body the gateway cannot turn into a request; the message names the field or tensor."""


@dataclass(frozen=True, slots=True)
class InferBody:
    request: oip.ModelInferRequest
    binary_outputs: frozenset[str]  # outputs to answer as raw bytes
    all_binary: bool


def parse_infer(body: bytes, header_length: str | None) -> InferBody:
    """The ModelInferRequest of a KServe REST infer body (model name and version come from the path)."""
    json_part, binary = _split(body, header_length)
    document = read_object(json_part)
    unknown = set(document) - {"id", "parameters", "inputs", "outputs"}
    if unknown:
        raise TensorBodyError(f"{sorted(unknown)[0]}: unknown field of an inference request")
    request = oip.ModelInferRequest(id=_string(document.get("id", ""), "id"))
    parameters = mapping(document.get("parameters"), "parameters")
    all_binary = bool(parameters.pop("binary_data_output", False))
    put_parameters(request.parameters, parameters, "parameters")
    inputs = document.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise TensorBodyError("inputs: must be a non-empty list of tensors")
    offset = 0
    for index, spec in enumerate(inputs):
        raw, offset = _input(request, spec, index, binary, offset)
        request.raw_input_contents.append(raw)
    if offset != len(binary):
        raise TensorBodyError(f"the body holds {len(binary) - offset} binary bytes no input claims")
    binary_outputs = set()
    outputs = document.get("outputs") or []
    if not isinstance(outputs, list):
        raise TensorBodyError("outputs: must be a list of outputs")
    for index, spec in enumerate(outputs):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise TensorBodyError(f"outputs[{index}]: must be an object with a name")
        wanted = request.outputs.add(name=spec["name"])
        options = mapping(spec.get("parameters"), f"outputs[{index}].parameters")
        if options.pop("binary_data", False):
            binary_outputs.add(spec["name"])
        put_parameters(wanted.parameters, options, f"outputs[{index}].parameters")
    return InferBody(request, frozenset(binary_outputs), all_binary)


def _split(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    if not _DIGITS.fullmatch(header_length) or int(header_length) > len(body):
        raise TensorBodyError(f"header {HEADER_LENGTH} must be the JSON's byte count, at most the body's")
    length = int(header_length)
    return body[:length], body[length:]


def read_object(text: bytes) -> dict[str, Any]:
    """A body's JSON object (as deep as the gateway reads any JSON, all of its strings text)."""
    try:
        document = loads(text)
    except InvalidJson as exc:
        raise TensorBodyError(f"the body is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise TensorBodyError("the body must be a JSON object")
    try:
        # A \ud800-\udfff escape alone is valid JSON but no text: it cannot be UTF-8 in a message.
        json.dumps(document, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise TensorBodyError("the body holds a lone UTF-16 surrogate escape, which is not text") from None
    return document


def mapping(value: Any, where: str) -> dict[str, Any]:
    """An optional JSON object (parameters): {} when absent or null."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TensorBodyError(f"{where}: must be a JSON object")
    return dict(value)


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise TensorBodyError(f"{where}: must be a string")
    return value


def put_parameters(target, values: dict[str, Any], where: str) -> None:
    """JSON parameter values into a map of InferParameter (bool, int64, double or string)."""
    for key, value in values.items():
        if isinstance(value, bool):
            target[key].bool_param = value
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            target[key].int64_param = value
        elif isinstance(value, float):
            target[key].double_param = value
        elif isinstance(value, str):
            target[key].string_param = value
        elif isinstance(value, dict | list):
            target[key].string_param = json.dumps(value)  # as the generate extension passes JSON values
        else:
            raise TensorBodyError(f"{where}.{key}: must be a boolean, number or string")


def _input(request: oip.ModelInferRequest, spec: Any, index: int, binary: bytes, offset: int) -> tuple[bytes, int]:
    if not isinstance(spec, dict):
        raise TensorBodyError(f"inputs[{index}]: must be an object")
    name = spec.get("name")
    where = name if isinstance(name, str) and name else f"inputs[{index}]"
    datatype, shape = spec.get("datatype"), spec.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise TensorBodyError(f"{where}: needs a name and a datatype")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and _INT64[0] <= d < _INT64[1] for d in shape
    ):
        raise TensorBodyError(f"{where}: shape must be a list of 64-bit integers")
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    options = mapping(spec.get("parameters"), f"{where}.parameters")
    size = options.pop("binary_data_size", None)
    if options:
        raise TensorBodyError(f"{where}: unsupported input parameter {sorted(options)[0]!r}")
    if size is not None:
        if "data" in spec:
            raise TensorBodyError(f"{where}: give data or parameters.binary_data_size, not both")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
            raise TensorBodyError(f"{where}: binary_data_size runs past the body's binary part")
        return binary[offset : offset + size], offset + size
    if "data" not in spec:
        raise TensorBodyError(f"{where}: has no data")
    return _pack(where, datatype, _flatten(spec["data"])), offset


def _flatten(data: Any) -> list[Any]:
    if isinstance(data, list):
        return [item for part in data for item in _flatten(part)]
    return [data]


def _pack(where: str, datatype: str, values: list[Any]) -> bytes:
    """JSON data as the raw buffer the server reads (BYTES: length-prefixed UTF-8)."""
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise TensorBodyError(f"{where}: BYTES data must be strings")
        return b"".join(len(e).to_bytes(4, "little") + e for e in (v.encode() for v in values))
    dtype = _DTYPES.get(datatype)
    if dtype is None:
        # The server names the datatype it does not know; JSON cannot carry one anyway.
        raise TensorBodyError(f"{where}: unknown datatype {datatype!r}")
    kinds = (bool,) if datatype == "BOOL" else (int,) if datatype in _INTEGER_TYPES else (int, float)
    if not all(isinstance(v, kinds) and (datatype == "BOOL" or not isinstance(v, bool)) for v in values):
        what = "booleans" if datatype == "BOOL" else "integers" if datatype in _INTEGER_TYPES else "numbers"
        raise TensorBodyError(f"{where}: {datatype} data must be {what}")
    try:
        return np.array(values, dtype=dtype).tobytes()
    except (OverflowError, ValueError):
        raise TensorBodyError(f"{where}: data does not fit {datatype}") from None


def infer_response_body(response: oip.ModelInferResponse, body: InferBody) -> tuple[bytes, int | None]:
    """The JSON (and binary) answer; the JSON's length when binary data follows it."""
    outputs, tail = [], []
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=False):
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if body.all_binary or tensor.name in body.binary_outputs:
            entry["parameters"] = {"binary_data_size": len(raw)}
            tail.append(raw)
        else:
            entry["data"] = _unpack(tensor.datatype, raw)
        outputs.append(entry)
    document = {"model_name": response.model_name, "model_version": response.model_version, "outputs": outputs}
    if response.id:
        document["id"] = response.id
    text = json.dumps(document, separators=(",", ":")).encode()
    return (text + b"".join(tail), len(text)) if tail else (text, None)


def _unpack(datatype: str, raw: bytes) -> list[Any]:
    if datatype == "BYTES":
        values, offset = [], 0
        while offset < len(raw):
            length = int.from_bytes(raw[offset : offset + 4], "little")
            values.append(raw[offset + 4 : offset + 4 + length].decode("utf-8", "replace"))
            offset += 4 + length
        return values
    return np.frombuffer(raw, dtype=_DTYPES[datatype]).tolist()


def texts_of(response: oip.ModelInferResponse) -> dict[str, Any]:
    """A response's outputs as generate's JSON keys: one element as itself, several as a list."""
    values: dict[str, Any] = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=False):
        data = _unpack(tensor.datatype, raw)
        values[tensor.name] = data[0] if len(data) == 1 else data
    return values
