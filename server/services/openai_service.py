"""OpenAIService: OpenAI's completions and chat completions over gRPC.

Built on the same served model (validation, tokenization, chat template) and
in-flight registry (cancel, deadline, abort on disconnect) as InferenceService,
so only the shapes differ: ids ``cmpl-…``/``chatcmpl-…``, ``created`` unix
seconds, ``object`` strings, ``system_fingerprint``, OpenAI's logprob layouts
and its defaults (completions: ``max_tokens`` 16; chat: unset means until
EOS or the context is full).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format, struct_pb2

from protoserve.engine.request import (
    CompletionDelta,
    FinishReason,
    PositionLogprobs,
    RequestOutput,
    TokenizedRequest,
)
from protoserve.engine.sampling.constraints.constraint import Constraint
from protoserve.engine.sampling.sampling_params import ContextPolicy, SamplingParams
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.openai.v1 import openai_pb2_grpc
from protoserve.server import errors
from protoserve.server.calls.admission import AdmittingServicer
from protoserve.server.calls.inflight import Call
from protoserve.server.limits import (
    MAX_CHAT_MESSAGES,
    MAX_COMPLETION_PROMPTS,
    MAX_LOGIT_BIAS_ENTRIES,
    OPENAI_MAX_STOP_STRINGS,
)
from protoserve.server.models.chat_turn import ChatTurn
from protoserve.server.models.sampling_mapping import json_text
from protoserve.server.models.served_model import CollectedOutput, ServedModel, new_request_id
from protoserve.server.security.auth import Identity
from protoserve.server.services.embeddings import Retrieval, embeddings_disabled
from protoserve.server.services.inference_service import call_deadline
from protoserve.server.tool_calls.call import ToolChoiceMode, ToolSpec
from protoserve.server.tool_calls.parsers import (
    CallArguments,
    CallStart,
    Content,
    StreamedOutput,
    parse_output,
)
from protoserve.server.tool_calls.request import (
    ToolPlan,
    message_tool_calls,
    tool_call_id,
    tool_choice,
    tool_constraint,
    tool_specs,
)

SERVER_VERSION = "protoserve-0.1.0"
MAX_COMPLETION_LOGPROBS = 5  # the completions API's `logprobs` range is 0-5
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "cancelled",
}

T = TypeVar("T")
_Found = tuple[str, Constraint]  # an output constraint and the request field it came from


def system_fingerprint(served: ServedModel) -> str:
    """Identifies the server build and how the model was loaded, as OpenAI's fingerprint does."""
    card = served.card
    key = f"{SERVER_VERSION}|{served.name}|{card.dtype}|{card.quantization}|{card.source}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def finish_reason_text(reason: FinishReason | None) -> str:
    return FINISH_REASONS.get(reason, "") if reason is not None else ""


def _python_value(value: struct_pb2.Value) -> Any:
    return json_format.MessageToDict(value)


def _as_token_ids(items: list[Any]) -> list[int] | None:
    """A JSON list of integral numbers as ints; None when it is anything else."""
    if not all(
        isinstance(x, float | int) and not isinstance(x, bool) and float(x).is_integer() for x in items
    ):
        return None
    return [int(x) for x in items]


def _stop_strings(req: Any, violations: list[tuple[str, str]]) -> list[str]:
    if not req.HasField("stop"):
        return []
    stop = _python_value(req.stop)
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > OPENAI_MAX_STOP_STRINGS:
            violations.append(("stop", f"at most {OPENAI_MAX_STOP_STRINGS} stop strings"))
        return stop
    violations.append(("stop", "must be a string or a list of strings"))
    return []


def _logit_bias(bias: Any, violations: list[tuple[str, str]]) -> dict[int, float]:
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        violations.append(("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries"))
        return {}
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            violations.append(("logit_bias", f"key {errors.echo(key)} is not a token id"))
    return out


def _stream_field_violations(req: Any, streaming: bool) -> list[tuple[str, str]]:
    """Stream settings on a unary call, which would otherwise be ignored."""
    if streaming:
        return []
    violations = []
    if req.stream:
        violations.append(("stream", "true needs the streaming method; this one answers once"))
    if req.HasField("stream_options"):
        violations.append(("stream_options", "only applies to streamed responses"))
    return violations


