"""bench/device_idle.py's host side: the idle arithmetic, and the step timer on an engine without a device
(no CUDA events, idle reported as None, the engine's own methods back afterwards)."""

from __future__ import annotations

import pytest
import torch

from bench.device_idle import DeviceIdle, timed_device_steps


class _Runner:
    device = torch.device("cpu")

    def execute(self) -> str:
        return "logits"


class _Engine:
    def __init__(self) -> None:
        self.runner = _Runner()
        self.steps = 0

    def step(self) -> list[str]:
        self.steps += 1
        return ["out"]


def test_idle_is_wall_time_less_busy_time_per_step() -> None:
    assert DeviceIdle(steps=4, wall_s=0.010, busy_ms=[1.5, 1.5, 1.5, 1.5]).idle_ms_per_step() == pytest.approx(1.0)
    assert DeviceIdle(steps=2, wall_s=0.001, busy_ms=[1.0, 1.0]).idle_ms_per_step() == 0.0  # never below zero
    assert DeviceIdle(steps=0).idle_ms_per_step() is None
    assert DeviceIdle(steps=3, wall_s=1.0, busy_ms=None).idle_ms_per_step() is None


def test_on_the_cpu_steps_are_counted_and_no_idle_is_claimed() -> None:
    engine = _Engine()
    with timed_device_steps(engine) as idle:
        assert engine.step() == ["out"] and engine.step() == ["out"]
        assert engine.runner.execute() == "logits"
    assert (idle.steps, engine.steps) == (2, 2) and idle.wall_s > 0
    assert idle.busy_ms is None and idle.idle_ms_per_step() is None
    assert "step" not in vars(engine) and "execute" not in vars(engine.runner)  # the timers are gone
