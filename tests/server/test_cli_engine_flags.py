"""Engine flags of the CLI reach EngineConfig (no model load)."""

from __future__ import annotations

import pytest

from protoserve.server.cli import _engine_config, build_parser


def test_deterministic_is_the_default_and_can_be_turned_off() -> None:
    assert _engine_config(build_parser().parse_args(["serve"])).deterministic is True
    fast = _engine_config(build_parser().parse_args(["serve", "--no-deterministic", "--max-num-seqs", "8"]))
    assert fast.deterministic is False and fast.max_num_seqs == 8
    assert _engine_config(build_parser().parse_args(["generate", "--no-deterministic", "--prompt", "x"])).deterministic is False


def test_kv_cache_dtype_flag() -> None:
    assert _engine_config(build_parser().parse_args(["serve"])).kv_cache_dtype == "auto"
    config = _engine_config(build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16"]))
    assert config.kv_cache_dtype == "bfloat16"
    assert _engine_config(build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "float16"])


def test_engine_config_refuses_an_unknown_kv_cache_dtype() -> None:
    from protoserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, int8"):
        EngineConfig(kv_cache_dtype="fp8").validate()
    with pytest.raises(ValueError, match="kv_cache_dtype int8 is served by the CPU attention kernel only"):
        EngineConfig(kv_cache_dtype="int8", device="cuda").validate()


def test_fairness_flags_reach_the_engine_and_bad_values_name_the_flag() -> None:
    from protoserve.server.cli import CliError

    config = _engine_config(build_parser().parse_args([
        "serve", "--max-running-per-identity", "8", "--max-kv-share-per-identity", "0.5",
        "--fairness-margin-tokens", "256",
    ]))
    assert (config.max_running_per_identity, config.max_kv_share_per_identity, config.fairness_margin_tokens) == (
        8, 0.5, 256)
    default = _engine_config(build_parser().parse_args(["serve"]))
    assert (default.max_running_per_identity, default.max_kv_share_per_identity) == (0, 1.0)
    with pytest.raises(CliError, match=r"^--max-kv-share-per-identity must be in \(0, 1\]"):
        _engine_config(build_parser().parse_args(["serve", "--max-kv-share-per-identity", "1.5"]))
    with pytest.raises(CliError, match="^--max-running-per-identity must be non-negative"):
        _engine_config(build_parser().parse_args(["serve", "--max-running-per-identity", "-1"]))


def test_async_scheduling_flag_defaults_by_device_and_refuses_tensor_parallel() -> None:
    from protoserve.server.cli import CliError

    def config(*flags: str):
        return _engine_config(build_parser().parse_args(["serve", *flags]))

    assert config().async_scheduling is None and not config().overlaps_steps()
    assert config("--device", "cuda").overlaps_steps()
    assert not config("--device", "cuda", "--no-async-scheduling").overlaps_steps()
    assert config("--async-scheduling").async_scheduling is True
    with pytest.raises(CliError, match="^--async-scheduling is not served with tensor_parallel_size > 1"):
        config("--async-scheduling", "--tensor-parallel-size", "2")


def test_stream_interval_flag_reaches_the_engine_and_refuses_zero(capsys) -> None:
    from protoserve.engine.config import EngineConfig

    assert _engine_config(build_parser().parse_args(["serve"])).stream_interval == 1
    assert _engine_config(build_parser().parse_args(["serve", "--stream-interval", "4"])).stream_interval == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--stream-interval", "0"])
    assert "--stream-interval: invalid value '0': a positive integer" in capsys.readouterr().err
    with pytest.raises(ValueError, match="stream_interval must be at least 1"):
        EngineConfig(stream_interval=0).validate()
