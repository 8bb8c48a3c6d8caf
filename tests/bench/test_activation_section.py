"""The activation-precision bench section: registered, its figures named, its runs in ABBA order
(the section itself runs in ``make bench``, ``--only activation``)."""

from __future__ import annotations

from bench.context import BenchContext
from bench.profile import PROFILES
from bench.run import SECTIONS
from bench.sections import activation


def test_registered_with_both_modes_figures() -> None:
    assert SECTIONS["activation"] is activation.steps
    [step] = activation.steps(BenchContext(PROFILES["default"]))
    names = {name for name, _ in step.expects}
    for kind in ("decode_c16", "prefill_512"):
        assert {f"activation.{kind}.{m}" for m in ("exact", "fast", "fast_over_exact")} <= names
    for quality in ("logit_error", "greedy_agreement"):
        assert {f"activation.{quality}.exact", f"activation.{quality}.fast"} <= names


def test_modes_alternate_abba() -> None:
    assert activation._abba(2) == ["exact", "fast", "fast", "exact"] * 2
