"""OpenAI's shapes of what the engine produced, shared by its surfaces: finish reasons, usage, the
system fingerprint and the two logprob layouts (completions' and chat's)."""

from __future__ import annotations

import hashlib

from google.protobuf import struct_pb2

from protoserve.engine.api import FinishReason, PositionLogprobs
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server.models.served_model import CollectedOutput, ServedModel

SERVER_VERSION = "protoserve-0.1.0"
FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "cancelled",
}


def system_fingerprint(served: ServedModel) -> str:
    """Identifies the server build and how the model was loaded, as OpenAI's fingerprint does."""
    card = served.card
    key = f"{SERVER_VERSION}|{served.name}|{card.dtype}|{card.quantization}|{card.source}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def finish_reason_text(reason: FinishReason | None) -> str:
    return FINISH_REASONS.get(reason, "") if reason is not None else ""


def usage(results: list[CollectedOutput]) -> oa.Usage:
    """The token counts of every prompt of a response, summed; ``cached_tokens`` always set, as OpenAI's."""
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    cached = sum(r.cached_prompt_tokens for r in results)
    return oa.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                    prompt_tokens_details=oa.PromptTokensDetails(cached_tokens=cached))


class OffsetTracker:
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


def completion_logprobs(
    served: ServedModel, positions: list[PositionLogprobs], offsets: OffsetTracker, choice: int, start: int
) -> oa.CompletionLogprobs:
    """The completions API's layout: parallel lists of tokens, logprobs, top alternatives and offsets,
    the offsets carried on from the choice's earlier tokens (``start`` for its first)."""
    tokens = [served.token_text(pos.chosen.token_id) for pos in positions]
    out = oa.CompletionLogprobs()
    for pos, token, offset in zip(positions, tokens, offsets.take(choice, tokens, start), strict=True):
        out.tokens.append(token)
        out.token_logprobs.append(pos.chosen.logprob)
        top = struct_pb2.Struct()
        for alt in pos.top:
            top[served.token_text(alt.token_id)] = alt.logprob
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
    return out


def chat_logprobs(served: ServedModel, positions: list[PositionLogprobs]) -> oa.ChatChoiceLogprobs:
    """The chat API's layout: per token its text, logprob, UTF-8 bytes and top alternatives."""
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
