"""Forward batches built the way the engine builds them, for the model and kernel tests.

A test describes each scheduled sequence as the engine holds it (its known token ids, how many
of them already have K/V in the cache, its block table) and gets the batch from
``protoserve.engine.execution.model_runner.build_forward_batch``, the function every production step goes through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import torch

from protoserve.engine.execution.forward_batch import ForwardBatch
from protoserve.engine.execution.model_runner import build_forward_batch
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.scheduling.sequence import Sequence


def scheduled(token_ids: Seq[int], num_computed: int, block_table: Seq[int]) -> Sequence:
    """A sequence whose first ``num_computed`` tokens are cached; a step computes the rest."""
    if not 0 <= num_computed < len(token_ids):
        raise ValueError(f"{num_computed} cached of {len(token_ids)} tokens leaves nothing to compute")
    ids = [int(t) for t in token_ids]
    return Sequence(
        seq_id=0, request_id="test", index=0, token_ids=ids, num_prompt_tokens=len(ids),
        max_len=len(ids) + 1, sampling=SamplingParams(), generator=torch.Generator(),
        num_computed_tokens=num_computed, block_table=[int(b) for b in block_table],
    )


def forward_batch(seqs: Seq[Sequence], block_size: int, every_position: bool = False) -> ForwardBatch:
    """One step over every uncomputed token of ``seqs``.

    ``every_position`` asks for the logits of each new token (the engine wants only each
    sequence's last), so tests can compare schedules position by position.
    """
    batch = build_forward_batch(list(seqs), [s.num_uncomputed_tokens for s in seqs], block_size)
    if every_position:
        batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
    return batch
