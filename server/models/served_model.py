"""ServedModel: one loaded model as the API serves it, the per-model adapter between the services and
its engine.

It composes the model's request and output handling, one concern a module: input validation
(input_validation.py: the limits a prompt must meet, checked before tokenizing), tokenization and
chat templates (prompt_rendering.py), the native requests' conversion into engine
``TokenizedRequest``s (request_conversion.py; the sampling fields through its SamplingMapping, the one
place they become engine parameters) and engine output's into ``protoserve.v1`` messages
(output_conversion.py). Every gRPC servicer builds on it, so every surface validates and tokenizes the
same way. It knows the engine's plain-data API and nothing of tensors; it raises
:class:`protoserve.server.errors.ServiceError` and never touches a gRPC context.

Field paths in violations are the request's own: ``sampling.temperature`` for InferenceService,
``temperature`` for OpenAIService (callers pass a rename map).

A request passes these stages: the API's message; the ``TokenizedRequest`` built here; the engine's
``AdmittedRequest`` (validated, fitted to the context) and ``RunningRequest`` (its ``Sequence`` per
choice); its outputs collected back here into a ``CollectedOutput``.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protoserve.engine.api import ModelKind
from protoserve.server import errors
from protoserve.server.models.input_validation import PromptLimits
from protoserve.server.models.output_conversion import CollectedOutput, OutputConverter
from protoserve.server.models.prompt_rendering import INLINE_TOKENIZE_CHARS, PromptRenderer
from protoserve.server.models.request_conversion import RequestConverter
from protoserve.server.models.sampling_mapping import SamplingMapping
from protoserve.server.tool_calls.rendering import ToolTemplate
from protoserve.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from protoserve.engine.runtime import AdapterStack, AsyncEngine

# What the services import from here, wherever it is defined.
__all__ = ["INLINE_TOKENIZE_CHARS", "CollectedOutput", "ModelCard", "ServedModel", "new_request_id"]


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


class ServedModel:
    """One loaded model as the API sees it: its engine and card, and the parts that validate and
    tokenize its requests and convert its output."""

    def __init__(
        self,
        engine: AsyncEngine,
        card: ModelCard,
        sampling_defaults: Mapping[str, float | int] | None = None,
        tool_parser: str | None = None,
        parse_special_in_messages: bool = False,
        aliases: tuple[str, ...] = (),
    ) -> None:
        """``sampling_defaults``: what requests that leave those fields unset get (server/models/sampling_mapping.py);
        ``tool_parser``: the tool-call format (``--tool-parser``), else read off the chat template;
        ``parse_special_in_messages``: special-token strings in the caller's messages (not in tool results)
        encode as control tokens, as before protoserve kept them text (``--parse-special-in-messages``);
        ``aliases``: other names requests may use for it (``--served-model-name NAME,ALIAS...``)."""
        self.engine = engine
        self.card = card
        self.aliases = aliases
        self.tokenizer = engine.tokenizer
        self.limits = PromptLimits.of(engine.tokenizer, engine.model_config.vocab_size, engine.max_model_len)
        self.sampling = SamplingMapping(self.limits.vocab_size, sampling_defaults or {})
        self.prompts = PromptRenderer(
            engine.tokenizer,
            self.limits,
            model_name=engine.model_name,
            tool_parser=tool_parser,
            parse_special_in_messages=parse_special_in_messages,
        )
        self.requests = RequestConverter(engine, self.prompts, self.sampling)
        self.outputs = OutputConverter(engine.tokenizer, engine.model_name)
        # The services ask the model, not its parts: these are the parts' entry points they use.
        self.encode_text = self.prompts.encode_text
        self.render_chat = self.prompts.render_chat
        self.prompt_ids = self.prompts.prompt_ids
        self.chat_ids = self.prompts.chat_ids
        self.token_id_violations = self.limits.token_id_violations
        self.tokenized_request = self.requests.tokenized_request
        self.check_constraint = self.requests.check_constraint
        self.token_text = self.outputs.token_text
        self.token_bytes = self.outputs.token_bytes
        self.delta_to_proto = self.outputs.delta_to_proto
        self.final_to_proto = self.outputs.final_to_proto
        self.response_to_proto = self.outputs.response_to_proto

    @property
    def name(self) -> str:
        return self.engine.model_name

    @property
    def kind(self) -> str:
        """Chat when it has a chat template, else completion."""
        return (ModelKind.CHAT if self.tokenizer.has_chat_template else ModelKind.COMPLETION).value

    @property
    def adapters(self) -> AdapterStack | None:
        """The engine's LoRA adapters (engine/lora), None when it serves none."""
        return self.engine.adapters

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_prompt_bytes(self) -> int:
        return self.limits.max_prompt_bytes

    @property
    def parse_special_in_messages(self) -> bool:
        return self.prompts.parse_special_in_messages

    @property
    def tool_template(self) -> ToolTemplate | None:
        """How this model takes tools; None when it has no chat template or no known call format."""
        return self.prompts.tool_template

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
            kind=self.kind,
            aliases=self.aliases,
            kv_bytes_per_token=self.engine.kv_bytes_per_token,
        )

    # ---- tokenizer RPCs ----------------------------------------------------------------

    async def tokenize(self, req: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """Tokenize RPC: text or chat → ids and their texts (the texts of many ids built off the loop)."""
        ids, _ = await self.requests.prompt_from_proto(req)
        tokens = await self.prompts.tokenizing(len(ids), lambda: [self.token_text(i) for i in ids])
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
