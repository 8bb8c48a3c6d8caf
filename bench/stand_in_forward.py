"""A stand-in forward for measuring the engine's host loop: the model replaced by precomputed logits.

``StandInModel`` takes the decoder's place under the runner, so everything ``LLMEngine.step()`` does
on the host runs as served (schedule, ``build_forward_batch``, sampling, detokenize, outputs) and the
forward costs a slice of a tensor. Its logits are float32 ``[rows, vocab]``, each row peaked on one
text token that changes from step to step, so greedy decoding emits real, varied text for the
tokenizer to detokenize. ``timed_host_phases`` splits each step's wall time by phase.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# Phases of one step, as LLMEngine.step() calls them; "other" is the rest of the step (drafting hooks,
# bookkeeping between the calls).
PHASES = ("schedule", "block_tables", "sampling", "postprocess", "outputs", "other")
FIRST_TEXT_TOKEN = 100  # SmolLM2's ids below this are special or single bytes; any text id would do
PEAK = 30.0  # a row's chosen logit stands this far above the others (~N(0, 1)): its argmax is certain


class StandInModel:
    """Called as the decoder is, ``model(batch, kv_cache)``: returns logits ``[len(logits_indices), vocab]``
    from ``variants`` precomputed tensors, taken in turn, without reading the batch's tokens."""

    def __init__(self, vocab: int, max_rows: int, variants: int = 4, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(variants, max_rows, vocab, generator=gen)
        self.peaks = torch.randint(FIRST_TEXT_TOKEN, vocab, (variants, max_rows), generator=gen)
        self.logits.scatter_(2, self.peaks.unsqueeze(2), PEAK)
        self.calls = 0
        self.seconds = 0.0  # time spent in here: not host-loop time

    def __call__(self, batch: Any, kv_cache: Any) -> torch.Tensor:
        start = time.perf_counter()
        rows = int(batch.logits_indices.shape[0])
        out = self.logits[self.calls % self.logits.shape[0], :rows]
        self.calls += 1
        self.seconds += time.perf_counter() - start
        return out

    def expected_token(self, call: int, row: int) -> int:
        """The token greedy decoding takes from row ``row`` of call ``call``."""
        return int(self.peaks[call % self.peaks.shape[0], row])


@dataclass
class PhaseTimes:
    """Seconds per phase of each timed step, in step order."""

    steps: list[dict[str, float]] = field(default_factory=list)

    def mean_ms(self, phase: str) -> float:
        return 1e3 * sum(s[phase] for s in self.steps) / len(self.steps)


def _timed(record: dict[str, float], phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record[phase] = record.get(phase, 0.0) + time.perf_counter() - start

    return call


@contextlib.contextmanager
def timed_host_phases(engine: Any, model: StandInModel) -> Iterator[PhaseTimes]:
    """Time every ``engine.step()`` made inside the block by phase (PHASES) into the PhaseTimes yielded.

    The timers are instance attributes over the engine's own methods, set for the block only;
    ``block_tables`` is the runner's execute less the stand-in model's time (the runner's host part).
    """
    times = PhaseTimes()
    record: dict[str, float] = {}
    targets = [(engine.scheduler, "schedule", "schedule"), (engine.runner, "execute", "execute"),
               (engine, "_sample", "sampling"), (engine, "_postprocess", "postprocess"),
               (engine, "_collect_outputs", "outputs")]
    step = engine.step

    def timed_step() -> Any:
        record.clear()
        model_before = model.seconds
        start = time.perf_counter()
        out = step()
        total = time.perf_counter() - start
        phases = {p: record.get(p, 0.0) for p in PHASES}
        phases["block_tables"] = record.get("execute", 0.0) - (model.seconds - model_before)
        phases["other"] = total - sum(phases[p] for p in PHASES if p != "other") - (model.seconds - model_before)
        phases["total"] = total - (model.seconds - model_before)
        times.steps.append(phases)
        return out

    for owner, name, phase in targets:
        setattr(owner, name, _timed(record, phase, getattr(owner, name)))
    engine.step = timed_step
    try:
        yield times
    finally:
        for owner, name, _ in targets:
            delattr(owner, name)
        del engine.step
