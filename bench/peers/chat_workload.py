"""Chat requests as a user sends them to either server: text messages, a nonce first, ~100 tokens.

Both servers are sent the same conversations through their OpenAI chat route, so
each applies the model's own chat template and tokenizes the text itself. The
nonce opens the system message, ahead of everything but the template's first
three tokens, so neither server's prefix cache can reuse another request's
prompt (protoserve caches whole 16-token blocks; llama-server reuses a slot's
common prefix token by token, which three tokens barely feed). Prompt words
are whole words of the model's own vocabulary (a leading-space token of
letters only), so each is one token and the prompt's length is known before
the server counts it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 100  # what both servers' usage should report, template included
NONCE_WORDS = 8
# SmolLM2's template around a system and a user message (<|im_start|>system\n ... <|im_end|>\n
# <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n: 13 tokens), plus a message's first word,
# which lacks its leading space and often splits in two: prompts come to 100-104 tokens.
TEMPLATE_TOKENS = 16
BYTE_LEVEL_SPACE = "\u0120"  # byte-level BPE's mark for a leading space ("Ġ")
MIN_WORD_LEN = 3


@dataclass(frozen=True)
class ChatSpec:
    """One chat request: a system message (the nonce), a user message, and how many tokens to generate."""

    system: str
    user: str
    max_tokens: int

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]

    def body(self, model: str) -> dict[str, Any]:
        return chat_body(model, self.messages(), self.max_tokens)


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """The OpenAI chat request: greedy, streamed with a usage chunk, EOS ignored (both servers honour
    ``ignore_eos``), so each answer is exactly ``max_tokens`` tokens."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def word_pool(vocabulary: Iterable[str]) -> list[str]:
    """Whole lowercase words from a byte-level BPE vocabulary (tokens of a leading space and letters)."""
    words = {
        token[1:]
        for token in vocabulary
        if token.startswith(BYTE_LEVEL_SPACE)
        and len(token) > MIN_WORD_LEN
        and token[1:].isascii()
        and token[1:].isalpha()
        and token[1:].islower()
    }
    return sorted(words)


def model_words(model: Path) -> list[str]:
    """The word pool of the model's own vocabulary."""
    from protoserve.engine.runtime import Tokenizer

    tokenizer = Tokenizer.from_path(model)
    return word_pool(tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size))


class ChatPromptFactory:
    """Conversations of ``PROMPT_TOKENS`` tokens: a fresh nonce, then seeded words.

    The same seed gives the same user messages (every server gets the same workload); nonces come
    from system entropy and are never repeated within a factory.
    """

    def __init__(self, words: list[str], seed: int = 0, prompt_tokens: int = PROMPT_TOKENS) -> None:
        if len(words) < 100:
            raise ValueError(f"word pool of {len(words)} words is too small for unique prompts")
        body = prompt_tokens - NONCE_WORDS - TEMPLATE_TOKENS
        if body < 1:
            raise ValueError(f"prompt_tokens {prompt_tokens} leaves no room after the nonce and template")
        self.words = words
        self.body_words = body
        self.rng = random.Random(seed)
        self._nonce_rng = random.SystemRandom()
        self._issued: set[str] = set()

    def nonce(self) -> str:
        while True:
            nonce = " ".join(self._nonce_rng.choice(self.words) for _ in range(NONCE_WORDS))
            if nonce not in self._issued:
                self._issued.add(nonce)
                return nonce

    def spec(self, max_tokens: int) -> ChatSpec:
        user = " ".join(self.rng.choice(self.words) for _ in range(self.body_words))
        return ChatSpec(system=self.nonce(), user=user, max_tokens=max_tokens)

    def specs(self, count: int, max_tokens: int) -> list[ChatSpec]:
        return [self.spec(max_tokens) for _ in range(count)]
