"""OpenAI's completions (``/v1/completions``): prompts in, ``n`` choices per prompt out.

Choice ``i*n+j`` is choice ``j`` of prompt ``i``. OpenAI's defaults apply: ``max_tokens`` 16, and
``logprobs`` is the number of alternatives per token (0-5), set at all to ask for logprobs.
"""

from __future__ import annotations

from typing import Any

from protoserve.engine.api import Choice, CompletionDelta, ContextPolicy
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server.limits import MAX_COMPLETION_PROMPTS
from protoserve.server.models.served_model import ServedModel
from protoserve.server.services.openai.chunked import ChoiceStream, ChunkedSurface, Reply
from protoserve.server.services.openai.outputs import (
    OffsetTracker,
    completion_logprobs,
    finish_reason_text,
)
from protoserve.server.services.openai.preparation import (
    PreparedRequest,
    Prompt,
    SamplingFields,
    checked_sampling,
)
from protoserve.server.services.openai.streaming import Generation
from protoserve.server.services.openai.translation import (
    Violations,
    as_token_ids,
    converted_sampling,
    output_constraint,
    python_value,
)

MAX_COMPLETION_LOGPROBS = 5  # the completions API's `logprobs` range is 0-5
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _prompt_items(req: oa.CreateCompletionRequest, violations: Violations) -> list[Any]:
    """OpenAI's prompt forms as a list of prompts: a string, strings, token ids, or lists of token ids."""
    value = python_value(req.prompt) if req.HasField("prompt") else None
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and as_token_ids(value) is not None:
        value = [value]
    if not isinstance(value, list) or not value:
        violations.append(("prompt", "must be a string, a list of strings or a list of token id lists"))
        return []
    if len(value) > MAX_COMPLETION_PROMPTS:
        # Before any tokenizing: each prompt would be an engine request of its own.
        violations.append(("prompt", f"at most {MAX_COMPLETION_PROMPTS} prompts per request"))
        return []
    return value


async def _prompts(
    served: ServedModel, req: oa.CreateCompletionRequest, violations: Violations
) -> list[Prompt]:
    """Each prompt tokenized (text) or checked against the vocabulary (token ids)."""
    items = _prompt_items(req, violations)
    prompts = []
    for i, item in enumerate(items):
        path = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids = await served.prompt_ids(item, path=path, policy=ContextPolicy.ALLOW_CONTEXT_STOP)
            if not ids:
                violations.append((path, "must produce at least one token"))
            prompts.append(Prompt(ids, item))
            continue
        ids = as_token_ids(item) if isinstance(item, list) else None
        if not ids:
            violations.append((path, "must be a non-empty string or a non-empty list of token ids"))
            continue
        bad = served.token_id_violations(ids, path)
        violations.extend(bad)
        if not bad:
            prompts.append(Prompt(ids, served.tokenizer.decode(ids, skip_special_tokens=False)))
    return prompts


def _logprob_violations(req: oa.CreateCompletionRequest) -> Violations:
    violations = []
    if req.HasField("logprobs") and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        violations.append(("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}]"))
    if req.echo and req.HasField("logprobs"):
        # Echoed prompt tokens would need prompt logprobs, which the engine does not compute.
        violations.append(("echo", "cannot be combined with logprobs"))
    return violations


class Completions(ChunkedSurface):
    """The completions surface: validation, the unary response and the stream's choices."""

    id_prefix = "cmpl"
    response = Reply(oa.CreateCompletionResponse, "text_completion")
    chunk = Reply(oa.CreateCompletionStreamResponse, "text_completion")

    async def validate(
        self,
        req: oa.CreateCompletionRequest,
        served: ServedModel,
        adapter: str | None,
        violations: Violations,
    ) -> PreparedRequest:
        prompts = await _prompts(served, req, violations)
        violations += _logprob_violations(req)
        constraint, paths = output_constraint(req, violations)
        converted = {
            **converted_sampling(req, violations),
            "logprobs": req.HasField("logprobs"),
            "top_logprobs": min(max(req.logprobs, 0), MAX_COMPLETION_LOGPROBS),
            "constraint": constraint,
        }
        paths["top_logprobs"] = "logprobs"
        fields = SamplingFields(req, {"max_tokens": DEFAULT_COMPLETION_MAX_TOKENS}, converted, paths)
        sampling, constraint_field = await checked_sampling(served, fields, violations)
        return PreparedRequest(
            served, prompts, sampling, echo=req.echo, adapter=adapter, constraint_field=constraint_field
        )

    def choice_stream(self, prepared: PreparedRequest) -> ChoiceStream:
        return _CompletionChunks(prepared)

    def choices(self, generation: Generation) -> list[oa.CompletionChoice]:
        prepared = generation.prepared
        choices = []
        for p, (prompt, result) in enumerate(zip(prepared.prompts, generation.results, strict=True)):
            prefix = prompt.text if prepared.echo else ""
            choices += [_choice(prepared, p, prefix, choice) for choice in result.choices]
        return choices


def _choice(prepared: PreparedRequest, prompt_index: int, prefix: str, choice: Choice) -> oa.CompletionChoice:
    """A finished choice of a prompt, after its echoed ``prefix``."""
    logprobs = None
    if prepared.sampling.logprobs:
        logprobs = completion_logprobs(prepared.served, choice.logprobs, OffsetTracker(), 0, len(prefix))
    return oa.CompletionChoice(
        text=prefix + choice.text,
        index=prompt_index * prepared.sampling.n + choice.index,
        logprobs=logprobs,
        finish_reason=finish_reason_text(choice.finish_reason),
    )


class _CompletionChunks:
    """A completion stream's choices: echoed prompts first, then one choice per delta."""

    def __init__(self, prepared: PreparedRequest) -> None:
        self.prepared = prepared
        self.offsets = OffsetTracker()

    def opening(self) -> list[oa.CompletionChoice]:
        """The echoed prompts, once per choice."""
        if not self.prepared.echo:
            return []
        n = self.prepared.sampling.n
        return [
            oa.CompletionChoice(text=prompt.text, index=q * n + j)
            for q, prompt in enumerate(self.prepared.prompts)
            for j in range(n)
        ]

    def choices(self, prompt_index: int, delta: CompletionDelta) -> list[oa.CompletionChoice]:
        if not (delta.text or delta.token_ids or delta.finish_reason is not None):
            return []
        prepared = self.prepared
        index = prompt_index * prepared.sampling.n + delta.index
        choice = oa.CompletionChoice(text=delta.text, index=index)
        if prepared.sampling.logprobs and delta.logprobs:
            start = len(prepared.prompts[prompt_index].text) if prepared.echo else 0
            choice.logprobs.CopyFrom(
                completion_logprobs(prepared.served, delta.logprobs, self.offsets, index, start)
            )
        if delta.finish_reason is not None:
            choice.finish_reason = finish_reason_text(delta.finish_reason)
        return [choice]
