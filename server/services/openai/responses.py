"""OpenAI's Responses API (``/v1/responses``): a conversation of items in, output items out, kept.

The request is read into chat turns, tools and sampling fields and prepared by the same pieces as
chat completions (``preparation.prepare_chat``), run by the same ``EngineRunner``; its output is
read into items by ``server.responses.events``. With ``store`` (the default) the response and its
input items are kept under the caller's identity (``server.responses.store``), and a later request
names it as ``previous_response_id`` to continue the conversation: that response's conversation,
input and output come before the new input (its ``instructions`` do not).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import grpc
from google.protobuf import json_format, struct_pb2

from protoserve.engine.api import Constraint, FinishReason, RequestOutput
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.openai.v1 import responses_pb2 as rs
from protoserve.server import errors
from protoserve.server.models.chat_turn import ChatTurn
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.models.sampling_mapping import json_text
from protoserve.server.responses.events import EventNumbers, OutputItems, lifecycle
from protoserve.server.responses.items import chat_turns, new_id, read_input
from protoserve.server.responses.store import (
    MissingLink,
    ResponseStore,
    StoredItem,
    StoredResponse,
    StoreFull,
)
from protoserve.server.security.auth import Identity
from protoserve.server.services.openai.preparation import (
    PreparedRequest,
    SamplingFields,
    ToolsAsked,
    prepare_chat,
)
from protoserve.server.services.openai.streaming import EngineRunner, Generation
from protoserve.server.services.openai.translation import Violations, one_constraint, python_value
from protoserve.server.tool_calls.request import FUNCTION_NAME, tool_choice, tool_specs
from protoserve.v1.inference_pb2 import ErrorReason

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# Chat's field paths as the Responses request names them (its tools and choice are flat).
_PATH_RENAMES = (
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
)


@dataclass
class Turn:
    """A Responses request, checked and prepared: what it runs and what it keeps."""

    request: rs.CreateResponseRequest
    prepared: PreparedRequest
    input_items: list[rs.ResponseItem]
    tool_choice: struct_pb2.Value


def _renamed(violations: Violations, start: int) -> None:
    """Rename chat's paths among ``violations[start:]`` to this request's, in place."""
    for i in range(start, len(violations)):
        path, problem = violations[i]
        for pattern, replacement in _PATH_RENAMES:
            path = pattern.sub(replacement, path)
        violations[i] = (path, problem)


def _chat_tools(req: rs.CreateResponseRequest) -> list[oa.ChatCompletionTool]:
    """The flat Responses tools as chat's, which nest the function."""
    tools = []
    for tool in req.tools:
        function = oa.FunctionDefinition(name=tool.name, description=tool.description)
        if tool.HasField("parameters"):
            function.parameters.CopyFrom(tool.parameters)
        if tool.HasField("strict"):
            function.strict = tool.strict
        tools.append(oa.ChatCompletionTool(type=tool.type, function=function))
    return tools


