"""InferenceService's requests to the engine's: a GenerateRequest or TokenizeRequest's input oneof to
token ids, and a whole GenerateRequest to a ``TokenizedRequest``.

Everything but the prompt is checked before the prompt is tokenized; violations name the request's
own fields (``sampling.temperature``), prefixed where the request sits inside another (``requests[3].``
in Batch). The sampling fields become engine parameters through the model's SamplingMapping, the one
place they do.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from protoserve.engine.api import Constraint, ContextPolicy, InvalidRequestError, TokenizedRequest
from protoserve.engine.runtime import adapter_problems
from protoserve.server import errors
from protoserve.server.models.chat_turn import ChatTurn
from protoserve.server.models.input_validation import (
    CONTEXT_POLICIES,
    check_chat_input,
    generate_request_violations,
)
from protoserve.server.models.prompt_rendering import PromptRenderer
from protoserve.server.models.sampling_mapping import (
    PathMap,
    SamplingMapping,
    path_function,
    speculative_from_proto,
)
from protoserve.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from protoserve.engine.runtime import AsyncEngine


@dataclass
class RequestConverter:
    """One model's native requests → engine requests, through its prompts and sampling mapping."""

    engine: AsyncEngine
    prompts: PromptRenderer
    sampling: SamplingMapping

    async def prompt_from_proto(
        self, req: pb.GenerateRequest | pb.TokenizeRequest, policy: ContextPolicy | None = None
    ) -> tuple[list[int], str]:
        """Token ids of a request's input oneof, and the field path they came from.

        Raises INVALID_ARGUMENT for a missing input, an empty prompt, token ids
        outside the vocabulary, malformed chat messages or text over the size cap,
        and (under ``policy``, see :meth:`PromptLimits.check_text`) OUT_OF_RANGE for
        a prompt the context cannot hold. Long text is tokenized off the event loop.
        """
        kind = req.WhichOneof("input")
        if kind is None:
            fields = "prompt, token_ids or chat" if isinstance(req, pb.GenerateRequest) else "text or chat"
            raise errors.invalid_argument([("input", f"one of {fields} is required")])
        if kind == "token_ids":
            ids = list(req.token_ids.ids)
            self.prompts.limits.check_token_ids(ids, "token_ids.ids", policy)
            return ids, "token_ids.ids"
        if kind == "chat":
            check_chat_input(req.chat)
            turns = [ChatTurn(m.role, m.content, m.name) for m in req.chat.messages]
            add_prompt = (
                req.chat.add_generation_prompt if req.chat.HasField("add_generation_prompt") else True
            )
            return await self.prompts.chat_ids(turns, add_generation_prompt=add_prompt, policy=policy), "chat"
        add_special = True
        if isinstance(req, pb.TokenizeRequest) and req.HasField("add_special_tokens"):
            add_special = req.add_special_tokens
        text = getattr(req, kind)  # "prompt" or "text"
        ids = await self.prompts.prompt_ids(text, path=kind, policy=policy, add_special_tokens=add_special)
        return ids, kind

    async def tokenized_request(
        self, req: pb.GenerateRequest, *, request_id: str, cache_salt: bytes, path_prefix: str = ""
    ) -> TokenizedRequest:
        """Validate an InferenceService GenerateRequest and build the engine request.

        ``request_id`` is the engine's id (the caller keeps the public one);
        ``cache_salt`` comes from the authenticated identity, never the body.
        ``path_prefix`` prefixes violation paths (e.g. ``requests[3].`` in Batch).
        """
        # Unset, max_tokens is "until the context is full".
        params = self.sampling.params(req.sampling, api_defaults={"max_tokens": None})
        if "speculative" in req.DESCRIPTOR.fields_by_name and req.HasField("speculative"):
            params = replace(params, speculative=speculative_from_proto(req.speculative))
        violations = generate_request_violations(req, params)
        violations.extend(adapter_problems(self.engine.adapters, req.adapter or None))
        policy = CONTEXT_POLICIES.get(req.context_policy)
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
            await asyncio.to_thread(self.engine.compile_constraint, constraint)
        except InvalidRequestError as exc:
            renamed = [(to_path(name), problem) for name, problem in exc.violations]
            raise errors.invalid_argument(renamed) from None
        return to_path(constraint.field)
