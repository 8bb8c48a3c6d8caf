"""AgentService: the ReAct loop (loop.py) served over gRPC, each model step a chat request with tools.

A step is the chat-with-tools path of the OpenAI surface, as plain data: the conversation rendered
with the run's tools through the model's chat template, the engine run under the run's call (so
Cancel, the deadline and a client going away stop it), the output parsed for calls by the model's
parser. ``tool_choice`` "required" on the first step is the same grammar that forces an OpenAI call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format

from protoserve.engine.api import ContextPolicy, FinishReason, SamplingParams, TokenizedRequest
from protoserve.server import errors
from protoserve.server.agent.loop import (
    DEFAULT_MAX_STEPS,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TOOL_TIMEOUT_S,
    AgentEvent,
    AgentOptions,
    AgentTimeout,
    Answer,
    StepOutput,
    StopReason,
    Thought,
    TokenUsage,
    ToolCallStarted,
    ToolResult,
    run_agent,
)
from protoserve.server.agent.tool_registry import ToolRegistry, ToolSelectionError
from protoserve.server.calls.admission import Admission, AdmittingServicer
from protoserve.server.calls.inflight import Call
from protoserve.server.limits import MAX_CHAT_MESSAGES
from protoserve.server.models.chat_turn import ChatTurn
from protoserve.server.models.served_model import CollectedOutput, ServedModel, new_request_id
from protoserve.server.rag.search_tool import search_tool
from protoserve.server.security.auth import Identity
from protoserve.server.services.embeddings import Retrieval
from protoserve.server.services.inference_service import call_deadline
from protoserve.server.tool_calls.call import ToolCall, ToolChoice, ToolChoiceMode, ToolSpec
from protoserve.server.tool_calls.parsers import parse_output
from protoserve.server.tool_calls.request import ToolPlan, tool_constraint
from protoserve.v1 import agent_pb2 as apb
from protoserve.v1 import agent_pb2_grpc
from protoserve.v1 import inference_pb2 as pb

# A step that leaves max_tokens unset gets this many: an agent's step is a thought and some calls,
# and an unbounded one would fill the context before the run could read a tool's result.
DEFAULT_STEP_MAX_TOKENS = 1024
MAX_RUN_TIMEOUT_S = 3600.0
RUN_ROLES = ("system", "user", "assistant")
STOP_REASONS = {
    StopReason.ANSWERED: apb.AGENT_STOP_REASON_ANSWERED,
    StopReason.MAX_STEPS: apb.AGENT_STOP_REASON_MAX_STEPS,
    StopReason.LENGTH: apb.AGENT_STOP_REASON_LENGTH,
}


@dataclasses.dataclass(frozen=True)
class _Run:
    """A checked RunAgentRequest: what every step of the run shares."""

    served: ServedModel
    registry: ToolRegistry  # the server's tools, plus this caller's document search when RAG is on
    specs: list[ToolSpec]
    options: AgentOptions
    sampling: SamplingParams
    messages: list[dict[str, Any]]


class AgentService(AdmittingServicer, agent_pb2_grpc.AgentServiceServicer):
    """RunAgent and ListTools over the server's tool registry."""

    def __init__(
        self, admission: Admission, *, registry: ToolRegistry, retrieval: Retrieval | None = None
    ) -> None:
        super().__init__(admission)
        self.registry = registry
        self.retrieval = retrieval or Retrieval()

    def _registry(self, identity: Identity) -> ToolRegistry:
        """The tools a run of ``identity`` may use: the server's, and a search of its own documents."""
        if self.retrieval.store is None:
            return self.registry
        return self.registry.with_tools(
            [(search_tool(identity, self.retrieval, self.inflight), "built-in (RAG)")]
        )

    @errors.reports_errors
    async def ListTools(self, request: apb.ListToolsRequest, context: grpc.aio.ServicerContext):
        """The tools a run of the caller may use, by name."""
        identity = self._admit(context)
        return apb.ListToolsResponse(tools=[_tool_info(spec) for spec in self._registry(identity).specs()])

    @errors.reports_errors
    async def RunAgent(self, request: apb.RunAgentRequest, context: grpc.aio.ServicerContext) -> None:
        """Stream a run's events, ending with its answer."""
        identity = self._admit(context)
        run = await self._checked(request, self._registry(identity))
        run_id = new_request_id("run")
        deadline = asyncio.get_running_loop().time() + run.options.timeout_s
        client_deadline = call_deadline(context)
        if client_deadline is not None:
            deadline = min(deadline, client_deadline)
        async with self.inflight.call(identity, run_id, deadline) as call:
            step = self._model_step(call, run, run_id)
            try:
                async with contextlib.aclosing(
                    run_agent(step, run.registry, run.messages, run.options)
                ) as events:
                    async for event in events:
                        await context.write(_response(run_id, event))
            except AgentTimeout:
                raise errors.deadline_exceeded() from None

    # ---- the request --------------------------------------------------------------------

    async def _checked(self, request: apb.RunAgentRequest, registry: ToolRegistry) -> _Run:
        served = self.models.get(request.model)
        violations: list[tuple[str, str]] = []
        messages = _messages(request, violations)
        try:
            specs = registry.specs(list(request.tools) or None)
        except ToolSelectionError as exc:
            violations.append((f"tools[{exc.index}]", str(exc)))
            specs = []
        choice = request.tool_choice or "auto"
        if choice not in ("auto", "required"):
            violations.append(("tool_choice", 'must be "auto" or "required"'))
        options = None
        try:
            options = AgentOptions(
                tools=list(request.tools) or None,
                first_tool_choice=choice if choice in ("auto", "required") else "auto",
                max_steps=request.max_steps if request.HasField("max_steps") else DEFAULT_MAX_STEPS,
                timeout_s=request.timeout_seconds
                if request.HasField("timeout_seconds")
                else DEFAULT_TIMEOUT_S,
                tool_timeout_s=(
                    request.tool_timeout_seconds
                    if request.HasField("tool_timeout_seconds")
                    else DEFAULT_TOOL_TIMEOUT_S
                ),
                parallel_tool_calls=request.parallel_tool_calls
                if request.HasField("parallel_tool_calls")
                else True,
            )
        except ValueError as exc:
            # AgentOptions names the field first: "max_steps must be ...".
            name, _, problem = str(exc).partition(" ")
            violations.append((_OPTION_FIELDS.get(name, name), problem))
        if options is not None and options.timeout_s > MAX_RUN_TIMEOUT_S:
            violations.append(("timeout_seconds", f"must be at most {MAX_RUN_TIMEOUT_S:g}"))
        if request.sampling.HasField("constraint"):
            violations.append(("sampling.constraint", "is set by the agent for each step; leave it unset"))
        params = served.sampling.params(
            request.sampling, api_defaults={"max_tokens": DEFAULT_STEP_MAX_TOKENS}
        )
        if params.n != 1:
            violations.append(("sampling.n", "must be 1: a run follows one conversation"))
        if served.tool_template is None:
            violations.append(
                (
                    "model",
                    f"model {served.name} has no chat template with a known tool-call format; start the server "
                    "with --tool-parser",
                )
            )
        served.sampling.check(params, lambda f: f"sampling.{f}", violations)
        assert options is not None  # a bad option was a violation, raised just above
        return _Run(served, registry, specs, options, params, messages)

    # ---- one model step --------------------------------------------------------------------

    def _model_step(self, call: Call, run: _Run, run_id: str):
        served, template = run.served, run.served.tool_template
        max_calls = None if run.options.parallel_tool_calls else 1
        numbers = itertools.count(1)
        given = len(run.messages)  # the caller's; the loop appends the run's own steps after them

        async def step(messages: list[dict[str, Any]], tool_choice: str) -> StepOutput:
            plan = ToolPlan(template.format, ToolChoice(ToolChoiceMode(tool_choice)), max_calls)
            constraint = tool_constraint(run.specs, plan)
            constraint_field = await served.check_constraint(
                constraint, {constraint.field: "tools"} if constraint else {}
            )
            prompt = await served.chat_ids(
                _turns(messages, given), path="messages", policy=ContextPolicy.ALLOW_CONTEXT_STOP, tools=run.specs
            )
            request = TokenizedRequest(
                request_id=f"{run_id}.step{next(numbers)}",
                prompt_token_ids=prompt,
                sampling=dataclasses.replace(run.sampling, constraint=constraint),
                context_policy=ContextPolicy.ALLOW_CONTEXT_STOP,
                cache_salt=call.identity.cache_salt,
                sampling_checked=True,
                constraint_field=constraint_field,
            )
            result = CollectedOutput(n=1)
            async for output in self.inflight.generate(call, served.engine, request):
                result.add(output)
            [choice] = result.choices
            found = parse_output(choice.text, template.format, max_calls)
            return StepOutput(
                content=found.content or "",
                tool_calls=found.tool_calls,
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                cached_prompt_tokens=result.cached_prompt_tokens,
                finish_reason="tool_calls"
                if found.tool_calls
                else ("length" if choice.finish_reason == FinishReason.LENGTH else "stop"),
            )

        return step