def _chat_tool_choice(req: rs.CreateResponseRequest, violations: Violations) -> struct_pb2.Value | None:
    """``tool_choice`` in chat's form: a mode string, or ``{"type": "function", "name": ...}`` nested."""
    if not req.HasField("tool_choice"):
        return None
    value = python_value(req.tool_choice)
    if value is None or isinstance(value, str):
        return req.tool_choice
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "name"}:
        return json_format.ParseDict(
            {"type": "function", "function": {"name": value["name"]}}, struct_pb2.Value()
        )
    violations.append(
        ("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}')
    )
    return None


def _tools_asked(
    req: rs.CreateResponseRequest, violations: Violations
) -> tuple[ToolsAsked, struct_pb2.Value]:
    """The request's tools and choice (read as chat's are) and the choice as the response states it."""
    start = len(violations)
    chat = oa.CreateChatCompletionRequest(tools=_chat_tools(req))
    choice_value = _chat_tool_choice(req, violations)
    if choice_value is not None:
        chat.tool_choice.CopyFrom(choice_value)
    specs = tool_specs(chat.tools, violations)
    choice = tool_choice(chat, specs, violations)
    _renamed(violations, start)
    if req.HasField("parallel_tool_calls") and not req.tools:
        violations.append(("parallel_tool_calls", "only applies to requests with tools"))
    parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True
    stated = struct_pb2.Value(string_value=choice.mode.value)
    if choice.name:
        stated = json_format.ParseDict({"type": "function", "name": choice.name}, struct_pb2.Value())
    return ToolsAsked(specs, choice, parallel), stated


def _text_format(req: rs.CreateResponseRequest, violations: Violations) -> list[tuple[str, Constraint]]:
    """``text.format``: nothing for text, any JSON object, or JSON valid against a schema."""
    if not req.text.HasField("format"):
        return []
    fmt = req.text.format
    path = "text.format"
    if fmt.type not in ("text", "json_object", "json_schema"):
        violations.append((f"{path}.type", "must be text, json_object or json_schema"))
        return []
    if fmt.type != "json_schema":
        for name in ("name", "schema", "strict", "description"):
            if fmt.HasField(name):
                violations.append((f"{path}.{name}", "only applies to type json_schema"))
        return [(path, Constraint.json_object())] if fmt.type == "json_object" else []
    if not FUNCTION_NAME.fullmatch(fmt.name):
        violations.append((f"{path}.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -"))
    if not fmt.HasField("schema"):
        violations.append((f"{path}.schema", "must be set for type json_schema"))
        return []
    schema = json_text(json_format.MessageToDict(fmt.schema))
    return [(f"{path}.schema", Constraint.json_schema(schema))]


def _sampling_fields(req: rs.CreateResponseRequest, violations: Violations) -> SamplingFields:
    """The Responses sampling: temperature, top_p and seed by name, max_output_tokens, text.format."""
    converted: dict[str, object] = {}
    paths = {"max_tokens": "max_output_tokens"}
    if req.HasField("max_output_tokens"):
        converted["max_tokens"] = req.max_output_tokens
    constraint, constraint_paths = one_constraint(_text_format(req, violations), violations)
    converted["constraint"] = constraint
    paths.update(constraint_paths)
    # Unset, max_output_tokens is "until EOS or the context is full".
    return SamplingFields(req, {"max_tokens": None}, converted, paths)


def _settings_violations(req: rs.CreateResponseRequest, streaming: bool) -> Violations:
    """The request's fields this server takes only in some values: each other value named."""
    violations: Violations = []
    if req.stream and not streaming:
        violations.append(("stream", "true needs the streaming method; this one answers once"))
    if req.include:
        violations.append(("include", "no extra output can be included here; send an empty list"))
    if req.HasField("truncation") and req.truncation != "disabled":
        violations.append(("truncation", 'only "disabled" is supported: a conversation too long is refused'))
    if req.HasField("temperature") and not 0 <= req.temperature <= 2:
        violations.append(("temperature", "must be in [0, 2]"))
    if len(req.metadata) > MAX_METADATA_PAIRS:
        violations.append(("metadata", f"at most {MAX_METADATA_PAIRS} pairs"))
    for key, value in req.metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            violations.append(
                (
                    f"metadata.{errors.clip(key, MAX_METADATA_KEY_CHARS)}",
                    f"keys at most {MAX_METADATA_KEY_CHARS} characters, values at most {MAX_METADATA_VALUE_CHARS}",
                )
            )
            break
    return violations


def stored(req: rs.CreateResponseRequest) -> bool:
    """Whether the response is kept (``store``, true unless the request says false)."""
    return req.store if req.HasField("store") else True


class Responses:
    """The Responses surface: validation, conversation state, the unary response and the stream."""

    def __init__(self, models: ModelRegistry, runner: EngineRunner, store: ResponseStore | None) -> None:
        self.models = models
        self.runner = runner
        self.store = store

    # --- preparation ------------------------------------------------------------------------

    async def prepare(self, req: rs.CreateResponseRequest, identity: Identity, *, streaming: bool) -> Turn:
        served, adapter = self.models.resolve(req.model)
        violations = _settings_violations(req, streaming)
        value = python_value(req.input) if req.HasField("input") else None
        input_items = read_input(value, violations)
        history = await self._history(req, identity)
        turns = [ChatTurn("system", req.instructions)] if req.HasField("instructions") else []
        turns += chat_turns(history + input_items)
        fields = _sampling_fields(req, violations)
        tools, stated_choice = _tools_asked(req, violations)
        prepared = await prepare_chat(
            served, turns, fields, violations, tools=tools, adapter=adapter, messages_path="input"
        )
        if stored(req):
            await self._check_room(identity, input_items)
        return Turn(req, prepared, input_items, stated_choice)

    async def _history(self, req: rs.CreateResponseRequest, identity: Identity) -> list[rs.ResponseItem]:
        """The conversation ``previous_response_id`` continues: each earlier response's input, then
        its output. Another identity's response, or none, is NOT_FOUND."""
        if not req.HasField("previous_response_id"):
            return []
        store = self.stored_responses()
        try:
            chain = await asyncio.to_thread(store.chain, identity.id, req.previous_response_id)
        except MissingLink as gone:
            raise errors.response_not_found(
                f"previous_response_id: response {errors.echo(gone.response_id)}, earlier in this "
                "conversation, was deleted"
            ) from None
        if chain is None:
            raise errors.response_not_found(
                f"previous_response_id: no stored response {errors.echo(req.previous_response_id)}"
            )
        items: list[rs.ResponseItem] = []
        for earlier in chain:
            items += [rs.ResponseItem.FromString(item.body) for item in earlier.items]
            items += list(rs.Response.FromString(earlier.body).output)
        return items

    async def _check_room(self, identity: Identity, items: list[rs.ResponseItem]) -> None:
        incoming = sum(item.ByteSize() for item in items)
        try:
            await asyncio.to_thread(
                self.stored_responses().check_room, identity.id, identity.quota_id, incoming
            )
        except StoreFull as exc:
            raise errors.quota_exceeded(str(exc)) from None

    def stored_responses(self) -> ResponseStore:
        """The store; FAILED_PRECONDITION when the server keeps no responses."""
        if self.store is None:
            raise errors.feature_disabled("stored responses need the server's data directory")
        return self.store

    # --- the response -----------------------------------------------------------------------

    @staticmethod
    def _response(turn: Turn, generation: Generation, status: str) -> rs.Response:
        req = turn.request
        response = rs.Response(
            id=generation.public_id,
            object="response",
            created_at=generation.created,
            status=status,
            model=turn.prepared.model,
            parallel_tool_calls=req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True,
            tool_choice=turn.tool_choice,
            tools=req.tools,
            truncation="disabled",
            store=stored(req),
            metadata=req.metadata,
        )
        response.text.format.type = "text"
        if req.HasField("text"):
            response.text.CopyFrom(req.text)
        for name in ("instructions", "max_output_tokens", "previous_response_id", "temperature", "top_p"):
            if req.HasField(name):
                setattr(response, name, getattr(req, name))
        return response

    @staticmethod
    def _finish(response: rs.Response, generation: Generation, output: OutputItems) -> None:
        """The finished response: its output, status and usage."""
        result = generation.results[0]
        response.status = Responses._status(generation)
        if response.status == "incomplete":
            response.incomplete_details.reason = "max_output_tokens"
        del response.output[:]
        response.output.extend(output.items)
        usage = response.usage
        usage.input_tokens = result.prompt_tokens
        usage.input_tokens_details.cached_tokens = result.cached_prompt_tokens
        usage.output_tokens = result.completion_tokens
        usage.output_tokens_details.reasoning_tokens = 0
        usage.total_tokens = result.prompt_tokens + result.completion_tokens

    async def _keep(self, turn: Turn, identity: Identity, response: rs.Response, created: float) -> None:
        if not stored(turn.request):
            return
        kept = StoredResponse(
            id=response.id,
            body=response.SerializeToString(),
            previous_id=turn.request.previous_response_id or None,
            created_at=created,
            items=tuple(StoredItem(item.id, item.SerializeToString()) for item in turn.input_items),
        )
        await asyncio.to_thread(self.stored_responses().put, identity.id, identity.quota_id, kept)

    @staticmethod
    def _status(generation: Generation) -> str:
        """``cancelled`` (CancelRequest, a deadline), ``incomplete`` (max_output_tokens) or ``completed``."""
        reasons = {c.finish_reason for c in generation.results[0].choices}
        if FinishReason.CANCELLED in reasons:
            return "cancelled"
        return "incomplete" if FinishReason.LENGTH in reasons else "completed"

    @staticmethod
    def _item_status(generation: Generation) -> str:
        """The last output item's: a message cut short by either is ``incomplete``."""
        return "completed" if Responses._status(generation) == "completed" else "incomplete"

    async def create(
        self, req: rs.CreateResponseRequest, context: grpc.aio.ServicerContext, identity: Identity
    ) -> rs.CreateResponseResponse:
        """Answer once: the whole output, read into items as the stream would have sent them."""
        turn = await self.prepare(req, identity, streaming=False)
        generation = Generation(turn.prepared, new_id("resp"))
        await self.runner.run(context, identity, generation)
        output = OutputItems(turn.prepared.tools)
        choice = generation.results[0].choices[0]
        output.feed(choice.text, True)
        output.finish(self._item_status(generation))
        response = self._response(turn, generation, "in_progress")
        self._finish(response, generation, output)
        await self._keep(turn, identity, response, time.time())
        return rs.CreateResponseResponse(response=response)

    async def create_stream(
        self, request: rs.CreateResponseStreamRequest, context: grpc.aio.ServicerContext, identity: Identity
    ) -> None:
        """Stream the typed events; a failure once the stream began is a ``response.failed`` event."""
        turn = await self.prepare(request.request, identity, streaming=True)
        generation = Generation(turn.prepared, new_id("resp"))
        response = self._response(turn, generation, "in_progress")
        output = OutputItems(turn.prepared.tools)
        numbers = EventNumbers()
        started = False

        async def write(*events: rs.CreateResponseStreamResponse) -> None:
            for event in events:
                await context.write(numbers.number(event))

        async def on_output(_: int, engine_output: RequestOutput) -> None:
            nonlocal started
            if not started:
                # The engine has taken the request: its refusals came before, as a plain status.
                started = True
                await write(
                    lifecycle("response.created", response), lifecycle("response.in_progress", response)
                )
            for delta in engine_output.deltas:
                await write(*output.feed(delta.text, delta.finish_reason is not None))

        try:
            await self.runner.run(context, identity, generation, on_output)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine's too (a model unloaded mid-stream)
            if not started:
                raise
            failure = errors.to_service_error(exc)
            await write(*output.finish("incomplete"))
            response.status = "failed"
            # OpenAI's error codes are lower case, as the gateway writes the ErrorInfo reason.
            response.error.code = ErrorReason.Name(failure.reason).removeprefix("ERROR_REASON_").lower()
            response.error.message = failure.message
            response.output.extend(output.items)
            await write(lifecycle("response.failed", response))
            return
        await write(*output.finish(self._item_status(generation)))
        self._finish(response, generation, output)
        await self._keep(turn, identity, response, time.time())
        # OpenAI has no event for a cancelled response: it did not complete.
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        await write(lifecycle(kind, response))
