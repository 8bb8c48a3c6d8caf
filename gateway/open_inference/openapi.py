"""The Open Inference Protocol's REST routes in the OpenAPI document, with KServe's own schemas.

Their bodies are not their messages' proto3 JSON (gateway/open_inference/), so the generator leaves
them out; this adds them at serve time from the same route table, with the request and response
schemas KServe's REST spec (and Triton's generate extension) define, written here by hand:
``$inference_request``, ``$request_input``, ``$inference_response``, ``$metadata_model_response``
and the others, under the ``kserve.`` and ``triton.`` prefixes. The liveness and readiness probes
need no key, as on gRPC; the rest takes the key like the native routes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from protoserve.gateway.generator.openapi import KEY_SECURITY
from protoserve.gateway.open_inference.tensor_json import HEADER_LENGTH
from protoserve.gateway.runtime.path_template import Variable
from protoserve.gateway.runtime.route import BodyCodec, Route

TAG = "OpenInferenceProtocol"
# The probes the server answers without a key (server/open_inference/service.py).
_PUBLIC = frozenset(f"/inference.GRPCInferenceService/{m}" for m in ("ServerLive", "ServerReady", "ModelReady"))
_EXAMPLE_MODEL = "SmolLM2-135M-Instruct"
_PATH_EXAMPLES = {"name": _EXAMPLE_MODEL, "model_name": _EXAMPLE_MODEL, "version": "1", "model_version": "1"}
_REF = "#/components/schemas/"

_SCALAR = {"type": ["boolean", "number", "string"]}
_PARAMETERS = {
    "type": "object",
    "description": "Named values, each a boolean, a number or a string.",
    "additionalProperties": _SCALAR,
}
_SHAPE = {"type": "array", "items": {"type": "integer", "minimum": -1}}
_TENSOR_DATA = {
    "type": "array",
    "description": "The tensor's elements in row-major order, flat or nested by its shape: numbers, "
    "booleans (BOOL) or strings (BYTES).",
}


def _tensor(description: str) -> dict[str, Any]:
    """A tensor in a request or a response: KServe's ``$request_input`` and ``$response_output``."""
    return {
        "type": "object",
        "description": description,
        "properties": {
            "name": {"type": "string"},
            "shape": _SHAPE,
            "datatype": {"type": "string"},
            "parameters": {"$ref": _REF + "kserve.Parameters"},
            "data": _TENSOR_DATA,
        },
        "required": ["name", "shape", "datatype"],
    }


_ERROR = {
    "type": "object",
    "description": "An error, as KServe's REST protocol writes it.",
    "properties": {"error": {"type": "string"}},
    "required": ["error"],
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "kserve.Parameters": _PARAMETERS,
    "kserve.Error": _ERROR,
    "kserve.ServerMetadataResponse": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string"},
            "extensions": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name"],
    },
    "kserve.TensorMetadata": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "datatype": {"type": "string"}, "shape": _SHAPE},
        "required": ["name", "datatype", "shape"],
    },
    "kserve.ModelMetadataResponse": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": {"$ref": _REF + "kserve.TensorMetadata"}},
            "outputs": {"type": "array", "items": {"$ref": _REF + "kserve.TensorMetadata"}},
        },
        "required": ["name"],
    },
    "kserve.RequestInput": _tensor("One input tensor: its elements in `data`, or (binary tensor data extension) "
                                   "`parameters.binary_data_size` bytes of the binary part after the JSON."),
    "kserve.RequestOutput": {
        "type": "object",
        "description": "An output asked for; `parameters.binary_data` true answers it as raw bytes.",
        "properties": {"name": {"type": "string"}, "parameters": {"$ref": _REF + "kserve.Parameters"}},
        "required": ["name"],
    },
    "kserve.InferenceRequest": {
        "type": "object",
        "description": "An inference request. Request `parameters` may carry the LLM's sampling keys; "
        "`binary_data_output` true answers every output as raw bytes.",
        "properties": {
            "id": {"type": "string"},
            "parameters": {"$ref": _REF + "kserve.Parameters"},
            "inputs": {"type": "array", "items": {"$ref": _REF + "kserve.RequestInput"}},
            "outputs": {"type": "array", "items": {"$ref": _REF + "kserve.RequestOutput"}},
        },
        "required": ["inputs"],
    },
    "kserve.ResponseOutput": _tensor("One output tensor: its elements in `data`, or `parameters.binary_data_size` "
                                     "bytes of the binary part after the JSON."),
    "kserve.InferenceResponse": {
        "type": "object",
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "parameters": {"$ref": _REF + "kserve.Parameters"},
            "outputs": {"type": "array", "items": {"$ref": _REF + "kserve.ResponseOutput"}},
        },
        "required": ["model_name", "outputs"],
    },
    "triton.GenerateRequest": {
        "type": "object",
        "description": "Triton's generate extension: the LLM's input tensors as JSON values, sampling "
        "keys in `parameters` (or as a JSON object in `sampling_parameters`).",
        "properties": {
            "id": {"type": "string"},
            "text_input": {"type": "string"},
            "sampling_parameters": {"type": ["string", "object"]},
            "stream": {"type": "boolean"},
            "exclude_input_in_output": {"type": "boolean"},
            "parameters": {"$ref": _REF + "kserve.Parameters"},
        },
        "required": ["text_input"],
    },
    "triton.GenerateResponse": {
        "type": "object",
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "text_output": {"type": "string"},
        },
        "required": ["model_name", "text_output"],
    },
}