_OPTION_FIELDS = {
    "max_steps": "max_steps",
    "timeout_s": "timeout_seconds",
    "tool_timeout_s": "tool_timeout_seconds",
    "first_tool_choice": "tool_choice",
    "tools": "tools",
}


def _messages(request: apb.RunAgentRequest, violations: list[tuple[str, str]]) -> list[dict[str, Any]]:
    if not request.messages:
        violations.append(("messages", "must not be empty"))
    if len(request.messages) > MAX_CHAT_MESSAGES:
        violations.append(("messages", f"at most {MAX_CHAT_MESSAGES} messages"))
        return []
    out = []
    for i, m in enumerate(request.messages):
        if m.role not in RUN_ROLES:
            violations.append((f"messages[{i}].role", f"must be one of {', '.join(RUN_ROLES)}"))
        entry: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            entry["name"] = m.name
        out.append(entry)
    return out


def _turns(messages: Sequence[dict[str, Any]], given: int) -> list[ChatTurn]:
    """The loop's OpenAI-form messages as the served model's chat turns; past the ``given`` first (the
    caller's), the run's own: model output that may quote a document, never parsed for special tokens."""
    turns = []
    for i, m in enumerate(messages):
        calls = tuple(
            ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in m.get("tool_calls") or ()
        )
        turns.append(
            ChatTurn(m["role"], m.get("content") or "", m.get("name", ""), calls, m.get("tool_call_id", ""),
                     from_caller=i < given)
        )
    return turns


