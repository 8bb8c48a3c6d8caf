"""Anthropic's Messages surface: a conversation in, one reply out, unary or as Anthropic's events.

Requests are read by ``conversion`` and prepared by the chat path every surface shares
(``prepare_chat``: sampling checked once, the chat template, tools planned and forced by grammar),
run by the shared :class:`EngineRunner`, and answered with ``replies``' blocks. ``max_tokens`` and
``model`` are required, as Anthropic requires them.
"""

from __future__ import annotations

import secrets

import grpc

from protoserve.anthropic.v1 import messages_pb2 as am
from protoserve.engine.api import ContextPolicy, RequestOutput
from protoserve.server import errors
from protoserve.server.limits import MAX_STOP_STRINGS
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.security.auth import Identity
from protoserve.server.services.anthropic.conversion import chat_turns, check_cache_control, tools_asked
from protoserve.server.services.anthropic.replies import BlockEvents, Event, StopReason, content_blocks
from protoserve.server.services.openai.preparation import (
    PreparedRequest,
    SamplingFields,
    plan_tools,
    prepare_chat,
)
from protoserve.server.services.openai.streaming import EngineRunner, Generation
from protoserve.server.services.openai.translation import Violations


def _request_checks(req: am.CreateMessageRequest | am.CountMessageTokensRequest, violations: Violations) -> None:
    if not req.model:
        violations.append(("model", "is required"))
    check_cache_control(req, "cache_control", violations)


def _sampling_fields(req: am.CreateMessageRequest, violations: Violations) -> SamplingFields:
    """Anthropic's sampling: max_tokens (required), temperature, top_p and top_k by name, and
    stop_sequences as the engine's stop strings."""
    if not req.HasField("max_tokens"):
        violations.append(("max_tokens", "is required"))
    if len(req.stop_sequences) > MAX_STOP_STRINGS:
        violations.append(("stop_sequences", f"at most {MAX_STOP_STRINGS} stop sequences"))
    return SamplingFields(req, {}, {"stop": list(req.stop_sequences)}, {"stop": "stop_sequences"})


class Messages:
    """The Messages surface: validation, the unary reply, the event stream and the token count."""

    def __init__(self, models: ModelRegistry, runner: EngineRunner) -> None:
        self.models = models
        self.runner = runner

    async def prepare(self, req: am.CreateMessageRequest, *, streaming: bool) -> PreparedRequest:
        violations: Violations = []
        _request_checks(req, violations)
        served, adapter = self.models.resolve(req.model)
        if req.stream and not streaming:
            violations.append(("stream", "true needs the streaming method; this one answers once"))
        turns = chat_turns(req.system if req.HasField("system") else None, req.messages, violations)
        fields = _sampling_fields(req, violations)
        tools = tools_asked(req.tools, req.tool_choice if req.HasField("tool_choice") else None, violations)
        return await prepare_chat(served, turns, fields, violations, tools=tools, adapter=adapter)

    @staticmethod
    def _start(prepared: PreparedRequest) -> Generation:
        return Generation(prepared, "msg_" + secrets.token_hex(12))

    @staticmethod
    def _message(
        generation: Generation, stop: StopReason | None, content: list[am.ContentBlock]
    ) -> am.CreateMessageResponse:
        prepared, result = generation.prepared, generation.results[0]
        message = am.CreateMessageResponse(
            id=generation.public_id,
            type="message",
            role="assistant",
            content=content,
            model=prepared.model,
            usage=am.Usage(
                input_tokens=result.prompt_tokens or len(prepared.prompts[0].token_ids),
                output_tokens=result.completion_tokens,
            ),
        )
        if stop is not None:
            message.stop_reason = stop.reason
            if stop.sequence is not None:
                message.stop_sequence = stop.sequence
        return message

    async def create(
        self, req: am.CreateMessageRequest, context: grpc.aio.ServicerContext, identity: Identity
    ) -> am.CreateMessageResponse:
        """Run the request to its end and answer with the whole reply."""
        prepared = await self.prepare(req, streaming=False)
        generation = self._start(prepared)
        await self.runner.run(context, identity, generation)
        choice = generation.results[0].choices[0]
        blocks = BlockEvents(prepared.tools)
        events = blocks.feed(choice.text, finished=True)
        stop = StopReason.of(choice, blocks.called, list(req.stop_sequences))
        return self._message(generation, stop, content_blocks(events))

    async def create_stream(
        self, request: am.CreateMessageStreamRequest, context: grpc.aio.ServicerContext, identity: Identity
    ) -> None:
        """Write the reply as Anthropic's events: message_start and a ping once the engine has taken
        the request, the blocks' events as the output comes, then message_delta and message_stop."""
        req = request.request
        prepared = await self.prepare(req, streaming=True)
        generation = self._start(prepared)
        blocks = BlockEvents(prepared.tools)
        stop: list[StopReason] = []

        async def write(_: int, output: RequestOutput) -> None:
            if not opened:
                # The engine has taken the request (its refusals come before any output, as a
                # plain error status), so the message starts now.
                opened.append(True)
                start = self._message(generation, None, [])
                start.usage.output_tokens = 0  # its first tokens go out as the blocks' deltas
                await context.write(Event(type="message_start", message=start))
                await context.write(Event(type="ping"))
            for delta in output.deltas:
                finished = delta.finish_reason is not None
                for event in blocks.feed(delta.text, finished):
                    await context.write(event)
                if finished:
                    stop.append(StopReason.of(delta, blocks.called, list(req.stop_sequences)))

        opened: list[bool] = []
        await self.runner.run(context, identity, generation, write)
        reason = stop[0] if stop else StopReason("end_turn")
        usage = self._message(generation, reason, []).usage  # cumulative, as the SDK reads it
        await context.write(Event(type="message_delta", delta=reason.delta(), usage=usage))
        await context.write(Event(type="message_stop"))

    async def count_tokens(self, req: am.CountMessageTokensRequest) -> am.CountMessageTokensResponse:
        """The input tokens CreateMessage would report for the same system, messages and tools."""
        violations: Violations = []
        _request_checks(req, violations)
        served, _ = self.models.resolve(req.model)
        turns = chat_turns(req.system if req.HasField("system") else None, req.messages, violations)
        tools = tools_asked(req.tools, req.tool_choice if req.HasField("tool_choice") else None, violations)
        # The tools a reply would be offered, planned as CreateMessage plans them ("none": none).
        _, offered = plan_tools(served, tools, SamplingFields(req, {}), violations)
        if violations:
            raise errors.invalid_argument(violations)
        ids = await served.chat_ids(turns, path="messages", policy=ContextPolicy.ALLOW_CONTEXT_STOP, tools=offered)
        return am.CountMessageTokensResponse(input_tokens=len(ids))