_INFER_EXAMPLE = {
    "inputs": [
        {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["The capital of France is"]},
        {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES",
         "data": ['{"temperature": 0, "max_tokens": 16}']},
    ]
}
_GENERATE_EXAMPLE = {"text_input": "The capital of France is", "parameters": {"temperature": 0, "max_tokens": 16}}


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF + name}}}


def _parameters(route: Route) -> list[dict[str, Any]]:
    parameters = [
        {"name": s.field_path, "in": "path", "required": True, "schema": {"type": "string"},
         "example": _PATH_EXAMPLES[s.field_path]}
        for s in route.path.segments
        if isinstance(s, Variable)
    ]
    if route.codec is BodyCodec.OIP_INFER:
        parameters.append({
            "name": HEADER_LENGTH, "in": "header", "required": False,
            "schema": {"type": "integer", "minimum": 0},
            "description": "Binary tensor data extension: the byte length of the JSON that starts the body; "
            "the inputs' `binary_data_size` bytes follow it.",
        })
    return parameters


def _request_body(route: Route) -> dict[str, Any] | None:
    if route.codec is BodyCodec.OIP_INFER:
        content = _json("kserve.InferenceRequest")
        content["application/json"]["examples"] = {"request": {"value": _INFER_EXAMPLE}}
        content["application/octet-stream"] = {"schema": {
            "type": "string", "format": "binary",
            "description": f"The JSON request, then its inputs' binary data ({HEADER_LENGTH} says where it starts).",
        }}
        return {"required": True, "content": content}
    if route.codec is BodyCodec.OIP_GENERATE:
        content = _json("triton.GenerateRequest")
        content["application/json"]["examples"] = {"request": {"value": _GENERATE_EXAMPLE}}
        return {"required": True, "content": content}
    return None


def _ok(route: Route) -> dict[str, dict[str, Any]]:
    if route.codec is BodyCodec.OIP_STATUS:
        return {"200": {"description": "Live or ready."}, "400": {"description": "Not live or not ready."}}
    if route.codec is BodyCodec.OIP_METADATA:
        name = "kserve.ModelMetadataResponse" if route.path.segments[-1] != "v2" else "kserve.ServerMetadataResponse"
        return {"200": {"description": "The metadata.", "content": _json(name)}}
    if route.codec is BodyCodec.OIP_INFER:
        content = _json("kserve.InferenceResponse")
        content["application/octet-stream"] = {"schema": {
            "type": "string", "format": "binary",
            "description": f"With binary outputs asked for: the JSON response, then their bytes "
            f"(the {HEADER_LENGTH} response header says where they start).",
        }}
        return {"200": {"description": "The outputs.", "content": content}}
    if route.server_streaming:
        # An event as OpenAPI 3.2 describes SSE: its `data` field JSON of the response (or the error).
        events = {"type": "object", "description": "Server-Sent Events: each `data:` field a "
                  "triton.GenerateResponse with the new text, or `{\"error\": ...}` last if it fails.",
                  "properties": {"data": {"type": "string", "contentMediaType": "application/json", "contentSchema": {
                      "anyOf": [{"$ref": _REF + "triton.GenerateResponse"}, {"$ref": _REF + "kserve.Error"}]}}}}
        return {"200": {"description": "The text as it is generated.", "content": {"text/event-stream": {"schema": events}}}}
    return {"200": {"description": "The generated text.", "content": _json("triton.GenerateResponse")}}


def _operation(route: Route) -> dict[str, Any]:
    method = route.grpc_method.rsplit("/", 1)[-1]
    operation: dict[str, Any] = {
        "operationId": f"OpenInference_{method}_{'_'.join(str(s).strip('{}') for s in route.path.segments)}",
        "tags": [TAG],
        "summary": f"inference.GRPCInferenceService.{method}",
        "security": [] if route.grpc_method in _PUBLIC else [dict(r) for r in KEY_SECURITY],
    }
    parameters = _parameters(route)
    if parameters:
        operation["parameters"] = parameters
    body = _request_body(route)
    if body is not None:
        operation["requestBody"] = body
    operation["responses"] = {**_ok(route), "default": {"description": "An error.", "content": _json("kserve.Error")}}
    return operation


def with_open_inference_routes(document: dict[str, Any], routes: Iterable[Route]) -> dict[str, Any]:
    """A copy of ``document`` with the Open Inference Protocol's routes among ``routes`` added."""
    served = copy.deepcopy(document)
    added = False
    for route in routes:
        if route.codec is BodyCodec.PROTO_JSON:
            continue
        served["paths"].setdefault(route.path.openapi_path(), {})[route.http_method.lower()] = _operation(route)
        added = True
    if added:
        served["components"]["schemas"].update(copy.deepcopy(SCHEMAS))
        served["tags"].append({"name": TAG, "description": "The Open Inference Protocol (KServe v2 REST, "
                               "Triton's generate extension): the gRPC port's inference.GRPCInferenceService."})
    return served
