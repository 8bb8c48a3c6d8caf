"""An Anthropic request's input in the server's terms: chat turns, tool specs and the tool choice.

Anthropic's conversation is user and assistant messages of content blocks; the chat templates take
system, user, assistant (with tool calls) and tool turns. So a ``system`` prompt is the system turn,
a user message's ``tool_result`` blocks are tool turns (in the order written, its text blocks the
user turns between them) and an assistant message's ``tool_use`` blocks are its turn's calls.
Blocks the server cannot honour (images, documents, thinking, citations) are refused naming their
path, as is every key a block does not define; ``cache_control`` is accepted everywhere Anthropic
takes it, since prompt prefixes are cached anyway.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import struct_pb2

from protoserve.anthropic.v1 import messages_pb2 as am
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server.limits import MAX_CHAT_MESSAGES
from protoserve.server.models.chat_turn import ChatTurn
from protoserve.server.models.sampling_mapping import json_text
from protoserve.server.services.openai.preparation import ToolsAsked
from protoserve.server.services.openai.translation import Violations, python_value
from protoserve.server.tool_calls.call import ToolCall, ToolChoice, ToolChoiceMode
from protoserve.server.tool_calls.request import tool_specs

# Text blocks of one message (or of the system prompt) are joined as vLLM joins content parts.
BLOCK_SEPARATOR = "\n"
# The keys each block kind defines; a null value asks for nothing, as everywhere in the gateway.
BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
}
BLOCK_ROLES = {"text": ("user", "assistant"), "tool_use": ("assistant",), "tool_result": ("user",)}
# Blocks Anthropic defines that nothing here can honour: the served models read text only.
UNSUPPORTED_BLOCKS = {
    "image": "the served models read text only",
    "document": "the served models read text only",
    "search_result": "search results are not supported",
    "thinking": "extended thinking is not supported",
    "redacted_thinking": "extended thinking is not supported",
    "server_tool_use": "Anthropic's server tools are not supported",
    "web_search_tool_result": "Anthropic's server tools are not supported",
}
CACHE_TTLS = ("5m", "1h")
# Where a chat tool's problems are reported, in Anthropic's field names.
_TOOL_PATHS = ((".function.name", ".name"), (".function.parameters", ".input_schema"))


def _cache_control_problem(value: Any) -> str | None:
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        return 'must be {"type": "ephemeral"}'
    if set(value) - {"type", "ttl"}:
        return 'takes only "type" and "ttl"'
    if value.get("ttl") is not None and value["ttl"] not in CACHE_TTLS:
        return f"ttl must be one of {', '.join(CACHE_TTLS)}"
    return None


def _checked_block(block: Any, path: str, role: str | None, violations: Violations) -> dict[str, Any] | None:
    """A content block whose kind, keys and field types are right (null keys dropped); None if not."""
    if not isinstance(block, dict):
        violations.append((path, "must be a content block object"))
        return None
    kind = block.get("type")
    if kind in UNSUPPORTED_BLOCKS:
        violations.append((f"{path}.type", f"{kind} blocks cannot be honoured: {UNSUPPORTED_BLOCKS[kind]}"))
        return None
    if kind not in BLOCK_KEYS:
        violations.append((f"{path}.type", f"must be one of {', '.join(BLOCK_KEYS)}"))
        return None
    if role is not None and role not in BLOCK_ROLES[kind]:
        violations.append((f"{path}.type", f"{kind} blocks belong in {BLOCK_ROLES[kind][0]} messages only"))
        return None
    block = {key: value for key, value in block.items() if value is not None}
    known = len(violations)
    for key in block.keys() - BLOCK_KEYS[kind]:
        violations.append((f"{path}.{key}", f"unknown field; a {kind} block has no field {key!r}"))
    if "cache_control" in block:
        problem = _cache_control_problem(block["cache_control"])
        if problem is not None:
            violations.append((f"{path}.cache_control", problem))
    if "citations" in block:
        violations.append((f"{path}.citations", "citations cannot be honoured"))
    _check_kind_fields(kind, block, path, violations)
    return block if len(violations) == known else None


def _check_kind_fields(kind: str, block: dict[str, Any], path: str, violations: Violations) -> None:
    if kind == "text" and not isinstance(block.get("text"), str):
        violations.append((f"{path}.text", "must be a string"))
    elif kind == "tool_use":
        for key in ("id", "name"):
            if not (isinstance(block.get(key), str) and block[key]):
                violations.append((f"{path}.{key}", "must be a non-empty string"))
        if not isinstance(block.get("input"), dict):
            violations.append((f"{path}.input", "must be an object"))
    elif kind == "tool_result":
        if not (isinstance(block.get("tool_use_id"), str) and block["tool_use_id"]):
            violations.append((f"{path}.tool_use_id", "must be a non-empty string"))
        if "is_error" in block and not isinstance(block["is_error"], bool):
            violations.append((f"{path}.is_error", "must be a boolean"))


def text_of(value: Any, path: str, violations: Violations) -> str:
    """A string, or the text of a list of text blocks (``system``, a tool result's ``content``)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        violations.append((path, "must be a string or a list of text blocks"))
        return ""
    texts = []
    for j, item in enumerate(value):
        where = f"{path}[{j}]"
        block = _checked_block(item, where, None, violations)
        if block is None:
            continue
        if block["type"] != "text":
            violations.append((f"{where}.type", "must be text"))
            continue
        texts.append(block["text"])
    return BLOCK_SEPARATOR.join(texts)


def _tool_result_turn(block: dict[str, Any], path: str, violations: Violations) -> ChatTurn:
    text = text_of(block.get("content"), f"{path}.content", violations)
    if block.get("is_error"):
        # The model reads the outcome; a failed call must not read as a successful one.
        text = f"Error: {text}"
    return ChatTurn("tool", text, tool_call_id=block["tool_use_id"])


def _message_turns(message: am.MessageParam, path: str, violations: Violations) -> list[ChatTurn]:
    role = message.role
    if role not in ("user", "assistant"):
        violations.append((f"{path}.role", "must be user or assistant"))
        return []
    content = python_value(message.content) if message.HasField("content") else None
    if isinstance(content, str):
        return [ChatTurn(role, content)]
    if not isinstance(content, list):
        violations.append((f"{path}.content", "must be a string or a list of content blocks"))
        return []
    turns: list[ChatTurn] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, item in enumerate(content):
        where = f"{path}.content[{j}]"
        block = _checked_block(item, where, role, violations)
        if block is None:
            continue
        if block["type"] == "text":
            texts.append(block["text"])
        elif block["type"] == "tool_use":
            calls.append(ToolCall(block["id"], block["name"], json_text(block["input"])))
        else:
            if texts:  # text written before a result is a user turn of its own, in order
                turns.append(ChatTurn("user", BLOCK_SEPARATOR.join(texts)))
                texts = []
            turns.append(_tool_result_turn(block, where, violations))
    if texts or calls or not turns:
        turns.append(ChatTurn(role, BLOCK_SEPARATOR.join(texts), tool_calls=tuple(calls)))
    return turns


def chat_turns(system: struct_pb2.Value | None, messages: Any, violations: Violations) -> list[ChatTurn]:
    """The system prompt and the messages as chat turns, each problem named by its path."""
    if not messages:
        violations.append(("messages", "must not be empty"))
        return []
    if len(messages) > MAX_CHAT_MESSAGES:
        violations.append(("messages", f"at most {MAX_CHAT_MESSAGES} messages"))
        return []
    turns = []
    if system is not None:
        text = text_of(python_value(system), "system", violations)
        if text:
            turns.append(ChatTurn("system", text))
    for i, message in enumerate(messages):
        turns.extend(_message_turns(message, f"messages[{i}]", violations))
    if messages[-1].role == "assistant":
        # Anthropic continues a final assistant message (prefill); the chat templates here would
        # close it and start a new reply instead, so it is refused rather than answered otherwise.
        violations.append(
            (f"messages[{len(messages) - 1}].role", "the last message must be the user's; prefill is not supported")
        )
    return turns


def check_cache_control(message: Any, path: str, violations: Violations) -> None:
    """A ``cache_control`` field of a request message (the request's own, a tool's), if it is set."""
    if message.HasField("cache_control"):
        value = {"type": message.cache_control.type, "ttl": message.cache_control.ttl or None}
        problem = _cache_control_problem(value)
        if problem is not None:
            violations.append((path, problem))


def _as_chat_tools(tools: Any, violations: Violations) -> list[oa.ChatCompletionTool]:
    chat_tools = []
    for i, tool in enumerate(tools):
        if tool.type not in ("", "custom"):
            violations.append(
                (f"tools[{i}].type", f"{tool.type!r} is one of Anthropic's server tools, which run on its side")
            )
        check_cache_control(tool, f"tools[{i}].cache_control", violations)
        function = oa.FunctionDefinition(name=tool.name, description=tool.description)
        if tool.HasField("input_schema"):
            function.parameters.CopyFrom(tool.input_schema)
        chat_tools.append(oa.ChatCompletionTool(type="function", function=function))
    return chat_tools


def _anthropic_path(path: str) -> str:
    for chat, ours in _TOOL_PATHS:
        if path.endswith(chat):
            return path.removesuffix(chat) + ours
    return path


def _tool_choice(choice: am.ToolChoice | None, names: set[str], violations: Violations) -> ToolChoice:
    if choice is None:
        return ToolChoice(ToolChoiceMode.AUTO if names else ToolChoiceMode.NONE)
    modes = {"auto": ToolChoiceMode.AUTO, "any": ToolChoiceMode.REQUIRED, "none": ToolChoiceMode.NONE}
    if choice.type == "tool":
        if choice.name not in names:
            violations.append(("tool_choice.name", f"{choice.name!r} is not one of the request's tools"))
            return ToolChoice(ToolChoiceMode.AUTO)
        return ToolChoice(ToolChoiceMode.NAMED, choice.name)
    if choice.type not in modes:
        violations.append(("tool_choice.type", "must be auto, any, tool or none"))
        return ToolChoice(ToolChoiceMode.AUTO)
    if choice.name:
        violations.append(("tool_choice.name", "only applies to type tool"))
    if choice.type != "none" and not names:
        violations.append(("tool_choice", f"{choice.type} needs tools"))
    return ToolChoice(modes[choice.type])


def tools_asked(tools: Any, choice: am.ToolChoice | None, violations: Violations) -> ToolsAsked:
    """The request's tools as specs (checked as chat's are) and its choice among them."""
    chat_violations: Violations = []
    specs = tool_specs(_as_chat_tools(tools, violations), chat_violations)
    violations.extend((_anthropic_path(path), problem) for path, problem in chat_violations)
    asked = _tool_choice(choice, {spec.name for spec in specs}, violations)
    parallel = True
    if choice is not None and choice.HasField("disable_parallel_tool_use"):
        if asked.mode == ToolChoiceMode.NONE:
            violations.append(("tool_choice.disable_parallel_tool_use", "only applies to auto, any and tool"))
        parallel = not choice.disable_parallel_tool_use
    return ToolsAsked(specs, asked, parallel)
