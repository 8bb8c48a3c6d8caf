"""Input validation: what a request's input may be for one model, checked before anything is tokenized.

:class:`PromptLimits` holds one model's bounds (its vocabulary, its context window, the most text it
tokenizes) and refuses input outside them cheaply: by counting characters, or with a lower bound on
the tokens text needs, never by tokenizing it. The functions below check a request's other fields.
Every check raises :class:`protoserve.server.errors.ServiceError` with field violations (or the
engine's ``ContextLengthError``, which the services map to OUT_OF_RANGE) or returns violations for the
caller to gather; field paths are the request's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protoserve.engine.api import ContextLengthError, ContextPolicy, SamplingParams
from protoserve.server import errors
from protoserve.server.limits import (
    MAX_CHAT_MESSAGES,
    MAX_CHAT_NAME_CHARS,
    MAX_PROMPT_BYTES,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRINGS,
)
from protoserve.server.models.chat_turn import CHAT_ROLES, ChatTurn
from protoserve.server.models.sampling_mapping import Violation
from protoserve.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from protoserve.engine.runtime import Tokenizer

CONTEXT_POLICIES: dict[int, ContextPolicy] = {
    pb.CONTEXT_POLICY_UNSPECIFIED: ContextPolicy.ALLOW_CONTEXT_STOP,
    pb.CONTEXT_POLICY_ALLOW_CONTEXT_STOP: ContextPolicy.ALLOW_CONTEXT_STOP,
    pb.CONTEXT_POLICY_REJECT: ContextPolicy.REJECT,
    pb.CONTEXT_POLICY_TRUNCATE_LEFT: ContextPolicy.TRUNCATE_LEFT,
    pb.CONTEXT_POLICY_TRUNCATE_RIGHT: ContextPolicy.TRUNCATE_RIGHT,
    pb.CONTEXT_POLICY_RESERVE_GENERATION: ContextPolicy.RESERVE_GENERATION,
}
# The engine refuses a prompt that fills the context under these policies; the others truncate.
FITTING_POLICIES = frozenset({ContextPolicy.ALLOW_CONTEXT_STOP, ContextPolicy.REJECT})


@dataclass
class PromptLimits:
    """One model's bounds on a prompt: token ids in ``[0, vocab_size)``, at most ``max_prompt_bytes``
    of text tokenized, and under a policy that refuses what the context cannot hold
    (``FITTING_POLICIES``), fewer than ``max_model_len`` tokens."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    max_prompt_bytes: int

    @classmethod
    def of(cls, tokenizer: Tokenizer, model_vocab_size: int, max_model_len: int) -> PromptLimits:
        # Ids must be both embeddable and decodable; a padded embedding table can exceed the tokenizer.
        vocab_size = min(tokenizer.vocab_size, model_vocab_size)
        # Text beyond this many bytes is not tokenized at all; where the context's byte bound is
        # larger, that, so a prompt that could fit is never refused for its size.
        span = tokenizer.max_token_span_bytes
        max_prompt_bytes = max(MAX_PROMPT_BYTES, max_model_len * span if span else 0)
        return cls(tokenizer, vocab_size, max_model_len, max_prompt_bytes)

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

    def check_text(self, text: str, *, path: str, policy: ContextPolicy | None) -> None:
        """Refuse, without tokenizing, text that cannot be served.

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

    def check_turns(self, turns: Sequence[ChatTurn], path: str) -> int:
        """The characters a conversation's texts hold together, after refusing over-long names and a
        conversation over ``max_prompt_bytes`` before it is rendered."""
        violations = [
            (f"{path}[{i}].name", f"must be at most {MAX_CHAT_NAME_CHARS} characters")
            for i, turn in enumerate(turns)
            if len(turn.name) > MAX_CHAT_NAME_CHARS
        ]
        if violations:
            raise errors.invalid_argument(violations)
        chars = sum(len(t.content) + len(t.name) + sum(len(c.arguments) for c in t.tool_calls) for t in turns)
        if chars > self.max_prompt_bytes:
            raise errors.invalid_argument(
                [
                    (
                        path,
                        f"hold {chars} characters; at most {self.max_prompt_bytes} bytes of text are tokenized",
                    )
                ]
            )
        return chars

    def token_id_violations(self, ids: Sequence[int], path: str) -> list[Violation]:
        """Violations for token ids outside the vocabulary (first few named)."""
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):
            return []  # the common case, at C speed even for a context's worth of ids
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if not bad:
            return []
        shown = ", ".join(str(i) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
        return [(path, f"token ids {shown} are outside the vocabulary [0, {self.vocab_size})")]

    def check_token_ids(self, ids: Sequence[int], path: str, policy: ContextPolicy | None) -> None:
        """A prompt given as token ids: not empty, in the vocabulary, and (under ``policy``) in the context."""
        if policy in FITTING_POLICIES and len(ids) >= self.max_model_len:
            raise ContextLengthError(
                len(ids),
                self.max_model_len,
                f"the prompt has {len(ids)} tokens but the context window (max_model_len) is "
                f"{self.max_model_len} tokens, which leaves no room to generate",
            )
        violations = self.token_id_violations(ids, path)
        if not ids:
            violations.append((path, "must not be empty"))
        if violations:
            raise errors.invalid_argument(violations)


def check_chat_input(chat: pb.ChatInput) -> None:
    """INVALID_ARGUMENT for a native chat input with too many or no messages, or unknown roles."""
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise errors.invalid_argument([("chat.messages", f"at most {MAX_CHAT_MESSAGES} messages")])
    violations = []
    if not chat.messages:
        violations.append(("chat.messages", "must not be empty"))
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            violations.append((f"chat.messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}"))
    if violations:
        raise errors.invalid_argument(violations)


def generate_request_violations(req: pb.GenerateRequest, params: SamplingParams) -> list[Violation]:
    """A GenerateRequest's own fields, and the sampling options that only make sense together."""
    violations: list[Violation] = []
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        violations.append(("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters"))
    if req.context_policy not in CONTEXT_POLICIES:
        violations.append(("context_policy", f"unknown value {req.context_policy}"))
    if params.top_logprobs and not params.logprobs:
        violations.append(("sampling.top_logprobs", "requires sampling.logprobs"))
    if len(params.stop) > MAX_STOP_STRINGS:
        violations.append(("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings"))
    constraint = req.sampling.constraint
    if constraint.WhichOneof("kind") == "json_object" and not constraint.json_object:
        violations.append(("sampling.constraint.json_object", "must be true (unset constraint: free text)"))
    return violations
