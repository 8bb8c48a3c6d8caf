"""ServedModel: one loaded model as the API serves it, the per-model adapter between the services and
its engine.

It turns request messages into engine ``TokenizedRequest``s (validation with field violations,
tokenization, chat templating; the sampling fields through its SamplingMapping, the one place they
become engine parameters) and engine output into ``protoserve.v1`` messages. Both gRPC servicers
(InferenceService and OpenAIService) build on it, so every surface validates and tokenizes the same
way. It knows the engine's plain-data API and nothing of tensors; it raises
:class:`protoserve.server.errors.ServiceError` and never touches a gRPC context.

Field paths in violations are the request's own: ``sampling.temperature`` for InferenceService,
``temperature`` for OpenAIService (callers pass a rename map).

A request passes these stages: the API's message; the ``TokenizedRequest`` built here; the engine's
``AdmittedRequest`` (validated, fitted to the context) and ``RunningRequest`` (its ``Sequence`` per
choice); its outputs collected back here into a ``CollectedOutput``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from protoserve.engine.errors import ContextLengthError, InvalidRequestError
from protoserve.engine.lora.stack import AdapterStack, adapter_problems
from protoserve.engine.request import (
    Choice,
    CompletionDelta,
    FinishReason,
    PositionLogprobs,
    RequestOutput,
    RequestStats,
    TokenizedRequest,
)
from protoserve.engine.sampling.constraints.constraint import Constraint
from protoserve.engine.sampling.sampling_params import ContextPolicy
from protoserve.server import errors
from protoserve.server.limits import (
    MAX_CHAT_MESSAGES,
    MAX_CHAT_NAME_CHARS,
    MAX_PROMPT_BYTES,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRINGS,
)
from protoserve.server.models.chat_turn import CHAT_ROLES, ChatTurn
from protoserve.server.models.sampling_mapping import (
    PathMap,
    SamplingMapping,
    path_function,
    speculative_from_proto,
)
from protoserve.server.tool_calls.call import ToolSpec
from protoserve.server.tool_calls.rendering import (
    ToolTemplate,
    choose_format,
    template_messages,
    template_renders_tools,
)
from protoserve.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from protoserve.engine.async_engine import AsyncEngine

T = TypeVar("T")

# Text shorter than this is tokenized on the event loop: it takes less time than a hop to a
# worker thread and back would (see INLINE_TOKENIZE_CHARS in the commit that set it).
INLINE_TOKENIZE_CHARS = 2048
# Longer texts are tokenized by these threads; the tokenizer releases the GIL meanwhile.
TOKENIZE_THREADS = max(1, min(4, os.cpu_count() or 1))
# The engine refuses a prompt that fills the context under these policies; the others truncate.
FITTING_POLICIES = frozenset({ContextPolicy.ALLOW_CONTEXT_STOP, ContextPolicy.REJECT})

CONTEXT_POLICIES: dict[int, ContextPolicy] = {
    pb.CONTEXT_POLICY_UNSPECIFIED: ContextPolicy.ALLOW_CONTEXT_STOP,
    pb.CONTEXT_POLICY_ALLOW_CONTEXT_STOP: ContextPolicy.ALLOW_CONTEXT_STOP,
    pb.CONTEXT_POLICY_REJECT: ContextPolicy.REJECT,
    pb.CONTEXT_POLICY_TRUNCATE_LEFT: ContextPolicy.TRUNCATE_LEFT,
    pb.CONTEXT_POLICY_TRUNCATE_RIGHT: ContextPolicy.TRUNCATE_RIGHT,
    pb.CONTEXT_POLICY_RESERVE_GENERATION: ContextPolicy.RESERVE_GENERATION,
}

FINISH_REASONS: dict[FinishReason | None, int] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


@dataclass(frozen=True)
class ModelCard:
    """What the server knows about a loaded model beyond the engine: how it was loaded."""

    dtype: str
    quantization: str
    source: str  # file or directory name of the weights
    kv_cache_dtype: str = ""  # the K/V pools' dtype as served ("auto" resolved); "" when unknown
    loaded_at: float = field(default_factory=time.time)  # unix seconds
    # The checkpoint's recommended sampling values (engine/loader/sampling_defaults.py).
    sampling_defaults: Mapping[str, float | int] = field(default_factory=dict)


def new_request_id(prefix: str = "req") -> str:
    """A server-assigned request id, unique enough for logs and Cancel."""
    return f"{prefix}-{secrets.token_hex(12)}"


def stop_reason_text(stop_reason: str | int | None) -> str:
    """The stop string, or the stop token id as text, or ""."""
    return "" if stop_reason is None else str(stop_reason)


def stats_to_proto(stats: RequestStats | None) -> pb.RequestStats:
    """Engine RequestStats → proto RequestStats."""
    if stats is None:
        return pb.RequestStats()
    return pb.RequestStats(
        queue_time_s=stats.queue_time_s,
        time_to_first_token_s=stats.time_to_first_token_s,
        prefill_time_s=stats.prefill_time_s,
        decode_time_s=stats.decode_time_s,
        e2e_time_s=stats.e2e_time_s,
        decode_tokens_per_s=stats.decode_tokens_per_s,
        prompt_tokens=stats.prompt_tokens,
        generated_tokens=stats.generated_tokens,
        cached_prompt_tokens=stats.cached_prompt_tokens,
        kv_blocks=stats.kv_blocks,
        kv_bytes=stats.kv_bytes,
        preemptions=stats.preemptions,
        truncated_prompt_tokens=stats.truncated_prompt_tokens,
        **_spec_stats(stats),
    )


def _spec_stats(stats: RequestStats) -> dict[str, int]:
    """The speculative counts, where the generated RequestStats has them (gen/ from before them lacks them)."""
    names = ("spec_num_drafts", "spec_draft_tokens", "spec_accepted_tokens")
    fields = pb.RequestStats.DESCRIPTOR.fields_by_name
    return {name: getattr(stats, name) for name in names if name in fields}


@dataclass
class CollectedOutput:
    """One engine request's outputs collected: choices, prompt size and stats.

    Streaming handlers feed it as they forward deltas, unary handlers read it at
    the end; either way usage comes from one place.
    """

    n: int
    choices: list[Choice] = field(init=False)
    num_prompt_tokens: int = 0
    stats: RequestStats | None = None
    finished: bool = False

    def __post_init__(self) -> None:
        self.choices = [Choice(i) for i in range(self.n)]

    def add(self, output: RequestOutput) -> None:
        for delta in output.deltas:
            self.choices[delta.index].add(delta)
        if output.num_prompt_tokens:
            self.num_prompt_tokens = output.num_prompt_tokens
        if output.stats is not None:
            self.stats = output.stats
        self.finished = self.finished or output.finished

    @property
    def prompt_tokens(self) -> int:
        if self.stats is not None and self.stats.prompt_tokens:
            return self.stats.prompt_tokens
        return self.num_prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def cached_prompt_tokens(self) -> int:
        return self.stats.cached_prompt_tokens if self.stats is not None else 0

    def usage(self) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
        )


class ServedModel:
    """One loaded model as the API sees it: request validation, tokenization, output protos."""

    def __init__(
        self,
        engine: AsyncEngine,
        card: ModelCard,
        sampling_defaults: Mapping[str, float | int] | None = None,
        tool_parser: str | None = None,
        parse_special_in_messages: bool = False,
    ) -> None:
        """``sampling_defaults``: what requests that leave those fields unset get (server/models/sampling_mapping.py);
        ``tool_parser``: the tool-call format (``--tool-parser``), else read off the chat template;
        ``parse_special_in_messages``: special-token strings in the caller's messages (not in tool results)
        encode as control tokens, as before protoserve kept them text (``--parse-special-in-messages``)."""
        self.engine = engine
        self._tool_parser = tool_parser
        self.parse_special_in_messages = parse_special_in_messages
        self.card = card
        self.tokenizer = engine.tokenizer
        # Ids must be both embeddable and decodable; a padded embedding table can exceed the tokenizer.
        self.vocab_size: int = min(engine.tokenizer.vocab_size, engine.model_config.vocab_size)
        self.sampling = SamplingMapping(self.vocab_size, sampling_defaults or {})
        # Decoding one id is pure; logprob-heavy streams ask for the same ids over and over.
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=65536)(self._token_text)
        # Text beyond this many bytes is not tokenized at all; where the context's byte bound is
        # larger, that, so a prompt that could fit is never refused for its size.
        span = self.tokenizer.max_token_span_bytes
        self.max_prompt_bytes = max(MAX_PROMPT_BYTES, self.max_model_len * span if span else 0)
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")

    # ---- the model ---------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.engine.model_name

    @property
    def adapters(self) -> AdapterStack | None:
        """The engine's LoRA adapters (engine/lora), None when it serves none."""
        # Not every engine behind a ServedModel serves adapters (a test double need not).
        return getattr(self.engine, "adapters", None)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def model_info(self, *, with_path: bool) -> pb.ModelInfo:
        """ListModels/GetModel description of this model; ``source`` is the weights' path on the
        server ``with_path``, else only its last component, so that callers learn no server paths."""
        config = self.engine.model_config
        summary = self.engine.model_summary
        return pb.ModelInfo(
            name=self.name,
            architecture=config.architecture,
            max_model_len=self.max_model_len,
            vocab_size=config.vocab_size,
            dtype=self.card.dtype,
            quantization=self.card.quantization,
            num_parameters=self.engine.num_parameters,
            has_chat_template=bool(self.tokenizer.has_chat_template),
            source=self.card.source if with_path else os.path.basename(os.path.normpath(self.card.source)),
            kv_cache_dtype=self.card.kv_cache_dtype,
            sampling_defaults=pb.SamplingParams(**self.sampling.effective_defaults()),
            num_active_parameters=summary.active_parameters,
            layer_pattern=summary.layer_pattern,
            sliding_window=summary.sliding_window or 0,
            num_experts=config.num_experts,
            experts_per_token=config.experts_per_token,
        )

    @functools.cached_property
    def tool_template(self) -> ToolTemplate | None:
        """How this model takes tools; None when it has no chat template or no known call format."""
        if not self.tokenizer.has_chat_template:
            return None
        renders = template_renders_tools(self.tokenizer.apply_chat_template)
        fmt = choose_format(self.tokenizer.chat_template or "", renders, self._tool_parser)
        return ToolTemplate(fmt, renders) if fmt is not None else None

    # ---- input ---------------------------------------------------------------------

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of plain text (with the GIL released for long text, so it suits worker threads)."""
        if len(text) < INLINE_TOKENIZE_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(self.tokenizer.encode_unlocked(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        turns: Sequence[ChatTurn],
        *,
        add_generation_prompt: bool = True,
        path: str = "chat.messages",
        policy: ContextPolicy | None = None,
        tools: Sequence[ToolSpec] = (),
    ) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, offered ``tools``.

        A template that refuses the conversation (say, roles that do not
        alternate) is the caller's error: INVALID_ARGUMENT on ``path``. The
        rendered text is size-checked as :meth:`checked_ids` does. Special-token
        strings in the messages' text stay text (engine/tokenizer/special_text.py):
        only the template draws the conversation's boundaries; tool results always,
        the caller's own messages and tools unless ``parse_special_in_messages``.
        """
        if not self.tokenizer.has_chat_template:
            raise errors.no_chat_template(self.name)
        turns = [self._guarded(t) for t in turns]
        if not self.parse_special_in_messages:
            guard = self.tokenizer.special_text
            tools = [replace(t, name=guard.protect(t.name), description=guard.protect(t.description),
                             parameters=guard.protect_tree(t.parameters)) for t in tools]
        variables: dict[str, Any] = {}
        if self.tool_template is not None:
            messages, variables = template_messages(turns, tools, self.tool_template)
        else:
            messages = [
                {"role": t.role, "content": t.content, **({"name": t.name} if t.name else {})} for t in turns
            ]
        # Imported here: the tokenizer package pulls in torch, and the server must bind
        # and answer health checks before anything that slow is imported.
        from protoserve.engine.tokenizer.chat_template import ChatTemplateError

        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except ChatTemplateError as exc:
            raise errors.invalid_argument(
                [(path, f"the chat template refused the conversation: {exc}")]
            ) from None
        if isinstance(rendered, str):
            # The template writes any BOS itself; adding special tokens again would double it.
            return self.checked_ids(rendered, path=path, policy=policy, add_special_tokens=False)
        return list(rendered)

    def _guarded(self, turn: ChatTurn) -> ChatTurn:
        """``turn`` with every text the template may write protected, unless the caller wrote it and
        special tokens in messages are parsed."""
        if self.parse_special_in_messages and turn.role != "tool" and turn.from_caller:
            return turn
        protect = self.tokenizer.special_text.protect
        calls = tuple(
            replace(c, id=protect(c.id), name=protect(c.name), arguments=self._protected_arguments(c.arguments))
            for c in turn.tool_calls
        )
        return replace(turn, content=protect(turn.content), name=protect(turn.name), tool_calls=calls,
                       tool_call_id=protect(turn.tool_call_id))

    def _protected_arguments(self, arguments: str) -> str:
        """A call's arguments protected as the template will see them: rendering decodes a JSON object
        (server/tool_calls/rendering.py), whose escapes (``\\u003c``) could spell a special string."""
        guard = self.tokenizer.special_text
        try:
            value = json.loads(arguments)
        except ValueError:
            return guard.protect(arguments)
        if not isinstance(value, dict):
            return guard.protect(arguments)
        protected = guard.protect_tree(value)
        # Unchanged text keeps its exact spelling; rewritten, it decodes to the protected object.
        return arguments if protected == value else json.dumps(protected, ensure_ascii=False)

    def checked_ids(
        self, text: str, *, path: str, policy: ContextPolicy | None, add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of ``text``, refusing first, without tokenizing, text that cannot be served.

        Any text over ``max_prompt_bytes`` is INVALID_ARGUMENT, whatever the policy (one that
        is over it in characters alone, before even a scan); under a policy that refuses
        prompts the context cannot hold (``FITTING_POLICIES``), text whose bytes need at least
        max_model_len tokens is OUT_OF_RANGE.
        """
        # Sized as sent: placeholders (engine/tokenizer/special_text.py) are longer than what they stand for.
        sized = self.tokenizer.special_text.revealed(text)
        self.check_text_chars(sized, path)
        # A character is at most 4 bytes and a token at least 1: shorter text cannot be too long.
        if policy in FITTING_POLICIES and 4 * len(sized) >= self.max_model_len:
            fewest = self.tokenizer.fewest_tokens(text)
            if fewest >= self.max_model_len:
                raise ContextLengthError(
                    fewest,
                    self.max_model_len,
                    f"the prompt ({errors.utf8_size(sized)} bytes) is at least {fewest} tokens, but the "
                    f"context window (max_model_len) is {self.max_model_len} tokens, which leaves no "
                    "room to generate",
                )
        if (
            len(sized) > self.max_prompt_bytes // 4
            and (size := errors.utf8_size(sized)) > self.max_prompt_bytes
        ):
            raise errors.invalid_argument(
                [(path, f"is {size} bytes; at most {self.max_prompt_bytes} bytes of text are tokenized")]
            )
        return self.encode_text(text, add_special_tokens=add_special_tokens)

    def check_text_chars(self, text: str, path: str) -> None:
        """INVALID_ARGUMENT for text with more characters than ``max_prompt_bytes`` (O(1): no scan)."""
        if len(text) > self.max_prompt_bytes:
            raise errors.invalid_argument(
                [
                    (
                        path,
                        f"is {len(text)} characters; at most {self.max_prompt_bytes} bytes of text are tokenized",
                    )
                ]
            )

    async def _tokenizing(self, chars: int, work: Callable[[], T]) -> T:
        """Run ``work`` inline for short input, else on a tokenizer thread so the loop keeps serving."""
        if chars < INLINE_TOKENIZE_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, work)

    async def prompt_ids(
        self, text: str, *, path: str, policy: ContextPolicy | None = None, add_special_tokens: bool = True
    ) -> list[int]:
        """:meth:`checked_ids` of a prompt, off the event loop when it is long."""
        self.check_text_chars(text, path)  # the huge refused here, without a hop to a thread
        return await self._tokenizing(
            len(text),
            functools.partial(
                self.checked_ids, text, path=path, policy=policy, add_special_tokens=add_special_tokens
            ),
        )

    async def chat_ids(
        self,
        turns: Sequence[ChatTurn],
        *,
        add_generation_prompt: bool = True,
        path: str = "chat.messages",
        policy: ContextPolicy | None = None,
        tools: Sequence[ToolSpec] = (),
    ) -> list[int]:
        """:meth:`render_chat` after the cheap checks, off the event loop when the conversation is long."""
        if not self.tokenizer.has_chat_template:
            raise errors.no_chat_template(self.name)
        violations = [
            (f"{path}[{i}].name", f"must be at most {MAX_CHAT_NAME_CHARS} characters")
            for i, turn in enumerate(turns)
            if len(turn.name) > MAX_CHAT_NAME_CHARS
        ]
        if violations:
            raise errors.invalid_argument(violations)
        chars = sum(len(t.content) + len(t.name) + sum(len(c.arguments) for c in t.tool_calls) for t in turns)
        if chars > self.max_prompt_bytes:  # the conversation's texts together, before rendering them
            raise errors.invalid_argument(
                [
                    (
                        path,
                        f"hold {chars} characters; at most {self.max_prompt_bytes} bytes of text are tokenized",
                    )
                ]
            )
        return await self._tokenizing(
            chars,
            functools.partial(
                self.render_chat,
                turns,
                add_generation_prompt=add_generation_prompt,
                path=path,
                policy=policy,
                tools=tools,
            ),
        )

    def token_id_violations(self, ids: Sequence[int], path: str) -> list[tuple[str, str]]:
        """Violations for token ids outside the vocabulary (first few named)."""
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):
            return []  # the common case, at C speed even for a context's worth of ids
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if not bad:
            return []
        shown = ", ".join(str(i) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
        return [(path, f"token ids {shown} are outside the vocabulary [0, {self.vocab_size})")]

    async def prompt_from_proto(
        self, req: pb.GenerateRequest | pb.TokenizeRequest, policy: ContextPolicy | None = None
    ) -> tuple[list[int], str]:
        """Token ids of a request's input oneof, and the field path they came from.

        Raises INVALID_ARGUMENT for a missing input, an empty prompt, token ids
        outside the vocabulary, malformed chat messages or text over the size cap,
        and (under ``policy``, see :meth:`checked_ids`) OUT_OF_RANGE for a prompt
        the context cannot hold. Long text is tokenized off the event loop.
        """
        kind = req.WhichOneof("input")
        if kind is None:
            fields = "prompt, token_ids or chat" if isinstance(req, pb.GenerateRequest) else "text or chat"
            raise errors.invalid_argument([("input", f"one of {fields} is required")])
        if kind == "token_ids":
            ids = list(req.token_ids.ids)
            if policy in FITTING_POLICIES and len(ids) >= self.max_model_len:
                raise ContextLengthError(
                    len(ids),
                    self.max_model_len,
                    f"the prompt has {len(ids)} tokens but the context window (max_model_len) is "
                    f"{self.max_model_len} tokens, which leaves no room to generate",
                )
            violations = self.token_id_violations(ids, "token_ids.ids")
            if not ids:
                violations.append(("token_ids.ids", "must not be empty"))
            if violations:
                raise errors.invalid_argument(violations)
            return ids, "token_ids.ids"
        if kind == "chat":
            if len(req.chat.messages) > MAX_CHAT_MESSAGES:
                raise errors.invalid_argument([("chat.messages", f"at most {MAX_CHAT_MESSAGES} messages")])
            violations = []
            if not req.chat.messages:
                violations.append(("chat.messages", "must not be empty"))
            for i, m in enumerate(req.chat.messages):
                if m.role not in CHAT_ROLES:
                    violations.append((f"chat.messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}"))
            if violations:
                raise errors.invalid_argument(violations)
            turns = [ChatTurn(m.role, m.content, m.name) for m in req.chat.messages]
            add_prompt = (
                req.chat.add_generation_prompt if req.chat.HasField("add_generation_prompt") else True
            )
            return await self.chat_ids(turns, add_generation_prompt=add_prompt, policy=policy), "chat"
        add_special = True
        if isinstance(req, pb.TokenizeRequest) and req.HasField("add_special_tokens"):
            add_special = req.add_special_tokens
        text = getattr(req, kind)  # "prompt" or "text"
        return await self.prompt_ids(text, path=kind, policy=policy, add_special_tokens=add_special), kind

    async def tokenized_request(
        self, req: pb.GenerateRequest, *, request_id: str, cache_salt: bytes, path_prefix: str = ""
    ) -> TokenizedRequest:
        """Validate an InferenceService GenerateRequest and build the engine request.

        ``request_id`` is the engine's id (the caller keeps the public one);
        ``cache_salt`` comes from the authenticated identity, never the body.
        ``path_prefix`` prefixes violation paths (e.g. ``requests[3].`` in Batch).
        Everything but the prompt is checked before the prompt is tokenized.
        """
        violations: list[tuple[str, str]] = []
        if len(req.request_id) > MAX_REQUEST_ID_CHARS:
            violations.append(("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters"))
        if req.context_policy not in CONTEXT_POLICIES:
            violations.append(("context_policy", f"unknown value {req.context_policy}"))
        # Unset, max_tokens is "until the context is full".
        params = self.sampling.params(req.sampling, api_defaults={"max_tokens": None})
        if "speculative" in req.DESCRIPTOR.fields_by_name and req.HasField("speculative"):
            params = replace(params, speculative=speculative_from_proto(req.speculative))
        if params.top_logprobs and not params.logprobs:
            violations.append(("sampling.top_logprobs", "requires sampling.logprobs"))
        if len(params.stop) > MAX_STOP_STRINGS:
            violations.append(("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings"))
        constraint = req.sampling.constraint
        if constraint.WhichOneof("kind") == "json_object" and not constraint.json_object:
            violations.append(
                ("sampling.constraint.json_object", "must be true (unset constraint: free text)")
            )
        policy = CONTEXT_POLICIES.get(req.context_policy)
        violations.extend(adapter_problems(self.adapters, req.adapter or None))
        try:
            # The speculative options sit beside sampling on the request, not inside it.
            self.sampling.check(params, lambda f: f if f.startswith("speculative") else f"sampling.{f}", violations)
            constraint_field = await self.check_constraint(params.constraint, lambda f: f"sampling.{f}")
            prompt_ids, source = await self.prompt_from_proto(req, policy)
        except errors.ServiceError as exc:
            if path_prefix and exc.violations:
                raise errors.invalid_argument([(path_prefix + f, p) for f, p in exc.violations]) from None
            raise
        if not prompt_ids:
            raise errors.invalid_argument([(path_prefix + source, "must produce at least one token")])
        return TokenizedRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=params,
            context_policy=CONTEXT_POLICIES[req.context_policy],
            priority=req.priority,
            cache_salt=cache_salt,
            sampling_checked=True,
            adapter=req.adapter or None,
            constraint_field=path_prefix + constraint_field if constraint_field else "",
        )

    async def check_constraint(self, constraint: Constraint | None, paths: PathMap) -> str:
        """Compile a request's checked constraint now, off the event loop, so one that does not compile
        is refused on the request's own field (``paths`` maps ``constraint.<kind>`` to it) before any
        tokenizing; the engine's own compile of it is then a cache hit.

        Returns that field ("" without a constraint), for the request's ``constraint_field``: a
        grammar-engine failure while generating names it too."""
        if constraint is None:
            return ""
        to_path = path_function(paths)
        try:
            await asyncio.to_thread(self.engine.engine.compile_constraint, constraint)
        except InvalidRequestError as exc:
            renamed = [(to_path(name), problem) for name, problem in exc.violations]
            raise errors.invalid_argument(renamed) from None
        return to_path(constraint.field)

    # ---- output ----------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw UTF-8 bytes a token stands for (may be part of a character)."""
        return bytes(self.tokenizer.token_bytes(token_id))

    def logprobs_to_proto(self, positions: Iterable[PositionLogprobs]) -> list[pb.PositionLogprobs]:
        """Engine logprobs → proto PositionLogprobs with token texts."""
        out = []
        for pos in positions:
            out.append(
                pb.PositionLogprobs(
                    chosen=self._token_logprob(pos.chosen.token_id, pos.chosen.logprob),
                    top=[self._token_logprob(t.token_id, t.logprob) for t in pos.top],
                )
            )
        return out

    def _token_logprob(self, token_id: int, logprob: float) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=token_id, token=self.token_text(token_id), logprob=logprob)

    def delta_to_proto(self, delta: CompletionDelta) -> pb.GenerateDelta:
        """One engine delta → proto GenerateDelta."""
        return pb.GenerateDelta(
            index=delta.index,
            text=delta.text,
            token_ids=delta.token_ids,
            logprobs=self.logprobs_to_proto(delta.logprobs),
        )

    def final_to_proto(self, result: CollectedOutput) -> pb.GenerateFinal:
        """The last stream message: finish reasons, usage and stats."""
        return pb.GenerateFinal(
            choices=[
                pb.ChoiceFinish(
                    index=c.index,
                    finish_reason=FINISH_REASONS[c.finish_reason],
                    stop_reason=stop_reason_text(c.stop_reason),
                )
                for c in result.choices
            ],
            usage=result.usage(),
            stats=stats_to_proto(result.stats),
            model=self.name,
        )

    def response_to_proto(self, request_id: str, result: CollectedOutput) -> pb.GenerateResponse:
        """A finished request → proto GenerateResponse."""
        return pb.GenerateResponse(
            request_id=request_id,
            model=self.name,
            choices=[
                pb.Choice(
                    index=c.index,
                    text=c.text,
                    token_ids=c.token_ids,
                    logprobs=self.logprobs_to_proto(c.logprobs),
                    finish_reason=FINISH_REASONS[c.finish_reason],
                    stop_reason=stop_reason_text(c.stop_reason),
                )
                for c in result.choices
            ],
            usage=result.usage(),
            stats=stats_to_proto(result.stats),
        )

    # ---- tokenizer RPCs ----------------------------------------------------------------

    async def tokenize(self, req: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """Tokenize RPC: text or chat → ids and their texts (the texts of many ids built off the loop)."""
        ids, _ = await self.prompt_from_proto(req)
        tokens = await self._tokenizing(len(ids), lambda: [self.token_text(i) for i in ids])
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens, max_model_len=self.max_model_len)

    def detokenize(self, req: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        """Detokenize RPC: ids → text."""
        violations = self.token_id_violations(req.token_ids, "token_ids")
        if violations:
            raise errors.invalid_argument(violations)
        skip = req.skip_special_tokens if req.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(
            text=self.tokenizer.decode(list(req.token_ids), skip_special_tokens=skip)
        )
