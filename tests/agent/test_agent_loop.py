"""The agent loop with scripted model steps: concurrency, error observations, limits, cancellation."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import pytest

from protoserve.server.agent.loop import (
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
from protoserve.server.agent.tool_registry import (
    FunctionTool,
    ToolRegistry,
    ToolSelectionError,
    builtin_tools,
)
from protoserve.server.tool_calls.call import ToolCall, ToolSpec

SLEEP_SCHEMA = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}
ANY_SCHEMA = {"type": "object", "properties": {}}


class Script:
    """A fake model: step i returns outputs[i] (or what a callable of it returns), recording its inputs."""

    def __init__(self, *outputs: StepOutput | Callable[[], Any]) -> None:
        self.outputs = list(outputs)
        self.seen: list[tuple[list[dict[str, Any]], str]] = []

    async def __call__(self, messages: list[dict[str, Any]], tool_choice: str) -> StepOutput:
        self.seen.append(([dict(m) for m in messages], tool_choice))
        output = self.outputs[len(self.seen) - 1]
        return await output() if callable(output) else output


def call(name: str, arguments: Any, call_id: str | None = None) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(call_id or f"call_{name}", name, text)


def calls_step(*calls: ToolCall, content: str = "", prompt: int = 10, completion: int = 5) -> StepOutput:
    return StepOutput(content, list(calls), prompt, completion, 0, "tool_calls")


def answer_step(
    content: str = "done", prompt: int = 20, completion: int = 3, finish: str = "stop"
) -> StepOutput:
    return StepOutput(content, [], prompt, completion, 0, finish)


class Tools:
    """Test tools: ``sleep`` (seconds), ``boom`` (raises), ``forever`` (60 s, records its cancellation)."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.started: list[str] = []

    async def sleep(self, arguments: dict) -> str:
        self.started.append("sleep")
        await asyncio.sleep(arguments["seconds"])
        return f"slept {arguments['seconds']}"

    async def boom(self, arguments: dict) -> str:
        raise RuntimeError("the tool broke")

    async def forever(self, arguments: dict) -> str:
        self.started.append("forever")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.append("forever")
            raise
        return "never"

    def registry(self) -> ToolRegistry:
        tools = [
            FunctionTool(ToolSpec("sleep", "", SLEEP_SCHEMA), self.sleep),
            FunctionTool(ToolSpec("boom", "", ANY_SCHEMA), self.boom),
            FunctionTool(ToolSpec("forever", "", ANY_SCHEMA), self.forever),
        ]
        return ToolRegistry([(tool, "built-in") for tool in builtin_tools()] + [(t, "test") for t in tools])


async def collect(step, registry, messages, **options) -> list[AgentEvent]:
    async with aclosing(run_agent(step, registry, messages, AgentOptions(**options))) as events:
        return [event async for event in events]


def payloads(events: list[AgentEvent], kind: type) -> list[Any]:
    return [e.payload for e in events if isinstance(e.payload, kind)]


async def test_one_step_runs_its_calls_concurrently_and_keeps_call_order() -> None:
    tools = Tools()
    script = Script(
        calls_step(call("sleep", {"seconds": 1}, "call_a"), call("sleep", {"seconds": 1}, "call_b")),
        answer_step(),
    )
    messages = [{"role": "user", "content": "sleep twice"}]
    started = time.perf_counter()
    events = await collect(script, tools.registry(), messages)
    assert time.perf_counter() - started < 1.5
    results = payloads(events, ToolResult)
    assert {r.id for r in results} == {"call_a", "call_b"}
    assert all(not r.is_error and r.content == "slept 1" for r in results)
    assert [e.duration_s for e in events if isinstance(e.payload, ToolResult)] == pytest.approx(
        [1.0, 1.0], abs=0.3
    )
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            call("sleep", {"seconds": 1}, "call_a").as_openai(),
            call("sleep", {"seconds": 1}, "call_b").as_openai(),
        ],
    }
    assert messages[2:4] == [
        {"role": "tool", "tool_call_id": "call_a", "content": "slept 1"},
        {"role": "tool", "tool_call_id": "call_b", "content": "slept 1"},
    ]
    assert messages[4] == {"role": "assistant", "content": "done"}
    assert script.seen[1][0] == messages[:4]  # step 2 read the results