def _converted_sampling(
    req: oa.CreateCompletionRequest | oa.CreateChatCompletionRequest, violations: list[tuple[str, str]]
) -> dict[str, Any]:
    """The sampling fields whose OpenAI form is not the engine's, converted; the rest map by name."""
    converted: dict[str, Any] = {}
    if req.HasField("top_k"):
        if req.top_k < -1:
            violations.append(("top_k", "must be -1, 0 (disabled) or positive"))
        converted["top_k"] = max(req.top_k, 0)  # vLLM's -1 is the engine's 0: disabled
    converted["logit_bias"] = _logit_bias(req.logit_bias, violations)
    converted["stop"] = _stop_strings(req, violations)
    return converted


def _response_format(
    req: oa.CreateCompletionRequest | oa.CreateChatCompletionRequest, violations: list[tuple[str, str]]
) -> list[_Found]:
    """OpenAI's ``response_format``: nothing for text, any JSON object, or JSON valid against a schema."""
    if not req.HasField("response_format"):
        return []
    fmt = req.response_format
    if fmt.type not in ("text", "json_object", "json_schema"):
        violations.append(("response_format.type", "must be text, json_object or json_schema"))
        return []
    if fmt.type != "json_schema":
        if fmt.HasField("json_schema"):
            violations.append(("response_format.json_schema", "only applies to type json_schema"))
        return [("response_format", Constraint.json_object())] if fmt.type == "json_object" else []
    if not fmt.json_schema.HasField("schema"):
        violations.append(("response_format.json_schema.schema", "must be set for type json_schema"))
        return []
    schema = json_text(json_format.MessageToDict(fmt.json_schema.schema))
    return [("response_format.json_schema.schema", Constraint.json_schema(schema))]


def _structured_outputs(req: Any, violations: list[tuple[str, str]]) -> list[_Found]:
    """vLLM's ``structured_outputs`` extension: each kind it sets, with its path."""
    if not req.HasField("structured_outputs"):
        return []
    so = req.structured_outputs
    found: list[_Found] = []
    known = len(violations)
    if so.HasField("json"):
        schema = _python_value(so.json)
        if isinstance(schema, str | dict):
            text = schema if isinstance(schema, str) else json_text(schema)
            found.append(("structured_outputs.json", Constraint.json_schema(text)))
        else:
            violations.append(("structured_outputs.json", "must be a JSON Schema object or a string of one"))
    if so.HasField("regex"):
        found.append(("structured_outputs.regex", Constraint.regex(so.regex)))
    if so.choice:
        found.append(("structured_outputs.choice", Constraint.choice(list(so.choice))))
    if so.HasField("grammar"):
        found.append(("structured_outputs.grammar", Constraint.grammar(so.grammar)))
    if so.HasField("json_object"):
        if so.json_object:
            found.append(("structured_outputs.json_object", Constraint.json_object()))
        else:
            violations.append(("structured_outputs.json_object", "must be true, or left out"))
    if not found and len(violations) == known:
        violations.append(("structured_outputs", "set one of json, regex, choice, grammar or json_object"))
    return found


def _output_constraint(
    req: Any, violations: list[tuple[str, str]]
) -> tuple[Constraint | None, dict[str, str]]:
    """The request's one output constraint and the path map from its engine field to the request's own
    field; a second one is refused naming it (nothing could honour both)."""
    found = _response_format(req, violations) + _structured_outputs(req, violations)
    if not found:
        return None, {}
    for path, _ in found[1:]:
        violations.append((path, f"cannot be combined with {found[0][0]}; set one output constraint"))
    path, constraint = found[0]
    return constraint, {constraint.field: path}


def _chat_delta(event: Content | CallStart | CallArguments) -> oa.ChatCompletionDelta:
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


def _with_role(index: int, choices: list[oa.ChatCompletionChunkChoice]) -> list[oa.ChatCompletionChunkChoice]:
    """A choice's first chunks with its role, as OpenAI streams a reply that may call tools: a first
    call carries the role with content null (the unary message's content when it only calls tools);
    text follows a role chunk of its own with content ""."""
    first = choices[0].delta
    if first.HasField("content") or (len(choices) == 1 and choices[0].finish_reason):
        role = oa.ChatCompletionDelta(role="assistant", content="")
        return [oa.ChatCompletionChunkChoice(index=index, delta=role), *choices]
    first.role = "assistant"
    return choices


