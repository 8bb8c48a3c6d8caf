"""Hidden states -> one vector per text, as sentence-transformers' Pooling and Normalize modules compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [B, T, H], attention_mask [B, T] (1 = token) -> [B, H]; padding never contributes.

    [CLS] and [SEP] count as tokens, as in sentence-transformers: the model was
    trained with them in the mean.
    """
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(mask == 0, -1e9).amax(dim=1)
    summed = (hidden * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp(min=1e-9)
    if mode == "mean":
        return summed / counts
    if mode == "mean_sqrt_len":
        return summed / counts.sqrt()
    raise ValueError(f"pooling mode {mode!r} is not supported")


def l2_normalize(vectors: torch.Tensor) -> torch.Tensor:
    return F.normalize(vectors, p=2, dim=1)
