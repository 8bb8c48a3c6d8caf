"""The ReAct loop: model step, the step's tool calls run together, their results back to the model.

``run_agent`` is an async generator of events; the server turns each into a RunAgentResponse. The
model step is a callable, so the loop knows nothing of the engine. Iterate it under
``contextlib.aclosing``: closing it, or cancelling the task that iterates it, cancels the in-flight
model step and every running tool and waits for them, so no task outlives the run.

A tool's failure (it raised, timed out, is not among the run's tools, or got arguments that are not
a JSON object satisfying its schema) becomes an error observation the model reads next step: the run
goes on. Only the model step's own errors and the run's deadline (AgentTimeout) end a run early.

With ``parallel_tool_calls`` False, a step that made several calls keeps only its first: the rest are
neither run nor written into the conversation, so the model sees the one call it got an answer to.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from protoserve.server.agent.tool_registry import InvalidArgumentsError, ToolRegistry, UnknownToolError
from protoserve.server.tool_calls.call import ToolCall

log = logging.getLogger(__name__)

DEFAULT_MAX_STEPS = 8
MAX_STEPS_LIMIT = 32
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_TOOL_TIMEOUT_S = 30.0
TOOL_CHOICES = ("auto", "required")
FINISH_REASONS = ("stop", "length", "tool_calls")


@dataclass(frozen=True)
class TokenUsage:
    """Tokens of one model step, or of several added together."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0

    def __add__(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.cached_prompt_tokens + other.cached_prompt_tokens,
        )


@dataclass
class StepOutput:
    """What one model step returned: its text outside tool calls, its calls and its tokens."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    finish_reason: str = "stop"

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, not {self.finish_reason!r}")

    @property
    def usage(self) -> TokenUsage:
        return TokenUsage(self.prompt_tokens, self.completion_tokens, self.cached_prompt_tokens)


# (messages in OpenAI chat form, tool_choice "auto" | "required") -> the step's output. The messages
# are the loop's snapshot for this step; the step may keep them.
ModelStep = Callable[[list[dict[str, Any]], str], Awaitable[StepOutput]]


@dataclass(frozen=True)
class AgentOptions:
    """A run's settings; each is checked here, naming the field."""

    tools: Sequence[str] | None = None  # the registry's tools the run may use; None or empty: all
    first_tool_choice: str = "auto"  # step 1's tool_choice; later steps are "auto" so the run can end
    max_steps: int = DEFAULT_MAX_STEPS
    timeout_s: float = DEFAULT_TIMEOUT_S  # the whole run
    tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S  # each tool call
    parallel_tool_calls: bool = True  # False: a step's first call only

    def __post_init__(self) -> None:
        if self.first_tool_choice not in TOOL_CHOICES:
            raise ValueError(
                f"first_tool_choice must be one of {TOOL_CHOICES}, not {self.first_tool_choice!r}"
            )
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int):
            raise ValueError(f"max_steps must be an integer, not {self.max_steps!r}")
        if not 1 <= self.max_steps <= MAX_STEPS_LIMIT:
            raise ValueError(f"max_steps must be between 1 and {MAX_STEPS_LIMIT}, not {self.max_steps}")
        for name in ("timeout_s", "tool_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")


class StopReason(StrEnum):
    ANSWERED = "answered"  # the model answered without calling a tool
    MAX_STEPS = "max_steps"  # max_steps steps all called tools
    LENGTH = "length"  # the last step hit max_tokens or the context window


@dataclass(frozen=True)
class Thought:
    """Text the model wrote in a step before its tool calls."""

    content: str


@dataclass(frozen=True)
class ToolCallStarted:
    """A tool call the model made, sent as it starts."""

    id: str
    name: str
    arguments: str  # the JSON text the model wrote


@dataclass(frozen=True)
class ToolResult:
    """A tool call's result or error, as the model reads it next step."""

    id: str
    name: str
    content: str
    is_error: bool


@dataclass(frozen=True)
class Answer:
    """The run's end: the answer (for MAX_STEPS, the last step's text) and the tokens of every step."""

    content: str
    stop_reason: StopReason
    steps: int
    usage: TokenUsage


AgentPayload = Thought | ToolCallStarted | ToolResult | Answer


@dataclass(frozen=True)
class AgentEvent:
    """One event of a run; ``usage`` is the step's tokens, on the step's first event only."""

    step: int  # the model step, from 1
    payload: AgentPayload
    elapsed_s: float  # since the run started
    duration_s: float  # the model step (thought, tool call, answer) or the tool call (tool result)
    usage: TokenUsage | None = None


