"""Where the fused decoder step's time goes: seconds per phase of the layer loop.

The phases are the step's own (norms and residual adds, the q/k/v projection, RoPE and the K/V write,
attention, the o projection, gate/up, the activation, down, the LM head), timed by member 0 of the
team: a linear's phase ends at the barrier after it, so it includes waiting for the slower member.
``bench/step_profile.py --phases`` prints them per batch size. Timing is process-wide and off unless
``timed`` turns it on; off, the step reads no clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from protoserve.kernels.cpu.extension import load

PHASES = ("norms_residual", "qkv", "rope_kv_write", "attention", "o_proj", "gate_up", "activation", "down",
          "lm_head")


def _extension():
    ext = load("decoder_step")
    if ext is None:
        raise RuntimeError("the CPU kernels are not available here")
    return ext


def take() -> dict[str, float]:
    """Seconds per phase of the steps timed since the last take, with ``steps`` and ``tokens``; resets."""
    return dict(_extension().take_step_phase_totals())


@contextmanager
def timed() -> Iterator[dict[str, float]]:
    """Time the fused steps run inside the block; the dict yielded is filled with ``take()``'s totals
    for them when the block ends."""
    ext = _extension()
    totals: dict[str, float] = {}
    take()
    ext.set_step_phase_timing(True)
    try:
        yield totals
    finally:
        ext.set_step_phase_timing(False)
        totals.update(take())
