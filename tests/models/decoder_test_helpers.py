"""Helpers for the model tests: tiny HF checkpoints and a minimal driver over the KV cache.

The driver stands in for the engine's scheduler: it gives every sequence its
own blocks, packs chunks of several sequences into one ForwardBatch per step
and collects the logits of every position, so tests can compare schedules
(one sequence alone, all in one batch, chunked prefill, token-by-token decode,
random mixes) position by position.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from forward_batches import forward_batch, scheduled
from torch import nn

from bench.tiny_checkpoints import random_model
from protoserve.engine.models.decoder import Decoder
from protoserve.engine.models.kv_cache import ContiguousKVCache, KVCache, PagedKVCache

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)
MISTRAL_WINDOW = 16

# A step: (sequence index, first position, end position) for each scheduled sequence.
Step = list[tuple[int, int, int]]
Schedule = Callable[[Sequence[Sequence[int]]], Iterator[Step]]


def hf_tiny_config(family: str):
    """A transformers config of one family, with the variant each family tests."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family == "llama":  # llama3 rope scaling, original context small so positions cross its bands
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        # Llama 2 style multi-head attention (as many KV heads as query heads).
        return LlamaConfig(
            **{**TINY, "num_key_value_heads": 4}, rope_parameters={"rope_theta": 50000.0, **scaling}
        )
    if family == "mistral":
        return MistralConfig(**TINY, sliding_window=MISTRAL_WINDOW)
    if family == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2Config(**TINY, tie_word_embeddings=True)
    if family == "qwen3":  # q/k norms, explicit head_dim != hidden/heads, linear rope scaling
        return Qwen3Config(
            **TINY, head_dim=32, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
        )
    raise ValueError(family)


def make_hf_checkpoint(
    family: str, directory: Path, seed: int = 0, max_shard_size: str | None = None
) -> nn.Module:
    """Save a tiny random transformers model of ``family`` to ``directory``; return it (float32, eval)."""
    model = random_model(hf_tiny_config(family), seed)  # logits O(1), so errors are meaningful
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return model


class Driver:
    """Runs schedules of chunks through a model and a cache, recording each position's logits."""

    def __init__(self, model: Decoder, cache: KVCache):
        self.model = model
        self.cache = cache

    def run(self, seqs: Sequence[Sequence[int]], schedule: Schedule) -> list[torch.Tensor]:
        bs = self.cache.block_size
        if isinstance(self.cache, ContiguousKVCache):
            tables = [[i] for i in range(len(seqs))]
        else:
            tables, next_block = [], 0
            for s in seqs:
                n = -(-len(s) // bs)
                tables.append(list(range(next_block, next_block + n)))
                next_block += n
            assert next_block <= self.cache.num_blocks, "cache too small for the test"
        out: list[list[torch.Tensor | None]] = [[None] * len(s) for s in seqs]
        for step in schedule(seqs):
            scheduled_now = [scheduled(seqs[i][:b], a, tables[i]) for i, a, b in step]
            batch = forward_batch(scheduled_now, bs, every_position=True)
            logits = self.model(batch, self.cache)
            row = 0
            for i, a, b in step:
                for pos in range(a, b):
                    out[i][pos] = logits[row]
                    row += 1
        return [torch.stack(rows) for rows in out]  # type: ignore[arg-type]


def paged_cache(model: Decoder, num_blocks: int = 256, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache.for_model(model.config, num_blocks, block_size, model.dtype)


def contiguous_cache(model: Decoder, max_seqs: int = 16, max_seq_len: int = 256) -> ContiguousKVCache:
    c = model.config
    return ContiguousKVCache(c.num_layers, max_seqs, max_seq_len, c.num_kv_heads, c.head_dim, model.dtype)


# -- schedules -----------------------------------------------------------------


def all_at_once(seqs: Sequence[Sequence[int]]) -> Iterator[Step]:
    yield [(i, 0, len(s)) for i, s in enumerate(seqs)]


def each_alone(seqs: Sequence[Sequence[int]]) -> Iterator[Step]:
    for i, s in enumerate(seqs):
        yield [(i, 0, len(s))]


def chunked(size: int) -> Schedule:
    def schedule(seqs: Sequence[Sequence[int]]) -> Iterator[Step]:
        for i, s in enumerate(seqs):
            for a in range(0, len(s), size):
                yield [(i, a, min(len(s), a + size))]

    return schedule


def token_by_token(seqs: Sequence[Sequence[int]]) -> Iterator[Step]:
    for i, s in enumerate(seqs):
        for a in range(len(s)):
            yield [(i, a, a + 1)]


def random_mix(seed: int) -> Schedule:
    """Each step, a random subset of sequences advances by a random chunk (decode-sized or prefill-sized), in random order."""

    def schedule(seqs: Sequence[Sequence[int]]) -> Iterator[Step]:
        rng = random.Random(seed)
        done = [0] * len(seqs)
        while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
            step = []
            for i, s in enumerate(seqs):
                if done[i] < len(s) and rng.random() < 0.7:
                    end = min(len(s), done[i] + rng.choice([1, 1, 2, 5, 16, 33]))
                    step.append((i, done[i], end))
                    done[i] = end
            rng.shuffle(step)
            if step:
                yield step

    return schedule


def prefill_then_decode_batched(prompt_lens: Sequence[int]) -> Schedule:
    """All prompts prefilled together, then every sequence decodes one token per step, all batched."""

    def schedule(seqs: Sequence[Sequence[int]]) -> Iterator[Step]:
        yield [(i, 0, n) for i, n in enumerate(prompt_lens)]
        pos = list(prompt_lens)
        while any(p < len(s) for p, s in zip(pos, seqs, strict=True)):
            step = [(i, p, p + 1) for i, (p, s) in enumerate(zip(pos, seqs, strict=True)) if p < len(s)]
            for i, p, _ in step:
                pos[i] = p + 1
            yield step

    return schedule


def greedy_generate(
    model: Decoder, prompts: Sequence[Sequence[int]], max_tokens: int, block_size: int = 16
) -> list[list[int]]:
    """Greedy continuation of every prompt, all sequences batched in each step."""
    c = model.config
    max_len = max(len(p) for p in prompts) + max_tokens
    per_seq = -(-max_len // block_size)
    cache = PagedKVCache.for_model(c, per_seq * len(prompts), block_size, model.dtype)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    seqs = [scheduled(list(p), 0, tables[i]) for i, p in enumerate(prompts)]
    for _ in range(max_tokens):
        logits = model(forward_batch(seqs, block_size), cache)
        for seq, tok in zip(seqs, logits.argmax(dim=-1).tolist(), strict=True):
            seq.num_computed_tokens = seq.num_tokens
            seq.append_token(tok)
    return [s.token_ids[len(p) :] for s, p in zip(seqs, prompts, strict=True)]
