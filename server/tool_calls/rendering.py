"""Tools, calls and results into the chat template's messages.

A template that renders ``tools`` itself (Qwen's, Llama 3.1's, Hermes') gets them as the ``tools``
variable, assistant messages with their ``tool_calls`` and ``tool`` messages, as transformers'
``apply_chat_template`` passes them. A template that ignores tools (SmolLM2's plain ChatML) would
drop them silently, so for it the tools are written into the system message in the format the
model's parser reads, its past calls become the assistant's text in that format, and tool results
become ``<tool_response>`` user turns, as SmolLM2's tool-use training data has them.

Whether a template renders tools is measured, not guessed: :func:`template_renders_tools` renders a
probe conversation with a tool whose name appears nowhere else.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protoserve.server.tool_calls.call import ToolCall, ToolSpec
from protoserve.server.tool_calls.parsers import FORMATS, HERMES, LLAMA3_JSON, SMOLLM2, ToolCallFormat

if TYPE_CHECKING:
    from protoserve.server.models.chat_turn import ChatTurn

_PROBE_NAME = "protoserve_probe_tool_7f3a"


@dataclass(frozen=True)
class ToolTemplate:
    """How a served model takes tools: the call format it writes and whether its template renders them."""

    format: ToolCallFormat
    renders_tools: bool


def template_renders_tools(render: Callable[..., str]) -> bool:
    """Whether ``render(messages, tools=...)`` puts the tools into the prompt."""
    probe = {
        "type": "function",
        "function": {
            "name": _PROBE_NAME,
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    try:
        text = render([{"role": "user", "content": "hi"}], tools=[probe])
    except Exception:  # noqa: BLE001 - a template that cannot take tools does not render them
        return False
    return _PROBE_NAME in text


def choose_format(template_source: str, renders_tools: bool, override: str | None) -> ToolCallFormat | None:
    """The call format: ``--tool-parser`` if given, else read off the template; None if unknown.

    A template that does not render tools gets SmolLM2's format, which our own instructions teach.
    """
    if override:
        return FORMATS[override]
    if not renders_tools:
        return SMOLLM2
    if "<tool_call>" in template_source:
        return HERMES
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return LLAMA3_JSON
    return None


def instructions(tools: Sequence[ToolSpec], fmt: ToolCallFormat) -> str:
    """A system prompt teaching ``fmt`` for templates that do not render tools."""
    listed = json.dumps([_function(t) for t in tools], ensure_ascii=False)
    key = fmt.arguments_key
    if fmt.list_in_tag:
        example = (
            f'{fmt.open_tag}[\n{{"name": "func_name1", "{key}": {{"argument1": "value1"}}}},\n'
            f"... (more tool calls as required)\n]{fmt.close_tag}"
        )
    elif fmt.open_tag:
        example = (
            f'{fmt.open_tag}\n{{"name": "func_name1", "{key}": {{"argument1": "value1"}}}}\n{fmt.close_tag}'
        )
    else:
        example = f'{{"name": "func_name1", "{key}": {{"argument1": "value1"}}}}'
    return (
        "You are an expert in composing functions. You are given a question and a set of possible "
        "functions. Based on the question, you will need to make one or more function/tool calls to "
        "achieve the purpose. If none of the functions can be used, answer the question directly.\n\n"
        f"You have access to the following tools:\n<tools>{listed}</tools>\n\n"
        "To call tools, the output MUST strictly adhere to the following format, and NO other text "
        f"MUST be included:\n{example}"
    )


def template_messages(
    messages: Sequence[ChatTurn], tools: Sequence[ToolSpec], template: ToolTemplate
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The template's messages and extra variables for a conversation offered ``tools``."""
    if template.renders_tools:
        variables = {"tools": [t.as_openai() for t in tools]} if tools else {}
        return [_native_message(m) for m in messages], variables
    return _written_messages(messages, tools, template.format), {}


def _function(tool: ToolSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": tool.name}
    if tool.description:
        out["description"] = tool.description
    out["parameters"] = tool.parameters
    return out


def _arguments_value(arguments: str) -> Any:
    """A call's arguments as templates expect them: the object, where the text is one."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _native_message(message: ChatTurn) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments_value(c.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def written_calls(calls: Sequence[ToolCall], fmt: ToolCallFormat) -> str:
    """Calls as the model writes them in ``fmt`` (what an assistant turn that called tools said)."""
    objects = [
        json.dumps({"name": c.name, fmt.arguments_key: _arguments_value(c.arguments)}, ensure_ascii=False)
        for c in calls
    ]
    if fmt.list_in_tag:
        return f"{fmt.open_tag}[{', '.join(objects)}]{fmt.close_tag}"
    if fmt.open_tag:
        return "\n".join(f"{fmt.open_tag}\n{o}\n{fmt.close_tag}" for o in objects)
    return "; ".join(objects)


def _written_messages(
    messages: Sequence[ChatTurn], tools: Sequence[ToolSpec], fmt: ToolCallFormat
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            response = f"<tool_response>\n{message.content}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + response  # one user turn holds a step's results
            else:
                out.append({"role": "user", "content": response, "_tool_responses": True})
            continue
        content = message.content
        if message.tool_calls:
            calls = written_calls(message.tool_calls, fmt)
            content = f"{content}\n{calls}" if content else calls
        entry: dict[str, Any] = {"role": message.role, "content": content}
        if message.name:
            entry["name"] = message.name
        out.append(entry)
    for entry in out:
        entry.pop("_tool_responses", None)
    if tools:
        teach = instructions(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{teach}" if out[0]["content"] else teach
        else:
            out.insert(0, {"role": "system", "content": teach})
    return out
