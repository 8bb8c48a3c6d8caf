"""Workloads: random-token prompts that start with a unique nonce, and request lists built from them.

Prompts are token ids (not text) so every path sees exactly the prompt length
asked for. Each prompt opens with a nonce drawn from one NonceSource shared by
the whole run: the engine's prefix cache keys blocks by a chained hash from
the first token on, so a unique first block means no request, in this run or
an earlier one against the same server, can reuse another's KV. Lengths and
prompt bodies come from a seeded generator, so every path gets the same
workload shape; only the nonces differ between runs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

# SmolLM2's special tokens sit at the bottom of the vocabulary; random bodies stay
# above them (and inside any small test vocabulary's reach of real models).
DEFAULT_TOKEN_RANGE = (100, 40_000)
NONCE_TOKENS = 4  # 4 tokens of ~40k values: ~2.6e18 nonces


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its prompt ids and exactly how many tokens to generate (EOS ignored)."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


class NonceSource:
    """Unique token-id prefixes; unseeded (system entropy) so two runs never share one."""

    def __init__(
        self, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE, length: int = NONCE_TOKENS
    ) -> None:
        self._rng = random.Random()
        self._low, self._high = token_range
        self.length = length
        self._issued: set[tuple[int, ...]] = set()

    def next(self) -> tuple[int, ...]:
        while True:
            nonce = tuple(self._rng.randrange(self._low, self._high) for _ in range(self.length))
            if nonce not in self._issued:
                self._issued.add(nonce)
                return nonce


class PromptFactory:
    """Prompts of a given length: a fresh nonce, then seeded random tokens."""

    def __init__(
        self, nonces: NonceSource, seed: int = 0, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE
    ):
        self.nonces = nonces
        self.rng = random.Random(seed)
        self._low, self._high = token_range

    def prompt(self, length: int) -> tuple[int, ...]:
        """``length`` token ids in total, the nonce included (so ``length`` must exceed the nonce)."""
        if length <= self.nonces.length:
            raise ValueError(f"prompt length {length} must exceed the nonce length {self.nonces.length}")
        body = [self.rng.randrange(self._low, self._high) for _ in range(length - self.nonces.length)]
        return self.nonces.next() + tuple(body)


def offline_workload(
    factory: PromptFactory, num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int]
) -> list[RequestSpec]:
    """nano-vllm's offline benchmark shape: prompt and output lengths uniform in the closed ranges."""
    specs = []
    for _ in range(num_requests):
        length = factory.rng.randint(*prompt_len)
        max_tokens = factory.rng.randint(*output_len)
        specs.append(RequestSpec(factory.prompt(length), max_tokens))
    return specs


def serving_workload(
    factory: PromptFactory,
    num_requests: int,
    prompt_len: int,
    max_tokens: int,
    long_every: int = 0,
    long_prompt_len: int = 0,
) -> list[RequestSpec]:
    """Fixed-shape requests; with ``long_every=k`` every k-th request has a ``long_prompt_len`` prompt."""
    specs = []
    for i in range(num_requests):
        long = long_every > 0 and i % long_every == long_every - 1
        specs.append(RequestSpec(factory.prompt(long_prompt_len if long else prompt_len), max_tokens))
    return specs


def output_tokens(specs: Sequence[RequestSpec]) -> int:
    """Tokens the specs ask for in total (what every path must generate, EOS being ignored)."""
    return sum(s.max_tokens for s in specs)
