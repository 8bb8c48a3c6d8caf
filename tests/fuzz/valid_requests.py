"""What a valid request holds, field by field, as JSON Schema: what the proto types cannot say.

Proto3 has no required fields, no ranges, and ``google.protobuf.Value`` fields
(prompt, stop, content) hold any JSON, so /openapi.json, generated from the
protos, calls almost anything valid, and a fuzzer drawing from it alone rarely
gets past validation to the engine. Both fuzzers lean on this one table:

* the gRPC fuzzer draws hinted fields from it (:func:`strategy`) for half of
  its messages, and
* the OpenAPI fuzzer runs on /openapi.json tightened with it
  (:func:`tightened`), so its positive cases are valid and its negative cases
  break these constraints one at a time.

Keys are a field's full proto name (which is also the OpenAPI component name
and property) or a bare field name for every request message that has it.
Small ``max_tokens`` and ``n`` keep each valid request short.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from hypothesis import strategies as st

TEXT = {"type": "string", "minLength": 1, "maxLength": 40}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1000}, "minItems": 1, "maxItems": 16}
STOP_STRINGS = {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 4}, "maxItems": 4}
ROLE = {"enum": ["system", "user", "assistant"]}
UNIT = {"type": "number", "minimum": 0.05, "maximum": 1}
PENALTY = {"type": "number", "minimum": -2, "maximum": 2}
OPENAI_STOP = {"anyOf": [TEXT, STOP_STRINGS]}
# Open Inference sampling keys as request parameters: few tokens.
OIP_SAMPLING = {
    "type": "object",
    "properties": {"max_tokens": {"type": "integer", "minimum": 1, "maximum": 8}, "temperature": {"enum": [0, 1]}},
    "required": ["max_tokens"],
    "additionalProperties": False,
}
CONTENT_PARTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": TEXT},
        "required": ["type", "text"],
        "additionalProperties": False,
    },
    "maxItems": 2,
}


def field_schemas(model: str) -> dict[str, dict[str, Any]]:
    """Valid values by field, for a server serving ``model``."""
    model_names = {"enum": sorted({"", model})}  # "": the default model
    return {
        "model": model_names,
        "protoserve.v1.GetModelRequest.name": model_names,
        "role": ROLE,
        "prompt": TEXT,
        "text": TEXT,
        "content": TEXT,
        "protoserve.openai.v1.CreateCompletionRequest.prompt": {
            "anyOf": [
                TEXT,
                {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 3},
                TOKEN_IDS,
                {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": 2},
            ]
        },
        "protoserve.openai.v1.ChatCompletionRequestMessage.content": {"anyOf": [TEXT, CONTENT_PARTS]},
        "protoserve.openai.v1.CreateCompletionRequest.stop": OPENAI_STOP,
        "protoserve.openai.v1.CreateChatCompletionRequest.stop": OPENAI_STOP,
        "stop": STOP_STRINGS,
        "ids": TOKEN_IDS,
        "protoserve.v1.DetokenizeRequest.token_ids": TOKEN_IDS,
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
        "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
        "protoserve.openai.v1.CreateResponseRequest.input": TEXT,
        "protoserve.openai.v1.CreateResponseRequest.include": {"type": "array", "items": TEXT, "maxItems": 0},
        "truncation": {"enum": ["disabled"]},
        # Not the bare `text` above: here it is the output's form, a message.
        "protoserve.openai.v1.CreateResponseRequest.text": {
            "type": "object",
            "properties": {
                "format": {
                    "type": "object",
                    "properties": {"type": {"enum": ["text", "json_object"]}},
                    "required": ["type"],
                },
            },
        },
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": 1},
        "n": {"type": "integer", "minimum": 1, "maximum": 3},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": UNIT,
        "typical_p": UNIT,
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "maximum": 50},
        "repetition_penalty": {"type": "number", "minimum": 0.5, "maximum": 2},
        "frequency_penalty": PENALTY,
        "presence_penalty": PENALTY,
        "seed": {"type": "integer", "minimum": 0, "maximum": 2**31},
        "protoserve.openai.v1.CreateCompletionRequest.logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "interval_ms": {"type": "integer", "minimum": 100, "maximum": 500},
        # The Open Inference Protocol's REST bodies (gateway/open_inference/openapi.py): the LLM's tensors.
        "kserve.InferenceRequest.parameters": OIP_SAMPLING,
        "kserve.InferenceRequest.outputs": {"type": "array", "items": TEXT, "maxItems": 0},
        "kserve.RequestInput.name": {"enum": ["text_input", "sampling_parameters", "exclude_input_in_output"]},
        "kserve.RequestInput.datatype": {"enum": ["BYTES", "BOOL"]},
        "kserve.RequestInput.shape": {"type": "array", "items": {"const": 1}, "minItems": 1, "maxItems": 1},
        "kserve.RequestInput.data": {"type": "array", "items": {"anyOf": [TEXT, {"type": "boolean"}]},
                                     "minItems": 1, "maxItems": 1},
        "kserve.RequestInput.parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        "triton.GenerateRequest.text_input": TEXT,
        "triton.GenerateRequest.parameters": OIP_SAMPLING,
        "triton.GenerateRequest.sampling_parameters": {"enum": ['{"max_tokens": 4}', "{}"]},
    }


# What a request must have, beyond what the protos say (OpenAPI component -> required properties);
# max_tokens too, so that a valid request never runs to the end of the context.
REQUIRED = {
    "protoserve.openai.v1.CreateCompletionRequest": ["prompt", "max_tokens"],
    "protoserve.openai.v1.CreateChatCompletionRequest": ["messages", "max_tokens"],
    "protoserve.anthropic.v1.CreateMessageRequest": ["model", "messages", "max_tokens"],
    "protoserve.anthropic.v1.CountMessageTokensRequest": ["model", "messages"],
    "protoserve.anthropic.v1.MessageParam": ["role", "content"],
    "protoserve.openai.v1.CreateResponseRequest": ["input", "max_output_tokens"],
    "protoserve.v1.GenerateRequest": ["sampling"],
    "protoserve.v1.SamplingParams": ["max_tokens"],
    "protoserve.openai.v1.ChatCompletionRequestMessage": ["role", "content"],
    "protoserve.v1.ChatMessage": ["role", "content"],
    "protoserve.v1.ChatInput": ["messages"],
    "protoserve.v1.TokenIds": ["ids"],
    "protoserve.v1.BatchRequest": ["requests"],
    "protoserve.v1.DetokenizeRequest": ["token_ids"],
    "kserve.InferenceRequest": ["inputs"],
    "kserve.RequestInput": ["name", "shape", "datatype", "data"],
    "triton.GenerateRequest": ["text_input", "parameters"],
}
# Proto oneofs the OpenAPI document cannot express: exactly one of these must be set.
ONE_OF = {
    "protoserve.v1.GenerateRequest": ["prompt", "token_ids", "chat"],
    "protoserve.v1.TokenizeRequest": ["text", "chat"],
}
# Lists the server takes non-empty, and how long a valid one is here (a Batch of many is slow).
LIST_SIZES = {
    "protoserve.openai.v1.CreateChatCompletionRequest": {"messages": (1, 4)},
    "protoserve.anthropic.v1.CreateMessageRequest": {"messages": (1, 4)},
    "protoserve.anthropic.v1.CountMessageTokensRequest": {"messages": (1, 4)},
    "protoserve.v1.ChatInput": {"messages": (1, 4)},
    "protoserve.v1.BatchRequest": {"requests": (1, 3)},
    "kserve.InferenceRequest": {"inputs": (1, 2)},
}


REF = "#/components/schemas/"
# Suffix of the request-only copies of components that responses share (e.g. SamplingParams is also
# ModelInfo.sampling_defaults): tightening them must not change what a valid response is.
REQUEST_COPY = ".request"


def _request_bodies(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        operation["requestBody"]["content"]["application/json"]
        for path in document["paths"].values()
        for operation in path.values()
        if "requestBody" in operation
    ]


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object in a schema tree."""
    pending = [node]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            yield item
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


