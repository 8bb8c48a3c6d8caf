"""serve --speculative-ngram K sets the engine's default speculation, on unless K is 0 (no model load)."""

from __future__ import annotations

import pytest

from protoserve.engine.speculative.params import SpeculativeParams
from protoserve.server.cli import CliError, _engine_config, build_parser


def test_speculative_ngram_flag_sets_the_engine_default():
    # On by default (4 drafts), off with 0; output never changes, so only speed depends on it.
    assert _engine_config(build_parser().parse_args(["serve"])).speculative == SpeculativeParams()
    assert SpeculativeParams().num_speculative_tokens == 4
    config = _engine_config(build_parser().parse_args(["serve", "--speculative-ngram", "6"]))
    assert config.speculative == SpeculativeParams(num_speculative_tokens=6)
    assert _engine_config(build_parser().parse_args(["serve", "--speculative-ngram", "0"])).speculative is None
    with pytest.raises(CliError, match=r"--speculative-ngram must be in \[1, 16\] \(0 turns speculation off\)"):
        _engine_config(build_parser().parse_args(["serve", "--speculative-ngram", "17"]))
    with pytest.raises(CliError, match=r"--speculative-ngram must be in \[1, 16\]"):
        _engine_config(build_parser().parse_args(["serve", "--speculative-ngram", "-1"]))
    # On cuda the default is off (measured on the CPU kernels only); the flag still turns it on.
    assert _engine_config(build_parser().parse_args(["serve", "--device", "cuda"])).speculative is None
    cuda = _engine_config(build_parser().parse_args(["serve", "--device", "cuda", "--speculative-ngram", "3"]))
    assert cuda.speculative == SpeculativeParams(num_speculative_tokens=3)


def test_speculative_model_flag_loads_a_draft_and_makes_it_the_default():
    config = _engine_config(build_parser().parse_args(["serve", "--speculative-model", "default"]))
    assert config.speculative_model == "default" and config.speculative == SpeculativeParams(method="draft")
    with pytest.raises(CliError, match="not both"):
        _engine_config(build_parser().parse_args(["serve", "--speculative-model", "x", "--speculative-ngram", "3"]))


def test_disable_by_batch_size_flag():
    # Drafting only while one sequence runs, for either method, unless the flag says otherwise.
    assert _engine_config(build_parser().parse_args(["serve"])).speculative_disable_by_batch_size == 1
    draft = _engine_config(build_parser().parse_args(["serve", "--speculative-model", "default"]))
    assert draft.speculative_disable_by_batch_size == 1
    args = ["serve", "--speculative-ngram", "4", "--speculative-disable-by-batch-size", "8"]
    assert _engine_config(build_parser().parse_args(args)).speculative_disable_by_batch_size == 8
    with pytest.raises(CliError, match="at least 1"):
        _engine_config(build_parser().parse_args(["serve", "--speculative-disable-by-batch-size", "0"]))
