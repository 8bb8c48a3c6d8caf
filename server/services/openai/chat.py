"""OpenAI's chat completions (``/v1/chat/completions``): a conversation in, ``n`` replies out.

Unset, ``max_tokens`` means until EOS or the context is full. With tools, each reply is parsed for
calls (in the model family's format), whole for the unary response and incrementally for the stream.
"""

from __future__ import annotations

from protoserve.engine.api import Choice
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server.limits import MAX_CHAT_MESSAGES
from protoserve.server.models.chat_turn import ChatTurn
from protoserve.server.models.served_model import ServedModel
from protoserve.server.services.openai.chat_stream import ChatChunks
from protoserve.server.services.openai.chunked import ChoiceStream, ChunkedSurface, Reply
from protoserve.server.services.openai.outputs import (
    chat_logprobs,
    finish_reason_text,
)
from protoserve.server.services.openai.preparation import (
    PreparedRequest,
    SamplingFields,
    ToolsAsked,
    prepare_chat,
)
from protoserve.server.services.openai.streaming import Generation
from protoserve.server.services.openai.translation import (
    Violations,
    converted_sampling,
    output_constraint,
    python_value,
)
from protoserve.server.tool_calls.parsers import parse_output
from protoserve.server.tool_calls.request import message_tool_calls, tool_call_id, tool_choice, tool_specs

CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def message_text(content: object) -> str | None:
    """A message's content as text: a string, or the concatenation of a list of text parts; None if
    it is neither."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def chat_turns(req: oa.CreateChatCompletionRequest, violations: Violations) -> list[ChatTurn]:
    """The request's messages as the served model's chat turns, each problem named by its path."""
    if not req.messages:
        violations.append(("messages", "must not be empty"))
    if len(req.messages) > MAX_CHAT_MESSAGES:
        violations.append(("messages", f"at most {MAX_CHAT_MESSAGES} messages"))
        return []
    turns = []
    for i, message in enumerate(req.messages):
        role = CHAT_ROLES.get(message.role)
        if role is None:
            violations.append((f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}"))
            continue
        text = message_text(python_value(message.content) if message.HasField("content") else None)
        if text is None:
            violations.append((f"messages[{i}].content", "must be a string or a list of text parts"))
            continue
        path = f"messages[{i}]"
        calls = message_tool_calls(message, path, violations)
        turns.append(ChatTurn(role, text, message.name, calls, tool_call_id(message, path, violations)))
    return turns


def _sampling_fields(req: oa.CreateChatCompletionRequest, violations: Violations) -> SamplingFields:
    """Chat's sampling: ``max_completion_tokens`` (or the older ``max_tokens``), logprobs, the rest."""
    if req.HasField("top_logprobs") and req.top_logprobs and not req.logprobs:
        violations.append(("top_logprobs", "requires logprobs"))
    both = req.HasField("max_completion_tokens") and req.HasField("max_tokens")
    if both and req.max_tokens != req.max_completion_tokens:
        # One of them would be ignored.
        violations.append(("max_tokens", "differs from max_completion_tokens; set one of them"))
    converted = converted_sampling(req, violations)
    max_field = "max_tokens" if req.HasField("max_tokens") else "max_completion_tokens"
    if req.HasField("max_completion_tokens"):
        converted["max_tokens"] = req.max_completion_tokens
        max_field = "max_completion_tokens"
    converted["constraint"], paths = output_constraint(req, violations)
    paths["max_tokens"] = max_field
    # Unset, max_tokens is "until EOS or the context is full".
    return SamplingFields(req, {"max_tokens": None}, converted, paths)


def _tools_asked(req: oa.CreateChatCompletionRequest, violations: Violations) -> ToolsAsked:
    specs = tool_specs(req.tools, violations)
    choice = tool_choice(req, specs, violations)
    if req.HasField("parallel_tool_calls") and not req.tools:
        violations.append(("parallel_tool_calls", "only applies to requests with tools"))
    parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True
    return ToolsAsked(specs, choice, parallel)


def _message(
    text: str, prepared: PreparedRequest, finish_reason: str
) -> tuple[oa.ChatCompletionMessage, str]:
    """A reply as the assistant's message (its tool calls parsed out, with tools) and its finish_reason."""
    plan = prepared.tools
    if plan is None:
        return oa.ChatCompletionMessage(role="assistant", content=text), finish_reason
    found = parse_output(text, plan.format, plan.max_calls)
    message = oa.ChatCompletionMessage(
        role="assistant",
        content=found.content,
        tool_calls=[
            oa.ChatCompletionMessageToolCall(
                id=call.id,
                type="function",
                function=oa.FunctionCall(name=call.name, arguments=call.arguments),
            )
            for call in found.tool_calls
        ],
    )
    return message, plan.finish_reason(bool(found.tool_calls), finish_reason)


class ChatCompletions(ChunkedSurface):
    """The chat completions surface: validation, the unary response and the stream's choices."""

    id_prefix = "chatcmpl"
    response = Reply(oa.CreateChatCompletionResponse, "chat.completion")
    chunk = Reply(oa.CreateChatCompletionStreamResponse, "chat.completion.chunk")

    async def validate(
        self,
        req: oa.CreateChatCompletionRequest,
        served: ServedModel,
        adapter: str | None,
        violations: Violations,
    ) -> PreparedRequest:
        turns = chat_turns(req, violations)
        fields = _sampling_fields(req, violations)
        tools = _tools_asked(req, violations)
        return await prepare_chat(served, turns, fields, violations, tools=tools, adapter=adapter)

    def choice_stream(self, prepared: PreparedRequest) -> ChoiceStream:
        return ChatChunks(prepared)

    def choices(self, generation: Generation) -> list[oa.ChatCompletionChoice]:
        return [_choice(generation.prepared, c) for c in generation.results[0].choices]


def _choice(prepared: PreparedRequest, c: Choice) -> oa.ChatCompletionChoice:
    message, finish_reason = _message(c.text, prepared, finish_reason_text(c.finish_reason))
    logprobs = chat_logprobs(prepared.served, c.logprobs) if prepared.sampling.logprobs else None
    return oa.ChatCompletionChoice(
        index=c.index, message=message, logprobs=logprobs, finish_reason=finish_reason
    )
