"""Serves the Open Inference Protocol's REST routes (route.codec other than PROTO_JSON) over gRPC.

The route table (from proto/vendor/triton/http_rules.yaml) says which gRPC method a path calls;
this module reads and writes the bodies KServe's REST API and Triton's generate extension use:
health and readiness as bare status codes (200, else 400), metadata with integer shapes, tensors as
JSON or binary data (tensor_json), and generate's flat JSON, streamed as SSE by ModelStreamInfer.
Errors are ``{"error": "<message>"}`` with the status the gRPC code maps to; a request
ModelStreamInfer refuses in its stream has no code there, so it is a 400.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

import grpc
from google.protobuf import json_format
from google.rpc import code_pb2

from protoserve.gateway.open_inference.tensor_json import (
    HEADER_LENGTH,
    TensorBodyError,
    infer_response_body,
    mapping,
    parse_infer,
    put_parameters,
    read_object,
    texts_of,
)
from protoserve.gateway.runtime.errors import HttpError, from_rpc_error, gateway_error
from protoserve.gateway.runtime.route import BodyCodec, ErrorStyle, Route
from protoserve.open_inference import grpc_service_pb2 as oip

if TYPE_CHECKING:
    from protoserve.gateway.runtime.handler import GatewayHandler, Receive, Scope, Send

# Generate's JSON keys that are LLM input tensors, and their datatypes (the rest of the body is refused).
_GENERATE_TENSORS = {"text_input": "BYTES", "stream": "BOOL", "sampling_parameters": "BYTES",
                     "exclude_input_in_output": "BOOL"}


def _bad(message: str) -> HttpError:
    return gateway_error(code_pb2.INVALID_ARGUMENT, message)


class OpenInferenceRoutes:
    """The bodies of the /v2 routes, on the gateway's channel, metadata and limits."""

    def __init__(self, gateway: GatewayHandler) -> None:
        self.gateway = gateway

    async def serve(self, route: Route, path_values: dict[str, str], scope: Scope, receive: Receive,
                    send: Send) -> None:
        """Answer one request; raises HttpError before anything is sent."""
        if scope.get("query_string"):  # KServe's REST routes take no query parameters: none is ignored
            names = sorted({name for name, _ in parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)})
            raise _bad(f"{', '.join(names) or 'query'}: unknown query parameter; the Open Inference Protocol's "
                       "routes take none")
        metadata = self.gateway.call_metadata(scope)
        timeout = self.gateway.call_timeout(scope)
        request = route.request_type(**path_values)
        body = await self.gateway.read_body(scope, receive) if route.body else b""
        try:
            if route.codec is BodyCodec.OIP_INFER:
                await self._infer(route, request, body, scope, metadata, timeout, send)
                return
            if route.codec is BodyCodec.OIP_GENERATE:
                self._generate_request(request, body, streaming=route.grpc_method.endswith("ModelStreamInfer"))
                if route.grpc_method.endswith("ModelStreamInfer"):
                    await self._generate_stream(route, request, metadata, timeout, send)
                    return
            response = await self._unary(route, request, metadata, timeout)
        except TensorBodyError as exc:
            raise _bad(str(exc)) from None
        if route.codec is BodyCodec.OIP_STATUS:
            ready = any(value is True for _, value in response.ListFields())
            await _send(send, 200 if ready else 400, b"", "text/plain")
        elif route.codec is BodyCodec.OIP_METADATA:
            await _send_json(send, 200, _metadata_json(response))
        else:  # generate
            await _send_json(send, 200, _generate_json(response))

    async def _unary(self, route: Route, request, metadata, timeout):
        try:
            return await self.gateway.channel.unary_unary(route.grpc_method, route.response_type)(
                request, metadata=metadata, timeout=timeout
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def _infer(self, route, request, body: bytes, scope, metadata, timeout, send: Send) -> None:
        length = next((v.decode("latin-1") for k, v in scope["headers"] if k == HEADER_LENGTH.encode()), None)
        parsed = parse_infer(body, length)
        parsed.request.model_name, parsed.request.model_version = request.model_name, request.model_version
        response = await self._unary(route, parsed.request, metadata, timeout)
        payload, json_length = infer_response_body(response, parsed)
        headers = [] if json_length is None else [(HEADER_LENGTH.encode(), str(json_length).encode())]
        kind = "application/json" if json_length is None else "application/octet-stream"
        await _send(send, 200, payload, kind, headers)

    @staticmethod
    def _generate_request(request: oip.ModelInferRequest, body: bytes, *, streaming: bool) -> None:
        document = read_object(body or b"{}")
        parameters = mapping(document.pop("parameters", None), "parameters")
        request_id = document.pop("id", "")
        if not isinstance(request_id, str):
            raise TensorBodyError("id: must be a string")
        request.id = request_id
        # Triton's vLLM examples put stream (and exclude_input_in_output) in parameters: tensors all the same.
        for key in ("stream", "exclude_input_in_output"):
            if key in parameters and key not in document:
                document[key] = parameters.pop(key)
        if streaming:
            document.setdefault("stream", True)
        for key, value in document.items():
            datatype = _GENERATE_TENSORS.get(key)
            if datatype is None:
                raise TensorBodyError(f"{key}: not an input of the generate extension; "
                                      f"it takes {', '.join(_GENERATE_TENSORS)} and parameters")
            if datatype == "BOOL":
                if not isinstance(value, bool):
                    raise TensorBodyError(f"{key}: must be true or false")
                raw = bytes([value])
            else:
                text = value if isinstance(value, str) else json.dumps(value)
                raw = len(text.encode()).to_bytes(4, "little") + text.encode()
            request.inputs.add(name=key, datatype=datatype, shape=[1])
            request.raw_input_contents.append(raw)
        put_parameters(request.parameters, parameters, "parameters")

    async def _generate_stream(self, route: Route, request, metadata, timeout, send: Send) -> None:
        call = self.gateway.channel.channel.stream_stream(
            route.grpc_method, request_serializer=oip.ModelInferRequest.SerializeToString,
            response_deserializer=oip.ModelStreamInferResponse.FromString,
        )(iter([request]), metadata=metadata, timeout=timeout)
        started = False
        try:
            async for message in call:
                if message.error_message:
                    if not started:
                        raise _bad(message.error_message)
                    await send({"type": "http.response.body", "body": _event({"error": message.error_message}),
                                "more_body": True})
                    break
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]})
                    started = True
                response = message.infer_response
                if response.outputs:
                    await send({"type": "http.response.body", "body": _event(_generate_json(response)),
                                "more_body": True})
                if response.parameters["triton_final_response"].bool_param:
                    break
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
            if not started:
                raise error from None
            await send({"type": "http.response.body", "body": _event(error.body(ErrorStyle.KSERVE)),
                        "more_body": True})
        finally:
            call.cancel()
        await send({"type": "http.response.body", "body": b""})


def _metadata_json(response) -> dict[str, Any]:
    document = json_format.MessageToDict(response, preserving_proto_field_name=True)
    for key in ("inputs", "outputs"):
        for tensor in document.get(key, []):
            tensor["shape"] = [int(d) for d in tensor.get("shape", [])]  # proto3 JSON writes int64 as strings
    return document


def _generate_json(response: oip.ModelInferResponse) -> dict[str, Any]:
    document: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        document["id"] = response.id
    document.update(texts_of(response))
    return document


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _send(send: Send, status: int, body: bytes, kind: str, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", kind.encode()), (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send: Send, status: int, payload: Any) -> None:
    await _send(send, status, json.dumps(payload, separators=(",", ":")).encode(), "application/json")
