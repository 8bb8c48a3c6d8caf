"""Mirostat v1 and v2 (Basu et al., 2021), as llama.cpp implements them (``llama_sampler_mirostat*``).

Both keep a per-sequence target ``mu`` (starting at ``2 * tau``), cut the
candidates sorted by probability down to a top set that ``mu`` decides, draw from
that set renormalized, and move ``mu`` by ``eta`` times the error between the drawn
token's surprise (``-log2 p`` in the renormalized set) and the target ``tau``.

- v1 estimates the Zipf exponent ``s_hat`` from the ``m`` most likely tokens and
  keeps the top ``k = ((eps * 2^mu) / (1 - N^-eps))^(1 / s_hat)``, ``eps = s_hat - 1``,
  N the vocabulary size.
- v2 keeps the leading tokens whose surprise is at most ``mu`` (at least one).

Candidates are the tokens with a finite logit: tokens a grammar, min_tokens or
the context made impossible take no part (llama.cpp keeps them with probability
0, which turns v1's ratio estimate into inf/nan when few tokens remain). The
functions here are pure: the sampler does the draw with the sequence's generator.
"""

from __future__ import annotations

import math

import torch

M_V1 = 100  # llama.cpp's m: how many of the most likely tokens estimate s_hat


def sorted_candidates(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities in float64, most likely first; their token ids) over the finite logits.

    The sort is stable, so equally likely tokens keep id order.
    """
    ids = torch.isfinite(logits).nonzero().squeeze(1)
    values, order = torch.sort(logits[ids].to(torch.float64), descending=True, stable=True)
    return torch.softmax(values, dim=0), ids[order]


def v1_keep(probs: torch.Tensor, mu: float, n_vocab: int, m: int = M_V1) -> int:
    """How many of the sorted candidates v1 keeps."""
    n = min(m - 1, probs.shape[0] - 1)
    if n < 1:
        return 1
    i = torch.arange(n, dtype=torch.float64)
    t = torch.log((i + 2) / (i + 1))
    b = torch.log(probs[:n] / probs[1 : n + 1])
    s_hat = float((t * b).sum() / (t * t).sum())
    eps = s_hat - 1.0
    try:
        k = ((eps * 2.0**mu) / (1.0 - n_vocab ** (-eps))) ** (1.0 / s_hat)
    except (ZeroDivisionError, OverflowError):
        k = math.inf if eps != 0.0 else 2.0**mu / math.log(n_vocab)  # eps -> 0: the limit of the formula
    if isinstance(k, complex) or math.isnan(k):
        return 1
    return max(1, min(probs.shape[0], int(k) if math.isfinite(k) else probs.shape[0]))


def v2_keep(probs: torch.Tensor, mu: float) -> int:
    """How many of the sorted candidates v2 keeps: those before the first whose surprise exceeds mu."""
    over = (-torch.log2(probs) > mu).nonzero()
    return max(1, int(over[0]) if over.numel() else probs.shape[0])


def updated_mu(mu: float, p_chosen: float, tau: float, eta: float) -> float:
    """mu after drawing a token of (renormalized) probability ``p_chosen``."""
    return mu - eta * (-math.log2(p_chosen) - tau)