def _embedding_inputs(value: Any, violations: list[tuple[str, str]]) -> tuple[list[str], list[list[int]] | None]:
    """OpenAI's input forms: a string, strings, token ids, or lists of token ids (texts, or ids)."""
    if isinstance(value, str):
        return [value], None
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return value, None
        ids = _as_token_ids(value)
        if ids is not None:
            return [], [ids]
        lists = [_as_token_ids(item) if isinstance(item, list) else None for item in value]
        if all(item is not None for item in lists):
            return [], lists
    violations.append(("input", "must be a string, a list of strings, token ids or lists of token ids"))
    return [], None


async def _merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's index.

    The first stream to fail fails the merge; leaving early cancels the rest.
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item, None))
            queue.put_nowait((index, done, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((index, None, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class _Prompt:
    """One prompt of a request: its token ids and, for echo, its text."""

    token_ids: list[int]
    text: str


@dataclass
class _Prepared:
    """A validated OpenAI request, ready for the engine."""

    served: ServedModel
    prompts: list[_Prompt]
    sampling: SamplingParams
    echo: bool = False
    tools: ToolPlan | None = None  # set when the model may call tools: its output is parsed for calls
    adapter: str | None = None  # the LoRA adapter `model` named, if it named one
    constraint_field: str = ""  # the request's field holding its output constraint, if it has one

    @property
    def model(self) -> str:
        """The ``model`` the response names: the adapter asked for (as vLLM answers), else the model."""
        return self.adapter or self.served.name


@dataclass(frozen=True)
class _Api:
    """What tells the completions and the chat completions responses apart around their choices."""

    id_prefix: str  # of the response id
    chunk_object: str  # the ``object`` of a streamed chunk
    chunk_type: type[oa.CreateCompletionStreamResponse] | type[oa.CreateChatCompletionStreamResponse]


COMPLETIONS = _Api("cmpl", "text_completion", oa.CreateCompletionStreamResponse)
CHAT_COMPLETIONS = _Api("chatcmpl", "chat.completion.chunk", oa.CreateChatCompletionStreamResponse)


class _OffsetTracker:
    """Character offsets of completion tokens (OpenAI's ``text_offset``), per choice."""

    def __init__(self) -> None:
        self.offsets: dict[int, int] = {}

    def take(self, choice: int, texts: list[str], start: int = 0) -> list[int]:
        offset = self.offsets.setdefault(choice, start)
        out = []
        for text in texts:
            out.append(offset)
            offset += len(text)
        self.offsets[choice] = offset
        return out


class OpenAIService(AdmittingServicer, openai_pb2_grpc.OpenAIServiceServicer):
    """OpenAI-compatible completions, chat completions, embeddings and models over gRPC."""

    def __init__(self, *services: Any, retrieval: Retrieval | None = None) -> None:
        super().__init__(*services)
        self.retrieval = retrieval or Retrieval()

    # ---- request preparation -----------------------------------------------------------

    async def _prepare_completion(self, req: oa.CreateCompletionRequest, *, streaming: bool) -> _Prepared:
        served, adapter = self.models.resolve(req.model)
        violations = _stream_field_violations(req, streaming)
        prompts = await self._completion_prompts(served, req, violations)
        if req.HasField("logprobs") and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
            violations.append(("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}]"))
        if req.echo and req.HasField("logprobs"):
            # Echoed prompt tokens would need prompt logprobs, which the engine does not compute.
            violations.append(("echo", "cannot be combined with logprobs"))
        constraint, paths = _output_constraint(req, violations)
        sampling = served.sampling.params(
            req,
            api_defaults={"max_tokens": DEFAULT_COMPLETION_MAX_TOKENS},
            **_converted_sampling(req, violations),
            # This API's logprobs is the number of alternatives: set at all, it asks for logprobs.
            logprobs=req.HasField("logprobs"),
            top_logprobs=min(max(req.logprobs, 0), MAX_COMPLETION_LOGPROBS),
            constraint=constraint,
        )
        paths["top_logprobs"] = "logprobs"
        served.sampling.check(sampling, paths, violations)
        constraint_field = await served.check_constraint(sampling.constraint, paths)
        return _Prepared(
            served, prompts, sampling, echo=req.echo, adapter=adapter, constraint_field=constraint_field
        )

    async def _completion_prompts(
        self, served: ServedModel, req: oa.CreateCompletionRequest, violations: list[tuple[str, str]]
    ) -> list[_Prompt]:
        """OpenAI's prompt forms: a string, strings, token ids, or lists of token ids."""
        value = _python_value(req.prompt) if req.HasField("prompt") else None
        if isinstance(value, str):
            value = [value]
        elif isinstance(value, list) and value and _as_token_ids(value) is not None:
            value = [value]
        if not isinstance(value, list) or not value:
            violations.append(("prompt", "must be a string, a list of strings or a list of token id lists"))
            return []
        if len(value) > MAX_COMPLETION_PROMPTS:
            # Before any tokenizing: each prompt would be an engine request of its own.
            violations.append(("prompt", f"at most {MAX_COMPLETION_PROMPTS} prompts per request"))
            return []
        prompts = []
        for i, item in enumerate(value):
            path = "prompt" if len(value) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                ids = await served.prompt_ids(item, path=path, policy=ContextPolicy.ALLOW_CONTEXT_STOP)
                if not ids:
                    violations.append((path, "must produce at least one token"))
                prompts.append(_Prompt(ids, item))
                continue
            ids = _as_token_ids(item) if isinstance(item, list) else None
            if not ids:
                violations.append((path, "must be a non-empty string or a non-empty list of token ids"))
                continue
            bad = served.token_id_violations(ids, path)
            violations.extend(bad)
            if not bad:
                prompts.append(_Prompt(ids, served.tokenizer.decode(ids, skip_special_tokens=False)))
        return prompts

    async def _prepare_chat(self, req: oa.CreateChatCompletionRequest, *, streaming: bool) -> _Prepared:
        served, adapter = self.models.resolve(req.model)
        violations = _stream_field_violations(req, streaming)
        turns = self._chat_turns(req, violations)
        if req.HasField("top_logprobs") and req.top_logprobs and not req.logprobs:
            violations.append(("top_logprobs", "requires logprobs"))
        both = req.HasField("max_completion_tokens") and req.HasField("max_tokens")
        if both and req.max_tokens != req.max_completion_tokens:
            # One of them would be ignored.
            violations.append(("max_tokens", "differs from max_completion_tokens; set one of them"))
        converted = _converted_sampling(req, violations)
        max_field = "max_tokens" if req.HasField("max_tokens") else "max_completion_tokens"
        if req.HasField("max_completion_tokens"):
            converted["max_tokens"] = req.max_completion_tokens
            max_field = "max_completion_tokens"
        converted["constraint"], paths = _output_constraint(req, violations)
        paths["max_tokens"] = max_field
        plan, offered = self._tool_plan(served, req, converted, paths, violations)
        # Unset, max_tokens is "until EOS or the context is full".
        sampling = served.sampling.params(req, api_defaults={"max_tokens": None}, **converted)
        served.sampling.check(sampling, paths, violations)
        constraint_field = await served.check_constraint(sampling.constraint, paths)
        prompt_ids = await served.chat_ids(
            turns, path="messages", policy=ContextPolicy.ALLOW_CONTEXT_STOP, tools=offered
        )
        return _Prepared(
            served,
            [_Prompt(prompt_ids, "")],
            sampling,
            tools=plan,
            adapter=adapter,
            constraint_field=constraint_field,
        )

    @staticmethod
    def _tool_plan(
        served: ServedModel,
        req: oa.CreateChatCompletionRequest,
        converted: dict[str, Any],
        paths: dict[str, str],
        violations: list[tuple[str, str]],
    ) -> tuple[ToolPlan | None, list[ToolSpec]]:
        """The request's tools: the plan for its output and the tools to render (none for "none").

        A call forced by ``tool_choice`` (or a strict tool under "auto") becomes the request's output
        constraint, so it cannot be combined with another one.
        """
        specs = tool_specs(req.tools, violations)
        choice = tool_choice(req, specs, violations)
        if req.HasField("parallel_tool_calls") and not req.tools:
            violations.append(("parallel_tool_calls", "only applies to requests with tools"))
        if choice.mode == ToolChoiceMode.NONE or not specs:
            return None, []
        template = served.tool_template
        if template is None:
            if served.tokenizer.has_chat_template:
                violations.append(
                    (
                        "tools",
                        f"model {served.name}'s chat template writes tool calls in a format this server has no "
                        "parser for; start the server with --tool-parser",
                    )
                )
            return None, []
        parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True
        plan = ToolPlan(template.format, choice, None if parallel else 1)
        if converted["constraint"] is not None:
            field = paths.get(converted["constraint"].field, "response_format")
            violations.append((field, 'cannot be combined with tools unless tool_choice is "none"'))
            return plan, specs
        constraint = tool_constraint(specs, plan)
        if constraint is not None:
            converted["constraint"] = constraint
            paths[constraint.field] = "tools"
        return plan, specs

    def _chat_turns(
        self, req: oa.CreateChatCompletionRequest, violations: list[tuple[str, str]]
    ) -> list[ChatTurn]:
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
            content = _python_value(message.content) if message.HasField("content") else None
            if content is None:
                text = ""
            elif isinstance(content, str):
                text = content
            elif isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                text = "".join(p["text"] for p in content)
            else:
                violations.append((f"messages[{i}].content", "must be a string or a list of text parts"))
                continue
            path = f"messages[{i}]"
            calls = message_tool_calls(message, path, violations)
            turns.append(ChatTurn(role, text, message.name, calls, tool_call_id(message, path, violations)))
        return turns

    def _engine_requests(
        self, public_id: str, prepared: _Prepared, identity: Identity
    ) -> list[TokenizedRequest]:
        return [
            TokenizedRequest(
                request_id=f"{public_id}.{i}",
                prompt_token_ids=prompt.token_ids,
                sampling=dataclasses.replace(prepared.sampling),
                context_policy=ContextPolicy.ALLOW_CONTEXT_STOP,
                cache_salt=identity.cache_salt,
                sampling_checked=True,
                adapter=prepared.adapter,
                constraint_field=prepared.constraint_field,
            )
            for i, prompt in enumerate(prepared.prompts)
        ]

    def _outputs(
        self, call: Call, prepared: _Prepared, requests: list[TokenizedRequest]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every prompt's engine outputs, concurrently, tagged with the prompt index.

        Callers close it (``contextlib.aclosing``) before leaving the call, so the
        tasks reading several prompts are gone before the call closes their streams.
        """
        return _merge([self.inflight.generate(call, prepared.served.engine, r) for r in requests])

    # ---- logprob shapes -------------------------------------------------------------------

    def _completion_logprobs(
        self, served: ServedModel, positions: list[PositionLogprobs], offsets: list[int]
    ) -> oa.CompletionLogprobs:
        out = oa.CompletionLogprobs()
        for pos, offset in zip(positions, offsets, strict=True):
            out.tokens.append(served.token_text(pos.chosen.token_id))
            out.token_logprobs.append(pos.chosen.logprob)
            top = struct_pb2.Struct()
            for alt in pos.top:
                top[served.token_text(alt.token_id)] = alt.logprob
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
        return out

    def _chat_logprobs(self, served: ServedModel, positions: list[PositionLogprobs]) -> oa.ChatChoiceLogprobs:
        return oa.ChatChoiceLogprobs(
            content=[
                oa.ChatCompletionTokenLogprob(
                    token=served.token_text(pos.chosen.token_id),
                    logprob=pos.chosen.logprob,
                    bytes=list(served.token_bytes(pos.chosen.token_id)),
                    top_logprobs=[
                        oa.TopLogprob(
                            token=served.token_text(alt.token_id),
                            logprob=alt.logprob,
                            bytes=list(served.token_bytes(alt.token_id)),
                        )
                        for alt in pos.top
                    ],
                )
                for pos in positions
            ]
        )

    @staticmethod
    def _usage(results: list[CollectedOutput]) -> oa.Usage:
        prompt = sum(r.prompt_tokens for r in results)
        completion = sum(r.completion_tokens for r in results)
        return oa.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    # ---- the two response skeletons ------------------------------------------------------------

    async def _complete(
        self, context: grpc.aio.ServicerContext, identity: Identity, prepared: _Prepared, api: _Api
    ) -> tuple[str, int, list[CollectedOutput]]:
        """Run every prompt to its end: the response id, its ``created`` and each prompt's result."""
        public_id = new_request_id(api.id_prefix)
        created = int(time.time())
        requests = self._engine_requests(public_id, prepared, identity)
        results = [CollectedOutput(n=prepared.sampling.n) for _ in requests]
        async with self.inflight.call(identity, public_id, call_deadline(context)) as call:
            async with contextlib.aclosing(self._outputs(call, prepared, requests)) as outputs:
                async for index, output in outputs:
                    results[index].add(output)
        return public_id, created, results

    async def _stream(
        self,
        context: grpc.aio.ServicerContext,
        identity: Identity,
        prepared: _Prepared,
        api: _Api,
        include_usage: bool,
        opening: Callable[[], Iterable[Any]],
        chunk_choices: Callable[[int, CompletionDelta], Iterable[Any]],
    ) -> None:
        """Write one chunk per choice ``opening`` gives once the engine has taken the request, then one
        per choice ``chunk_choices`` makes of each delta (with its prompt's index), then the usage.
        """
        public_id = new_request_id(api.id_prefix)
        created = int(time.time())
        served = prepared.served
        fingerprint = system_fingerprint(served)

        def chunk(choices: list[Any], usage: oa.Usage | None = None) -> Any:
            return api.chunk_type(
                id=public_id,
                object=api.chunk_object,
                created=created,
                model=prepared.model,
                choices=choices,
                usage=usage,
                system_fingerprint=fingerprint,
            )

        requests = self._engine_requests(public_id, prepared, identity)
        results = [CollectedOutput(n=prepared.sampling.n) for _ in requests]
        async with self.inflight.call(identity, public_id, call_deadline(context)) as call:
            started = False
            async with contextlib.aclosing(self._outputs(call, prepared, requests)) as outputs:
                async for p, output in outputs:
                    if not started:
                        # The engine has accepted the request (its refusals come before any
                        # output, as a plain error status), so the opening chunks go out now.
                        started = True
                        for choice in opening():
                            await context.write(chunk([choice]))
                    results[p].add(output)
                    for delta in output.deltas:
                        for choice in chunk_choices(p, delta):
                            await context.write(chunk([choice]))
        if include_usage:
            await context.write(chunk([], self._usage(results)))

    # ---- completions ------------------------------------------------------------------------

    @errors.reports_errors
    async def CreateCompletion(
        self, request: oa.CreateCompletionRequest, context: grpc.aio.ServicerContext
    ) -> oa.CreateCompletionResponse:
        """Complete one or more prompts; choice i*n+j is choice j of prompt i."""
        identity = self._admit(context)
        prepared = await self._prepare_completion(request, streaming=False)
        served, n = prepared.served, prepared.sampling.n
        public_id, created, results = await self._complete(context, identity, prepared, COMPLETIONS)
        choices = []
        for p, (prompt, result) in enumerate(zip(prepared.prompts, results, strict=True)):
            for choice in result.choices:
                prefix = prompt.text if prepared.echo else ""
                logprobs = None
                if prepared.sampling.logprobs:
                    texts = [served.token_text(pos.chosen.token_id) for pos in choice.logprobs]
                    offsets = _OffsetTracker().take(0, texts, start=len(prefix))
                    logprobs = self._completion_logprobs(served, choice.logprobs, offsets)
                choices.append(
                    oa.CompletionChoice(
                        text=prefix + choice.text,
                        index=p * n + choice.index,
                        logprobs=logprobs,
                        finish_reason=finish_reason_text(choice.finish_reason),
                    )
                )
        return oa.CreateCompletionResponse(
            id=public_id,
            object="text_completion",
            created=created,
            model=prepared.model,
            choices=choices,
            usage=self._usage(results),
            system_fingerprint=system_fingerprint(served),
        )

    @errors.reports_errors
    async def CreateCompletionStream(
        self, request: oa.CreateCompletionStreamRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Stream completion chunks; the last chunk of each choice carries its finish_reason."""
        identity = self._admit(context)
        inner = request.request
        prepared = await self._prepare_completion(inner, streaming=True)
        n = prepared.sampling.n
        offsets = _OffsetTracker()

        def echoes() -> list[oa.CompletionChoice]:
            # After the first output, so an engine refusal is a plain error status.
            if not prepared.echo:
                return []
            return [
                oa.CompletionChoice(text=prompt.text, index=q * n + j)
                for q, prompt in enumerate(prepared.prompts)
                for j in range(n)
            ]

        def chunk_choices(p: int, delta: CompletionDelta) -> list[oa.CompletionChoice]:
            choice = self._completion_chunk_choice(prepared.served, prepared, p, delta, offsets)
            return [] if choice is None else [choice]

        await self._stream(
            context,
            identity,
            prepared,
            COMPLETIONS,
            inner.stream_options.include_usage,
            echoes,
            chunk_choices,
        )

    def _completion_chunk_choice(
        self,
        served: ServedModel,
        prepared: _Prepared,
        prompt_index: int,
        delta: CompletionDelta,
        offsets: _OffsetTracker,
    ) -> oa.CompletionChoice | None:
        if not (delta.text or delta.token_ids or delta.finish_reason is not None):
            return None
        index = prompt_index * prepared.sampling.n + delta.index
        choice = oa.CompletionChoice(text=delta.text, index=index)
        if prepared.sampling.logprobs and delta.logprobs:
            texts = [served.token_text(pos.chosen.token_id) for pos in delta.logprobs]
            start = len(prepared.prompts[prompt_index].text) if prepared.echo else 0
            choice.logprobs.CopyFrom(
                self._completion_logprobs(served, delta.logprobs, offsets.take(index, texts, start))
            )
        if delta.finish_reason is not None:
            choice.finish_reason = finish_reason_text(delta.finish_reason)
        return choice

    # ---- chat completions -----------------------------------------------------------------

    @errors.reports_errors
    async def CreateChatCompletion(
        self, request: oa.CreateChatCompletionRequest, context: grpc.aio.ServicerContext
    ) -> oa.CreateChatCompletionResponse:
        """Answer a conversation with n choices."""
        identity = self._admit(context)
        prepared = await self._prepare_chat(request, streaming=False)
        served = prepared.served
        public_id, created, results = await self._complete(context, identity, prepared, CHAT_COMPLETIONS)
        choices = []
        for c in results[0].choices:
            message = oa.ChatCompletionMessage(role="assistant", content=c.text)
            finish_reason = finish_reason_text(c.finish_reason)
            if prepared.tools is not None:
                found = parse_output(c.text, prepared.tools.format, prepared.tools.max_calls)
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
                finish_reason = prepared.tools.finish_reason(bool(found.tool_calls), finish_reason)
            choices.append(
                oa.ChatCompletionChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._chat_logprobs(served, c.logprobs) if prepared.sampling.logprobs else None,
                    finish_reason=finish_reason,
                )
            )
        return oa.CreateChatCompletionResponse(
            id=public_id,
            object="chat.completion",
            created=created,
            model=prepared.model,
            choices=choices,
            usage=self._usage(results),
            system_fingerprint=system_fingerprint(served),
        )

    @errors.reports_errors
    async def CreateChatCompletionStream(
        self, request: oa.CreateChatCompletionStreamRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Stream chat chunks: role first, then content, then an empty delta with finish_reason."""
        identity = self._admit(context)
        inner = request.request
        prepared = await self._prepare_chat(inner, streaming=True)
        served = prepared.served
        plan = prepared.tools

        def roles() -> list[oa.ChatCompletionChunkChoice]:
            if plan is not None:
                return []  # with tools, each choice's role goes with its first delta (_with_role)
            delta = oa.ChatCompletionDelta(role="assistant", content="")
            return [oa.ChatCompletionChunkChoice(index=i, delta=delta) for i in range(prepared.sampling.n)]

        outputs: dict[int, StreamedOutput] = {}
        opened: set[int] = set()  # with tools: the choices whose role has gone out

        def deltas(index: int, text: str, finished: bool) -> list[oa.ChatCompletionDelta]:
            """The deltas of new text: content as it is, or, with tools, what the parser found in it."""
            if plan is None:
                return [oa.ChatCompletionDelta(content=text)] if text else []
            output = outputs.setdefault(index, StreamedOutput(plan.format, plan.max_calls))
            return [_chat_delta(event) for event in output.feed(text, finished)]

        def chunk_choices(_: int, d: CompletionDelta) -> list[oa.ChatCompletionChunkChoice]:
            choices = [
                oa.ChatCompletionChunkChoice(index=d.index, delta=delta)
                for delta in deltas(d.index, d.text, d.finish_reason is not None)
            ]
            if prepared.sampling.logprobs and d.logprobs:
                if not choices:
                    choices.append(
                        oa.ChatCompletionChunkChoice(index=d.index, delta=oa.ChatCompletionDelta())
                    )
                choices[0].logprobs.CopyFrom(self._chat_logprobs(served, d.logprobs))
            if d.finish_reason is not None:
                reason = finish_reason_text(d.finish_reason)
                if plan is not None:
                    reason = plan.finish_reason(outputs[d.index].parser.calls_started > 0, reason)
                choices.append(
                    oa.ChatCompletionChunkChoice(
                        index=d.index, delta=oa.ChatCompletionDelta(), finish_reason=reason
                    )
                )
            if plan is not None and choices and d.index not in opened:
                opened.add(d.index)
                return _with_role(d.index, choices)
            return choices

        await self._stream(
            context,
            identity,
            prepared,
            CHAT_COMPLETIONS,
            inner.stream_options.include_usage,
            roles,
            chunk_choices,
        )

    # ---- embeddings -----------------------------------------------------------------------------

    @errors.reports_errors
    async def CreateEmbedding(
        self, request: oa.CreateEmbeddingRequest, context: grpc.aio.ServicerContext
    ) -> oa.CreateEmbeddingResponse:
        """OpenAI's embeddings: a vector per input, as floats or base64 float32s."""
        identity = self._admit(context)
        embedder = self.retrieval.embedder
        if embedder is None:
            raise embeddings_disabled()
        meter = embedder.meter(self.inflight, identity)
        meter.admit()  # a request of the caller's rpm; its tokens are charged before the model runs
        embedder.check_model(request.model)
        violations: list[tuple[str, str]] = []
        if request.encoding_format not in ("", "float", "base64"):
            violations.append(("encoding_format", 'must be "float" or "base64"'))
        if request.HasField("dimensions") and request.dimensions != embedder.dimensions:
            violations.append((
                "dimensions",
                f"model {embedder.name} returns {embedder.dimensions} dimensions and cannot shorten them",
            ))
        value = _python_value(request.input) if request.HasField("input") else None
        texts, ids = _embedding_inputs(value, violations)
        if violations:
            raise errors.invalid_argument(violations)
        path = "input"
        try:
            if ids is not None:
                done = await embedder.embed_token_ids(ids, path, tenant=identity.id, charge=meter.charge)
            else:
                done = await embedder.embed_texts(texts, path, tenant=identity.id, charge=meter.charge)
        finally:
            meter.record()
        data = []
        for i, vector in enumerate(done.vectors):
            embedding = struct_pb2.Value()
            if request.encoding_format == "base64":
                embedding.string_value = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            else:
                embedding.list_value.values.extend(struct_pb2.Value(number_value=x) for x in vector.tolist())
            data.append(oa.EmbeddingObject(object="embedding", index=i, embedding=embedding))
        return oa.CreateEmbeddingResponse(
            object="list",
            data=data,
            model=embedder.name,
            usage=oa.EmbeddingUsage(prompt_tokens=done.total_tokens, total_tokens=done.total_tokens),
        )

    # ---- models ---------------------------------------------------------------------------------

    @staticmethod
    def _model(served: ServedModel, adapter: str | None = None) -> oa.Model:
        """A model, or one of its LoRA adapters with ``parent`` naming it (as vLLM lists adapters)."""
        model = oa.Model(id=adapter or served.name, object="model", created=int(served.card.loaded_at),
                         owned_by="protoserve")
        if adapter:
            model.parent = served.name
        return model

    @errors.reports_errors
    async def ListModels(self, request: oa.ListModelsRequest, context: grpc.aio.ServicerContext):
        """OpenAI's model list: every model, then its LoRA adapters."""
        self._admit(context)
        data = []
        for served in self.models.all():
            data.append(self._model(served))
            data.extend(self._model(served, a) for a in (served.adapters.names() if served.adapters else []))
        return oa.ListModelsResponse(object="list", data=data)

    @errors.reports_errors
    async def RetrieveModel(self, request: oa.RetrieveModelRequest, context: grpc.aio.ServicerContext):
        """One model by id; NOT_FOUND when it is not loaded."""
        self._admit(context)
        if not request.model:
            raise errors.invalid_argument([("model", "is required")])
        return oa.RetrieveModelResponse(model=self._model(*self.models.resolve(request.model)))
