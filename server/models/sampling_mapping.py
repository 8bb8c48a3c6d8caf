"""SamplingMapping: a request's sampling fields -> engine SamplingParams, with their defaults and checks.

The one place where a request's parameters become the engine's. ``protoserve.v1.SamplingParams`` and
the OpenAI requests name their sampling fields as ``protoserve.engine.sampling.sampling_params.SamplingParams`` does, so
the fields a message shares with it are copied by name: a field the request sets is taken as it is;
one it leaves unset gets the served model's default (the ``--default-*`` flags over the model's own
recommendation), else its API's default, else SamplingParams' own. A new sampling parameter is
therefore a proto field, a SamplingParams field and the sampler's use of it. Only fields whose form
differs per API (OpenAI's string-or-list ``stop``, its string-keyed ``logit_bias``, the completions
API's integer ``logprobs``) are converted by their service and handed in, and so is an OpenAI
request's output constraint (``response_format`` / ``structured_outputs``); the native
``SamplingParams.constraint`` message is converted here (:func:`constraint_from_proto`).

"Unset" is protobuf presence: HasField for ``optional`` fields, empty for lists and maps, zero for
the rest. A field without presence cannot be set to zero, so its SamplingParams default must be zero,
and a parameter a model may give a default to needs ``optional`` (tests/server/test_sampling_mapping.py
holds both).

Validation is the engine's own (``SamplingParams.validate``) with its field names renamed to the
request's paths, plus the server's caps on input size (server/limits.py). A request the server has
checked goes to the engine marked so (``TokenizedRequest.sampling_checked``), which then does not
check its parameters a second time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from protoserve.engine.api import (
    MIROSTAT_REPLACES,
    Constraint,
    ConstraintKind,
    SamplingParams,
    SpeculativeParams,
)
from protoserve.server import errors
from protoserve.server.limits import (
    MAX_CONSTRAINT_CHARS,
    MAX_CONSTRAINT_CHOICES,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
)

log = logging.getLogger(__name__)

# The parameters a served model may give defaults to, as vLLM's --generation-config does: a
# request that leaves one unset gets the model's recommended value.
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))

Violation = tuple[str, str]
PathMap = Mapping[str, str] | Callable[[str], str]


def _is_map(fd: FieldDescriptor) -> bool:
    return fd.message_type is not None and fd.message_type.GetOptions().map_entry


@functools.cache
def shared_fields(descriptor: Descriptor) -> tuple[FieldDescriptor, ...]:
    """The fields of a message type that SamplingParams has too, by name: scalars, lists and maps.

    A message-typed field (say, a ``google.protobuf.Value``) never fits an engine field as it is;
    its service converts it.
    """
    return tuple(
        fd
        for fd in descriptor.fields
        if fd.name in ENGINE_FIELDS and (fd.message_type is None or _is_map(fd))
    )


def is_set(message: Message, fd: FieldDescriptor) -> bool:
    """Whether the request set the field (see the module docstring for what unset means)."""
    if fd.is_repeated:  # maps too
        return len(getattr(message, fd.name)) > 0
    if fd.has_presence:
        return message.HasField(fd.name)
    return getattr(message, fd.name) != fd.default_value


def set_values(message: Message, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The shared fields ``message`` sets, as plain Python values, leaving out ``skip``."""
    skipped = frozenset(skip)
    values: dict[str, Any] = {}
    for fd in shared_fields(message.DESCRIPTOR):
        if fd.name in skipped or not is_set(message, fd):
            continue
        value = getattr(message, fd.name)
        if _is_map(fd):
            value = dict(value)
        elif fd.is_repeated:
            value = list(value)
        values[fd.name] = value
    return values


def json_text(value: Any) -> str:
    """Compact JSON of a value read from a ``google.protobuf.Struct``/``Value`` (see struct_data)."""
    return json.dumps(struct_data(value), separators=(",", ":"), ensure_ascii=False)


def struct_data(value: Any) -> Any:
    """A value read from a ``google.protobuf.Struct``/``Value``, the same in every process.

    Integral numbers become ints: a Struct holds every number as a double, and a schema's
    ``minItems`` must be an integer. Object keys come in a fixed order: a Struct is a protobuf map,
    whose iteration order differs from one process to the next, and these values become prompt text
    (tool definitions) and grammars (whose objects list their keys in the schema's order), so the
    same request would render and sample differently after a restart. Keys are sorted, except a
    JSON Schema's ``properties``, which follow its ``required`` array (an array keeps the client's
    order: a pydantic model's or a strict tool's field order), the others sorted after them.
    """
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [struct_data(item) for item in value]
    if not isinstance(value, dict):
        return value
    out = {key: struct_data(value[key]) for key in sorted(value)}
    properties, required = out.get("properties"), out.get("required")
    if isinstance(properties, dict) and isinstance(required, list):
        first = [name for name in dict.fromkeys(required) if isinstance(name, str) and name in properties]
        rest = sorted(set(properties) - set(first))
        out["properties"] = {name: properties[name] for name in [*first, *rest]}
    return out


def constraint_from_proto(message: Message) -> Constraint | None:
    """The engine Constraint of a ``protoserve.v1.Constraint`` (None when no kind is set).

    ``json_object: false`` is the caller's to refuse: it cannot mean "unconstrained" in a oneof.
    """
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    if kind == ConstraintKind.JSON_SCHEMA:
        return Constraint.json_schema(json_text(json_format.MessageToDict(message.json_schema)))
    if kind == ConstraintKind.JSON_OBJECT:
        return Constraint.json_object()
    if kind == ConstraintKind.CHOICE:
        return Constraint.choice(list(message.choice.values))
    return Constraint(ConstraintKind(kind), getattr(message, kind))


