"""Running a Decoder over a paged cache with a LoRA slot per sequence, every position's logits kept."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import torch
from forward_batches import scheduled

from protoserve.engine.execution.model_runner import build_forward_batch
from protoserve.engine.lora.stack import NO_ADAPTER
from protoserve.engine.models.decoder import Decoder
from protoserve.engine.models.kv_cache import PagedKVCache

BLOCK = 4


def run_prompts(model: Decoder, prompts: Seq[Seq[int]], slots: Seq[int]) -> list[torch.Tensor]:
    """Every position's logits of each prompt, all prompts prefilled in one forward, prompt i under slot i."""
    c = model.config
    per_seq = -(-max(len(p) for p in prompts) // BLOCK)
    cache = PagedKVCache(c.num_layers, per_seq * len(prompts), BLOCK, c.num_kv_heads, c.head_dim, model.dtype)
    seqs = [scheduled(list(p), 0, range(i * per_seq, (i + 1) * per_seq)) for i, p in enumerate(prompts)]
    batch = build_forward_batch(seqs, [s.num_uncomputed_tokens for s in seqs], BLOCK, list(slots))
    batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
    logits = model(batch, cache)
    return list(logits.split([len(p) for p in prompts]))


def run_base(model: Decoder, prompts: Seq[Seq[int]]) -> list[torch.Tensor]:
    return run_prompts(model, prompts, [NO_ADAPTER] * len(prompts))


def prompts(seed: int = 1, lens: Seq[int] = (5, 23, 17)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
