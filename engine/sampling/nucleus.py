"""Top-p (nucleus) filtering: keep the most likely tokens until their mass reaches p.

The rule, on probabilities in descending order (ties: the lower token id ranks first): a token is kept
when the mass ranked above it is below p, so the most likely token always stays and the token that
crosses p is kept too (transformers' TopPLogitsWarper and vLLM keep the same set). Masses are float64
prefix sums of a float64 softmax, taken in that order by the host row and the batched rows alike, so
both keep the same tokens.

Why not sort the row: on the CPU a full stable sort of a 49k-token vocabulary costs more than a
single-stream decode step. The nucleus almost always lies among the few hundred most likely tokens:
``apply_top_p`` finds it with ``torch.topk`` over a growing candidate count and sorts only those, and
the tokens left out are provably outside it (the mass above each of them is at least the candidates'
whole mass, which reached p). Near-flat rows, whose candidates hold little of p, sort the whole row.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
FIRST_CANDIDATES = 128
GROWTH = 8


def keep_sorted(cum: torch.Tensor, p: torch.Tensor | float) -> torch.Tensor:
    """Which of the descending-ordered probabilities (last dim), given as their prefix sums ``cum``,
    the nucleus keeps: the first always, then each one whose preceding prefix mass is below p."""
    keep = torch.empty_like(cum, dtype=torch.bool)
    keep[..., 0] = True
    keep[..., 1:] = cum[..., :-1] < p
    return keep


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """One row's logits with every token outside the top-p nucleus set to -inf (p >= 1: unchanged)."""
    if p >= 1.0:
        return logits
    probs = torch.softmax(logits, dim=0, dtype=torch.float64)
    vocab = probs.shape[0]
    k = min(FIRST_CANDIDATES, vocab)
    while True:
        kth = torch.topk(probs, k, sorted=False).values.min()
        # Every token at least as likely as the k-th (ties included), in token-id order; tokens of
        # probability 0 only once all are candidates (they are outside any nucleus the others reach).
        candidates = torch.nonzero(probs >= kth if kth > 0 or k == vocab else probs > 0).squeeze(1)
        desc, order = torch.sort(probs[candidates], descending=True, stable=True)
        cum = desc.cumsum(dim=0)
        mass = float(cum[-1])
        if k == vocab or mass >= p:
            break
        # Far short of p, or the next round would take a quarter of the row: sort the whole row,
        # which costs less than the rounds a near-flat distribution would need.
        k = vocab if mass < p / 4 or k * GROWTH > vocab // 4 else k * GROWTH
    kept = candidates[order[keep_sorted(cum, p)]]
    out = torch.full_like(logits, NEG_INF)
    out[kept] = logits[kept]
    return out
