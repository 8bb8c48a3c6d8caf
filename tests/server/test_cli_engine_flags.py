"""Engine flags of the CLI reach EngineConfig (no model load)."""

from __future__ import annotations

from server.cli import _engine_config, build_parser


def test_deterministic_is_the_default_and_can_be_turned_off() -> None:
    assert _engine_config(build_parser().parse_args(["serve"])).deterministic is True
    fast = _engine_config(build_parser().parse_args(["serve", "--no-deterministic", "--max-num-seqs", "8"]))
    assert fast.deterministic is False and fast.max_num_seqs == 8
    assert _engine_config(build_parser().parse_args(["generate", "--no-deterministic", "--prompt", "x"])).deterministic is False