def _request_components(document: dict[str, Any]) -> set[str]:
    """Components reachable from a request body: the ones clients write."""
    schemas = document["components"]["schemas"]
    found: set[str] = set()
    pending = [body["schema"] for body in _request_bodies(document)]
    while pending:
        for node in _walk(pending.pop()):
            name = node.get("$ref", "").removeprefix(REF)
            if name and name not in found:
                found.add(name)
                pending.append(schemas[name])
    return found


def _split_requests(document: dict[str, Any]) -> list[str]:
    """Give request bodies copies of the components they use; returns the copies' original names."""
    schemas = document["components"]["schemas"]
    names = sorted(_request_components(document))
    for name in names:
        schemas[name + REQUEST_COPY] = copy.deepcopy(schemas[name])
    for root in [body["schema"] for body in _request_bodies(document)] + [schemas[n + REQUEST_COPY] for n in names]:
        for node in _walk(root):
            if node.get("$ref", "").removeprefix(REF) in names:
                node["$ref"] += REQUEST_COPY
    return names


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema without its null option: JSON null means "unset" to protobuf, so not "given"."""
    schema = dict(schema)
    if "anyOf" in schema:
        options = [option for option in schema.pop("anyOf") if option != {"type": "null"}]
        schema.update(options[0] if len(options) == 1 else {"anyOf": options})
    if isinstance(schema.get("type"), list):
        schema["type"] = [kind for kind in schema["type"] if kind != "null"]
    return schema


def tightened(document: dict[str, Any], model: str) -> dict[str, Any]:
    """A copy of the OpenAPI document whose request schemas describe valid requests only."""
    document = copy.deepcopy(document)
    schemas = document["components"]["schemas"]
    fields = field_schemas(model)
    for name in _split_requests(document):
        schema = schemas[name + REQUEST_COPY]
        if "properties" not in schema or name.startswith("google."):
            continue
        schema["additionalProperties"] = False  # the server refuses unknown fields
        for prop in schema["properties"]:
            valid = fields.get(f"{name}.{prop}", fields.get(prop))
            if valid is not None:
                schema["properties"][prop] = {**valid, "description": schema["properties"][prop].get("description", "")}
        for prop, (least, most) in LIST_SIZES.get(name, {}).items():
            schema["properties"][prop] = {**schema["properties"][prop], "minItems": least, "maxItems": most}
        if name in REQUIRED:
            schema["required"] = REQUIRED[name]
            for prop in REQUIRED[name]:
                schema["properties"][prop] = _not_null(schema["properties"][prop])
        if name in ONE_OF:
            schema["oneOf"] = [{"required": [member]} for member in ONE_OF[name]]
    _name_the_served_model(document)
    return document


def _name_the_served_model(document: dict[str, Any]) -> None:
    """The Open Inference routes name the model in their path: the example's (the served model)."""
    for path, operations in document["paths"].items():
        if not path.startswith("/v2/"):
            continue
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "path":
                    parameter["schema"] = {"enum": [parameter["example"]]}


def strategy(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values of one of the schemas above (the JSON Schema subset this table uses)."""
    if "anyOf" in schema:
        return st.one_of([strategy(option) for option in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema["type"]
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength"))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        items = strategy(schema["items"])
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=schema.get("maxItems"))
    if kind == "object":
        properties = {name: strategy(sub) for name, sub in schema["properties"].items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in properties.items() if k in required},
            optional={k: v for k, v in properties.items() if k not in required},
        )
    raise ValueError(f"no strategy for {schema}")
