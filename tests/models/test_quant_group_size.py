"""``--quant-group-size N``: the int4 group size for quantizing a float checkpoint on load.

It reaches the loader through EngineConfig; a size the kernels do not take is a usage error naming
the flag, and one that does not divide a quantized layer's in_features fails the load naming the layer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from family_checkpoints import TINY, write_byte_tokenizer

from protoserve.engine.config import EngineConfig
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.loader.load import load_model
from protoserve.engine.models.linear import Int4Linear
from protoserve.server import exit_codes
from protoserve.server.cli import CliError, _engine_config, build_parser

PROTOSERVE = Path(sys.executable).with_name("protoserve")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def odd_mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose MLP is 96 wide: down_proj's in_features take groups of 32, not 64."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = tmp_path_factory.mktemp("odd-mlp")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, "intermediate_size": 96}, num_hidden_layers=2))
        model.save_pretrained(directory, safe_serialization=True)
    write_byte_tokenizer(directory)
    return directory


def int4_group_sizes(model: torch.nn.Module) -> set[int]:
    return {m.group_size for m in model.modules() if isinstance(m, Int4Linear)}


def test_the_flag_reaches_the_engine_config_and_a_bad_size_names_the_flag() -> None:
    assert _engine_config(build_parser().parse_args(["serve"])).quant_group_size == 32
    assert _engine_config(build_parser().parse_args(["serve", "--quant-group-size", "128"])).quant_group_size == 128
    with pytest.raises(CliError, match=r"^--quant-group-size must be one of 32, 64, 128, 256, got 48"):
        _engine_config(build_parser().parse_args(["serve", "--quant-group-size", "48"]))
    # Never accepted and ignored: a precision that makes no int4 groups refuses the flag.
    with pytest.raises(CliError, match=r"^--quant-group-size sets int4 groups, and --quantization int8 makes none"):
        _engine_config(build_parser().parse_args(["serve", "--quantization", "int8", "--quant-group-size", "64"]))


def test_the_engine_quantizes_in_the_configured_groups(tiny_checkpoint, one_thread) -> None:
    directory, _ = tiny_checkpoint("llama")
    engine = LLMEngine.from_pretrained(str(directory), quantization="int4", progress=False,
                                       config=EngineConfig(quant_group_size=64, max_kv_blocks=16))
    assert int4_group_sizes(engine.runner.model) == {64}


def test_a_size_that_does_not_divide_a_layer_names_the_layer(odd_mlp: Path) -> None:
    assert int4_group_sizes(load_model(odd_mlp, quantization="int4", group_size=32, progress=False).model) == {32}
    with pytest.raises(ValueError, match=r"int4 group size 64 does not divide in_features=96 of layers\.0\.mlp\.down_proj"):
        load_model(odd_mlp, quantization="int4", group_size=64, progress=False)


@pytest.mark.live
def test_generate_with_a_size_that_does_not_divide_a_layer_is_one_line_naming_it(odd_mlp: Path) -> None:
    done = subprocess.run(
        [str(PROTOSERVE), "generate", "--model", str(odd_mlp), "--quantization", "int4", "--quant-group-size", "64",
         "--prompt", "hi", "--max-tokens", "2", "--no-progress"],
        cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert "Traceback" not in done.stderr and done.returncode == exit_codes.MODEL_LOAD, done.stderr
    assert "group size 64 does not divide in_features=96 of layers.0.mlp.down_proj" in done.stderr
