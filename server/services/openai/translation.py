"""OpenAI's request fields in the engine's terms: pure functions, one per field family.

Each reads a field of an OpenAI-shaped request (any message with that field: completions, chat, or a
surface built on them) and appends a (field path, problem) violation for what it cannot take, so a
request is refused once, naming every bad field.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, struct_pb2

from protoserve.engine.api import Constraint
from protoserve.server import errors
from protoserve.server.limits import MAX_LOGIT_BIAS_ENTRIES, OPENAI_MAX_STOP_STRINGS
from protoserve.server.models.sampling_mapping import Violation, json_text

Violations = list[Violation]
FoundConstraint = tuple[str, Constraint]  # an output constraint and the request field it came from


def python_value(value: struct_pb2.Value) -> Any:
    """A ``google.protobuf.Value`` field (OpenAI's "string or list" fields) as plain Python."""
    return json_format.MessageToDict(value)


def as_token_ids(items: list[Any]) -> list[int] | None:
    """A JSON list of integral numbers as ints; None when it is anything else."""
    if not all(
        isinstance(x, float | int) and not isinstance(x, bool) and float(x).is_integer() for x in items
    ):
        return None
    return [int(x) for x in items]


def stream_field_violations(req: Any, streaming: bool) -> Violations:
    """Stream settings on a unary call, which would otherwise be ignored."""
    if streaming:
        return []
    violations = []
    if req.stream:
        violations.append(("stream", "true needs the streaming method; this one answers once"))
    if req.HasField("stream_options"):
        violations.append(("stream_options", "only applies to streamed responses"))
    return violations


def stop_strings(req: Any, violations: Violations) -> list[str]:
    """OpenAI's ``stop``: unset, null, a string or a list of strings."""
    if not req.HasField("stop"):
        return []
    stop = python_value(req.stop)
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > OPENAI_MAX_STOP_STRINGS:
            violations.append(("stop", f"at most {OPENAI_MAX_STOP_STRINGS} stop strings"))
        return stop
    violations.append(("stop", "must be a string or a list of strings"))
    return []


def logit_bias(bias: Any, violations: Violations) -> dict[int, float]:
    """OpenAI's ``logit_bias`` map, keyed by token ids written as strings."""
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        violations.append(("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries"))
        return {}
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            violations.append(("logit_bias", f"key {errors.echo(key)} is not a token id"))
    return out


def converted_sampling(req: Any, violations: Violations) -> dict[str, Any]:
    """The sampling fields whose OpenAI form is not the engine's, converted; the rest map by name."""
    converted: dict[str, Any] = {}
    if req.HasField("top_k"):
        if req.top_k < -1:
            violations.append(("top_k", "must be -1, 0 (disabled) or positive"))
        converted["top_k"] = max(req.top_k, 0)  # vLLM's -1 is the engine's 0: disabled
    converted["logit_bias"] = logit_bias(req.logit_bias, violations)
    converted["stop"] = stop_strings(req, violations)
    return converted


def response_format(req: Any, violations: Violations) -> list[FoundConstraint]:
    """OpenAI's ``response_format``: nothing for text, any JSON object, or JSON valid against a schema."""
    if not req.HasField("response_format"):
        return []
    fmt = req.response_format
    if fmt.type not in ("text", "json_object", "json_schema"):
        violations.append(("response_format.type", "must be text, json_object or json_schema"))
        return []
    if fmt.type != "json_schema":
        if fmt.HasField("json_schema"):
            violations.append(("response_format.json_schema", "only applies to type json_schema"))
        return [("response_format", Constraint.json_object())] if fmt.type == "json_object" else []
    if not fmt.json_schema.HasField("schema"):
        violations.append(("response_format.json_schema.schema", "must be set for type json_schema"))
        return []
    schema = json_text(json_format.MessageToDict(fmt.json_schema.schema))
    return [("response_format.json_schema.schema", Constraint.json_schema(schema))]


def structured_outputs(req: Any, violations: Violations) -> list[FoundConstraint]:
    """vLLM's ``structured_outputs`` extension: each kind it sets, with its path."""
    if not req.HasField("structured_outputs"):
        return []
    so = req.structured_outputs
    found: list[FoundConstraint] = []
    known = len(violations)
    if so.HasField("json"):
        schema = python_value(so.json)
        if isinstance(schema, str | dict):
            text = schema if isinstance(schema, str) else json_text(schema)
            found.append(("structured_outputs.json", Constraint.json_schema(text)))
        else:
            violations.append(("structured_outputs.json", "must be a JSON Schema object or a string of one"))
    if so.HasField("regex"):
        found.append(("structured_outputs.regex", Constraint.regex(so.regex)))
    if so.choice:
        found.append(("structured_outputs.choice", Constraint.choice(list(so.choice))))
    if so.HasField("grammar"):
        found.append(("structured_outputs.grammar", Constraint.grammar(so.grammar)))
    if so.HasField("json_object"):
        if so.json_object:
            found.append(("structured_outputs.json_object", Constraint.json_object()))
        else:
            violations.append(("structured_outputs.json_object", "must be true, or left out"))
    if not found and len(violations) == known:
        violations.append(("structured_outputs", "set one of json, regex, choice, grammar or json_object"))
    return found


def one_constraint(
    found: list[FoundConstraint], violations: Violations
) -> tuple[Constraint | None, dict[str, str]]:
    """The one output constraint of those a request set, and the path map from its engine field to the
    request's own field; a second one is refused naming it (nothing could honour both)."""
    if not found:
        return None, {}
    for path, _ in found[1:]:
        violations.append((path, f"cannot be combined with {found[0][0]}; set one output constraint"))
    path, constraint = found[0]
    return constraint, {constraint.field: path}


def output_constraint(req: Any, violations: Violations) -> tuple[Constraint | None, dict[str, str]]:
    """The request's one output constraint (``response_format`` or ``structured_outputs``) and its paths."""
    return one_constraint(response_format(req, violations) + structured_outputs(req, violations), violations)
