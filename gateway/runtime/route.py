"""The route table entry the generator emits and the runtime serves."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from google.protobuf.message import Message

from protoserve.gateway.runtime.path_template import PathTemplate


class Framing(enum.StrEnum):
    """How a server stream is written on the HTTP side (GatewayRule.framing)."""

    SSE = "sse"
    SSE_EVENTS = "sse_events"  # `event: <type>` per message, no [DONE] (OpenAI Responses, Anthropic)
    NDJSON = "ndjson"


class ErrorStyle(enum.StrEnum):
    """Which JSON body a failed call answers with (GatewayRule.error_style)."""

    GOOGLE_RPC_STATUS = "google_rpc_status"
    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    KSERVE = "kserve"  # {"error": "<message>"}: the Open Inference Protocol's REST errors


class BodyCodec(enum.StrEnum):
    """How a route's HTTP body maps to its messages: proto3 JSON, or one of the Open Inference
    Protocol's REST forms (gateway/open_inference/), whose bodies are not its messages' JSON."""

    PROTO_JSON = "proto_json"
    OIP_STATUS = "oip_status"  # no body; 200 when the answer's one bool is true, else 400
    OIP_METADATA = "oip_metadata"  # JSON with integer shapes
    OIP_INFER = "oip_infer"  # tensors as JSON data or the binary tensor data extension
    OIP_GENERATE = "oip_generate"  # Triton's generate extension (SSE when the method streams)


@dataclass(frozen=True, slots=True)
class StreamTarget:
    """The server-streaming method that serves a route whose body says ``"stream": true``.

    Its request is built by putting the route's own request message into
    ``wrap_field`` (the streaming method's ``body`` field).
    """

    grpc_method: str
    request_type: type[Message]
    response_type: type[Message]
    wrap_field: str
    response_body: str = ""


@dataclass(frozen=True, slots=True)
class Route:
    """One HTTP binding of one gRPC method, as described by its google.api.http rule.

    ``body`` is "" (no body: every unbound field comes from the query string),
    "*" (the whole request, minus path variables) or a top-level field name.
    ``response_body`` names the response field written as the HTTP body ("" for
    the whole response).
    """

    http_method: str
    path: PathTemplate
    grpc_method: str
    request_type: type[Message]
    response_type: type[Message]
    server_streaming: bool = False
    body: str = ""
    response_body: str = ""
    framing: Framing = Framing.SSE
    error_style: ErrorStyle = ErrorStyle.GOOGLE_RPC_STATUS
    reject_unknown_fields: bool = False
    # Unknown top-level body fields accepted and dropped despite reject_unknown_fields.
    ignored_fields: tuple[str, ...] = ()
    stream: StreamTarget | None = None
    codec: BodyCodec = BodyCodec.PROTO_JSON
