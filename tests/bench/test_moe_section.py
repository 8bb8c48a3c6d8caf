"""The MoE bench section: registered with its figures and the issue's target, and its two paths
agree bit for bit on the smoke sizes (the section itself runs in ``make bench``, ``--only moe``)."""

from __future__ import annotations

import torch

from bench.context import BenchContext
from bench.profile import PROFILES
from bench.run import SECTIONS
from bench.sections import moe


def test_registered_with_its_figures_and_the_issue_target():
    assert SECTIONS["moe"] is moe.steps
    [step] = moe.steps(BenchContext(PROFILES["default"]))
    assert step.expects == (
        ("moe.grouped.t64", "tok/s"),
        ("moe.per_token.t64", "tok/s"),
        ("moe.ratio.t64", "ratio"),
    )
    assert moe.RATIO_TARGET.met(3.0) and not moe.RATIO_TARGET.met(2.99)


def test_smoke_run_reports_three_figures_from_paths_that_agree():
    [step] = moe.steps(BenchContext(PROFILES["smoke"]))
    grouped, loop, ratio = step.run(None)  # the resource goes unused
    assert grouped.value > 0 and loop.value > 0
    assert abs(ratio.value - grouped.value / loop.value) < 1e-9
    assert grouped.details["tokens_per_step"] == 64


def test_paths_are_the_same_computation():
    blocks = moe.build_stack(2, seed=3)
    x = torch.randn(64, moe.HIDDEN)
    with torch.inference_mode():
        assert torch.equal(moe.grouped_step(blocks, x), moe.per_token_step(blocks, x))
