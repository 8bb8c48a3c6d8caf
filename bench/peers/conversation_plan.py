"""Conversations as users hold them: one shared system prompt, a message per turn, think time between turns.

Every user of a level talks over the same ~500-token system prompt (an
assistant's instructions, as a deployment sets them), which opens with a nonce
fresh for each server and round: within a round the users share it, and no
round or server can reuse another's. Each user sends a seeded message of
whole vocabulary words per turn and waits a seeded think time after each
answer before the next; the first turns are spread over the same think-time
range, as users arrive one by one rather than all in one instant. The same
seed gives every server the same messages and think times.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.peers.chat_workload import NONCE_WORDS, ChatPromptFactory


@dataclass(frozen=True)
class ConversationSizes:
    """The shape of one profile's conversations."""

    users: tuple[int, ...]  # one load level per count: that many conversations at once
    turns: int
    answer_tokens: int  # each answer, EOS ignored, so every server does the same work
    rounds: int  # each level runs once per round on every server, the servers in turn
    max_seconds: float  # no new turn starts after this long at one level
    system_prompt_tokens: int = 500
    message_tokens: int = 32
    think_s: tuple[float, float] = (0.5, 2.0)  # uniform, after each answer

    # The template's tokens around one turn's two messages (<|im_start|>user\n...<|im_end|>\n and the
    # assistant's): an upper bound, so a conversation at its longest fits what is sized for it.
    TEMPLATE_TOKENS_PER_TURN = 16

    def conversation_tokens(self) -> int:
        """Tokens of one conversation at its longest: the system prompt and every turn with its answer."""
        per_turn = self.message_tokens + self.answer_tokens + self.TEMPLATE_TOKENS_PER_TURN
        return self.system_prompt_tokens + self.TEMPLATE_TOKENS_PER_TURN + self.turns * per_turn


SIZES = {
    "default": ConversationSizes(users=(16, 64), turns=4, answer_tokens=48, rounds=2, max_seconds=600.0),
    "full": ConversationSizes(users=(16, 64), turns=8, answer_tokens=64, rounds=2, max_seconds=1200.0),
    "smoke": ConversationSizes(users=(2, 4), turns=3, answer_tokens=8, rounds=1, max_seconds=120.0),
}


@dataclass(frozen=True)
class UserScript:
    """One user's side of a conversation: when it starts, what it says each turn, how long it thinks."""

    start_s: float  # after the level starts
    messages: tuple[str, ...]  # one per turn
    think_s: tuple[float, ...]  # before each turn after the first

    def __post_init__(self) -> None:
        if len(self.think_s) != max(0, len(self.messages) - 1):
            raise ValueError(f"{len(self.messages)} turns need {len(self.messages) - 1} think times")


@dataclass(frozen=True)
class ConversationPlan:
    """One level of one round: the shared system prompt and every user's script."""

    system: str
    users: tuple[UserScript, ...]
    answer_tokens: int


class ConversationFactory:
    """Plans from the model's word pool: bodies and think times by seed, a fresh nonce each plan."""

    def __init__(self, words: list[str], sizes: ConversationSizes) -> None:
        if sizes.system_prompt_tokens <= NONCE_WORDS:
            raise ValueError(
                f"a {sizes.system_prompt_tokens}-token system prompt leaves no room after the nonce"
            )
        self.words = words
        self.sizes = sizes
        self._nonces = ChatPromptFactory(words)  # its nonces: system entropy, never repeated

    def _words(self, rng: random.Random, count: int) -> str:
        return " ".join(rng.choice(self.words) for _ in range(count))

    def plan(self, users: int, seed: int) -> ConversationPlan:
        s = self.sizes
        rng = random.Random(seed)
        system = f"{self._nonces.nonce()} {self._words(rng, s.system_prompt_tokens - NONCE_WORDS)}"
        scripts = tuple(
            UserScript(
                start_s=rng.uniform(0.0, s.think_s[1]),
                messages=tuple(self._words(rng, s.message_tokens) for _ in range(s.turns)),
                think_s=tuple(rng.uniform(*s.think_s) for _ in range(s.turns - 1)),
            )
            for _ in range(users)
        )
        return ConversationPlan(system, scripts, s.answer_tokens)