class AgentTimeout(Exception):
    """The run went past its ``timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"agent run timed out after {timeout_s} s")
        self.timeout_s = timeout_s


@dataclass(frozen=True)
class _Outcome:
    content: str
    is_error: bool
    duration_s: float


class _StepEvents:
    """Makes one model step's events: the step's usage rides on the first, elapsed time on each."""

    def __init__(self, step: int, usage: TokenUsage, run_started: float) -> None:
        self._step = step
        self._usage: TokenUsage | None = usage
        self._run_started = run_started

    def __call__(self, payload: AgentPayload, duration_s: float) -> AgentEvent:
        usage, self._usage = self._usage, None
        return AgentEvent(self._step, payload, time.perf_counter() - self._run_started, duration_s, usage)


class _ToolFailure(Exception):
    """A call that becomes an error observation; the message is what the model reads."""


async def run_agent(
    step: ModelStep, registry: ToolRegistry, messages: list[dict[str, Any]], options: AgentOptions
) -> AsyncIterator[AgentEvent]:
    """Runs the loop over ``messages``, appending each step's assistant message and tool results to it
    (in call order), and the answer's assistant message at the end.

    ToolSelectionError (before any event) names a tool of ``options.tools`` the registry lacks;
    AgentTimeout ends a run past ``options.timeout_s``; the model step's own exceptions pass through.
    """
    allowed = [spec.name for spec in registry.specs(options.tools)]
    started = time.perf_counter()
    deadline = asyncio.get_running_loop().time() + options.timeout_s
    total = TokenUsage()
    content = ""
    tasks: list[asyncio.Task[_Outcome]] = []
    try:
        for number in range(1, options.max_steps + 1):
            choice = options.first_tool_choice if number == 1 else "auto"
            step_started = time.perf_counter()
            async with _run_deadline(deadline, options.timeout_s):
                output = await step(list(messages), choice)
            step_s = time.perf_counter() - step_started
            total += output.usage
            content = output.content
            event = _StepEvents(number, output.usage, started)

            if not output.tool_calls:
                messages.append({"role": "assistant", "content": content})
                reason = StopReason.LENGTH if output.finish_reason == "length" else StopReason.ANSWERED
                yield event(Answer(content, reason, number, total), step_s)
                return

            calls = output.tool_calls if options.parallel_tool_calls else output.tool_calls[:1]
            # Started before the first event is sent, so a slow consumer does not delay the tools.
            tasks = [
                asyncio.create_task(
                    _run_call(registry, call, allowed, options.tool_timeout_s), name=f"agent-tool-{call.id}"
                )
                for call in calls
            ]
            if content:
                yield event(Thought(content), step_s)
            for call in calls:
                yield event(ToolCallStarted(call.id, call.name, call.arguments), step_s)

            outcomes: list[_Outcome | None] = [None] * len(calls)
            pending = {task: index for index, task in enumerate(tasks)}
            while pending:
                async with _run_deadline(deadline, options.timeout_s):
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for index in sorted(pending.pop(task) for task in done):
                    outcome = outcomes[index] = tasks[index].result()
                    call = calls[index]
                    yield event(
                        ToolResult(call.id, call.name, outcome.content, outcome.is_error), outcome.duration_s
                    )
            tasks = []

            messages.append(
                {
                    "role": "assistant",
                    "content": content or None,
                    "tool_calls": [c.as_openai() for c in calls],
                }
            )
            messages.extend(
                {"role": "tool", "tool_call_id": call.id, "content": outcome.content}
                for call, outcome in zip(calls, outcomes, strict=True)
            )

        answer = Answer(content, StopReason.MAX_STEPS, options.max_steps, total)
        yield AgentEvent(options.max_steps, answer, time.perf_counter() - started, 0.0)
    finally:
        await _cancel(tasks)


@asynccontextmanager
async def _run_deadline(deadline: float, timeout_s: float) -> AsyncIterator[None]:
    # Scoped to one await at a time: at a yield the consumer's own code runs in the same task, and a
    # scope spanning it would cancel that code, not the run.
    scope = asyncio.timeout_at(deadline)
    try:
        async with scope:
            yield
    except TimeoutError:
        if scope.expired():
            raise AgentTimeout(timeout_s) from None
        raise


async def _cancel(tasks: list[asyncio.Task[_Outcome]]) -> None:
    running = [task for task in tasks if not task.done()]
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running)


async def _run_call(registry: ToolRegistry, call: ToolCall, allowed: list[str], timeout_s: float) -> _Outcome:
    started = time.perf_counter()
    try:
        content = await _invoke(registry, call, allowed, timeout_s)
    except _ToolFailure as failure:
        return _Outcome(f"error: {failure}", True, time.perf_counter() - started)
    return _Outcome(content, False, time.perf_counter() - started)


async def _invoke(registry: ToolRegistry, call: ToolCall, allowed: list[str], timeout_s: float) -> str:
    if call.name not in allowed:
        log.info("agent call %s: unknown tool %r", call.id, call.name)
        raise _ToolFailure(f"unknown tool {call.name!r}; the tools are {', '.join(allowed)}")
    arguments = _decode_arguments(call)
    scope = asyncio.timeout(timeout_s)
    try:
        async with scope:
            return await registry.call(call.name, arguments)
    except (InvalidArgumentsError, UnknownToolError) as exc:
        log.info("agent call %s: %s", call.id, exc)
        raise _ToolFailure(str(exc)) from None
    except TimeoutError as exc:
        if not scope.expired():
            raise _failed(call, exc) from None
        log.warning("agent call %s: tool %r timed out after %s s", call.id, call.name, timeout_s)
        raise _ToolFailure(f"tool {call.name!r} timed out after {float(timeout_s)} s") from None
    except Exception as exc:
        raise _failed(call, exc) from None


def _failed(call: ToolCall, exc: Exception) -> _ToolFailure:
    log.warning("agent call %s: tool %r failed: %s: %s", call.id, call.name, type(exc).__name__, exc)
    return _ToolFailure(f"tool {call.name!r} failed: {type(exc).__name__}: {exc}")


def _decode_arguments(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except (ValueError, TypeError, RecursionError) as exc:  # ValueError: also ints past Python's digit limit
        log.info("agent call %s: arguments of %r are not JSON", call.id, call.name)
        raise _ToolFailure(f"arguments of {call.name!r} are not valid JSON: {exc}") from None
    if not isinstance(arguments, dict):
        log.info("agent call %s: arguments of %r are not an object", call.id, call.name)
        raise _ToolFailure(
            f"arguments of {call.name!r} must be a JSON object, not {type(arguments).__name__}"
        )
    return arguments
