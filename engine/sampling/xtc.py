"""XTC, llama.cpp's "exclude top choices" sampler: now and then, the likeliest candidates are taken away.

With probability ``probability`` (one uniform from the sequence's own generator, drawn only while at
least two candidates remain), every candidate at least ``threshold`` likely is dropped except the least
likely of them, so the draw still has a sensible choice but not the most predictable ones. Nothing is
dropped when fewer than two candidates are that likely. A transcription of llama.cpp's
``llama_sampler_xtc_apply`` over a logits row whose dropped tokens are ``-inf``; the probabilities are
the softmax of the row as the earlier filters left it (here after temperature, as min-p sees them:
llama.cpp applies temperature last).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_xtc(logits: torch.Tensor, probability: float, threshold: float, generator: torch.Generator) -> torch.Tensor:
    """``logits`` (1-D float) with XTC applied; the same tensor when it drops nothing."""
    if probability <= 0.0 or int(torch.isfinite(logits).sum()) < 2:
        return logits
    chance = float(torch.rand((), generator=generator, dtype=torch.float64))
    if chance > probability:
        return logits
    probs = torch.softmax(logits, dim=0)
    order = torch.sort(probs, descending=True, stable=True).indices
    above = int(((probs >= threshold) & torch.isfinite(logits)).sum())  # a dropped token is no candidate
    if above < 2:
        return logits
    out = logits.clone()
    out[order[: above - 1]] = NEG_INF  # all of them but the last, the least likely
    return out
