"""A chat completion stream's choices: each choice's role, then its content (or, with tools, the
pieces of its calls as the parser finds them), then an empty delta with its finish_reason."""

from __future__ import annotations

from protoserve.engine.api import CompletionDelta
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server.services.openai.outputs import chat_logprobs, finish_reason_text
from protoserve.server.services.openai.preparation import PreparedRequest
from protoserve.server.tool_calls.parsers import CallArguments, CallStart, Content, StreamedOutput


def chat_delta(event: Content | CallStart | CallArguments) -> oa.ChatCompletionDelta:
    """A parser event as OpenAI streams it: content, a call's first piece (id, type, name) or more arguments."""
    if isinstance(event, Content):
        return oa.ChatCompletionDelta(content=event.text)
    if isinstance(event, CallStart):
        piece = oa.ChoiceDeltaToolCall(
            index=event.index,
            id=event.id,
            type="function",
            function=oa.ChoiceDeltaFunctionCall(name=event.name, arguments=""),
        )
    else:
        piece = oa.ChoiceDeltaToolCall(
            index=event.index, function=oa.ChoiceDeltaFunctionCall(arguments=event.text)
        )
    return oa.ChatCompletionDelta(tool_calls=[piece])


def with_role(index: int, choices: list[oa.ChatCompletionChunkChoice]) -> list[oa.ChatCompletionChunkChoice]:
    """A choice's first chunks with its role, as OpenAI streams a reply that may call tools: a first
    call carries the role with content null (the unary message's content when it only calls tools);
    text follows a role chunk of its own with content ""."""
    first = choices[0].delta
    if first.HasField("content") or (len(choices) == 1 and choices[0].finish_reason):
        role = oa.ChatCompletionDelta(role="assistant", content="")
        return [oa.ChatCompletionChunkChoice(index=index, delta=role), *choices]
    first.role = "assistant"
    return choices


class ChatChunks:
    """The choices of one chat stream, with the per-choice state tool parsing needs."""

    def __init__(self, prepared: PreparedRequest) -> None:
        self.prepared = prepared
        self.outputs: dict[int, StreamedOutput] = {}
        self.opened: set[int] = set()  # with tools: the choices whose role has gone out

    def opening(self) -> list[oa.ChatCompletionChunkChoice]:
        """Each choice's role, unless tools may make it go with the choice's first delta."""
        if self.prepared.tools is not None:
            return []  # with tools, each choice's role goes with its first delta (with_role)
        delta = oa.ChatCompletionDelta(role="assistant", content="")
        return [oa.ChatCompletionChunkChoice(index=i, delta=delta) for i in range(self.prepared.sampling.n)]

    def _deltas(self, index: int, text: str, finished: bool) -> list[oa.ChatCompletionDelta]:
        """The deltas of new text: content as it is, or, with tools, what the parser found in it."""
        plan = self.prepared.tools
        if plan is None:
            return [oa.ChatCompletionDelta(content=text)] if text else []
        output = self.outputs.setdefault(index, StreamedOutput(plan.format, plan.max_calls))
        return [chat_delta(event) for event in output.feed(text, finished)]

    def choices(self, _: int, d: CompletionDelta) -> list[oa.ChatCompletionChunkChoice]:
        """The chunk choices of one engine delta (chat has one prompt, so its index is not needed)."""
        prepared, plan = self.prepared, self.prepared.tools
        choices = [
            oa.ChatCompletionChunkChoice(index=d.index, delta=delta)
            for delta in self._deltas(d.index, d.text, d.finish_reason is not None)
        ]
        if prepared.sampling.logprobs and d.logprobs:
            if not choices:
                choices.append(oa.ChatCompletionChunkChoice(index=d.index, delta=oa.ChatCompletionDelta()))
            choices[0].logprobs.CopyFrom(chat_logprobs(prepared.served, d.logprobs))
        if d.finish_reason is not None:
            reason = finish_reason_text(d.finish_reason)
            if plan is not None:
                reason = plan.finish_reason(self.outputs[d.index].parser.calls_started > 0, reason)
            choices.append(
                oa.ChatCompletionChunkChoice(
                    index=d.index, delta=oa.ChatCompletionDelta(), finish_reason=reason
                )
            )
        if plan is not None and choices and d.index not in self.opened:
            self.opened.add(d.index)
            return with_role(d.index, choices)
        return choices
