"""SpeculativeParams: a request's speculative-decoding options, validated like SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft", "off")
MAX_SPECULATIVE_TOKENS = 16  # drafts per step; more mostly adds rejected work
MAX_NGRAM = 16


@dataclass(frozen=True)
class SpeculativeParams:
    """``method="ngram"`` drafts up to ``num_speculative_tokens`` tokens per step by prompt lookup with
    suffix sizes ``prompt_lookup_max`` down to ``prompt_lookup_min`` (vLLM's names); ``"draft"`` drafts
    them with the engine's draft model (``EngineConfig.speculative_model``); ``"off"`` decodes one
    token per step (a request may turn off a server default this way)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # 1-token matches in free text draft mostly wrong tokens
    prompt_lookup_max: int = 3

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def validate(self, prefix: str = "speculative") -> list[tuple[str, str]]:
        """(field, problem) pairs, fields named ``<prefix>.<name>``; empty when valid."""
        bad: list[tuple[str, str]] = []
        if self.method not in METHODS:
            return [(f"{prefix}.method", f"must be one of {', '.join(METHODS)}")]
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            bad.append((f"{prefix}.num_speculative_tokens", f"must be in [1, {MAX_SPECULATIVE_TOKENS}]"))
        if not 1 <= self.prompt_lookup_min <= MAX_NGRAM:
            bad.append((f"{prefix}.prompt_lookup_min", f"must be in [1, {MAX_NGRAM}]"))
        if not 1 <= self.prompt_lookup_max <= MAX_NGRAM:
            bad.append((f"{prefix}.prompt_lookup_max", f"must be in [1, {MAX_NGRAM}]"))
        elif self.prompt_lookup_max < self.prompt_lookup_min:
            bad.append((f"{prefix}.prompt_lookup_max", "must not be below prompt_lookup_min"))
        return bad
