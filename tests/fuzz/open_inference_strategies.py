"""Hypothesis strategies for Open Inference Protocol requests: tensors a client might get wrong.

``infer_requests(llms, embedders)`` draws ModelInferRequests with input tensors of the served
models' names and others, every datatype and some that do not exist, shapes that fit their data and shapes that
do not (negative, empty, past any size), data as typed contents or raw buffers (BYTES elements with
right and wrong length prefixes), sampling parameters as JSON and as request parameters (known keys
with any value, unknown keys, Triton's reserved ones) and outputs asked for by any name, each field
right most of the time so that the ones after it are looked at too. Half of what it draws is a
valid LLM or embedding request.

``rest_infer_bodies(...)`` draws the same for KServe's REST infer route: JSON tensors, or the
binary tensor data extension with its header right, wrong or missing.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st
from proto_strategies import json_values

from protoserve.open_inference import grpc_service_pb2 as oip

INPUT_NAMES = ("text_input", "stream", "sampling_parameters", "exclude_input_in_output")
OTHER_NAMES = ("embedding", "text_output", "", "TEXT_INPUT", "text_input ")
DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64", "BYTES")
ODD_DATATYPES = ("FP16", "BF16", "bytes", "", "STRING")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "min_p", "ignore_eos", "n",
                 "logprobs", "repetition_penalty", "frequency_penalty", "no_such_key")
RESERVED = ("triton_enable_empty_final_response", "sequence_id", "sequence_start", "priority", "timeout",
            "triton_anything", "binary_data_output")
# What a valid request asks of the model: few tokens, so the fuzz server stays quick.
VALID_SAMPLING = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 8)},
    optional={"temperature": st.floats(0, 2), "top_k": st.integers(-1, 50), "seed": st.integers(0, 2**31),
              "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3))},
)


def length_prefixed(elements: list[bytes]) -> bytes:
    return b"".join(len(e).to_bytes(4, "little") + e for e in elements)


def _sampling_json() -> st.SearchStrategy[str]:
    anything = st.dictionaries(st.sampled_from(SAMPLING_KEYS), json_values(), max_size=4)
    return st.one_of(VALID_SAMPLING, anything, json_values()).map(json.dumps) | st.text(max_size=16)


def _bytes_buffer(count: int) -> st.SearchStrategy[bytes]:
    """A raw BYTES buffer: well-formed (any count of elements), or cut, or with a lying prefix."""
    elements = st.lists(st.one_of(st.text(max_size=24).map(str.encode), st.binary(max_size=8)),
                        min_size=count, max_size=count) | st.lists(st.binary(max_size=8), max_size=3)
    well_formed = elements.map(length_prefixed)
    lying = st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=8)).map(
        lambda pair: pair[0].to_bytes(4, "little") + pair[1])
    return st.one_of(well_formed, lying, well_formed.map(lambda b: b[:-1] if b else b"\x01"), st.binary(max_size=16))


@st.composite
def _tensor(draw: st.DrawFn, raw: bool) -> tuple[oip.ModelInferRequest.InferInputTensor, bytes | None]:
    name = _rarely(draw, st.sampled_from(INPUT_NAMES), st.sampled_from(OTHER_NAMES) | st.text(max_size=12))
    valid = {"text_input": "BYTES", "sampling_parameters": "BYTES", "stream": "BOOL", "exclude_input_in_output": "BOOL"}
    datatype = _rarely(draw, st.just(valid.get(name, "BYTES")), st.sampled_from(DATATYPES + ODD_DATATYPES))
    shape = _rarely(draw, st.just([1]), st.lists(st.integers(-2, 4), max_size=3)
                    | st.lists(st.sampled_from([2**31, 2**62, 2**63 - 1, -(2**63)]), min_size=1, max_size=2))
    tensor = oip.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape)
    if _rarely(draw, st.just(False), st.booleans()):
        tensor.parameters["binary_data_size"].int64_param = draw(st.integers(0, 8))
    count = 1 if shape == [1] else draw(st.integers(0, 3))
    if datatype == "BYTES":
        texts = (st.just(["The capital of France is"]) if name == "text_input" else st.lists(
            _sampling_json() if name == "sampling_parameters" else st.text(max_size=24), min_size=count, max_size=count))
        elements = draw(texts.map(lambda values: [v.encode("utf-8", "surrogatepass") for v in values]))
        buffer = draw(st.just(length_prefixed(elements)) | _bytes_buffer(count))
    else:
        buffer = draw(st.binary(max_size=16) | st.just(b"\x01" * count))
    if raw:
        return tensor, buffer
    contents = tensor.contents
    if datatype == "BYTES":
        contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=24), max_size=3)) if draw(st.booleans())
                                       else [buffer[4:]])
    else:
        field = draw(st.sampled_from([f.name for f in oip.InferTensorContents.DESCRIPTOR.fields]))
        values = {"bool_contents": st.booleans(), "bytes_contents": st.binary(max_size=4),
                  "fp32_contents": st.floats(width=32), "fp64_contents": st.floats(),
                  "int_contents": st.integers(-(2**31), 2**31 - 1), "int64_contents": st.integers(-(2**63), 2**63 - 1),
                  "uint_contents": st.integers(0, 2**32 - 1), "uint64_contents": st.integers(0, 2**64 - 1)}[field]
        getattr(contents, field).extend(draw(st.lists(values, max_size=3)))
    return tensor, None


def _parameter(value: Any) -> oip.InferParameter:
    parameter = oip.InferParameter()
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    elif isinstance(value, str):
        parameter.string_param = value
    return parameter  # None: a parameter with no value


PARAMETER_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(), st.text(max_size=12))


def _rarely(draw: st.DrawFn, usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> Any:
    """``odd`` one time in four: each field of a request is right most of the time, so that the
    fields after it get looked at too."""
    return draw(odd if draw(st.integers(0, 3)) == 0 else usual)


@st.composite
def _valid_inputs(draw: st.DrawFn, embedder: bool) -> list[tuple[oip.ModelInferRequest.InferInputTensor, bytes]]:
    """A valid request's tensors (raw): the LLM's prompt and few tokens, or texts to embed."""
    if embedder:
        texts = draw(st.lists(st.text(min_size=1, max_size=24), min_size=1, max_size=3))
        tensor = oip.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES", shape=[len(texts)])
        return [(tensor, length_prefixed([t.encode("utf-8", "surrogatepass") for t in texts]))]
    prompt = draw(st.text(min_size=1, max_size=24)).encode("utf-8", "surrogatepass")
    inputs = [(oip.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES", shape=[1]),
               length_prefixed([prompt])),
              (oip.ModelInferRequest.InferInputTensor(name="sampling_parameters", datatype="BYTES", shape=[1]),
               length_prefixed([json.dumps(draw(VALID_SAMPLING)).encode()]))]
    for name in draw(st.lists(st.sampled_from(["stream", "exclude_input_in_output"]), max_size=2, unique=True)):
        inputs.append((oip.ModelInferRequest.InferInputTensor(name=name, datatype="BOOL", shape=[1]),
                       bytes([draw(st.integers(0, 1))])))
    return inputs


@st.composite
def infer_requests(draw: st.DrawFn, llms: tuple[str, ...], embedders: tuple[str, ...]) -> oip.ModelInferRequest:
    """Any ModelInferRequest a client could send the served models, valid half the time."""
    if draw(st.booleans()):
        embedder = bool(embedders) and draw(st.booleans())
        request = oip.ModelInferRequest(model_name=draw(st.sampled_from(embedders if embedder else llms)),
                                        model_version=draw(st.sampled_from(["", "1"])), id=draw(st.text(max_size=8)))
        for tensor, buffer in draw(_valid_inputs(embedder)):
            request.inputs.append(tensor)
            request.raw_input_contents.append(buffer)
        return request
    models = llms + embedders
    request = oip.ModelInferRequest(
        model_name=_rarely(draw, st.sampled_from(models), st.text(max_size=12)),
        model_version=_rarely(draw, st.sampled_from(["", "1"]), st.text(max_size=4)),
        id=draw(st.just("") | st.text(max_size=16)),
    )
    raw = draw(st.booleans())
    for tensor, buffer in draw(st.lists(_tensor(raw), max_size=4)):
        request.inputs.append(tensor)
        if raw and buffer is not None:
            request.raw_input_contents.append(buffer)
    if raw and _rarely(draw, st.just(False), st.booleans()):
        request.raw_input_contents.extend(draw(st.lists(st.binary(max_size=8), max_size=2)))  # one too many
    parameters = _rarely(draw, st.just({}), st.dictionaries(
        st.sampled_from(SAMPLING_KEYS + RESERVED) | st.text(max_size=8), PARAMETER_VALUES, max_size=3))
    for key, value in parameters.items():
        request.parameters[key].CopyFrom(_parameter(value))
    outputs = _rarely(draw, st.just([]), st.lists(st.sampled_from(["text_output", "embedding", ""])
                                                  | st.text(max_size=8), max_size=2))
    for name in outputs:
        wanted = request.outputs.add(name=name)
        if draw(st.booleans()):
            wanted.parameters["binary_data"].bool_param = True
    return request


# ---- REST ---------------------------------------------------------------------------------------


def _json_tensor() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"name": st.sampled_from(INPUT_NAMES) | st.text(max_size=8),
         "datatype": st.sampled_from(DATATYPES + ODD_DATATYPES),
         "shape": st.just([1]) | st.lists(st.integers(-2, 4) | st.sampled_from([2**63, 2**64, -(2**70)]), max_size=3)},
        optional={"data": json_values(), "parameters": json_values()},
    )


@st.composite
def rest_infer_bodies(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    """(body, headers) for POST .../infer: JSON tensors, or JSON then binary data with its header
    right, off by some bytes, not a number, or absent."""
    if draw(st.booleans()):
        sampling = json.dumps(draw(VALID_SAMPLING))
        document: dict[str, Any] = {"inputs": [
            {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [draw(st.text(min_size=1, max_size=16))]},
            {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES", "data": [sampling]},
        ]}
    else:
        document = draw(st.fixed_dictionaries(
            {"inputs": st.lists(_json_tensor(), max_size=3) | json_values()},
            optional={"id": json_values(), "parameters": json_values(), "outputs": json_values()},
        ))
    binary = b""
    inputs = document.get("inputs") if isinstance(document, dict) else None
    if isinstance(inputs, list) and inputs and draw(st.booleans()):
        # The binary extension: move the first input's data after the JSON.
        first = inputs[0] if isinstance(inputs[0], dict) else {}
        data = first.pop("data", None)
        binary = (length_prefixed([str(d).encode() for d in data]) if isinstance(data, list)
                  else draw(st.binary(max_size=12)))
        size = draw(st.just(len(binary)) | st.integers(-3, 40) | st.sampled_from([2**63, 1.5, "8", None]))
        first["parameters"] = {"binary_data_size": size}
    text = json.dumps(document).encode()
    header = draw(st.sampled_from(["right", "off", "junk", "none"])) if binary else "none"
    headers = {"content-type": "application/octet-stream" if binary else "application/json"}
    if header == "right":
        headers["inference-header-content-length"] = str(len(text))
    elif header == "off":
        headers["inference-header-content-length"] = str(max(0, len(text) + draw(st.integers(-8, 8))))
    elif header == "junk":
        headers["inference-header-content-length"] = draw(st.sampled_from(["-1", "1e3", " 5", "0x10", "99999999999"]))
    return text + binary, headers
