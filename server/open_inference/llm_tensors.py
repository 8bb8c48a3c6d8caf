"""The LLM's tensors as Triton's vLLM backend defines them, read into a native GenerateRequest.

Inputs: ``text_input`` (BYTES [1], the prompt), and optionally ``stream`` (BOOL [1]: deltas on
ModelStreamInfer), ``sampling_parameters`` (BYTES [1]: a JSON object) and
``exclude_input_in_output`` (BOOL [1]). Output: ``text_output`` (BYTES [1]). The sampling keys are
``protoserve.v1.SamplingParams``' fields (vLLM's names: temperature, top_p, top_k, max_tokens, seed,
stop, ...), read into that message and so through the one sampling mapping the native API uses;
they may also come as request ``parameters`` (what Triton's generate extension sends). Numbers may
be JSON strings, as the vLLM backend's examples send them; ``stop`` may be one string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from protoserve.open_inference import grpc_service_pb2 as oip
from protoserve.server import errors
from protoserve.server.open_inference.tensors import Tensor, TensorSpec, check_tensor, tensor_error, text_of
from protoserve.v1 import inference_pb2 as pb

TEXT_INPUT = TensorSpec("text_input", "BYTES", (1,))
STREAM = TensorSpec("stream", "BOOL", (1,))
SAMPLING_PARAMETERS = TensorSpec("sampling_parameters", "BYTES", (1,))
EXCLUDE_INPUT = TensorSpec("exclude_input_in_output", "BOOL", (1,))
TEXT_OUTPUT = TensorSpec("text_output", "BYTES", (1,))
INPUTS = (TEXT_INPUT, STREAM, SAMPLING_PARAMETERS, EXCLUDE_INPUT)
OUTPUTS = (TEXT_OUTPUT,)

# vLLM's SamplingParams default, which the vLLM backend's users get when they name none.
DEFAULT_MAX_TOKENS = 16
# Fields with no output tensor here: taking them would change nothing the caller can see.
_NOT_SERVED = {
    "logprobs": "no logprobs output tensor is served",
    "top_logprobs": "no logprobs output tensor is served",
    "n": "one text_output per request; send n requests",
}
# Request parameters tritonclient reserves; only the stream's final-response flag means something here.
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
_RESERVED = {
    "sequence_id": "sequence batching is not served",
    "sequence_start": "sequence batching is not served",
    "sequence_end": "sequence batching is not served",
    "priority": "request priorities are not served over this protocol",
    "timeout": "set the gRPC deadline (or x-request-timeout over HTTP) instead",
}


@dataclass(frozen=True, slots=True)
class LlmCall:
    """What one inference request asks of the LLM."""

    request: pb.GenerateRequest
    prompt: str
    stream: bool
    exclude_input: bool
    # Where each sampling key came from ("sampling_parameters" or "parameters"), to name it in errors.
    origins: dict[str, str] = field(default_factory=dict)
    empty_final_response: bool = False

    def field_path(self, native_path: str) -> str:
        """A native GenerateRequest field path as this request spelled it."""
        if native_path == "prompt":
            return TEXT_INPUT.name
        head, _, rest = native_path.partition(".")
        if head == "sampling" and rest:
            key = rest.split(".")[0].split("[")[0]
            return f"{self.origins.get(key, SAMPLING_PARAMETERS.name)}.{rest}"
        return native_path


def read_llm_call(
    model: str, request: oip.ModelInferRequest, inputs: dict[str, Tensor], *, streaming_rpc: bool
) -> LlmCall:
    """The LlmCall of a ModelInferRequest to the LLM; INVALID_ARGUMENT naming the tensor or key at fault."""
    known = {spec.name: spec for spec in INPUTS}
    for name, tensor in inputs.items():
        if name not in known:
            raise tensor_error(name, f"is not an input of {model}; it takes {', '.join(known)}")
        check_tensor(tensor, known[name])
    if TEXT_INPUT.name not in inputs:
        raise tensor_error(TEXT_INPUT.name, "is required (BYTES [1]: the prompt)")
    (prompt,) = text_of(inputs[TEXT_INPUT.name])
    stream = _flag(inputs, STREAM.name)
    exclude = _flag(inputs, EXCLUDE_INPUT.name)
    if stream and not streaming_rpc:
        raise tensor_error(STREAM.name, "true needs ModelStreamInfer (or /generate_stream); ModelInfer answers once")
    if stream and exclude is False:
        # As the vLLM backend: a stream carries only new text.
        raise tensor_error(EXCLUDE_INPUT.name, "false cannot be streamed: deltas carry only new text")
    empty_final = False
    values: dict[str, tuple[str, Any]] = {}
    for key, parameter in request.parameters.items():
        if key == EMPTY_FINAL_RESPONSE:
            if not streaming_rpc:
                raise errors.invalid_argument([(f"parameters.{key}", "only means something on ModelStreamInfer")])
            empty_final = _parameter_value(key, parameter) is True
        elif key in _RESERVED or key.startswith("triton_"):
            raise errors.invalid_argument([(f"parameters.{key}", _RESERVED.get(key, "not supported"))])
        else:
            values[key] = ("parameters", _parameter_value(key, parameter))
    if SAMPLING_PARAMETERS.name in inputs:
        for key, value in _sampling_json(inputs[SAMPLING_PARAMETERS.name]).items():
            if key in values:
                raise errors.invalid_argument(
                    [(f"sampling_parameters.{key}", "is also given as a request parameter; give it once")]
                )
            values[key] = ("sampling_parameters", value)
    sampling = _sampling(values)
    origins = {key: origin for key, (origin, _) in values.items()}
    generate = pb.GenerateRequest(model=model, request_id=request.id, prompt=prompt, sampling=sampling)
    return LlmCall(generate, prompt, bool(stream), exclude if exclude is not None else bool(stream),
                   origins, empty_final)


def _flag(inputs: dict[str, Tensor], name: str) -> bool | None:
    tensor = inputs.get(name)
    return None if tensor is None else bool(tensor.values[0])


def _parameter_value(key: str, parameter: oip.InferParameter) -> Any:
    kind = parameter.WhichOneof("parameter_choice")
    if kind is None:
        raise errors.invalid_argument([(f"parameters.{key}", "has no value")])
    return getattr(parameter, kind)


def _sampling_json(tensor: Tensor) -> dict[str, Any]:
    (text,) = text_of(tensor)
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise tensor_error(tensor.name, f"is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise tensor_error(tensor.name, "must be a JSON object of sampling parameters")
    return value


def _sampling(values: dict[str, tuple[str, Any]]) -> pb.SamplingParams:
    """The SamplingParams message of the keys given; every unknown or unusable key is named."""
    message = pb.SamplingParams()
    fields = message.DESCRIPTOR.fields_by_name
    violations: list[tuple[str, str]] = []
    for key, (origin, value) in values.items():
        path = f"{origin}.{key}"
        if key in _NOT_SERVED:
            violations.append((path, _NOT_SERVED[key]))
            continue
        if key not in fields:
            violations.append((path, "unknown sampling parameter"))
            continue
        if key == "stop" and isinstance(value, str):
            value = [value]
        try:
            json_format.ParseDict({key: value}, message)
        except json_format.ParseError as exc:
            violations.append((path, f"invalid value {errors.echo(json.dumps(value))}: {exc}"))
    if violations:
        raise errors.invalid_argument(violations)
    if not message.HasField("max_tokens"):
        message.max_tokens = DEFAULT_MAX_TOKENS
    return message
