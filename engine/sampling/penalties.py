"""Logit adjustments that depend on a request's tokens: bias, penalties, min_tokens masking.

Each function edits one sequence's float32 logits row ``[V]`` in place. They are
elementwise over the vocabulary, so a row's result never depends on other rows.
"""

from __future__ import annotations

import torch


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    """Add OpenAI-style per-token biases (a bias of +100 all but forces a token)."""
    ids = torch.tensor(list(bias.keys()), dtype=torch.int64)
    values = torch.tensor(list(bias.values()), dtype=logits.dtype)
    logits.index_add_(0, ids, values)


def mask_tokens(logits: torch.Tensor, token_ids: list[int]) -> None:
    """Make tokens impossible (used to hold back EOS and stop tokens before min_tokens)."""
    if token_ids:
        logits[torch.tensor(token_ids, dtype=torch.int64)] = float("-inf")


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> None:
    """CTRL-style penalty on every token of prompt and output: positive logits divided, negative multiplied."""
    values = logits[seen_ids]
    logits[seen_ids] = torch.where(values > 0, values / penalty, values * penalty)


def apply_frequency_presence(
    logits: torch.Tensor, output_ids: torch.Tensor, frequency: float, presence: float
) -> None:
    """OpenAI penalties over generated tokens: ``frequency * count + presence * (count > 0)``."""
    counts = torch.bincount(output_ids, minlength=logits.shape[0])[: logits.shape[0]].to(logits.dtype)
    logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)
