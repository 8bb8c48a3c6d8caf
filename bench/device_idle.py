"""Device idle time per engine step: the steps' wall time less the device's busy time in their forwards.

Each forward the runner enqueues is bracketed by CUDA events, so its busy time is read off the device's
own clock; what is left of a step's wall time is the device waiting on the host (schedule, block
tables, sampling read back, outputs), the time async scheduling (engine/execution/async_step.py) hides.
Measured on cuda only: on the CPU the host runs the forward itself and there is no device to idle.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DeviceIdle:
    """Steps timed, their wall seconds, and each forward's busy milliseconds (None: no device timed)."""

    steps: int = 0
    wall_s: float = 0.0
    busy_ms: list[float] | None = field(default_factory=list)

    def idle_ms_per_step(self) -> float | None:
        if not self.steps or self.busy_ms is None:
            return None
        # A forward still running when the last step returned counts as busy: never below zero.
        return max(0.0, (1e3 * self.wall_s - sum(self.busy_ms)) / self.steps)


@contextlib.contextmanager
def timed_device_steps(engine: Any) -> Iterator[DeviceIdle]:
    """Time every ``engine.step()`` inside the block, and on cuda each forward's busy time; the timers are
    instance attributes set for the block only."""
    import torch

    cuda = engine.runner.device.type == "cuda"
    idle = DeviceIdle(busy_ms=[] if cuda else None)
    events: list[tuple[Any, Any]] = []
    execute, step = engine.runner.execute, engine.step

    def timed_execute(*args: Any, **kwargs: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = execute(*args, **kwargs)
        end.record()
        events.append((start, end))
        return out

    def timed_step() -> Any:
        began = time.perf_counter()
        out = step()
        idle.wall_s += time.perf_counter() - began
        idle.steps += 1
        return out

    if cuda:
        engine.runner.execute = timed_execute
    engine.step = timed_step
    try:
        yield idle
    finally:
        del engine.step
        if cuda:
            del engine.runner.execute
            torch.cuda.synchronize()
            idle.busy_ms = [start.elapsed_time(end) for start, end in events]