def speculative_from_proto(message: Message) -> SpeculativeParams:
    """The engine SpeculativeParams of a ``protoserve.v1.SpeculativeOptions``: unset fields take
    SpeculativeParams' defaults; a set zero stays zero, for validation to refuse on its field."""
    default = SpeculativeParams()
    values = {name: getattr(message, name) if message.HasField(name) else getattr(default, name)
              for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")}
    return SpeculativeParams(method=message.method or default.method, **values)


def constraint_problems(constraint: Constraint | None) -> list[Violation]:
    """The server's caps on a constraint's size, on the engine's field name (``constraint.<kind>``)."""
    if constraint is None:
        return []
    problems = []
    if len(constraint.choices) > MAX_CONSTRAINT_CHOICES:
        problems.append((constraint.field, f"at most {MAX_CONSTRAINT_CHOICES} choices"))
    if len(constraint.text) + sum(len(choice) for choice in constraint.choices) > MAX_CONSTRAINT_CHARS:
        problems.append((constraint.field, f"at most {MAX_CONSTRAINT_CHARS} characters"))
    return problems


def default_problems(defaults: Mapping[str, float | int]) -> list[Violation]:
    """(field, problem) for every default that is not a DEFAULTABLE field or not a valid value of it."""
    unknown = [(name, "no server default can be set for it") for name in defaults if name not in DEFAULTABLE]
    if unknown:
        return unknown
    return SamplingParams(**defaults).validate()


def served_defaults(
    model: Mapping[str, float | int], flags: Mapping[str, float | int], model_name: str
) -> dict[str, float | int]:
    """The defaults a served model applies: the server's flags over the model's own recommendation.

    A recommendation the engine would refuse is left out (and logged): every request that left the
    field unset would be refused for a value its caller never sent.
    """
    usable = dict(model)
    for name, problem in default_problems(model):
        log.warning("model %s: its recommended %s %r is not used: %s", model_name, name, model[name], problem)
        usable.pop(name, None)
    merged = {**usable, **flags}
    if merged:
        log.info("model %s: requests that leave them unset get %s", model_name,
                 ", ".join(f"{name}={value}" for name, value in sorted(merged.items())))
    return merged


def path_function(paths: PathMap) -> Callable[[str], str]:
    """An engine field name -> the request's field path."""
    return paths if callable(paths) else (lambda name: paths.get(name, name))


@dataclass(frozen=True)
class SamplingMapping:
    """Requests' sampling fields -> engine SamplingParams for one served model.

    ``defaults`` are the values requests that leave a field unset get (the server's flags over
    the model's own; keys from DEFAULTABLE); ``vocab_size`` bounds token ids in the parameters.
    """

    vocab_size: int
    defaults: Mapping[str, float | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = default_problems(self.defaults)
        if problems:
            raise ValueError("; ".join(f"default {name}: {problem}" for name, problem in problems))

    def params(
        self, message: Message, *, api_defaults: Mapping[str, Any] | None = None, **converted: Any
    ) -> SamplingParams:
        """Engine parameters of ``message`` (unvalidated: see :meth:`check`).

        ``api_defaults`` are the API's own defaults for fields it leaves unset (the completions
        API's 16 ``max_tokens``); ``converted`` are fields the service converted itself, which win.
        """
        explicit = {**set_values(message, converted), **converted}
        defaults = self.defaults
        if explicit.get("mirostat_mode"):
            # Mirostat picks the candidates itself: a served default for a filter it replaces (a model card's
            # top_p) is not the request's choice, so it does not apply; one the request sets is refused.
            defaults = {name: value for name, value in defaults.items() if name not in MIROSTAT_REPLACES}
        values = {**(api_defaults or {}), **defaults, **explicit}
        fields = message.DESCRIPTOR.fields_by_name
        if "constraint" not in converted and "constraint" in fields and message.HasField("constraint"):
            values["constraint"] = constraint_from_proto(message.constraint)
        return SamplingParams(**values)

    def effective_defaults(self) -> dict[str, float | int]:
        """What each DEFAULTABLE field is for a request that leaves it unset."""
        builtin = SamplingParams()
        return {name: self.defaults.get(name, getattr(builtin, name)) for name in DEFAULTABLE}

    def check(self, params: SamplingParams, paths: PathMap, extra: Iterable[Violation] = ()) -> None:
        """Raise INVALID_ARGUMENT naming every bad field of ``params``, after the ``extra`` ones.

        ``paths`` maps the engine's field names to the request's field paths.
        """
        to_path = path_function(paths)
        if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            # Alone: a problem per entry of a huge map would bury this one.
            raise errors.invalid_argument([(to_path("logit_bias"), f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")])
        violations = list(extra)
        capped = constraint_problems(params.constraint)
        violations += [(to_path(name), problem) for name, problem in capped]
        if capped:  # validating a schema's text means parsing it: not one over the cap
            params = dataclasses.replace(params, constraint=None)
        violations += [(to_path(name), problem) for name, problem in params.validate(self.vocab_size)]
        if any(len(stop) > MAX_STOP_STRING_CHARS for stop in params.stop):
            violations.append(
                (to_path("stop"), f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters")
            )
        if violations:
            raise errors.invalid_argument(violations)
