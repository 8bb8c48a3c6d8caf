"""Measuring hooks for the bench and profilers: a model's logits at every position, and the fused
C++ step's calls timed one by one.

They go through the same pieces a served step does (``build_forward_batch``, a paged K/V cache,
the model's forward), so what they measure is what serving runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from protoserve.engine.execution.model_runner import build_forward_batch
from protoserve.engine.models.decoder import Decoder
from protoserve.engine.models.fused_step import FusedStep
from protoserve.engine.models.kv_cache import PagedKVCache
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.scheduling.sequence import Sequence as EngineSequence
from protoserve.kernels.cpu import step_phases

BLOCK_SIZE = 16


def all_position_logits(model: Decoder, token_ids: Sequence[int], kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits [len(token_ids), vocab] float32 of one forward over ``token_ids`` on a fresh paged cache:
    row i predicts token i + 1 (teacher forcing). ``kv_dtype`` is the cache's storage."""
    tokens = [int(t) for t in token_ids]
    if not tokens:
        raise ValueError("token_ids must not be empty")
    c = model.config
    blocks = -(-len(tokens) // BLOCK_SIZE)
    cache = PagedKVCache.for_model(c, blocks, BLOCK_SIZE, kv_dtype)
    seq = EngineSequence(seq_id=0, request_id="all-positions", index=0, token_ids=tokens,
                         num_prompt_tokens=len(tokens), max_len=len(tokens) + 1, sampling=SamplingParams(),
                         generator=torch.Generator(), num_computed_tokens=0, block_table=list(range(blocks)))
    batch = build_forward_batch([seq], [len(tokens)], BLOCK_SIZE)
    # The engine asks for the last position's logits only; every position's are asked here.
    batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
    return model(batch, cache).float()


@dataclass(frozen=True)
class FusedStepCall:
    """One call of the fused C++ step: the tokens it computed, its wall time, its sequences' mean
    length (context included), and, when phases were asked for, its seconds per phase of the layer
    loop (``protoserve.kernels.cpu.step_phases.PHASES``)."""

    num_tokens: int
    seconds: float
    mean_seq_len: float
    phases: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def timed_fused_steps(phases: bool = False) -> Iterator[list[FusedStepCall]]:
    """Record every fused-step call made inside the block (any model, this process) into the list
    yielded, in call order; ``phases`` also splits each call's time by phase.

    The timer is installed for the block only, so the serving path carries no hook at all. The
    time is the C++ step's alone: no scheduling, embedding lookup or sampling.
    """
    calls: list[FusedStepCall] = []
    original = FusedStep.__call__

    def timed(self: FusedStep, batch, *args, **kwargs) -> torch.Tensor:
        with step_phases.timed() if phases else contextlib.nullcontext({}) as split:
            start = time.perf_counter()
            out = original(self, batch, *args, **kwargs)
            seconds = time.perf_counter() - start
        calls.append(FusedStepCall(int(batch.slot_mapping.numel()), seconds, float(batch.seq_lens.float().mean()),
                                   {name: split[name] for name in step_phases.PHASES} if phases else {}))
        return out

    FusedStep.__call__ = timed
    try:
        yield calls
    finally:
        FusedStep.__call__ = original