async def test_results_come_in_completion_order_messages_in_call_order() -> None:
    script = Script(
        calls_step(
            call("sleep", {"seconds": 0.3}, "call_slow"), call("sleep", {"seconds": 0.01}, "call_fast")
        ),
        answer_step(),
    )
    messages = [{"role": "user", "content": "go"}]
    events = await collect(script, Tools().registry(), messages)
    kinds = [(type(e.payload).__name__, getattr(e.payload, "id", None)) for e in events]
    assert kinds == [
        ("ToolCallStarted", "call_slow"),
        ("ToolCallStarted", "call_fast"),
        ("ToolResult", "call_fast"),
        ("ToolResult", "call_slow"),
        ("Answer", None),
    ]
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == ["call_slow", "call_fast"]
    elapsed = [e.elapsed_s for e in events]
    assert elapsed == sorted(elapsed)


async def test_failed_calls_are_error_observations_and_the_run_goes_on(caplog) -> None:
    caplog.set_level(logging.INFO, logger="protoserve.server.agent")
    step_calls = [
        call("sleep", {"seconds": 5}, "call_timeout"),
        call("boom", {}, "call_raise"),
        call("nope", {}, "call_unknown"),
        call("calculator", '{"expression": ', "call_bad_json"),
        call("calculator", "[1, 2]", "call_not_object"),
        call("calculator", {"expression": 3}, "call_schema"),
        call("calculator", {"expression": "1/0"}, "call_tool_value_error"),
        call("calculator", {"expression": "6*7"}, "call_ok"),
    ]
    script = Script(calls_step(*step_calls), answer_step("the answer is 42"))
    messages = [{"role": "user", "content": "try everything"}]
    started = time.perf_counter()
    events = await collect(script, Tools().registry(), messages, tool_timeout_s=0.2)
    assert time.perf_counter() - started < 1.0

    results = {r.id: r for r in payloads(events, ToolResult)}
    expected = {
        "call_timeout": "error: tool 'sleep' timed out after 0.2 s",
        "call_raise": "error: tool 'boom' failed: RuntimeError: the tool broke",
        "call_unknown": "error: unknown tool 'nope'; the tools are boom, calculator, forever, sleep",
        "call_not_object": "error: arguments of 'calculator' must be a JSON object, not list",
        "call_schema": "error: invalid arguments for 'calculator': $.expression: 3 is not of type 'string'",
        "call_tool_value_error": "error: tool 'calculator' failed: ValueError: division by zero",
    }
    for call_id, content in expected.items():
        assert (results[call_id].content, results[call_id].is_error) == (content, True)
    assert results["call_bad_json"].is_error
    assert results["call_bad_json"].content.startswith(
        "error: arguments of 'calculator' are not valid JSON: "
    )
    assert (results["call_ok"].content, results["call_ok"].is_error) == ("42", False)

    tool_messages = [m for m in messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == [c.id for c in step_calls]
    assert tool_messages[0]["content"] == expected["call_timeout"]
    assert payloads(events, Answer)[0].content == "the answer is 42"

    assert "Traceback" not in caplog.text
    assert all(r.exc_info is None for r in caplog.records)
    assert any("timed out" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


async def test_a_tool_outside_the_run_selection_is_unknown() -> None:
    script = Script(calls_step(call("sleep", {"seconds": 0})), answer_step())
    events = await collect(
        script, Tools().registry(), [{"role": "user", "content": "x"}], tools=["calculator"]
    )
    (result,) = payloads(events, ToolResult)
    assert (result.content, result.is_error) == (
        "error: unknown tool 'sleep'; the tools are calculator",
        True,
    )


async def test_an_unknown_tool_in_the_options_fails_before_any_step() -> None:
    script = Script(answer_step())
    with pytest.raises(ToolSelectionError) as info:
        await collect(script, Tools().registry(), [], tools=["calculator", "web_search"])
    assert (info.value.name, info.value.index) == ("web_search", 1)
    assert script.seen == []


async def test_max_steps_ends_with_the_last_steps_text() -> None:
    script = Script(
        *[calls_step(call("calculator", {"expression": f"{i}+1"}), content=f"thinking {i}") for i in range(3)]
    )
    messages = [{"role": "user", "content": "loop"}]
    events = await collect(script, Tools().registry(), messages, max_steps=3)
    assert len(script.seen) == 3
    last = events[-1]
    assert last.payload == Answer("thinking 2", StopReason.MAX_STEPS, 3, TokenUsage(30, 15, 0))
    assert (last.step, last.usage, last.duration_s) == (3, None, 0.0)
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["1", "2", "3"]


async def test_length_and_answered_stop_reasons() -> None:
    events = await collect(Script(answer_step("cut", finish="length")), Tools().registry(), [])
    assert events[-1].payload.stop_reason == StopReason.LENGTH
    events = await collect(Script(answer_step("fine")), Tools().registry(), [])
    assert events[-1].payload == Answer("fine", StopReason.ANSWERED, 1, TokenUsage(20, 3, 0))


async def test_first_tool_choice_applies_to_step_one_only() -> None:
    script = Script(
        calls_step(call("calculator", {"expression": "1"})),
        calls_step(call("calculator", {"expression": "2"})),
        answer_step(),
    )
    await collect(script, Tools().registry(), [], first_tool_choice="required")
    assert [choice for _, choice in script.seen] == ["required", "auto", "auto"]
    script = Script(answer_step())
    await collect(script, Tools().registry(), [])
    assert [choice for _, choice in script.seen] == ["auto"]


async def test_usage_rides_on_each_steps_first_event() -> None:
    script = Script(
        calls_step(
            call("calculator", {"expression": "1"}, "c1"),
            call("calculator", {"expression": "2"}, "c2"),
            content="let me add",
            prompt=11,
            completion=7,
        ),
        calls_step(call("calculator", {"expression": "3"}, "c3"), prompt=12, completion=8),
        StepOutput("4", [], 13, 9, 6, "stop"),
    )
    events = await collect(script, Tools().registry(), [])
    shape = [(e.step, type(e.payload).__name__, e.usage) for e in events]
    step1, step2 = TokenUsage(11, 7, 0), TokenUsage(12, 8, 0)
    assert shape == [
        (1, "Thought", step1),
        (1, "ToolCallStarted", None),
        (1, "ToolCallStarted", None),
        (1, "ToolResult", None),
        (1, "ToolResult", None),
        (2, "ToolCallStarted", step2),
        (2, "ToolResult", None),
        (3, "Answer", TokenUsage(13, 9, 6)),
    ]
    assert events[0].payload == Thought("let me add")
    assert events[1].payload == ToolCallStarted("c1", "calculator", '{"expression": "1"}')
    assert events[-1].payload.usage == TokenUsage(36, 24, 6)
    assert events[-1].payload.steps == 3


async def test_durations_are_the_model_steps_and_the_tools() -> None:
    async def slow_step() -> StepOutput:
        await asyncio.sleep(0.2)
        return calls_step(call("sleep", {"seconds": 0.1}), content="hm")

    events = await collect(Script(slow_step, answer_step()), Tools().registry(), [])
    thought, started, result, answer = events
    assert thought.duration_s == started.duration_s == pytest.approx(0.2, abs=0.1)
    assert result.duration_s == pytest.approx(0.1, abs=0.08)
    assert result.elapsed_s == pytest.approx(0.3, abs=0.1)
    assert answer.duration_s < 0.05


async def test_parallel_tool_calls_false_keeps_the_first_call_only() -> None:
    tools = Tools()
    script = Script(
        calls_step(call("sleep", {"seconds": 0}, "first"), call("forever", {}, "second")), answer_step()
    )
    messages: list[dict[str, Any]] = []
    events = await collect(script, tools.registry(), messages, parallel_tool_calls=False)
    assert [p.id for p in payloads(events, ToolCallStarted)] == ["first"]
    assert [p.id for p in payloads(events, ToolResult)] == ["first"]
    assert tools.started == ["sleep"]
    assert [c["id"] for c in messages[0]["tool_calls"]] == ["first"]
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == ["first"]


async def test_the_run_timeout_raises_during_a_step() -> None:
    async def hanging_step() -> StepOutput:
        await asyncio.sleep(60)
        raise AssertionError("unreachable")

    started = time.perf_counter()
    with pytest.raises(AgentTimeout, match="timed out after 0.2 s"):
        await collect(Script(hanging_step), Tools().registry(), [], timeout_s=0.2)
    assert time.perf_counter() - started < 0.5


async def test_the_run_timeout_raises_during_tools_and_cancels_them() -> None:
    tools = Tools()
    script = Script(calls_step(call("forever", {})), answer_step())
    started = time.perf_counter()
    with pytest.raises(AgentTimeout):
        await collect(script, tools.registry(), [], timeout_s=0.3)
    assert time.perf_counter() - started < 0.6
    assert tools.cancelled == ["forever"]


async def test_closing_the_generator_cancels_running_tools() -> None:
    tools = Tools()
    script = Script(
        calls_step(call("forever", {}), call("sleep", {"seconds": 60}, "call_sleep")), answer_step()
    )
    async with aclosing(run_agent(script, tools.registry(), [], AgentOptions())) as events:
        async for event in events:
            if isinstance(event.payload, ToolCallStarted):
                await asyncio.sleep(0.05)  # let the tools start
                break
        started = time.perf_counter()
    assert time.perf_counter() - started < 0.2
    assert tools.cancelled == ["forever"]
    assert tools.started == ["forever", "sleep"]
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_cancelling_the_consumer_cancels_running_tools() -> None:
    tools = Tools()
    script = Script(calls_step(call("forever", {})), answer_step())
    seen: list[AgentEvent] = []

    async def consume() -> None:
        async with aclosing(run_agent(script, tools.registry(), [], AgentOptions())) as events:
            async for event in events:
                seen.append(event)

    task = asyncio.create_task(consume())
    while not tools.started:
        await asyncio.sleep(0.01)
    started = time.perf_counter()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.perf_counter() - started < 0.2
    assert tools.cancelled == ["forever"]
    assert [type(e.payload) for e in seen] == [ToolCallStarted]
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_cancelling_the_consumer_cancels_the_model_step() -> None:
    step_cancelled = asyncio.Event()

    async def hanging_step() -> StepOutput:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            step_cancelled.set()
            raise
        raise AssertionError("unreachable")

    task = asyncio.create_task(collect(Script(hanging_step), Tools().registry(), []))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert step_cancelled.is_set()


async def test_a_model_step_error_passes_through() -> None:
    async def failing_step() -> StepOutput:
        raise RuntimeError("engine down")

    with pytest.raises(RuntimeError, match="engine down"):
        await collect(Script(failing_step), Tools().registry(), [])


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"first_tool_choice": "none"}, "first_tool_choice"),
        ({"max_steps": 0}, "max_steps"),
        ({"max_steps": 33}, "max_steps"),
        ({"max_steps": 2.5}, "max_steps"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"tool_timeout_s": -1}, "tool_timeout_s"),
    ],
)
def test_bad_options_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        AgentOptions(**options)


def test_step_output_checks_its_finish_reason() -> None:
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        StepOutput("x", [], 0, 0, 0, "eos")