def _usage(usage: TokenUsage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
    )


def _response(run_id: str, event: AgentEvent) -> apb.RunAgentResponse:
    out = apb.RunAgentResponse(
        run_id=run_id, step=event.step, elapsed_s=event.elapsed_s, duration_s=event.duration_s
    )
    if event.usage is not None:
        out.usage.CopyFrom(_usage(event.usage))
    payload = event.payload
    if isinstance(payload, Thought):
        out.thought.content = payload.content
    elif isinstance(payload, ToolCallStarted):
        out.tool_call.CopyFrom(
            apb.AgentToolCall(id=payload.id, name=payload.name, arguments=payload.arguments)
        )
    elif isinstance(payload, ToolResult):
        out.tool_result.CopyFrom(
            apb.AgentToolResult(
                id=payload.id, name=payload.name, content=payload.content, is_error=payload.is_error
            )
        )
    elif isinstance(payload, Answer):
        out.answer.CopyFrom(
            apb.AgentAnswer(
                content=payload.content,
                stop_reason=STOP_REASONS[payload.stop_reason],
                steps=payload.steps,
                usage=_usage(payload.usage),
            )
        )
    return out


def _tool_info(spec: ToolSpec) -> apb.ToolInfo:
    info = apb.ToolInfo(name=spec.name, description=spec.description)
    json_format.ParseDict(spec.parameters, info.parameters)
    return info
