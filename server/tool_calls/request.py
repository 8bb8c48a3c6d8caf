"""A chat request's tools, ``tool_choice`` and past calls, read and checked, and the plan they make.

Every problem is a (field path, message) violation on the request's own field, as the rest of the
server reports them: a tool with a bad name or a non-object schema, an unknown function in
``tool_choice``, a tool message without its ``tool_call_id``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from protoserve.engine.api import Constraint
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server.limits import MAX_TOOLS
from protoserve.server.models.sampling_mapping import struct_data
from protoserve.server.tool_calls.call import ToolCall, ToolChoice, ToolChoiceMode, ToolSpec
from protoserve.server.tool_calls.forcing import auto_strict_grammar, forced_grammar
from protoserve.server.tool_calls.parsers import ToolCallFormat

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
Violations = list[tuple[str, str]]


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of its output: the format to parse, the choice, a call limit."""

    format: ToolCallFormat
    choice: ToolChoice
    max_calls: int | None  # 1 when parallel_tool_calls is false

    def finish_reason(self, called: bool, reason: str) -> str:
        """OpenAI's finish_reason: "tool_calls" when the model called (a named function's is "stop")."""
        if called and reason == "stop" and self.choice.mode != ToolChoiceMode.NAMED:
            return "tool_calls"
        return reason


def tool_specs(tools: Any, violations: Violations) -> list[ToolSpec]:
    """The request's ``tools`` as specs; each problem named by its ``tools[i]`` path."""
    if len(tools) > MAX_TOOLS:
        violations.append(("tools", f"at most {MAX_TOOLS} tools"))
        return []
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        path = f"tools[{i}]"
        if tool.type != "function":
            violations.append((f"{path}.type", 'must be "function"'))
            continue
        function = tool.function
        if not FUNCTION_NAME.fullmatch(function.name):
            violations.append((f"{path}.function.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -"))
            continue
        if function.name in seen:
            violations.append((f"{path}.function.name", f"{function.name!r} names two tools"))
            continue
        seen.add(function.name)
        parameters: dict[str, Any] = {"type": "object", "properties": {}}
        if function.HasField("parameters"):
            # Integral numbers as integers and keys in an order every process agrees on (struct_data).
            parameters = struct_data(json_format.MessageToDict(function.parameters))
            if parameters.get("type", "object") != "object":
                violations.append((f"{path}.function.parameters", "must be a JSON Schema of type object"))
                continue
        specs.append(ToolSpec(function.name, function.description, parameters, bool(function.strict)))
    return specs


def tool_choice(
    req: oa.CreateChatCompletionRequest, specs: list[ToolSpec], violations: Violations
) -> ToolChoice:
    """The request's ``tool_choice``: "auto" with tools and "none" without, unless it says otherwise."""
    default = ToolChoice(ToolChoiceMode.AUTO if specs else ToolChoiceMode.NONE)
    if not req.HasField("tool_choice"):
        return default
    value = json_format.MessageToDict(req.tool_choice)
    if value is None:
        return default
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            violations.append(("tool_choice", 'must be "none", "auto", "required" or a named function'))
            return default
        choice = ToolChoice(ToolChoiceMode(value))
    elif (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
        and set(value) == {"type", "function"}
        and set(value["function"]) == {"name"}
        and isinstance(value["function"]["name"], str)
    ):
        name = value["function"]["name"]
        if name not in {s.name for s in specs}:
            violations.append(("tool_choice.function.name", f"{name!r} is not one of the request's tools"))
            return default
        choice = ToolChoice(ToolChoiceMode.NAMED, name)
    else:
        violations.append(
            ("tool_choice", 'must be a string or {"type": "function", "function": {"name": ...}}')
        )
        return default
    if choice.mode != ToolChoiceMode.NONE and not specs:
        violations.append(
            ("tool_choice", f"{value if isinstance(value, str) else 'a named function'} needs tools")
        )
    return choice


def message_tool_calls(
    message: oa.ChatCompletionRequestMessage, path: str, violations: Violations
) -> tuple[ToolCall, ...]:
    """An assistant message's past calls, checked."""
    if message.tool_calls and message.role != "assistant":
        violations.append((f"{path}.tool_calls", "only assistant messages carry tool calls"))
        return ()
    calls = []
    for j, call in enumerate(message.tool_calls):
        where = f"{path}.tool_calls[{j}]"
        if call.type != "function":
            violations.append((f"{where}.type", 'must be "function"'))
        elif not call.function.name:
            violations.append((f"{where}.function.name", "is required"))
        else:
            calls.append(ToolCall(call.id, call.function.name, call.function.arguments))
    return tuple(calls)


def tool_call_id(message: oa.ChatCompletionRequestMessage, path: str, violations: Violations) -> str:
    """A tool message's ``tool_call_id``, which OpenAI requires; other roles must not set one."""
    if message.role == "tool" and not message.tool_call_id:
        violations.append((f"{path}.tool_call_id", "is required for role tool"))
    elif message.role != "tool" and message.tool_call_id:
        violations.append((f"{path}.tool_call_id", "only tool messages answer a call"))
    return message.tool_call_id


def tool_constraint(specs: list[ToolSpec], plan: ToolPlan) -> Constraint | None:
    """The grammar a plan needs: forced calls, auto with a strict tool, or none."""
    single = plan.max_calls == 1
    if plan.choice.mode == ToolChoiceMode.NAMED:
        named = [s for s in specs if s.name == plan.choice.name]
        return Constraint.lark(forced_grammar(named, plan.format, single=True))
    if plan.choice.mode == ToolChoiceMode.REQUIRED:
        return Constraint.lark(forced_grammar(specs, plan.format, single=single))
    if plan.choice.mode == ToolChoiceMode.AUTO and any(s.strict for s in specs):
        return Constraint.lark(auto_strict_grammar(specs, plan.format, single=single))
    return None
